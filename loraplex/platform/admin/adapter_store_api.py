"""Adapter uploads through the admin API: each file goes into the content-addressed store as a blob
(`PUT /admin/api/blobs/sha256:<hex>`, the raw bytes), then the adapter is registered by naming its
files' digests (`POST /admin/api/tenants/{name}/adapters` with `files` instead of `path`).

Why two steps: an upload streams to disk whatever its size and is checked against its digest, a
client asks which files the server holds already (`GET /admin/api/blobs/...`) and skips them, and
registration stays one small JSON request that the engine validates before the row is written.
"""

from __future__ import annotations

import asyncio

from litestar import Request, get, put
from litestar.params import FromPath

from loraplex.adapters.store import StoreError
from loraplex.platform.admin.schemas import AdapterIn, BlobOut
from loraplex.platform.errors import PlatformError, invalid, not_found
from loraplex.platform.state import Platform, PlatformDep

_STATUS = {"too_large": 413, "no_space": 507, "storage_error": 500}  # the rest are the caller's mistakes: 400


def from_store_error(exc: StoreError) -> PlatformError:
    return PlatformError(_STATUS.get(exc.code, 400), exc.message, code=exc.code, param=exc.param)


@get("/blobs/{digest:str}")
async def get_blob(platform: PlatformDep, digest: FromPath[str]) -> BlobOut:
    try:
        blob = platform.store.blob(digest)
    except StoreError as exc:
        raise from_store_error(exc) from None
    if blob is None:
        raise not_found(f"the store holds no blob {digest}", "digest", code="blob_not_found")
    return BlobOut(blob.digest, blob.size)


@put("/blobs/{digest:str}", status_code=201, request_max_body_size=None)
async def put_blob(platform: PlatformDep, request: Request, digest: FromPath[str]) -> BlobOut:
    """The body is the file's raw bytes; they are kept only if their SHA-256 is `digest`. The store's
    byte limit applies as they arrive (Litestar's own body limit would cap adapters at 10 MB)."""
    try:
        blob = await platform.store.receive(digest, request.stream(), request.content_length)
    except StoreError as exc:
        raise from_store_error(exc) from None
    return BlobOut(blob.digest, blob.size)


async def adapter_path(platform: Platform, data: AdapterIn) -> str:
    """The directory a registration names: its `path`, or the store's directory of its uploaded `files`."""
    if (data.path is None) == (data.files is None):
        raise invalid("give the adapter's directory (`path`) or its uploaded files (`files`), one of them",
                      "files" if data.path is None else "path")
    if data.files is None:
        return data.path
    try:
        return str(await asyncio.to_thread(platform.store.adapter_dir, data.files))
    except StoreError as exc:
        raise from_store_error(exc) from None


adapter_store_handlers = [get_blob, put_blob]

"""`loraplex adapters upload|list|delete` over a running server's admin API, and `gc` of its store.

upload: each PEFT file is hashed here, sent only if the server's store lacks it (as raw bytes,
streamed from disk), and the adapter is then registered by those digests, so the server validates it
against its base model before any row is written. The server and admin token come from
`--server` / `$LORAPLEX_SERVER_URL` and `$LORAPLEX_ADMIN_TOKEN` (never a flag: flags show in `ps`).
gc runs where the store and database are (`LORAPLEX_*` as for `serve`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import httpx
from sqlalchemy import select

from loraplex.adapters.store import AdapterStore, file_digest
from loraplex.cli.storage import with_session
from loraplex.cli.table import add_json_flag, print_rows
from loraplex.engine.api import PEFT_CONFIG_FILE, PEFT_FILES, PEFT_WEIGHTS_FILE, missing_weights_reason
from loraplex.platform.db.tables import Adapter
from loraplex.platform.settings import Settings


def add_parser(sub) -> None:
    p = sub.add_parser("adapters", help="upload, list and delete tenants' LoRA adapters on a server")
    asub = p.add_subparsers(dest="adapters_command", required=True)
    up = asub.add_parser("upload", help="upload a PEFT LoRA directory and register it for a tenant")
    up.add_argument("directory", help="holds adapter_config.json and adapter_model.safetensors")
    up.add_argument("--tenant", required=True, help="the tenant that owns it (only its keys can use it)")
    up.add_argument("--name", required=True, help="what the tenant's requests call it (`model`)")
    up.add_argument("--base-model", required=True, help="the served base model it was trained on")
    up.set_defaults(func=_upload)
    ls = asub.add_parser("list", help="list a tenant's adapters")
    ls.add_argument("--tenant", required=True, help="whose adapters")
    add_json_flag(ls)
    ls.set_defaults(func=_list)
    rm = asub.add_parser("delete", help="delete a tenant's adapter (its running requests finish)")
    rm.add_argument("name", help="the adapter's name")
    rm.add_argument("--tenant", required=True, help="the tenant that owns it")
    rm.set_defaults(func=_delete)
    for q in (up, ls, rm):
        q.add_argument("--server", default=os.environ.get("LORAPLEX_SERVER_URL") or "http://127.0.0.1:8000",
                       help="the server's base URL (default $LORAPLEX_SERVER_URL or http://127.0.0.1:8000)")
    gc = asub.add_parser("gc", help="remove uploaded files no adapter uses any more, from this host's store")
    gc.add_argument("--min-age-hours", type=float, default=24.0,
                    help="keep anything younger than this, such as uploads not yet registered (default 24)")
    gc.set_defaults(func=_gc)


class _Admin:
    """The admin API of one server; an error answer or an unreachable server is one ValueError line."""

    def __init__(self, server: str):
        token = os.environ.get("LORAPLEX_ADMIN_TOKEN")
        if not token:
            raise ValueError("set LORAPLEX_ADMIN_TOKEN to the server's admin token")
        self.server = server.rstrip("/")
        self.client = httpx.Client(base_url=f"{self.server}/admin/api", timeout=httpx.Timeout(60, read=600),
                                   headers={"authorization": f"Bearer {token}"})

    def call(self, method: str, path: str, ok: tuple[int, ...] = (200, 201, 204), hint: str = "",
             **kwargs) -> httpx.Response:
        """`hint`: said after the error when the connection breaks mid-request."""
        try:
            r = self.client.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ValueError(f"cannot reach {self.server}: {exc}") from None
        except httpx.HTTPError as exc:
            raise ValueError(f"{method} {path} on {self.server} failed: {exc or type(exc).__name__}{hint}") from None
        if r.status_code not in ok:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text.strip()[:200] or r.reason_phrase
            raise ValueError(f"{self.server} answered {r.status_code}: {message}")
        return r


def _upload(args: argparse.Namespace) -> int:
    files = _peft_files(Path(args.directory))
    admin = _Admin(args.server)
    digests = {}
    for name, path in files.items():
        digest = digests[name] = file_digest(path)
        if admin.call("GET", f"/blobs/{digest}", ok=(200, 404)).status_code == 200:
            print(f"{name}: already on the server ({digest})")
            continue
        with open(path, "rb") as f:
            admin.call("PUT", f"/blobs/{digest}", content=f,
                       headers={"content-type": "application/octet-stream",
                                "content-length": str(path.stat().st_size)},
                       hint=" (the server cuts off an upload larger than its LORAPLEX_ADAPTER_MAX_BYTES)")
        print(f"{name}: uploaded {path.stat().st_size} bytes ({digest})")
    row = admin.call("POST", f"/tenants/{args.tenant}/adapters",
                     json={"name": args.name, "base_model": args.base_model, "files": digests}).json()
    print(f"registered adapter {row['name']} for tenant {row['tenant']} on {row['base_model']}")
    return 0


def _peft_files(directory: Path) -> dict[str, Path]:
    """The directory's two PEFT files, or one clear error (pickled weights are never sent)."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (expected {' and '.join(PEFT_FILES)} inside)")
    if not (directory / PEFT_CONFIG_FILE).is_file():
        raise ValueError(f"{directory}: {PEFT_CONFIG_FILE} is missing")
    if not (directory / PEFT_WEIGHTS_FILE).is_file():
        raise ValueError(f"{directory}: {missing_weights_reason(directory)}")
    return {name: directory / name for name in PEFT_FILES}


def _list(args: argparse.Namespace) -> int:
    rows = _Admin(args.server).call("GET", f"/tenants/{args.tenant}/adapters").json()
    print_rows(args, ("name", "base_model", "path"), rows)
    return 0


def _delete(args: argparse.Namespace) -> int:
    _Admin(args.server).call("DELETE", f"/tenants/{args.tenant}/adapters/{args.name}")
    print(f"deleted adapter {args.name} of tenant {args.tenant}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    if args.min_age_hours < 0:
        raise ValueError(f"--min-age-hours must be >= 0, got {args.min_age_hours}")
    settings = Settings.from_env()

    async def paths(session) -> list[str]:
        return list((await session.execute(select(Adapter.path))).scalars())

    done = AdapterStore(settings.adapter_store_root, settings.adapter_max_bytes).collect(
        with_session(paths, settings), args.min_age_hours * 3600)
    print(f"removed {done.adapters} adapter directories and {done.blobs} blobs ({done.bytes_freed} bytes freed)")
    return 0

"""Adapters uploaded through the admin API (blobs in the content-addressed store, then registered
by their digests) serve exactly as the same directory registered by path; bad uploads and
registrations are refused with clear errors and leave no blob and no row."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from litestar.testing import TestClient

from loraplex.adapters.store import file_digest
from loraplex.engine.api import PEFT_CONFIG_FILE, PEFT_FILES, PEFT_WEIGHTS_FILE
from tests.integration.conftest import ADMIN_TOKEN, Api


def put_blob(client: TestClient, data: bytes, digest: str, token: str | None = ADMIN_TOKEN):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return client.put(f"/admin/api/blobs/{digest}", content=data, headers=headers)


def upload(api: Api, directory: Path) -> dict[str, str]:
    """Each of the directory's PEFT files as a blob; returns the `files` a registration names."""
    files = {}
    for name in PEFT_FILES:
        data, digest = (directory / name).read_bytes(), file_digest(directory / name)
        r = put_blob(api.client, data, digest)
        assert r.status_code == 201 and r.json() == {"digest": digest, "size": len(data)}, r.text
        files[name] = digest
    return files


def register(api: Api, tenant: str, name: str, **source):
    return api.client.post(f"/admin/api/tenants/{tenant}/adapters", headers=api.admin,
                           json={"name": name, "base_model": "synthetic:tiny", **source})


def adapter_rows(api: Api, tenant: str) -> dict[str, dict]:
    r = api.client.get(f"/admin/api/tenants/{tenant}/adapters", headers=api.admin)
    assert r.status_code == 200, r.text
    return {row["name"]: row for row in r.json()}


def error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    return body


def content(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_an_uploaded_adapter_serves_as_its_directory_does(api, peft_dirs):
    tenant = api.tenant()
    key = api.key(tenant)
    weights = file_digest(peft_dirs[0] / PEFT_WEIGHTS_FILE)
    error(api.client.get(f"/admin/api/blobs/{weights}", headers=api.admin), 404, "blob_not_found")
    files = upload(api, peft_dirs[0])
    r = api.client.get(f"/admin/api/blobs/{weights}", headers=api.admin)
    assert r.json() == {"digest": weights, "size": (peft_dirs[0] / PEFT_WEIGHTS_FILE).stat().st_size}

    assert register(api, tenant, "uploaded", files=files).status_code == 201
    assert register(api, tenant, "by-path", path=str(peft_dirs[0])).status_code == 201
    stored = Path(adapter_rows(api, tenant)["uploaded"]["path"])
    assert stored.parent == api.backend.settings.adapter_store_root / "adapters"
    assert (stored / PEFT_WEIGHTS_FILE).read_bytes() == (peft_dirs[0] / PEFT_WEIGHTS_FILE).read_bytes()
    tuned = content(api.chat(key, model="uploaded"))
    assert tuned == content(api.chat(key, model="by-path")) != content(api.chat(key))


def test_the_same_files_registered_twice_are_stored_once(api, peft_dirs):
    first, second = api.tenant(), api.tenant()
    files = upload(api, peft_dirs[1])
    assert register(api, first, "mine", files=files).status_code == 201
    assert register(api, second, "theirs", files=files).status_code == 201
    assert adapter_rows(api, first)["mine"]["path"] == adapter_rows(api, second)["theirs"]["path"]


def test_bytes_that_are_not_what_their_digest_says_are_refused(api, peft_dirs):
    data = (peft_dirs[0] / PEFT_CONFIG_FILE).read_bytes()
    wrong = "sha256:" + "ab" * 32
    body = error(put_blob(api.client, data, wrong), 400, "digest_mismatch")
    assert file_digest(peft_dirs[0] / PEFT_CONFIG_FILE) in body["message"]
    error(api.client.get(f"/admin/api/blobs/{wrong}", headers=api.admin), 404, "blob_not_found")
    error(put_blob(api.client, data, "sha256:short"), 400, "invalid_digest")
    assert put_blob(api.client, data, file_digest(peft_dirs[0] / PEFT_CONFIG_FILE), token=None).status_code == 401


def test_registrations_that_cannot_be_served_leave_no_row(api, peft_dirs, tmp_path):
    tenant = api.tenant()
    files = upload(api, peft_dirs[0])
    unsent = {**files, PEFT_WEIGHTS_FILE: "sha256:" + "cd" * 32}
    body = error(register(api, tenant, "a", files=unsent), 400, "blob_missing")
    assert body["param"] == f"files.{PEFT_WEIGHTS_FILE}" and "upload it first" in body["message"]
    error(register(api, tenant, "a", files={PEFT_CONFIG_FILE: files[PEFT_CONFIG_FILE]}), 400, "invalid_files")
    error(register(api, tenant, "a", files=files, path=str(peft_dirs[0])), 400, "invalid_value")
    error(register(api, tenant, "a"), 400, "invalid_value")

    # the config says rank 4 over rank-8 tensors: the engine refuses it before the row is written
    config = json.loads((peft_dirs[0] / PEFT_CONFIG_FILE).read_text())
    (tmp_path / PEFT_CONFIG_FILE).write_text(json.dumps({**config, "r": 4}))
    (tmp_path / PEFT_WEIGHTS_FILE).write_bytes((peft_dirs[0] / PEFT_WEIGHTS_FILE).read_bytes())
    body = error(register(api, tenant, "a", files=upload(api, tmp_path)), 400, "invalid_adapter")
    assert body["param"] == "files" and "adapter rejected by the engine" in body["message"]
    assert adapter_rows(api, tenant) == {}


def test_an_upload_over_the_byte_limit_is_413_and_kept_nowhere(backend, peft_dirs):
    weights = peft_dirs[0] / PEFT_WEIGHTS_FILE
    root = backend.settings.data_dir / "small-store"
    with TestClient(backend.app(adapter_store_dir=root, adapter_max_bytes=4096), timeout=60) as client:
        body = error(put_blob(client, weights.read_bytes(), file_digest(weights)), 413, "too_large")
        assert "4096" in body["message"]
        assert sorted(p for p in root.rglob("*") if p.is_file()) == []


def test_an_upload_beyond_litestars_own_body_limit_streams_to_the_store(api):
    data = bytes(range(256)) * (48 << 10)  # 12 MiB: Litestar refuses bodies over 10 MB unless told not to
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    r = put_blob(api.client, data, digest)
    assert r.status_code == 201 and r.json() == {"digest": digest, "size": len(data)}, r.text


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_the_blob_endpoints_are_admin_only(api, method):
    r = api.client.request(method, "/admin/api/blobs/sha256:" + "0" * 64, content=b"x",
                           headers={"authorization": "Bearer not-the-admin-token"})
    error(r, 401, "invalid_admin_token")

"""Keys and the admin API: stored as sha256, revocation and expiry across instances, disabled
tenants, admin authentication, and bad input that changes nothing."""

from __future__ import annotations

import hashlib
import logging
import time

from litestar.testing import TestClient
from sqlalchemy import func, select

from loraplex.platform.db.database import make_engine, session_factory
from loraplex.platform.db.tables import Adapter, ApiKey
from tests.integration.conftest import ADMIN_TOKEN, run


def _rows(settings, model, **where):
    async def query():
        engine = make_engine(settings.database_url)
        try:
            async with session_factory(engine)() as session:
                stmt = select(model).filter_by(**where)
                return list((await session.execute(stmt)).scalars())
        finally:
            await engine.dispose()

    return run(query())


def _count(settings, model) -> int:
    async def query():
        engine = make_engine(settings.database_url)
        try:
            async with engine.connect() as conn:
                return (await conn.execute(select(func.count()).select_from(model))).scalar_one()
        finally:
            await engine.dispose()

    return run(query())


def test_key_is_stored_only_as_sha256_with_a_display_prefix(api):
    tenant = api.tenant()
    r = api.client.post(f"/admin/api/tenants/{tenant}/keys", json={"name": "ci", "rpm_limit": 10},
                        headers=api.admin)
    created = r.json()
    key = created["key"]
    assert key.startswith("lpx-") and len(key) > 40 and created["prefix"] == key[:12]
    (row,) = _rows(api.backend.settings, ApiKey, prefix=created["prefix"])
    assert row.secret_hash == hashlib.sha256(key.encode()).hexdigest()
    assert key not in repr([getattr(row, c.name) for c in ApiKey.__table__.columns])
    listed = api.client.get(f"/admin/api/tenants/{tenant}/keys", headers=api.admin).json()
    assert [k["prefix"] for k in listed] == [created["prefix"]] and "key" not in listed[0]


def test_revoked_key_is_refused_within_a_second_on_another_instance(api):
    tenant = api.tenant()
    key = api.key(tenant)
    with TestClient(api.backend.app(), timeout=60) as other:
        headers = {"authorization": f"Bearer {key}"}
        assert other.get("/v1/models", headers=headers).status_code == 200  # now cached there
        revoked = api.client.post(f"/admin/api/keys/{key[:12]}/revoke", headers=api.admin)
        assert revoked.status_code == 200 and revoked.json()["revoked_at"]
        assert api.chat(key).status_code == 401  # this instance forgets at once
        time.sleep(1.0)
        r = other.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "revoked" in r.json()["error"]["message"]


def test_expired_key_is_refused(api):
    key = api.key(api.tenant(), expires_in_s=1)
    assert api.chat(key, max_tokens=1).status_code == 200
    time.sleep(1.1)
    r = api.chat(key, max_tokens=1)
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]


def test_disabled_tenant_keys_are_refused_until_enabled(api):
    tenant = api.tenant()
    key = api.key(tenant)
    assert api.client.post(f"/admin/api/tenants/{tenant}/disable", headers=api.admin).json()["status"] == "disabled"
    assert api.chat(key, max_tokens=1).status_code == 401
    assert api.client.post(f"/admin/api/tenants/{tenant}/enable", headers=api.admin).json()["status"] == "active"
    assert api.chat(key, max_tokens=1).status_code == 200


def test_admin_api_needs_the_admin_token(api):
    assert api.client.get("/admin/api/tenants").status_code == 401
    r = api.client.get("/admin/api/tenants", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    tenant_key = api.key(api.tenant())
    assert api.client.get("/admin/api/tenants", headers={"authorization": f"Bearer {tenant_key}"}).status_code == 401
    with TestClient(api.backend.app(admin_token=None)) as closed:
        r = closed.get("/admin/api/tenants", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


def test_wrong_admin_tokens_lock_the_address_out_of_the_api_and_the_ui(api):
    """After 3 wrong tokens (this app's limit) the address gets 429 for the window, the right token
    included, on the admin API and the UI's login alike; no token at all is not counted."""
    from loraplex.admin_ui import AdminUI

    with TestClient(api.backend.app(plugins=[AdminUI()], admin_auth_max_failures=3, admin_auth_window_s=60)) as app:
        good = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        for _ in range(5):
            assert app.get("/admin/api/tenants").status_code == 401  # no token: no guess
        assert app.get("/admin/api/tenants", headers={"authorization": "Bearer wrong-1"}).status_code == 401
        assert app.get("/admin/api/tenants", headers=good).status_code == 200  # a success clears the count
        for i in range(3):
            assert app.get("/admin/api/tenants", headers={"authorization": f"Bearer wrong-{i}"}).status_code == 401
        r = app.get("/admin/api/tenants", headers=good)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_auth_failures", r.text
        assert 55 <= int(r.headers["retry-after"]) <= 60
        login = app.post("/admin/login", data={"token": ADMIN_TOKEN, "next": "/admin"}, follow_redirects=False)
        assert login.status_code == 429 and "Too many wrong admin tokens" in login.text
    with TestClient(api.backend.app(admin_auth_max_failures=0)) as unlimited:
        for i in range(20):
            unlimited.get("/admin/api/tenants", headers={"authorization": f"Bearer wrong-{i}"})
        assert unlimited.get("/admin/api/tenants", headers=good).status_code == 200


def test_admin_lists_and_registers_models(api):
    tenant = api.tenant()
    names = [t["name"] for t in api.client.get("/admin/api/tenants", headers=api.admin).json()]
    assert tenant in names
    assert api.client.get(f"/admin/api/tenants/{tenant}", headers=api.admin).json()["tier"] == "standard"
    models = {m["name"] for m in api.client.get("/admin/api/models", headers=api.admin).json()}
    assert "synthetic:tiny" in models  # registered at startup from the engine
    new = f"extra-{tenant}"
    r = api.client.post("/admin/api/models", json={"name": new, "source": "/models/x.gguf"}, headers=api.admin)
    assert r.status_code == 201 and r.json()["source"] == "/models/x.gguf"
    assert api.client.post("/admin/api/models", json={"name": new}, headers=api.admin).status_code == 409


def test_bad_input_answers_clearly_and_writes_nothing(api, tmp_path):
    settings = api.backend.settings
    tenant = api.tenant()
    keys_before, adapters_before = _count(settings, ApiKey), _count(settings, Adapter)
    for spec, param in (({"rpm_limit": 0}, "rpm_limit"), ({"max_priority": "vip"}, "max_priority"),
                        ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at"), ({"name": "a b"}, "name")):
        r = api.client.post(f"/admin/api/tenants/{tenant}/keys", json=spec, headers=api.admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert api.client.post("/admin/api/tenants/nobody/keys", json={}, headers=api.admin).status_code == 404
    bad_dir = tmp_path / "not-an-adapter"
    bad_dir.mkdir()
    r = api.adapter(tenant, "broken", bad_dir)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
    assert api.adapter(tenant, "x", bad_dir, base_model="unknown-base").status_code == 404
    assert api.adapter(tenant, "bad:name", bad_dir).status_code == 400
    assert _count(settings, ApiKey) == keys_before and _count(settings, Adapter) == adapters_before
    dup = api.client.post("/admin/api/tenants", json={"name": tenant}, headers=api.admin)
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "already_exists"
    assert api.client.post("/admin/api/tenants", json={"name": ""}, headers=api.admin).status_code == 400


def test_duplicate_adapter_name_is_refused(api, peft_dirs):
    tenant = api.tenant()
    assert api.adapter(tenant, "once", peft_dirs[0]).status_code == 201
    assert api.adapter(tenant, "once", peft_dirs[1]).status_code == 409
    listed = api.client.get(f"/admin/api/tenants/{tenant}/adapters", headers=api.admin).json()
    assert [(a["name"], a["path"]) for a in listed] == [("once", str(peft_dirs[0]))]
    assert listed[0]["engine_id"].startswith(f"adapter-{listed[0]['id']}-")


def test_keys_never_reach_the_logs(api, caplog):
    key = api.key(api.tenant())
    with caplog.at_level(logging.DEBUG):
        api.chat(key, max_tokens=2)
        api.chat(key + "tampered")
        api.chat(key, model="missing-model")
    assert caplog.records and not any(key in r.getMessage() for r in caplog.records)

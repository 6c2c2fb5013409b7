"""`loraplex adapters upload|list|delete|gc` against the real `loraplex serve` (embedded SQLite),
with the uploaded adapter then served to the `openai` client; bad input is one `loraplex: error:` line.
The server's adapter slots and base weights are bf16 under the fp32 model (`--lora-dtype`,
`--weight-dtype`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch

from loraplex.engine.api import PEFT_FILES
from loraplex.engine.lora.slots import slot_buffer_bytes
from loraplex.engine.models.synthetic import synthetic_model
from tests.e2e import test_serve_models as serve_models
from tests.e2e.server import free_port, start
from tests.e2e.test_cli_platform import EMBEDDED, loraplex, one_line_error

ADMIN = "e2e-adapters-admin-token"
MODEL = "synthetic:tiny"


@pytest.fixture(scope="module")
def data_env(tmp_path_factory):
    return {**EMBEDDED, "LORAPLEX_DATA_DIR": str(tmp_path_factory.mktemp("data")), "LORAPLEX_ADMIN_TOKEN": ADMIN}


LIMIT = 2_000_000  # bytes an upload may send: more than the tiny model's rank-8 adapter


@pytest.fixture(scope="module")
def server(data_env):
    srv = start({**data_env, "LORAPLEX_ADAPTER_MAX_BYTES": str(LIMIT)}, "--no-demo", "--lora-dtype", "bfloat16",
                "--weight-dtype", "bfloat16")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def cli_env(data_env, server):
    return {**data_env, "LORAPLEX_SERVER_URL": server.base_url}


@pytest.fixture(scope="module")
def tenant(server):
    headers = {"authorization": f"Bearer {ADMIN}"}
    assert httpx.post(f"{server.base_url}/admin/api/tenants", json={"name": "acme"}, headers=headers).is_success
    key = httpx.post(f"{server.base_url}/admin/api/tenants/acme/keys", json={}, headers=headers).json()["key"]
    return openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory):
    return Path(serve_models.peft_dir(tmp_path_factory.mktemp("peft"), seed=5))  # for MODEL, rank 8


def ask(client: openai.OpenAI, model: str) -> str:
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    return answer.choices[0].message.content


def ok(out) -> str:
    assert out.returncode == 0, out.stderr
    return out.stdout


def gauge(server, name: str) -> int:
    text = httpx.get(f"{server.base_url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    (line,) = [x for x in text.splitlines() if x.startswith(f"{name} ")]
    return int(float(line.split()[1]))


def slot_bytes(server) -> int:
    return gauge(server, "loraplex_adapter_slot_bytes")


def test_the_server_runs_bf16_base_weights(server):
    """--weight-dtype reaches the engine: its weights gauge counts bf16 panels beside the loaded fp32
    tensors, as an engine made here with that setting does, less than fp32 panels would take."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.core import EngineCore

    def weight_bytes(weight_dtype: str) -> int:
        cfg = EngineConfig(model=MODEL, device="cpu", num_kv_blocks=8, weight_dtype=weight_dtype)
        return EngineCore(cfg).stats().models.weight_bytes

    assert gauge(server, "loraplex_model_weight_bytes") == weight_bytes("bfloat16") < weight_bytes("auto")


def test_upload_serve_delete_and_collect(cli_env, server, tenant, peft_dir):
    first = ok(loraplex(cli_env, "adapters", "upload", str(peft_dir), "--tenant", "acme", "--name", "tuned",
                        "--base-model", MODEL))
    assert first.count(": uploaded ") == 2 and "registered adapter tuned for tenant acme" in first
    tuned = ask(tenant, "tuned")
    assert tuned != ask(tenant, MODEL) and tuned == ask(tenant, f"{MODEL}:tuned")
    # the 8 slots of rank 8 hold bf16: their buffers, and the adapter's fp32 folded copy (the repeated
    # prompt's uncached last 8 tokens ran as one decode step, wholly on it), less than fp32 buffers alone
    config = synthetic_model("tiny")[0]
    assert slot_buffer_bytes(config, 8, 8, torch.bfloat16) - 32 <= slot_bytes(server) < slot_buffer_bytes(
        config, 8, 8, torch.float32) - 32

    again = ok(loraplex(cli_env, "adapters", "upload", str(peft_dir), "--tenant", "acme", "--name", "again",
                        "--base-model", MODEL))
    assert again.count("already on the server") == 2 and ask(tenant, "again") == tuned
    listed = {row["name"]: row["path"] for row in json.loads(ok(loraplex(cli_env, "adapters", "list", "--tenant",
                                                                          "acme", "--json")))}
    assert listed.keys() == {"tuned", "again"} and listed["tuned"] == listed["again"]  # one stored copy

    assert "deleted adapter tuned" in ok(loraplex(cli_env, "adapters", "delete", "tuned", "--tenant", "acme"))
    with pytest.raises(openai.NotFoundError):
        ask(tenant, "tuned")
    kept = ok(loraplex(cli_env, "adapters", "gc", "--min-age-hours", "0"))
    assert "removed 0 adapter directories and 0 blobs" in kept  # "again" still names the files
    assert ask(tenant, "again") == tuned
    ok(loraplex(cli_env, "adapters", "delete", "again", "--tenant", "acme"))
    freed = ok(loraplex(cli_env, "adapters", "gc", "--min-age-hours", "0"))
    size = sum((peft_dir / name).stat().st_size for name in PEFT_FILES)
    assert f"removed 1 adapter directories and 2 blobs ({size} bytes freed)" in freed
    one_line_error(loraplex(cli_env, "adapters", "delete", "again", "--tenant", "acme"), "answered 404")


def test_bad_uploads_are_one_line_and_register_nothing(cli_env, server, tenant, peft_dir, tmp_path):
    def upload(directory, env=cli_env, *extra):
        return loraplex(env, "adapters", "upload", str(directory), "--tenant", "acme", "--name", "bad",
                        "--base-model", MODEL, *extra)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(peft_dir / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not unpickled")
    one_line_error(upload(pickled), "pickle files are refused")
    one_line_error(upload(tmp_path / "nowhere"), "not a directory")
    one_line_error(upload(peft_dir, {**cli_env, "LORAPLEX_ADMIN_TOKEN": ""}), "LORAPLEX_ADMIN_TOKEN")
    one_line_error(upload(peft_dir, {**cli_env, "LORAPLEX_ADMIN_TOKEN": "wrong"}), "answered 401")
    one_line_error(upload(peft_dir, cli_env, "--server", f"http://127.0.0.1:{free_port()}"), "cannot reach")

    huge = tmp_path / "huge"
    huge.mkdir()
    shutil.copy(peft_dir / "adapter_config.json", huge)
    (huge / "adapter_model.safetensors").write_bytes(b"\0" * (LIMIT + 1))
    one_line_error(upload(huge), "LORAPLEX_ADAPTER_MAX_BYTES")

    mismatched = tmp_path / "mismatched"
    shutil.copytree(peft_dir, mismatched)
    config = json.loads((mismatched / "adapter_config.json").read_text())
    (mismatched / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    one_line_error(upload(mismatched), "answered 400: adapter rejected by the engine")
    listed = ok(loraplex(cli_env, "adapters", "list", "--tenant", "acme", "--json"))
    assert "bad" not in [row["name"] for row in json.loads(listed)]

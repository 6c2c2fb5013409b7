"""The content-addressed adapter store on a real file system: uploads are kept only whole and only
under their own digest, adapter directories are links to immutable blobs, and `collect` removes only
what no row names and is past its grace period."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest

from loraplex.adapters.store import AdapterStore, StoreError, file_digest, parse_digest
from loraplex.engine.api import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE

CONFIG, WEIGHTS = b'{"r": 8}', bytes(range(256)) * 5000  # the weights span several write chunks


def digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


async def _chunks(data: bytes, size: int = 65536):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def receive(store: AdapterStore, data: bytes, claimed: str | None = None, announced: int | None = None):
    return asyncio.run(store.receive(claimed or digest(data), _chunks(data), announced))


def leftovers(store: AdapterStore) -> list[str]:
    return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())


@pytest.fixture
def store(tmp_path) -> AdapterStore:
    return AdapterStore(tmp_path / "store", max_blob_bytes=4 << 20)


def uploaded(store: AdapterStore, config: bytes = CONFIG, weights: bytes = WEIGHTS) -> dict[str, str]:
    receive(store, config)
    receive(store, weights)
    return {PEFT_CONFIG_FILE: digest(config), PEFT_WEIGHTS_FILE: digest(weights)}


def test_an_upload_is_kept_read_only_under_its_digest(store):
    assert store.blob(digest(WEIGHTS)) is None
    blob = receive(store, WEIGHTS)
    assert (blob.digest, blob.size) == (digest(WEIGHTS), len(WEIGHTS))
    assert store.blob(digest(WEIGHTS).upper().replace("SHA256", "sha256")) == blob
    path = store.root / "blobs" / "sha256" / parse_digest(blob.digest)
    assert path.read_bytes() == WEIGHTS and file_digest(path) == blob.digest
    assert path.stat().st_mode & 0o777 == 0o444
    inode = path.stat().st_ino
    receive(store, WEIGHTS)  # the same bytes again: the blob already there stays
    assert path.stat().st_ino == inode and leftovers(store) == [f"blobs/sha256/{path.name}"]


@pytest.mark.parametrize("claimed", ["sha256:" + "0" * 64, None])
def test_bytes_that_do_not_match_their_digest_or_are_too_large_leave_nothing(store, claimed):
    if claimed is None:  # too large, found while streaming and from the announced size
        big = os.urandom(store.max_blob_bytes + 1)
        with pytest.raises(StoreError) as err:
            receive(store, big)
        assert err.value.code == "too_large"
        with pytest.raises(StoreError) as err:
            receive(store, CONFIG, announced=store.max_blob_bytes + 1)
        assert err.value.code == "too_large"
    else:
        with pytest.raises(StoreError) as err:
            receive(store, WEIGHTS, claimed=claimed)
        assert err.value.code == "digest_mismatch" and digest(WEIGHTS) in err.value.message
        assert store.blob(claimed) is None
    assert leftovers(store) == []


@pytest.mark.parametrize("text", ["sha256:abc", "md5:" + "0" * 64, "0" * 64, "sha256:" + "g" * 64])
def test_a_malformed_digest_is_refused(store, text):
    with pytest.raises(StoreError) as err:
        store.blob(text)
    assert err.value.code == "invalid_digest" and "sha256:<64 hex digits>" in err.value.message


def test_an_adapter_directory_links_its_blobs_and_the_same_files_share_one(store):
    files = uploaded(store)
    first = store.adapter_dir(files)
    assert sorted(p.name for p in first.iterdir()) == sorted([PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, "manifest.json"])
    weights = store.root / "blobs" / "sha256" / parse_digest(files[PEFT_WEIGHTS_FILE])
    assert (first / PEFT_WEIGHTS_FILE).stat().st_ino == weights.stat().st_ino  # a link, not a copy
    assert (first / PEFT_CONFIG_FILE).read_bytes() == CONFIG
    assert store.adapter_dir(dict(reversed(files.items()))) == first
    other = store.adapter_dir(uploaded(store, config=b'{"r": 16}'))
    assert other != first and (other / PEFT_WEIGHTS_FILE).stat().st_ino == weights.stat().st_ino
    assert not any((store.root / "tmp").iterdir())


def test_an_adapter_directory_needs_exactly_the_peft_files_all_uploaded(store):
    files = uploaded(store)
    for bad, code in (({PEFT_CONFIG_FILE: files[PEFT_CONFIG_FILE]}, "invalid_files"),
                      ({**files, "adapter_model.bin": files[PEFT_WEIGHTS_FILE]}, "invalid_files"),
                      ({**files, PEFT_WEIGHTS_FILE: digest(b"never sent")}, "blob_missing"),
                      ({**files, PEFT_WEIGHTS_FILE: "not-a-digest"}, "invalid_digest")):
        with pytest.raises(StoreError) as err:
            store.adapter_dir(bad)
        assert err.value.code == code, err.value.message
    assert not (store.root / "adapters").exists()


def age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_collect_removes_only_unnamed_files_past_their_grace_period(store):
    shared = store.adapter_dir(uploaded(store))  # named by a row
    dropped = store.adapter_dir(uploaded(store, config=b'{"r": 4}'))  # its row deleted
    fresh = store.adapter_dir(uploaded(store, config=b'{"r": 2}'))  # being registered now
    stray = receive(store, b"uploaded, never registered")
    (store.root / "tmp" / "blob-crashed").write_bytes(b"half an upload")
    for path in [*(store.root / "blobs" / "sha256").iterdir(), shared, dropped,
                 store.root / "tmp" / "blob-crashed"]:
        age(path, 7200)

    done = store.collect([str(shared)], min_age_s=3600)
    assert (done.adapters, done.blobs) == (1, 2)  # `dropped`, its config blob and the stray blob
    assert done.bytes_freed == len(b'{"r": 4}') + len(b"uploaded, never registered") + len(b"half an upload")
    assert shared.is_dir() and fresh.is_dir() and not dropped.exists()
    assert (shared / PEFT_WEIGHTS_FILE).read_bytes() == WEIGHTS and store.blob(stray.digest) is None
    assert store.blob(digest(WEIGHTS)) is not None  # shared by the named directory
    assert store.collect([str(shared), str(fresh)], min_age_s=3600) == type(done)(0, 0, 0)

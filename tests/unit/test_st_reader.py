"""The safetensors reader of adapter loads: views equal to the safetensors library's tensors, odd
alignments and mixed dtypes, malformed files refused with ValueError, and reads into a recycled buffer
from the page cache or from the disk (O_DIRECT)."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.lora.st_reader import (
    DIRECT_ALIGN,
    drop_from_page_cache,
    flat_view,
    parse_safetensors,
    read_file,
    resident_pages,
    view,
)


def read_safetensors(path) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    entries, region = parse_safetensors(read_file(path))
    return {name: view(region, e) for name, e in entries.items()}, flat_view(region, entries)


def raw_file(path, entries: dict[str, tuple[str, list[int], bytes]], pad: int = 0) -> None:
    """Writes a safetensors file by hand: {name: (dtype, shape, data bytes)} in order, the header
    padded with `pad` spaces (which shifts the data region's alignment)."""
    header, data = {}, b""
    for name, (dtype, shape, blob) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps(header).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_matches_the_safetensors_library(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(3 + i, 5, generator=gen) for i in range(12)} | {"scalar": torch.tensor(2.5)}
    save_file(tensors, tmp_path / "a.safetensors")
    got, whole = read_safetensors(tmp_path / "a.safetensors")
    expected = load_file(tmp_path / "a.safetensors")
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].shape == t.shape and got[name].is_contiguous() and torch.equal(got[name], t)
    assert whole is not None and whole.numel() == sum(t.numel() for t in expected.values())
    assert torch.equal(whole.sort().values, torch.cat([t.reshape(-1) for t in expected.values()]).sort().values)


@pytest.mark.parametrize("pad", [0, 1, 2, 3])
def test_mixed_dtypes_and_misaligned_offsets(tmp_path, pad):
    half = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float16)  # 6 bytes: the next tensor is misaligned
    single = torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=torch.float32)
    raw_file(tmp_path / "m.safetensors", {"h": ("F16", [3], half.numpy().tobytes()),
                                          "f": ("F32", [2, 2], single.numpy().tobytes())}, pad=pad)
    got, whole = read_safetensors(tmp_path / "m.safetensors")
    assert torch.equal(got["h"], half) and torch.equal(got["f"], single)
    assert whole is None  # two dtypes: no one flat view


@pytest.mark.parametrize("content, needle", [
    (b"\x01\x00", "shorter than the 8-byte header"),
    (struct.pack("<Q", 100) + b"{}", "runs past the end"),
    (struct.pack("<Q", 4) + b"nope", "not valid JSON"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
])
def test_malformed_headers_refused(tmp_path, content, needle):
    (tmp_path / "bad.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=needle):
        read_safetensors(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("entry, needle", [
    (("F32", [2, 2], b"\0" * 12), "do not fit the file"),  # 12 bytes for 16
    (("F32", [-1, 4], b""), "do not fit the file"),
    (("Q4", [2], b"\0" * 2), "malformed header entry"),
    (("F32", "2x2", b"\0" * 16), "malformed header entry"),
])
def test_malformed_tensor_entries_refused(tmp_path, entry, needle):
    raw_file(tmp_path / "bad.safetensors", {"w": entry})
    with pytest.raises(ValueError, match=needle):
        read_safetensors(tmp_path / "bad.safetensors")


def test_reads_into_a_recycled_buffer_when_the_file_fits(tmp_path):
    tensors = {"w": torch.arange(12, dtype=torch.float32).view(3, 4)}
    save_file(tensors, tmp_path / "w.safetensors")
    size = (tmp_path / "w.safetensors").stat().st_size
    spare = torch.full((2 * DIRECT_ALIGN,), 7, dtype=torch.uint8)  # room for one aligned block wherever it starts
    data = read_file(tmp_path / "w.safetensors", into=spare)
    assert len(data) == size and data.data_ptr() % DIRECT_ALIGN == 0
    assert spare.data_ptr() <= data.data_ptr() < spare.data_ptr() + DIRECT_ALIGN  # inside the spare
    entries, region = parse_safetensors(data)
    assert torch.equal(view(region, entries["w"]), tensors["w"])
    small = torch.zeros(DIRECT_ALIGN, dtype=torch.uint8)[1:]  # no aligned block fits: a new buffer, untouched
    data = read_file(tmp_path / "w.safetensors", into=small)
    assert not small.data_ptr() <= data.data_ptr() < small.data_ptr() + len(small)
    assert len(data) == size and data.data_ptr() % DIRECT_ALIGN == 0 and not small.any()


def test_flat_view_only_when_tensors_tile_an_aligned_region(tmp_path):
    a, b = torch.ones(4), torch.full((2,), 2.0)
    aligned = 0
    for pad in range(4):  # one of four header paddings puts the data region on a 4-byte boundary
        raw_file(tmp_path / "t.safetensors", {"a": ("F32", [4], a.numpy().tobytes()),
                                              "b": ("F32", [2], b.numpy().tobytes())}, pad=pad)
        entries, region = parse_safetensors(read_file(tmp_path / "t.safetensors"))
        if region.storage_offset() % 4:
            assert flat_view(region, entries) is None
            continue
        aligned += 1
        assert torch.equal(flat_view(region, entries), torch.cat([a, b]))
        without_b = {k: e for k, e in entries.items() if k != "b"}  # b's bytes now belong to no tensor
        assert flat_view(region, without_b) is None
    assert aligned == 1


def mincore_pages(path) -> int:
    """How many of the file's pages the page cache holds, told by mincore over a shared mapping (any Linux;
    a mapping only looks, it reads nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                             ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))


def kernel_has_cachestat() -> bool:
    with open(__file__, "rb") as f:
        return resident_pages(f.fileno()) is not None


def cached_pages(path) -> int:
    """How many of the file's pages the page cache holds: cachestat where the kernel has it (6.5 and
    later), else mincore."""
    with open(path, "rb") as f:
        pages = resident_pages(f.fileno())
    return mincore_pages(path) if pages is None else pages


def test_cachestat_and_mincore_agree_where_the_kernel_has_cachestat(tmp_path):
    if not kernel_has_cachestat():
        pytest.skip("this kernel has no cachestat (before Linux 6.5): the reader always reads through the "
                    "page cache, which the 'no cachestat' state of the next test covers")
    path = tmp_path / "f"
    path.write_bytes(os.urandom(5 * mmap.PAGESIZE + 3))
    drop_from_page_cache(path)
    with open(path, "rb") as f:
        f.seek(2 * mmap.PAGESIZE)
        f.read(10)  # (readahead may bring in the pages after it, never those before)
        os.posix_fadvise(f.fileno(), 0, 2 * mmap.PAGESIZE, os.POSIX_FADV_DONTNEED)
    counts = []
    for _ in range(2):
        with open(path, "rb") as f:
            counts.append((resident_pages(f.fileno()), mincore_pages(path)))
    assert counts[0][0] == counts[0][1] and 1 <= counts[0][0] <= 4 and counts[0] == counts[1]


# sizes around the O_DIRECT block: below one, exactly one, one past three, a split read's halves
@pytest.mark.parametrize("size", [1001, DIRECT_ALIGN, 3 * DIRECT_ALIGN + 1, 5 * DIRECT_ALIGN - 7])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("state", ["cached", "cold", "partly cached", "no direct I/O", "no cachestat"])
def test_read_file_returns_every_byte(tmp_path, monkeypatch, size, split, state):
    """Every byte, into new memory and into a recycled buffer: copied from the page cache when it holds the
    whole file, else read with O_DIRECT (which leaves the page cache as it was), and where direct I/O is
    not offered, or the kernel cannot say what the page cache holds, read through the page cache."""
    from loraplex.engine.lora import st_reader

    through_cache = state in ("no direct I/O", "no cachestat") or not kernel_has_cachestat()

    blob = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    path = tmp_path / "f"
    path.write_bytes(blob.numpy().tobytes())
    monkeypatch.setattr(st_reader, "SPLIT_READ_BYTES", 64 if split else 1 << 40)
    if state == "no direct I/O":
        monkeypatch.setattr(st_reader, "_open_direct", lambda path: None)
    if state == "no cachestat":  # as on a kernel before 6.5
        monkeypatch.setattr(st_reader, "resident_pages", lambda fd: None)
    pages = -(-size // mmap.PAGESIZE)
    assert cached_pages(path) == pages  # just written
    if state != "cached":
        drop_from_page_cache(path)
        assert cached_pages(path) == 0  # (the test's premise: eviction works on tmp_path's file system)
    if state == "partly cached":  # the first page only
        path.read_bytes()
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), mmap.PAGESIZE, 0, os.POSIX_FADV_DONTNEED)
        assert cached_pages(path) == 1
    before = cached_pages(path)
    spare = torch.zeros(4 * DIRECT_ALIGN + size, dtype=torch.uint8)
    for into in (None, spare):
        assert torch.equal(read_file(path, into=into), blob)
    assert cached_pages(path) == (pages if through_cache else before)


def test_identical_headers_share_one_read_only_parse_and_the_file_size_still_counts(tmp_path):
    a = torch.arange(6, dtype=torch.float32)
    for name in ("one", "two"):  # two files, byte-identical headers
        raw_file(tmp_path / f"{name}.safetensors", {"a": ("F32", [6], a.numpy().tobytes())})
    first, _ = parse_safetensors(read_file(tmp_path / "one.safetensors"))
    second, region = parse_safetensors(read_file(tmp_path / "two.safetensors"))
    assert first is second and torch.equal(view(region, second["a"]), a)
    with pytest.raises(TypeError):
        second["b"] = second["a"]  # shared between loads: nobody may change it
    data = read_file(tmp_path / "two.safetensors")
    with pytest.raises(ValueError, match="do not fit the file"):  # the same header over a cut-short file
        parse_safetensors(data[:-4].clone())

"""Block-quantized weights kept as GGUF stores them (Q8_0, Q4_0, Q4_1, and the K-quants Q4_K, Q5_K, Q6_K), so a
decode step reads 4.5-8.5 bits a weight instead of 32.

- `BlockWeight` is a projection [out, in] as rows of blocks (32 weights, or 256 for a K-quant: uint8
  [out, in / block weights * block bytes]); row operations (select, permute, concatenate) work on whole rows,
  as the loaders need.
- `dequantize` gives exactly the values gguf's own dequantization gives (the C kernels compute with the
  same ones: kernels/cpu/quant_blocks.h); `quantize` makes blocks from fp32 weights (per-block scales,
  rounded to nearest), for `--weight-dtype int8|int4` over a float checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block of Q8_0 / Q4_0 / Q4_1 (and per sub-block group of a K-quant)
SUPER_BLOCK = 256  # weights per K-quant block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q5_k": 176, "q6_k": 210}
BLOCK_WEIGHTS = {fmt: SUPER_BLOCK if fmt.endswith("_k") else BLOCK for fmt in BLOCK_BYTES}
# --weight-dtype int8 / int4 on the CPU: the block format a float checkpoint is quantized to
CPU_QUANTIZED = {"int8": "q8_0", "int4": "q4_1"}
# ... on CUDA: kernels/quant_linear.py's kinds (per-channel int8 through the W8A16 kernel, FP8 on sm89+)
CUDA_QUANTIZED = {"int8": "int8", "fp8": "fp8"}


@dataclass(frozen=True)
class BlockWeight:
    """A weight [out_features, in_features] in one of BLOCK_BYTES' formats."""

    fmt: str
    data: torch.Tensor  # uint8 [out_features, in_features / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt]]

    def __post_init__(self) -> None:
        if self.fmt not in BLOCK_BYTES:
            raise ValueError(f"block format {self.fmt!r} is not one of {', '.join(BLOCK_BYTES)}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] % BLOCK_BYTES[self.fmt]:
            raise ValueError(f"{self.fmt} blocks must be uint8 [rows, blocks * {BLOCK_BYTES[self.fmt]}], got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.data.shape[1] // BLOCK_BYTES[self.fmt] * BLOCK_WEIGHTS[self.fmt]))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to(self, device=None, dtype=None) -> BlockWeight:
        """On `device` (blocks keep their format: `dtype` is the model's, for the float tensors beside them)."""
        return self if device is None else BlockWeight(self.fmt, self.data.to(device))

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [n] dequantized to fp32 [n, in]: an embedding lookup without a float copy of the table."""
        return dequantize(BlockWeight(self.fmt, torch.index_select(self.data, 0, index.to(self.data.device))))

    @staticmethod
    def cat(weights: list[BlockWeight]) -> BlockWeight:
        fmts = {w.fmt for w in weights}
        if len(fmts) != 1:
            raise ValueError(f"cannot concatenate weights of formats {sorted(fmts)}")
        return BlockWeight(weights[0].fmt, torch.cat([w.data for w in weights]))


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """fp16 values [..., 1] from their two bytes [..., 2], widened to fp32 (exact)."""
    return raw.contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """(b >> s) & mask for each shift: bytes [..., n] -> [..., len(shifts), n]."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=b.device).view(-1, 1)
    return (b.unsqueeze(-2) >> s) & mask


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 6-bit sub-block scales and mins [..., 8] (fp32) from their 12 bytes [..., 12], as gguf's
    Q4_K.get_scale_min unpacks them."""
    d, m, md = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def _dequantize_k(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """K-quant blocks [rows, n, bytes] -> fp32 [rows, n, 256], as gguf's Q4_K / Q5_K / Q6_K dequantize_blocks:
    q * (d * sc) - dmin * mn, or (q - 32) * (d * sc) for Q6_K, each product and difference rounded once."""
    rows, n = blocks.shape[:2]
    if fmt == "q6_k":
        lo = _bits(blocks[..., :128].reshape(rows, n, 2, 64), [0, 4], 15)  # [rows, n, 2, 2, 64]
        hi = _bits(blocks[..., 128:192].reshape(rows, n, 2, 32), [0, 2, 4, 6], 3)  # [rows, n, 2, 4, 32]
        q = (lo.reshape(rows, n, 16, 16) | (hi.reshape(rows, n, 16, 16) << 4)).to(torch.int16) - 32
        d = _halves(blocks[..., 208:210]) * blocks[..., 192:208].contiguous().view(torch.int8).float()  # [rows, n, 16]
        return (d.unsqueeze(-1) * q.float()).reshape(rows, n, -1)
    sc, mn = _k_scales(blocks[..., 4:16])  # [rows, n, 8]
    d, dm = _halves(blocks[..., 0:2]) * sc, _halves(blocks[..., 2:4]) * mn  # [rows, n, 8]
    qs = blocks[..., 16:] if fmt == "q4_k" else blocks[..., 48:]  # [rows, n, 128]
    q = _bits(qs.reshape(rows, n, 4, 32), [0, 4], 15).reshape(rows, n, 8, 32)  # sub-blocks of 32
    if fmt == "q5_k":
        q = q | (_bits(blocks[..., 16:48], list(range(8)), 1) << 4)  # [rows, n, 8, 32]
    return (d.unsqueeze(-1) * q.float() - dm.unsqueeze(-1)).reshape(rows, n, -1)


def dequantize(w: BlockWeight) -> torch.Tensor:
    """fp32 [out, in]: weight i of a block is q * d (Q8_0), (nib - 8) * d (Q4_0) or nib * d + m (Q4_1),
    a product then a sum, each rounded once, or a K-quant's (_dequantize_k): gguf's dequantization, bit for
    bit."""
    data = w.data  # (once: a PanelBlocks unpacks it on each access)
    rows = data.shape[0]
    blocks = data.view(rows, -1, BLOCK_BYTES[w.fmt])  # [rows, blocks, bytes]
    if w.fmt.endswith("_k"):
        return _dequantize_k(w.fmt, blocks).reshape(rows, -1)
    d = _halves(blocks[..., 0:2])  # [rows, blocks, 1]
    if w.fmt == "q8_0":
        out = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    else:
        qs = blocks[..., 4 if w.fmt == "q4_1" else 2:]  # [rows, blocks, 16]
        nib = torch.cat((qs & 15, qs >> 4), dim=-1)  # [rows, blocks, 32]: weights 0-15, then 16-31
        q4_0 = w.fmt == "q4_0"
        out = (nib.to(torch.int16) - 8).float() * d if q4_0 else nib.float() * d + _halves(blocks[..., 2:4])
    return out.reshape(rows, -1)


def quantize(w: torch.Tensor, fmt: str) -> BlockWeight:
    """Blocks of fp32 weights [out, in] (in a multiple of 32): Q8_0 with d = max|w| / 127, Q4_1 with
    m = min w and d = (max w - m) / 15 (d and m rounded to fp16 first, the integers then rounded to
    nearest against them). Q4_0 is not made here (Q4_1 loses less at the same speed)."""
    if fmt not in ("q8_0", "q4_1"):
        raise ValueError(f"quantize makes q8_0 or q4_1 blocks, not {fmt!r}")
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"a weight quantized to {fmt} must be [out, in] with in a multiple of {BLOCK}, "
                         f"got {tuple(w.shape)}")
    rows = w.shape[0]
    x = w.detach().float().reshape(rows, -1, BLOCK)  # [rows, blocks, 32]
    if fmt == "q8_0":
        d = (x.abs().amax(-1, keepdim=True) / 127).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
        q = torch.clamp(torch.round(x * inv), -127, 127).to(torch.int8)
        parts = (d.view(torch.uint8), q.view(torch.uint8))
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d, m = ((hi - lo) / 15).half(), lo.half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(()))
        q = torch.clamp(torch.round((x - m.float()) * inv), 0, 15).to(torch.uint8)
        parts = (d.view(torch.uint8), m.view(torch.uint8), q[..., :16] | (q[..., 16:] << 4))
    return BlockWeight(fmt, torch.cat(parts, dim=-1).reshape(rows, -1).contiguous())

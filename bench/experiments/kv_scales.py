"""Experiment: KV cache scale layouts by fake quantization (K/V quantized then dequantized as a cache would hold them).

The engine runs as usual (fp32 weights and compute, fp32 cache holding the exact K/V) on the torch_sdpa backend,
swapped for a subclass that keeps a shadow cache per layer: each step's K/V are written exactly, the touched blocks'
shadow rows are recomputed under the scheme, and attention (first chunks included) reads the shadow only.

Schemes per side (K or V), "kind[:sym|asym][:mode]":
  none | fp16 | bf16                 the exact values, or cast and back
  token[:sym|asym]                   one scale per (token, kv head); token:sym is kv_dtype.quantize itself
  chan[:sym|asym][:exact|resid|inc][:h]  one scale (and offset) per (block of 16 tokens, kv head, channel):
      exact  the open block requantized from its exact values at every write (a cache keeping them aside)
      resid  the open block kept exact, quantized once full (KIVI's residual)
      inc    incremental: a write that widens a channel's range re-rounds the block's stored entries of that
             channel to the new grid (double rounding); a write's own tokens quantized together (a prefill
             chunk's full blocks at once)
      seq    incremental, one token at a time in position order whatever the write: per token, widen each
             channel's [min, max] by it, re-round the block's earlier rows of the widened channels from their
             stored values, then quantize the token; a block's bytes depend only on its tokens (not on chunking)
":h": the block's scales and offsets rounded to fp16 as stored (else fp32).
  chan|token[:sym|asym]:pos|pos16    by position: a block is quantized once, from its exact values, when it fills;
      a query at position p reads the blocks before its own (index < p // block) quantized and its own block's
      rows (positions <= p) exact (pos16: rounded to fp16, as a side buffer held in fp16 would keep them), so
      attention does not depend on how a prompt was cut into chunks (a custom attention, _pos_attend)
  smooth[:sym|asym][:int8|fp8][:alpha][:nomean]   static per-channel smoothing, then one scale per (token, kv
      head): x' = (x - m) / s^alpha, with m and s each channel's mean and RMS (per layer and kv head) over a
      calibration text that is not a bench prompt (CALIBRATION); rows hold x' quantized per token, and the
      reader gets x'' s^alpha + m. In an engine m and s fold into the query (q.m shifts a row's scores by a
      constant, which softmax ignores; q_c s_c multiplies back), so the cache layout stays per token.
  group[:sym|asym]:G[:smooth]        per token, one scale (fp16) per G channels, after smoothing or not
  third field "own": a row scheme (smooth, token, group) read as pos reads, its own block exact ("own+sink":
      and the sequence's first token exact)
  chan[:sym|asym]:posq               as pos, but the open block held per token (int8, symmetric) and full blocks
      made from those rows (no exact side buffer): the cheap variant of pos
Asymmetric: q = round((x - min) / s) in [0, 255], s = (max - min) / 255, value = q * s + min (min kept as a float).

Run: PYTHONPATH=. .venv/bin/python bench/experiments/kv_scales.py --schemes "token,token" "chan:sym:exact,token"
(each argument "K,V"); prints one JSON line per scheme. Smoothing is calibrated on CALIBRATION with
--calib-tokens generated tokens each (--oracle: on the bench prompts, a diagnosis). --block-size: the engine's
(and the scales') block; --budget: the chunked-prefill budget of the schemes' engines; --selftest only checks
that "seq" stores the same values whatever the chunking.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from loraplex.cli.bench.engine import bench_prompts
from loraplex.cli.bench.kv import next_token_agreement, positions_alike
from loraplex.cli.bench.lora import agreement
from loraplex.cli.bench.quant import _requests
from loraplex.engine.api import GenerateRequest
from loraplex.engine.attention.base import write_kv
from loraplex.engine.attention.torch_sdpa import TorchSdpaBackend
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.kv.kv_dtype import dequantize, quantize
from loraplex.engine.kv.smoothing import CALIBRATION
from loraplex.engine.models.loader import load_model, resolve_model

MODEL = "smollm2-135m"


def _grid(lo: torch.Tensor, hi: torch.Tensor, sym: bool, half: bool = False):
    """(scale, offset) of the int8 grid covering [lo, hi] (per channel); half: both stored as fp16."""
    if sym:
        s = torch.maximum(hi.abs(), lo.abs()) / 127
        off = torch.zeros_like(s)
    else:
        s, off = (hi - lo) / 255, lo
    return (s.half().float(), off.half().float()) if half else (s, off)


def _round(x: torch.Tensor, s: torch.Tensor, off: torch.Tensor, sym: bool) -> torch.Tensor:
    safe = torch.where(s > 0, s, 1.0)
    if sym:
        return (x / safe).round().clamp(-127, 127) * s
    return ((x - off) / safe).round().clamp(0, 255) * s + off


class Side:
    """One scheme over one cache (K or V of one layer): the shadow rows attention reads."""

    def __init__(self, spec: str, true: torch.Tensor, calib: tuple[torch.Tensor, torch.Tensor] | None = None):
        parts = spec.split(":")
        self.group = 0
        if parts[0] == "group":  # group:sym|asym:G[:smooth]: per token, one scale per G channels
            self.group = int(parts[2])
            if len(parts) > 3:
                mean, rms = calib
                self.m, self.s = mean, rms.clamp_min(1e-6)
            else:
                self.m, self.s = 0.0, 1.0
            parts = parts[:2]
        if parts[0] == "smooth":  # smooth:sym:int8:alpha[:nomean]
            self.elem = torch.float8_e4m3fn if len(parts) > 2 and parts[2] == "fp8" else torch.int8
            alpha = float(parts[3]) if len(parts) > 3 else 1.0
            mean, rms = calib  # [kv_heads, head_dim] each
            self.m = torch.zeros_like(mean) if len(parts) > 4 and parts[4] == "nomean" else mean
            self.s = rms.clamp_min(1e-6) ** alpha
            parts = parts[:2]
        self.kind = parts[0]
        self.sym = (parts[1] if len(parts) > 1 else "sym") == "sym"
        self.mode = parts[2] if len(parts) > 2 else "exact"
        self.half = len(parts) > 3 and parts[3] == "h"  # block scales and offsets kept as fp16
        self.true = true  # [blocks, bs, kv_heads, head_dim] fp32, exact values
        self.shadow = torch.zeros_like(true)  # pos modes: the full blocks' quantized values ("far")
        self.pos = self.mode in ("pos", "pos16", "posq")
        self.rowwise_pos = False  # set by keep_own_block_exact: rows quantized one by one, own block exact
        # what a query reads of its own block: the exact values (pos), fp16 (pos16), else the shadow itself
        self.near = (true if self.mode == "pos" else torch.zeros_like(true)) if self.pos else self.shadow
        if self.kind == "chan" and self.mode in ("inc", "seq"):
            self.lo = torch.zeros(true.shape[0], *true.shape[2:])  # [blocks, kv_heads, head_dim]
            self.hi = torch.zeros_like(self.lo)

    def update(self, slots: torch.Tensor) -> None:
        bs, hd = self.true.shape[1], self.true.shape[-1]
        flat_t = self.true.view(-1, *self.true.shape[2:])
        flat_s = self.shadow.view(-1, *self.true.shape[2:])
        if self.pos and not self.rowwise_pos:
            if self.mode == "pos16":
                self.near.view(-1, *self.true.shape[2:])[slots] = flat_t[slots].half().float()
            if self.mode == "posq":  # the open block held per token (int8, symmetric), full blocks made from it
                self.near.view(-1, *self.true.shape[2:])[slots] = dequantize(quantize(flat_t[slots], torch.int8),
                                                                            hd, torch.float32)
            src = self.near if self.mode == "posq" else self.true
            for b in (slots[slots % bs == bs - 1] // bs).unique().tolist():  # blocks this write fills
                self.shadow[b] = self._whole(src[b])
            return
        if self.kind == "group":
            x = (flat_t[slots] - self.m) / self.s
            g = x.unflatten(-1, (-1, self.group))  # [t, kv, groups, G]
            if self.sym:
                sc = g.abs().amax(-1, keepdim=True).half().float() / 127
                g = (g / torch.where(sc > 0, sc, 1.0)).round().clamp(-127, 127) * sc
            else:
                g = _round(g, *_grid(g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), False, True), False)
            flat_s[slots] = g.flatten(-2) * self.s + self.m
            return
        if self.kind == "smooth":
            x = (flat_t[slots] - self.m) / self.s
            if self.sym:
                x = dequantize(quantize(x, self.elem), hd, torch.float32)
            else:
                x = _round(x, *_grid(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), False), False)
            flat_s[slots] = x * self.s + self.m
            return
        if self.kind in ("none", "fp16", "bf16", "token"):
            x = flat_t[slots]
            if self.kind == "fp16":
                x = x.half().float()
            elif self.kind == "bf16":
                x = x.bfloat16().float()
            elif self.kind == "token" and self.sym:
                x = dequantize(quantize(x, torch.int8), hd, torch.float32)
            elif self.kind == "token":
                x = _round(x, *_grid(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), False), False)
            flat_s[slots] = x
            return
        blocks, offs = slots // bs, slots % bs
        for b in blocks.unique().tolist():
            sel = blocks == b
            first, last = int(offs[sel].min()), int(offs[sel].max())
            if self.mode == "inc":
                self._inc(b, first, last)
                continue
            if self.mode == "seq":  # one token at a time: the same bytes whatever the write's chunking
                for o in range(first, last + 1):
                    self._inc(b, o, o)
                continue
            x = self.true[b, :last + 1]  # [t, kv_heads, head_dim]
            if self.mode == "resid" and last < bs - 1:
                self.shadow[b, :last + 1] = x
                continue
            s, off = _grid(x.amin(0), x.amax(0), self.sym, self.half)
            self.shadow[b, :last + 1] = _round(x, s, off, self.sym)

    def keep_own_block_exact(self) -> None:
        """A row scheme (smooth, token, ...) whose reader takes its own block's rows exact (an fp side block)."""
        self.pos, self.rowwise_pos, self.near = True, True, self.true

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """A full block [bs, kv_heads, head_dim] quantized once: per channel over the block, or per token."""
        if self.kind == "none":  # "none:sym:pos": the custom attention over exact values (a check of it)
            return x
        if self.kind == "chan":
            return _round(x, *_grid(x.amin(0), x.amax(0), self.sym, self.half), self.sym)
        assert self.kind == "token", self.kind
        if self.sym:
            return dequantize(quantize(x, torch.int8), x.shape[-1], torch.float32)
        return _round(x, *_grid(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), False), False)

    def _inc(self, b: int, first: int, last: int) -> None:
        x = self.true[b, first:last + 1]
        lo, hi = x.amin(0), x.amax(0)
        if first > 0:  # the block's range so far (a write at offset 0 starts a block: a fresh one, or reused)
            lo, hi = torch.minimum(lo, self.lo[b]), torch.maximum(hi, self.hi[b])
        s, off = _grid(lo, hi, self.sym, self.half)
        if first > 0:
            old = _grid(self.lo[b], self.hi[b], self.sym, self.half)
            changed = (s != old[0]) | (off != old[1])  # [kv_heads, head_dim]: only those channels re-rounded
            prev = self.shadow[b, :first]
            self.shadow[b, :first] = torch.where(changed, _round(prev, s, off, self.sym), prev)
        self.shadow[b, first:last + 1] = _round(x, s, off, self.sym)
        self.lo[b], self.hi[b] = lo, hi


def selftest() -> None:
    """"seq" on random data with outlier channels: one write, token by token, and two chunks store the same."""
    g = torch.Generator().manual_seed(0)
    bs, heads, hd = 16, 3, 64
    true = torch.randn(2, bs, heads, hd, generator=g)
    true[..., [3, 17, 40]] *= 30  # outlier channels
    true[:, 5:9, :, 17] += 200  # a late widening of one channel
    for spec in ("chan:asym:seq", "chan:sym:seq", "chan:asym:seq:h"):
        stores = []
        for cuts in ([0, 2 * bs], list(range(2 * bs + 1)), [0, 7, 2 * bs], [0, 3, 16, 21, 2 * bs]):
            side = Side(spec, true)
            for a, z in zip(cuts, cuts[1:], strict=False):
                side.update(torch.arange(a, z))
            stores.append(side.shadow.clone())
        assert all(torch.equal(stores[0], x) for x in stores[1:]), spec
        one = Side(spec.replace("seq", "exact"), true)  # each block rounded once from its exact values
        one.update(torch.arange(2 * bs))
        rms = [((x - true)[..., :3].pow(2).mean().sqrt().item()) for x in (stores[0], one.shadow)]
        print(f"selftest {spec}: 4 chunkings store identical values; rms err (plain channels) {rms[0]:.4g} "
              f"vs {rms[1]:.4g} rounded once")
    _selftest_pos(true)
    inc = []
    for cuts in ([0, 2 * bs], list(range(2 * bs + 1))):
        side = Side("chan:asym:inc", true)
        for a, z in zip(cuts, cuts[1:], strict=False):
            side.update(torch.arange(a, z))
        inc.append(side.shadow.clone())
    n = (inc[0] != inc[1]).sum().item()
    print(f"selftest chan:asym:inc (for contrast): one write vs token by token differ in {n} values")


def _selftest_pos(true: torch.Tensor) -> None:
    """"pos": the same shadows whatever the chunking, and _pos_attend (rows sharing a context, or each its own)
    against a direct loop: query p over the quantized rows of the blocks before its own, then its own exactly."""
    g = torch.Generator().manual_seed(1)
    bs, n = true.shape[1], true.shape[0] * true.shape[1]
    q = torch.randn(n, 6, true.shape[-1], generator=g)  # 6 heads over 3 kv heads
    for spec in ("chan:asym:pos", "chan:asym:pos16", "token:asym:pos"):
        sides = []
        for cuts in ([0, n], list(range(n + 1)), [0, 7, 16, 21, n]):
            ks, vs = Side(spec, true), Side("token:asym:pos", true * 0.5)
            for a, z in zip(cuts, cuts[1:], strict=False):
                ks.update(torch.arange(a, z))
                vs.update(torch.arange(a, z))
            sides.append((ks, vs))
        assert all(torch.equal(sides[0][i].shadow, x[i].shadow) for x in sides[1:] for i in (0, 1)), spec
        ks, vs = sides[0]
        kv = [t.view(-1, *t.shape[2:]) for t in (ks.shadow, ks.near, vs.shadow, vs.near)]
        pos = torch.arange(n)
        shared = _pos_attend(q, *kv, pos, pos, bs)
        per_row = _pos_attend(q, *(x.expand(n, *x.shape) for x in kv), pos, pos, bs)
        want = []
        for p in range(n):
            cut = p // bs * bs
            k = torch.cat([kv[0][:cut], kv[1][cut:p + 1]]).repeat_interleave(2, 1).transpose(0, 1)
            v = torch.cat([kv[2][:cut], kv[3][cut:p + 1]]).repeat_interleave(2, 1).transpose(0, 1)
            want.append(torch.nn.functional.scaled_dot_product_attention(q[p].unsqueeze(1), k, v)[:, 0])
        err = max((x - torch.stack(want)).abs().max().item() for x in (shared, per_row))
        assert err < 1e-4, (spec, err)
        print(f"selftest {spec}: 3 chunkings store identical values; attention matches a direct loop ({err:.1e})")




class Collect(TorchSdpaBackend):
    """The exact K rows each layer writes (keyed by its cache), for calibration."""

    name = "torch_sdpa"

    def __init__(self):
        self.ks: dict[int, list[torch.Tensor]] = {}
        self.vs: dict[int, list[torch.Tensor]] = {}

    skip_sink = False  # leave out each sequence's first token (kept exact by ",sink" schemes)

    def forward(self, q, k, v, k_cache, v_cache, meta):
        keep = torch.ones(k.shape[0], dtype=torch.bool)
        if self.skip_sink:
            keep[[p.start for p in meta.prefills if p.gather is None]] = False
        self.ks.setdefault(k_cache.data_ptr(), []).append(k[keep].detach().clone())
        self.vs.setdefault(k_cache.data_ptr(), []).append(v[keep].detach().clone())
        return super().forward(q, k, v, k_cache, v_cache, meta)


def calibrate(loaded, threads: int, new_tokens: int, texts=CALIBRATION, skip_sink: bool = False
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (in call order): each K channel's mean and RMS about it [kv_heads, head_dim] over CALIBRATION
    and the model's greedy replies to it."""
    core = make_core(loaded, "torch_sdpa", "float32", len(texts), threads)
    core.runner.model.attention = col = Collect()
    col.skip_sink = skip_sink
    generate(core, list(texts), new_tokens)
    out = []
    for key, rows in col.ks.items():
        stats = []
        for x in (torch.cat(rows), torch.cat(col.vs[key])):  # [tokens, kv_heads, head_dim]
            mean = x.mean(0)
            stats.append((mean, (x - mean).pow(2).mean(0).sqrt()))
        out.append(tuple(stats))
    print(f"calibrated on {sum(len(r) for r in next(iter(col.ks.values())))} steps' rows: "
          f"{torch.cat(next(iter(col.ks.values()))).shape[0]} tokens", flush=True)
    return out


class FakeQuantBackend(TorchSdpaBackend):
    name = "torch_sdpa"

    def __init__(self, k_spec: str, v_spec: str, calib: list | None = None, sink: str = ""):
        self.specs = (k_spec, v_spec)
        self.sink = sink
        self.sides: dict[int, tuple[Side, Side]] = {}
        self.calib = calib

    def forward(self, q, k, v, k_cache, v_cache, meta):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)  # the exact values
        key = k_cache.data_ptr()
        if key not in self.sides:
            ck, cv = self.calib[len(self.sides)] if self.calib else (None, None)
            self.sides[key] = (Side(self.specs[0], k_cache, ck), Side(self.specs[1], v_cache, cv))
        ks, vs = self.sides[key]
        ks.update(meta.slot_mapping)
        vs.update(meta.slot_mapping)
        if "own" in self.sink:  # a row scheme with each query's own block exact: see Side.keep_own_block_exact
            for side in (ks, vs):
                if not side.rowwise_pos:
                    side.keep_own_block_exact()
        sink = self.sink.replace("own", "").strip("+")
        if sink:  # sink/sinkk/sinkv: a sequence's first token (a first chunk's first row) kept exact on
            # both sides, K only or V only; row0: every block's first row
            if sink == "row0":
                rows = meta.slot_mapping[meta.slot_mapping % meta.block_size == 0]
            else:
                rows = meta.slot_mapping[[p.start for p in meta.prefills if p.gather is None]]
            for side in {"sink": (ks, vs), "sinkk": (ks,), "sinkv": (vs,), "row0": (ks, vs)}[sink]:
                flat_t, flat_s = (t.view(-1, *side.true.shape[2:]) for t in (side.true, side.shadow))
                flat_s[rows] = flat_t[rows]
        if ks.pos or vs.pos:
            return self._by_position(q, ks, vs, meta)
        n_kv = k.shape[1]
        kq = ks.shadow.view(-1, n_kv, k.shape[2])[meta.slot_mapping]
        vq = vs.shadow.view(-1, n_kv, k.shape[2])[meta.slot_mapping]
        return super().forward(q, kq, vq, ks.shadow, vs.shadow, meta)

    @staticmethod
    def _by_position(q: torch.Tensor, ks: Side, vs: Side, meta) -> torch.Tensor:
        """Every row attends by its position: earlier blocks from the sides' shadows, its own block from near."""
        n_tok, heads, hd = q.shape
        bs = meta.block_size
        srcs = [t.view(-1, *t.shape[2:]) for t in (ks.shadow, ks.near, vs.shadow, vs.near)]  # [slots, kv, hd]
        out = q.new_empty(n_tok, heads, hd)
        if meta.decode_rows is not None:  # each row its own context: block table, length
            n = meta.decode_rows.shape[0]
            ctx = (meta.decode_blocks.unsqueeze(-1) * bs + torch.arange(bs)).view(n, -1)  # [n, C] slots
            kv = [x[ctx] for x in srcs]  # [n, C, kv, hd]
            out[meta.decode_rows] = _pos_attend(q[meta.decode_rows], *kv, meta.decode_lens - 1,
                                                torch.arange(ctx.shape[1]), bs)
        for p in meta.prefills:
            ctx = meta.slot_mapping[p.start:p.end] if p.gather is None else p.gather
            n = p.end - p.start
            kv = [x[ctx] for x in srcs]  # [C, kv, hd]: shared by the chunk's rows
            out[p.start:p.end] = _pos_attend(q[p.start:p.end], *kv, torch.arange(len(ctx) - n, len(ctx)),
                                             torch.arange(len(ctx)), bs)
        return out.view(n_tok, heads * hd)


def _pos_attend(q, kf, kn, vf, vn, q_pos, k_pos, bs):
    """q [n, heads, hd] at positions q_pos [n]; keys at k_pos [C]: k*/v* [C, kv, hd] shared, or [n, C, kv, hd]
    per row; "f" (quantized) for blocks before the query's own, "n" (exact) for its own block up to itself."""
    group = q.shape[1] // kf.shape[-2]
    kf, kn, vf, vn = (x.repeat_interleave(group, dim=-2) for x in (kf, kn, vf, vn))
    eq = "nhd,chd->nhc" if kf.dim() == 3 else "nhd,nchd->nhc"
    qb, kb = (q_pos // bs).unsqueeze(1), (k_pos // bs).unsqueeze(0)
    near = ((kb == qb) & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))).unsqueeze(1)  # [n, 1, C]
    far = (kb < qb).unsqueeze(1)
    scale = q.shape[-1] ** -0.5
    s = torch.where(near, torch.einsum(eq, q, kn), torch.einsum(eq, q, kf)) * scale
    p = torch.softmax(s.masked_fill(~(near | far), float("-inf")), dim=-1)
    ev = "nhc,chd->nhd" if vf.dim() == 3 else "nhc,nchd->nhd"
    return torch.einsum(ev, p * near, vn) + torch.einsum(ev, p * far, vf)


def make_core(loaded, backend: str, kv: str, n: int, threads: int, block_size: int = 16,
              budget: int = 2048) -> EngineCore:
    cfg = EngineConfig(model=MODEL, device="cpu", dtype="float32", kv_cache_dtype=kv, max_num_seqs=n,
                       max_num_batched_tokens=budget, speculative_tokens=0, kv_cache_bytes=256 * 2**20,
                       attention_backend=backend, num_threads=threads, block_size=block_size)
    return EngineCore(cfg, loaded=loaded)


def generate(core: EngineCore, prompts: list[str], new_tokens: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for ev in core.run(_requests(prompts, new_tokens, MODEL, "g")):
        out.setdefault(ev.request_id.rsplit("-", 1)[1], []).extend(ev.token_ids)
    return out


def per_prompt(got: dict[str, list[int]], want: dict[str, list[int]]) -> list[float]:
    return [next((i for i, (a, b) in enumerate(zip(got[r], w, strict=False)) if a != b), len(w)) / len(w)
            for r, w in want.items()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", nargs="+", default=[], help='"K,V" each; "engine:<backend>:<kv dtype>" '
                    "runs the engine itself")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--wide", action="store_true", help="the 48 distinct bench prompts and each again ending "
                    "'End with a summary.' instead of 'Begin with an introduction.' (96; --prompts is ignored)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tf", action="store_true", help="teacher-forced next-token agreement too")
    ap.add_argument("--dump", help="a JSON file for every scheme's tokens (the reference's under 'ref')")
    ap.add_argument("--block-size", type=int, default=16, help="the engine's KV block (and the scales' block)")
    ap.add_argument("--budget", type=int, default=2048, help="the schemes' max_num_batched_tokens (chunked "
                    "prefill's budget; the reference keeps 2048)")
    ap.add_argument("--calib-tokens", type=int, default=64, help="greedy tokens generated after each "
                    "calibration text (their K rows count too)")
    ap.add_argument("--calib-skip-sink", action="store_true", help="calibration leaves out each text's first "
                    "token")
    ap.add_argument("--oracle", action="store_true", help="calibrate smoothing on the bench prompts themselves "
                    "(a diagnosis: what a perfect calibration would give)")
    ap.add_argument("--selftest", action="store_true", help='only check "seq" against chunking, then exit')
    args = ap.parse_args()
    if args.selftest:
        selftest()
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_model(resolve_model(MODEL), torch.float32, torch.device("cpu"))
    prompts = bench_prompts(args.prompts)
    if args.wide:
        base = bench_prompts(48)
        prompts = base + [p.replace("Begin with an introduction.", "End with a summary.") for p in base]
        args.prompts = len(prompts)
    ref_core = make_core(loaded, "torch_sdpa", "float32", args.prompts, args.threads, args.block_size)
    ref = generate(ref_core, prompts, args.new_tokens)  # the fp32 cache on torch_sdpa: the reference
    ids = [ref_core.prepare(GenerateRequest(f"ids-{i}", MODEL, prompt=prompts[int(i)])).prompt_ids for i in ref]
    del ref_core
    dump = {"ref": ref}
    calib = None
    if any("smooth" in x for x in args.schemes):
        calib = calibrate(loaded, args.threads, args.calib_tokens, prompts if args.oracle else CALIBRATION,
                          args.calib_skip_sink)
    for scheme in args.schemes:
        t0 = time.perf_counter()
        if scheme.startswith("engine:"):
            _, backend, kv = scheme.split(":")
            core = make_core(loaded, backend, kv, args.prompts, args.threads, args.block_size, args.budget)
        else:
            core = make_core(loaded, "torch_sdpa", "float32", args.prompts, args.threads, args.block_size,
                             args.budget)
            core.runner.model.attention = FakeQuantBackend(*scheme.split(",")[:2], calib=calib,
                                                               sink=(scheme.split(",") + [""])[2])
        out = generate(core, prompts, args.new_tokens)
        gen_s = time.perf_counter() - t0
        pp = per_prompt(out, ref)
        row = {"scheme": scheme, **agreement(out, ref), "positions_alike": positions_alike(out, ref),
               "per_prompt_min": round(min(pp), 3), "per_prompt_median": round(statistics.median(pp), 3),
               "per_prompt_q1": round(statistics.quantiles(pp, n=4)[0], 3), "gen_s": round(gen_s, 1)}
        if args.tf:
            t1 = time.perf_counter()
            row["next_token_agreement"] = next_token_agreement(core, MODEL, ids, list(ref.values()))
            row["tf_s"] = round(time.perf_counter() - t1, 1)
        print(json.dumps(row), flush=True)
        dump[scheme] = out
        if args.dump:
            with open(args.dump, "w") as f:
                json.dump(dump, f)
        del core


if __name__ == "__main__":
    main()

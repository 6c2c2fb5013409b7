"""The sampler's batched tensor math: filters, additive logit changes, counter-based noise, the draw and
log-probability tables, all as whole-batch tensor ops on the logits' device (no per-row loop, no host sync).

Randomness is counter-based: a row's noise is a hash of (its request's key, its output position, the token
id), so a request's draw depends on nothing else in the batch and needs no generator state. The draw is
the exponential race (Gumbel-max): argmax over tokens of p / E with E ~ Exp(1) i.i.d. picks token i with
probability p_i exactly, and needs no softmax, sort or cumulative sum (each would be a cross-row-size
reduction whose rounding could differ with the batch shape).
"""

from __future__ import annotations

import torch

# splitmix64's constants, as int64 (the same bits as the unsigned values; int64 multiplication wraps).
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_POSITION = 0xD1B54A32D192ED03 - 2**64  # an odd constant apart from the token stride, for positions
_UNIFORM_BITS = 24  # fp32's mantissa: the top bits of a hash give a uniform in (0, 1) with no rounding


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: the sign bit would fill in)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (as uint64 bits), in place: a bijection whose every output bit
    depends on every input bit, so consecutive counters give independent-looking values. (In place with
    one scratch tensor: on the CPU the allocations of out-of-place ops took 2/3 of the time.)"""
    scratch = torch.empty_like(z)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=scratch)
        z.bitwise_xor_(scratch.bitwise_and_((1 << (64 - shift)) - 1))  # z ^= z >>> shift (logical)
        if multiplier is not None:
            z.mul_(multiplier)
    return z


def as_int64(value: int) -> int:
    """A 64-bit seed (signed or unsigned) as the int64 with the same low 64 bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seeds [rows] int64, positions [rows] int64 (the output index drawn) -> [rows] int64 keys: one
    stream of noise per (request, position)."""
    return mix64_(mix64_(seeds + _GOLDEN).add_(positions * _POSITION))


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """keys [rows] int64, counters [rows, n] or [n] int64 -> [rows, n] fp32 uniform in (0, 1), a pure
    function of (key, counter): draws for any use (token noise, an acceptance test) without a generator."""
    z = mix64_(keys[:, None] + counters * _GOLDEN)  # [rows, n]
    return _srl(z, 64 - _UNIFORM_BITS).float().add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)


def exponential_race(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] fp32 logits (already divided by temperature, -inf = excluded), keys [rows] ->
    [rows] int64 token ids, token i drawn with probability softmax(x)_i.
    argmax_i(x_i - log E_i) with E_i = -log(U_i): a row with every token excluded gives token 0."""
    ids = torch.arange(x.shape[1], device=x.device)  # [vocab]
    score = uniforms(keys, ids).log_().neg_().log_()  # [rows, vocab]: log E
    return score.neg_().add_(x).argmax(-1)  # x - log E


def filter_logits(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                  min_p: torch.Tensor | None, k_max: int = 0) -> torch.Tensor:
    """x [rows, vocab] fp32 logits after temperature -> x with -inf for every token a row's filters drop,
    in this order (as Hugging Face applies them):
    - top_k [rows] int64: keep tokens not below the k-th largest logit (ties kept); 0 or >= vocab = off.
    - top_p [rows] fp32: over the top-k survivors, drop a token when those ranked above it already reach
      top_p of the probability (the first always stays); 1 = off.
    - min_p [rows] fp32: drop tokens less likely than min_p x the most likely; 0 = off.
    A None argument means no row uses that filter (its ops are skipped). k_max: the largest k of the rows
    (known on the host, so no sync here)."""
    vocab = x.shape[1]
    drop = None  # [rows, vocab] bool
    if top_p is not None:
        values, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [rows, vocab]: deterministic ties
        if top_k is not None:
            values = values.masked_fill(values < _kth(values, top_k)[:, None], float("-inf"))
        probs = values.softmax(-1)
        cut = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p < 1)[:, None]
        cut |= values == float("-inf")  # the top-k cut, as a drop too
        drop = torch.zeros_like(cut).scatter_(1, order, cut)
    elif top_k is not None:
        drop = x < _kth(torch.topk(x, min(vocab, max(1, k_max))).values, top_k)[:, None]
    if drop is not None:
        x = x.masked_fill(drop, float("-inf"))
    if min_p is not None:
        floor = x.max(-1).values + min_p.log()  # [rows]: log(min_p x p_max) - log Z; -inf where min_p is 0
        x = x.masked_fill(x < floor[:, None], float("-inf"))
    return x


def _kth(values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """values [rows, n] sorted descending (n >= every active k), top_k [rows] -> [rows] the k-th largest
    value, -inf where top-k is off."""
    k = top_k.clamp(min=1, max=values.shape[1])
    kth = values.gather(1, (k - 1)[:, None]).squeeze(1)  # [rows]
    return torch.where(top_k > 0, kth, torch.full_like(kth, float("-inf")))


def add_at(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
    """logits [rows, vocab] += values at (rows[n], ids[n]) for n pairs, in place with one scatter-add
    (pairs may repeat: they add up)."""
    logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)


def logprob_table(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [rows, vocab], tokens [rows] int64 -> [rows, 1 + 2k] fp64: each row's log-probability of
    its token, then the ids and log-probabilities of its k most likely tokens (fp64 holds both exactly),
    ready for one copy to the host."""
    lp = logits.float().log_softmax(-1)  # [rows, vocab]
    chosen = lp.gather(1, tokens[:, None])  # [rows, 1]
    if not k:
        return chosen.double()
    top = torch.topk(lp, k)
    return torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=1)


def unpack_logprobs(table: list[float], ks: list[int], k_max: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """logprob_table(..., k_max)'s rows, flattened on the host -> (chosen, [(id, logprob) of the row's
    ks[r] most likely])."""
    width = 1 + 2 * k_max
    out = []
    for r, k in enumerate(ks):
        row = table[r * width:(r + 1) * width]
        out.append((row[0], [(int(row[1 + j]), row[1 + k_max + j]) for j in range(k)]))
    return out

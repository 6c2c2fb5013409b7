"""Next-token sampling with per-request parameters.

Greedy rows are one argmax over the batch (on the CPU in C, kernels/cpu/argmax.c: torch's took 1.3-1.9
ms of a 32-row decode step). Sampled rows draw from their own request's
torch.Generator, one draw per step, so a seeded request gives the same tokens whatever else
shares its batch. A request with drafts (speculative decoding) has a row per draft too. Greedy: the
drafts up to the first the argmax disagrees with are kept, then the argmax after them, which is
exactly what decoding one token at a time would have given. Sampled (speculative sampling with a
deterministic draft): draft d is kept with probability p(d); at the first one not kept, the token is
drawn from p without d, renormalized; after all are kept, one more from the next row's p. Each
emitted token is then distributed exactly as p, as in plain sampling.
"""

from __future__ import annotations

import torch

from loraplex.engine.api import SamplingParams
from loraplex.engine.guided.guide import Guide
from loraplex.engine.guided.masks import apply_masks
from loraplex.engine.kernels.cpu.argmax import argmax_available, argmax_rows
from loraplex.engine.sched.request import Request


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """OpenAI presence/frequency penalties over each request's generated tokens, in place.
    logits: [reqs, vocab]."""
    for i, r in enumerate(reqs):
        sp = r.sampling
        if (sp.presence_penalty == 0 and sp.frequency_penalty == 0) or not r.output_ids:
            continue
        ids = torch.tensor(r.output_ids, device=logits.device)
        counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
            0, ids, torch.ones(len(ids), device=logits.device))  # [vocab]
        logits[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [vocab] fp32, already divided by temperature
    if top_k and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first stays.
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """logits: [rows, vocab] -> each row's argmax (the first of equal maxima, as torch picks)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1 \
            and argmax_available():
        return argmax_rows(logits).tolist()
    return logits.argmax(-1).tolist()


# A step's log-probabilities for one request: (the sampled token's, [(id, logprob) of the k most likely]).
StepLogprobs = tuple[float, list[tuple[int, float]]]


def sample_steps(logits: torch.Tensor, reqs: list[Request]) -> tuple[list[list[int]], list[list[StepLogprobs | None]]]:
    """logits: [rows, vocab], one row per request and one more per draft it carries (r.spec_ids), in
    order -> each request's new tokens and their log-probabilities (None where not asked). Sets each
    drafting request's `num_rejected`."""
    if not any(r.spec_ids for r in reqs):
        tokens, logprobs = sample(logits, reqs)
        return [[t] for t in tokens], [[lp] for lp in logprobs]
    tokens_out: list[list[int]] = [[] for _ in reqs]
    logprobs_out: list[list[StepLogprobs | None]] = [[] for _ in reqs]
    plain, row = [], 0
    for i, r in enumerate(reqs):
        if r.spec_ids:
            tokens_out[i], logprobs_out[i] = _verify(logits[row:row + 1 + len(r.spec_ids)], r)
            row += 1 + len(r.spec_ids)
        else:
            plain.append((i, row))
            row += 1
    if plain:
        tokens, logprobs = sample(logits[[row for _, row in plain]], [reqs[i] for i, _ in plain])
        for (i, _), t, lp in zip(plain, tokens, logprobs, strict=True):
            tokens_out[i], logprobs_out[i] = [t], [lp]
    return tokens_out, logprobs_out


def _verify(rows: torch.Tensor, r: Request) -> tuple[list[int], list[StepLogprobs | None]]:
    """rows: [1 + drafts, vocab], the logits after the request's last token and after each draft ->
    the drafts kept, then the token after the last of them."""
    k = r.sampling.logprobs
    raw = rows.clone() if k is not None else None  # [1 + drafts, vocab]
    _bias(rows, r)
    tokens = _verify_greedy(rows, r.spec_ids) if r.sampling.temperature == 0 else _verify_sampled(rows, r)
    r.num_rejected = len(r.spec_ids) - (len(tokens) - 1)
    if raw is None:
        return tokens, [None] * len(tokens)
    return tokens, list(token_logprobs(raw[:len(tokens)], tokens, [k] * len(tokens)))


def _verify_greedy(rows: torch.Tensor, drafts: list[int]) -> list[int]:
    best = greedy_tokens(rows)  # rows: [1 + drafts, vocab]
    kept = 0
    while kept < len(drafts) and drafts[kept] == best[kept]:
        kept += 1
    return best[:kept + 1]


def _verify_sampled(rows: torch.Tensor, r: Request) -> list[int]:
    g = r.generator
    tokens = []
    for j, draft in enumerate(r.spec_ids):
        p = _probs(rows[j], r.sampling)
        if torch.rand((), generator=g) < p[draft]:
            tokens.append(draft)
            continue
        p[draft] = 0.0  # not kept: drawn from p without the draft
        if not p.sum() > 0:  # p(draft) was 1 but for rounding: nothing else can be drawn
            return [*tokens, draft]
        return [*tokens, int(torch.multinomial(p, 1, generator=g))]
    # every draft kept: the next token from the last row
    return [*tokens, int(torch.multinomial(_probs(rows[-1], r.sampling), 1, generator=g))]


def _probs(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """row: [vocab] logits -> the sampling distribution on the CPU: temperature, then top-k and top-p."""
    return _filter_top_k_top_p(row / sp.temperature, sp.top_k, sp.top_p).softmax(-1).cpu()


def bias_tensors(pairs: tuple[tuple[int, float], ...], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A logit_bias as (ids [n] long, values [n] fp32) on `device`: built once per request."""
    return (torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device),
            torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device))


def _bias(rows: torch.Tensor, r: Request) -> None:
    """Adds the request's logit_bias to rows: [rows, vocab], in place, with one index_add_."""
    if not r.sampling.logit_bias:
        return
    if r.bias is None:  # a Request made without the frontend (tests): built on its first step, once
        r.bias = bias_tensors(r.sampling.logit_bias, rows.device)
    ids, values = r.bias
    rows.index_add_(1, ids, values.to(rows.dtype).expand(rows.shape[0], -1))


def sample(logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[StepLogprobs | None]]:
    """logits: [reqs, vocab] fp32 -> one token id per request, and the log-probabilities of those
    that asked (None for the others), taken from the logits before anything below changes them."""
    wanted = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
    raw = logits[wanted] if wanted else None  # [wanted, vocab], a copy
    tokens = _choose(logits, reqs)
    logprobs: list[StepLogprobs | None] = [None] * len(reqs)
    if raw is not None:
        found = token_logprobs(raw, [tokens[i] for i in wanted], [reqs[i].sampling.logprobs for i in wanted])
        for i, step in zip(wanted, found, strict=True):
            logprobs[i] = step
    return tokens, logprobs


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[StepLogprobs]:
    """logits: [rows, vocab] fp32; each row's log-probability of its token, with its ks[row] most likely
    tokens (generated tokens, and prompt tokens for echo)."""
    lp = logits.log_softmax(-1)  # [rows, vocab]
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    k_max = max(ks)
    top = torch.topk(lp, k_max) if k_max else None
    ids = top.indices.tolist() if top is not None else []
    values = top.values.tolist() if top is not None else []
    return [(chosen[r], list(zip(ids[r][:k], values[r][:k], strict=True)) if k else []) for r, k in enumerate(ks)]


def _rows_to_mask(reqs: list[Request], greedy: list[int] | None) -> list[tuple[int, Guide]]:
    """The guided rows that need their mask, given each row's unmasked best token (`greedy`, after bias
    and penalties): a greedy row whose best token the schema allows picks it masked or not, so where
    its mask was not started ahead of the forward pass, one token is checked instead of the whole
    vocabulary filled (the mask's cost on a CPU with no spare core; most steps pass the check)."""
    return [(i, r.guide) for i, r in enumerate(reqs) if r.guide is not None and not (
        greedy is not None and r.sampling.temperature == 0 and not r.guide.ahead and r.guide.allows(greedy[i]))]


def _choose(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    """logits: [reqs, vocab] fp32, changed in place -> one token id per request."""
    for i, r in enumerate(reqs):
        _bias(logits[i:i + 1], r)
    apply_penalties(logits, reqs)  # (a per-token shift: it commutes with the masks' -inf)
    greedy = greedy_tokens(logits) if any(r.sampling.temperature == 0 for r in reqs) else None
    # masks before the filters (top-k, top-p), which only ever see allowed tokens
    masked = _rows_to_mask(reqs, greedy)
    apply_masks(logits, masked)
    for i, _ in masked:
        if greedy is not None and reqs[i].sampling.temperature == 0:
            greedy[i] = greedy_tokens(logits[i:i + 1])[0]
    out = []
    for i, r in enumerate(reqs):
        sp = r.sampling
        if sp.temperature == 0:
            out.append(greedy[i])
            continue
        out.append(int(torch.multinomial(_probs(logits[i], sp), 1, generator=r.generator)))
    return out

"""Next-token sampling with per-request parameters, for the whole batch at once on the logits' device.

- Order (sampling_ops.py): logit bias, penalties and guided masks, then for sampled rows temperature,
  top-k, top-p and min-p with per-row parameter tensors built once per step (neutral where a row has no
  filter), then one draw.
- Greedy rows are one argmax (on the CPU in C, kernels/cpu/argmax.c, in place of torch's slower one).
- A sampled row's noise is a hash of (its request's seed, its output position, the token id), so a seeded
  request gives the same tokens whatever shares its batch; an unseeded request's key is the random seed
  its generator took at admission.
- The step's token ids (and the log-probabilities asked for) come to the host in one copy, started
  without waiting (`draw`: the next step may be scheduled meanwhile).
- Drafts (speculative decoding) have a row each. Greedy: the drafts up to the first the argmax disagrees
  with are kept, then the argmax after them, exactly what decoding one token at a time gives. Sampled
  (speculative sampling with a deterministic draft): draft d is kept with probability p(d); at the first
  one not kept, the token is drawn from p without d, renormalized; after all are kept, one more from the
  next row's p. Each emitted token is distributed exactly as p.
"""

from __future__ import annotations

from collections import Counter

import torch

from loraplex.engine import sampling_ops as ops
from loraplex.engine.api import SamplingParams
from loraplex.engine.guided.guide import Guide
from loraplex.engine.guided.masks import apply_masks
from loraplex.engine.host_copy import upload
from loraplex.engine.kernels.cpu.argmax import argmax_available, argmax_rows
from loraplex.engine.sched.request import Request


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """OpenAI presence/frequency penalties over each request's generated tokens, in place, for the whole
    batch in one scatter: token t, generated c > 0 times, loses frequency_penalty * c + presence_penalty.
    logits: [reqs, vocab]."""
    rows, ids, values = [], [], []
    for i, r in enumerate(reqs):
        sp = r.sampling
        if (sp.presence_penalty == 0 and sp.frequency_penalty == 0) or not r.output_ids:
            continue
        for token, count in Counter(r.output_ids).items():
            rows.append(i)
            ids.append(token)
            values.append(-(sp.frequency_penalty * count + sp.presence_penalty))
    if rows:
        device = logits.device
        ops.add_at(logits, torch.tensor(rows, device=device), torch.tensor(ids, device=device),
                   torch.tensor(values, dtype=torch.float32, device=device))
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """One row's filters (for draft verification): logits [vocab] fp32, already divided by temperature ->
    [vocab] with -inf where top-k, top-p or min-p drop (ops.filter_logits on a batch of one)."""
    device = logits.device
    return ops.filter_logits(
        logits[None], torch.tensor([top_k], device=device) if top_k else None,
        torch.tensor([top_p], device=device) if top_p < 1 else None,
        torch.tensor([min_p], device=device) if min_p > 0 else None, top_k)[0]


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """logits: [rows, vocab] -> each row's argmax (the first of equal maxima, as torch picks)."""
    return _argmax(logits).tolist()


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab] -> [rows] int64 argmax on the logits' device (the C kernel for dense fp32
    rows on the CPU)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1 \
            and argmax_available():
        return argmax_rows(logits)
    return logits.argmax(-1)


# A step's log-probabilities for one request: (the sampled token's, [(id, logprob) of the k most likely]).
StepLogprobs = tuple[float, list[tuple[int, float]]]


def sample_steps(logits: torch.Tensor, reqs: list[Request]
                 ) -> tuple[list[list[int]], list[list[StepLogprobs | None]], list[int]]:
    """logits: [rows, vocab], one row per request and one more per draft it carries (r.spec_ids), in
    order -> each request's new tokens, their log-probabilities (None where not asked) and how many
    of its drafts the model did not keep (the step output's; nothing is set on the requests)."""
    if not any(r.spec_ids for r in reqs):
        tokens, logprobs = sample(logits, reqs)
        return [[t] for t in tokens], [[lp] for lp in logprobs], [0] * len(reqs)
    tokens_out: list[list[int]] = [[] for _ in reqs]
    logprobs_out: list[list[StepLogprobs | None]] = [[] for _ in reqs]
    rejected = [0] * len(reqs)
    plain, row = [], 0
    for i, r in enumerate(reqs):
        if r.spec_ids:
            tokens_out[i], logprobs_out[i] = _verify(logits[row:row + 1 + len(r.spec_ids)], r)
            rejected[i] = len(r.spec_ids) - (len(tokens_out[i]) - 1)
            row += 1 + len(r.spec_ids)
        else:
            plain.append((i, row))
            row += 1
    if plain:
        tokens, logprobs = sample(logits[[row for _, row in plain]], [reqs[i] for i, _ in plain])
        for (i, _), t, lp in zip(plain, tokens, logprobs, strict=True):
            tokens_out[i], logprobs_out[i] = [t], [lp]
    return tokens_out, logprobs_out, rejected


def _verify(rows: torch.Tensor, r: Request) -> tuple[list[int], list[StepLogprobs | None]]:
    """rows: [1 + drafts, vocab], the logits after the request's last token and after each draft ->
    the drafts kept, then the token after the last of them."""
    k = r.sampling.logprobs
    raw = rows.clone() if k is not None else None  # [1 + drafts, vocab]
    _bias(rows, r)
    tokens = _verify_greedy(rows, r.spec_ids) if r.sampling.temperature == 0 else _verify_sampled(rows, r)
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
    """row: [vocab] logits -> the sampling distribution on the CPU: temperature, then top-k, top-p, min-p."""
    return _filter_top_k_top_p(row / sp.temperature, sp.top_k, sp.top_p, sp.min_p).softmax(-1).cpu()


def bias_tensors(pairs: tuple[tuple[int, float], ...], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A logit_bias as (ids [n] long, values [n] fp32) on `device`: built once per request."""
    return (torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device),
            torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device))


def _bias_of(r: Request, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's logit_bias tensors: those built at prepare, or (a Request made without the frontend,
    in tests) built now, without writing onto the request."""
    return r.bias if r.bias is not None else bias_tensors(r.sampling.logit_bias, device)


def _bias(rows: torch.Tensor, r: Request) -> None:
    """Adds the request's logit_bias to rows: [rows, vocab], in place, with one index_add_."""
    if not r.sampling.logit_bias:
        return
    ids, values = _bias_of(r, rows.device)
    rows.index_add_(1, ids, values.to(rows.dtype).expand(rows.shape[0], -1))


def _add_biases(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Every request's logit_bias added to its row of logits: [reqs, vocab], in place, in one scatter."""
    biased = [i for i, r in enumerate(reqs) if r.sampling.logit_bias]
    if not biased:
        return
    pairs = [_bias_of(reqs[i], logits.device) for i in biased]
    rows = torch.tensor([i for i in biased for _ in reqs[i].sampling.logit_bias], device=logits.device)
    ops.add_at(logits, rows, torch.cat([ids for ids, _ in pairs]), torch.cat([values for _, values in pairs]))


def request_key(r: Request) -> int:
    """The key of a sampled request's noise (ops.row_keys with its output position): its seed, or for an
    unseeded request the random seed its generator took at admission."""
    if r.sampling.seed is not None:
        return ops.as_int64(r.sampling.seed)
    return ops.as_int64(r.generator.initial_seed())


def _to_host(t: torch.Tensor) -> list:
    """A device-to-host copy that waits for it (log-probabilities of drafts and prompts)."""
    return t.tolist()


class DrawnTokens:
    """A step's sampled tokens on the device (`tokens`: the next step's inputs), with their one copy to
    the host (and the log-probabilities asked for) started without waiting: pinned memory and an event on
    CUDA, so the host can schedule the next step meanwhile. `result()` waits for the copy."""

    def __init__(self, tokens: torch.Tensor, flat: torch.Tensor, wanted: list[int], ks: list[int]):
        self.tokens = tokens  # [reqs] int64 on the logits' device
        self._wanted, self._ks = wanted, ks
        self._ready = None
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
            flat = host
        self._flat = flat  # [reqs (+ wanted x (1 + 2k))] on the host once the copy is done

    def result(self) -> tuple[list[int], list[StepLogprobs | None]]:
        """Each request's token id, and the log-probabilities of those that asked (None for the others)."""
        if self._ready is not None:
            self._ready.synchronize()
        flat, n = self._flat.tolist(), self.tokens.shape[0]
        logprobs: list[StepLogprobs | None] = [None] * n
        if self._wanted:
            ks = self._ks
            for i, step in zip(self._wanted, ops.unpack_logprobs(flat[n:], ks, max(ks)), strict=True):
                logprobs[i] = step
        return [int(t) for t in flat[:n]], logprobs


def draw(logits: torch.Tensor, reqs: list[Request], positions: list[int] | None = None) -> DrawnTokens:
    """logits: [reqs, vocab] fp32 -> one token per request on the device, its copy to the host under way.
    Log-probabilities are taken from the logits before anything below changes them. positions: each
    request's output position (its noise key; default: its next_output_index)."""
    wanted = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
    raw = logits[wanted] if wanted else None  # [wanted, vocab], a copy
    tokens = _choose(logits, reqs, positions)  # [reqs] int64, on the logits' device
    if raw is None:
        return DrawnTokens(tokens, tokens, [], [])
    ks = [reqs[i].sampling.logprobs for i in wanted]
    chosen = tokens[torch.tensor(wanted, device=tokens.device)]  # [wanted]
    table = ops.logprob_table(raw, chosen, max(ks))  # [wanted, 1 + 2k]
    return DrawnTokens(tokens, torch.cat([tokens.double(), table.flatten()]), wanted, ks)


def sample(logits: torch.Tensor, reqs: list[Request], positions: list[int] | None = None
           ) -> tuple[list[int], list[StepLogprobs | None]]:
    """`draw`, waiting for its tokens: one token id per request and the log-probabilities asked for."""
    return draw(logits, reqs, positions).result()


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[StepLogprobs]:
    """logits: [rows, vocab] fp32; each row's log-probability of its token, with its ks[row] most likely
    tokens (generated tokens, and prompt tokens for echo), brought to the host in one copy."""
    table = ops.logprob_table(logits, torch.tensor(tokens, device=logits.device), max(ks))  # [rows, 1 + 2k]
    return ops.unpack_logprobs(_to_host(table.flatten()), ks, max(ks))


def _rows_to_mask(reqs: list[Request], greedy: list[int] | None) -> list[tuple[int, Guide]]:
    """The guided rows that need their mask, given each row's unmasked best token (`greedy`, after bias
    and penalties): a greedy row whose best token the schema allows picks it masked or not, so where
    its mask was not started ahead of the forward pass, one token is checked instead of the whole
    vocabulary filled (the mask's cost on a CPU with no spare core; most steps pass the check)."""
    return [(i, r.guide) for i, r in enumerate(reqs) if r.guide is not None and not (
        greedy is not None and r.sampling.temperature == 0 and not r.guide.ahead and r.guide.allows(greedy[i]))]


def _choose(logits: torch.Tensor, reqs: list[Request], positions: list[int] | None = None) -> torch.Tensor:
    """logits: [reqs, vocab] fp32, changed in place -> [reqs] int64 token ids on the logits' device."""
    if positions is None:
        positions = [r.next_output_index for r in reqs]
    _add_biases(logits, reqs)
    apply_penalties(logits, reqs)  # (a per-token shift: it commutes with the masks' -inf)
    greedy = [i for i, r in enumerate(reqs) if r.sampling.temperature == 0]
    drawn = [i for i, r in enumerate(reqs) if r.sampling.temperature != 0]
    hint = None
    if logits.device.type == "cpu" and any(reqs[i].guide is not None and not reqs[i].guide.ahead for i in greedy):
        hint = _argmax(logits).tolist()  # on the CPU a read, not a copy: guided greedy rows may skip their mask
    # masks before the filters (top-k, top-p, min-p), which only ever see allowed tokens
    apply_masks(logits, _rows_to_mask(reqs, hint))
    if not drawn:
        return _argmax(logits)
    if not greedy:
        return _draw(logits, reqs, positions)
    tokens = torch.empty(len(reqs), dtype=torch.long, device=logits.device)  # [reqs]
    greedy_index, drawn_index = (torch.tensor(rows, device=logits.device) for rows in (greedy, drawn))
    tokens[greedy_index] = _argmax(logits[greedy_index])
    tokens[drawn_index] = _draw(logits[drawn_index], [reqs[i] for i in drawn], [positions[i] for i in drawn])
    return tokens


def _draw(logits: torch.Tensor, reqs: list[Request], positions: list[int]) -> torch.Tensor:
    """logits: [reqs, vocab] of sampled requests -> [reqs] int64 draws: temperature, the filters with
    per-row parameter tensors (neutral where a row has none), then the exponential race on each row's
    noise, keyed by (request_key, output position)."""
    device, vocab = logits.device, logits.shape[1]
    sps = [r.sampling for r in reqs]
    top_k = [min(sp.top_k, vocab) for sp in sps]
    (params,) = upload(device, torch.float32, [x for sp, k in zip(sps, top_k, strict=True)
                                               for x in (sp.temperature, k, sp.top_p, sp.min_p)])
    params = params.view(-1, 4)  # [reqs, 4]
    (counters,) = upload(device, torch.long,
                         [x for r, p in zip(reqs, positions, strict=True) for x in (request_key(r), p)])
    counters = counters.view(-1, 2)  # [reqs, 2]: key, position
    x = logits.float() / params[:, 0:1]  # [reqs, vocab]
    x = ops.filter_logits(x, params[:, 1].long() if any(top_k) else None,
                          params[:, 2] if any(sp.top_p < 1 for sp in sps) else None,
                          params[:, 3] if any(sp.min_p > 0 for sp in sps) else None, max(top_k))
    return ops.exponential_race(x, ops.row_keys(counters[:, 0], counters[:, 1]))

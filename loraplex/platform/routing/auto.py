"""`model: "auto"`: the cheapest base model that can take the request.

- The pool: base models an operator gave an `auto_max_complexity` (0-1; admin API, admin UI, `loraplex models route`,
  or `models calibrate` for a share of traffic), the highest score each should take (routing/learned/scorer.py: the
  learned scorer's probability that the strong model is needed, or complexity.py's heuristic).
- A request for "auto" goes, among the pool's models this instance serves and the key may use, to:
  1. those whose context holds the prompt (counted by each model's own tokenizer) and the max_tokens asked for (or
     one token);
  2. of those, the ones whose auto_max_complexity reaches the request's score;
  3. of those, the cheapest at the price in force now: prompt tokens x input price + the tokens it may generate
     (max_tokens, else the key's or server's default cap) x output price; a model without a price costs nothing, as
     billing charges it. Equal costs, or prices in different currencies, go to the lower auto_max_complexity (the
     smaller model in the operator's ranking), then to the name.
- If no model reaches the score, the most capable one that fits takes it; if none fits, the one with the longest
  context, whose context-length error the client then gets. With no model in the pool for this key, "auto" answers
  404 like any model that does not exist.
- A key limited to some models routes among those; one whose allowed models include "auto" routes over the whole pool
  (a key limited to ["auto"] can reach models only through the router).
- The response's `model` names the model chosen, headers `x-loraplex-model` and `x-loraplex-complexity` tell the
  decision, and the ledger row keeps `routed_from = "auto"` and the score (`route_score`, which calibration reads).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from loraplex.billing.prices import Price
from loraplex.billing.usage import utcnow
from loraplex.engine.api import ContextLengthExceededError, EngineClient, GenerateRequest, ModelNotFoundError
from loraplex.platform.auth import Principal
from loraplex.platform.errors import model_not_found
from loraplex.platform.routing.complexity import RequestText
from loraplex.platform.routing.learned.requests import request_text as request_text  # (callers import it from here)
from loraplex.platform.routing.learned.scorer import Scorer
from loraplex.platform.routing.resolution import ModelRouter, Target, model_allowed
from loraplex.platform.tenancy.catalog import AUTO

# Scoring reads the request's text: it runs here, never on the event loop; two threads at most, so a
# flood of long prompts queues instead of taking a thread each.
_SCORER = ThreadPoolExecutor(2, thread_name_prefix="loraplex-auto-score")


@dataclass(frozen=True)
class Candidate:
    """One model of the pool as this request would meet it."""

    name: str
    max_complexity: float
    context: int  # the model's max_model_len
    prompt_tokens: int  # the prompt under this model's tokenizer
    price: Price | None  # in force now

    def fits(self, max_tokens: int | None) -> bool:
        return self.prompt_tokens + (max_tokens or 1) <= self.context

    def cost_picos(self, output_tokens: int) -> int:
        return 0 if self.price is None else self.price.cost_picos(self.prompt_tokens, 0, output_tokens)


def choose(candidates: Sequence[Candidate], score: float, max_tokens: int | None, output_tokens: int) -> Candidate:
    """The model for a request of complexity `score` (see the module docstring); `candidates` must
    not be empty. `max_tokens` is the request's own (None: not given), `output_tokens` what it may
    generate, for the cost."""
    fitting = [c for c in candidates if c.fits(max_tokens)]
    if not fitting:
        return max(candidates, key=lambda c: (c.context, c.max_complexity, c.name))
    able = [c for c in fitting if c.max_complexity >= score]
    if not able:
        return max(fitting, key=lambda c: (c.max_complexity, -c.cost_picos(output_tokens), c.name))
    comparable = len({c.price.currency for c in able if c.price is not None}) <= 1
    return min(able, key=lambda c: (c.cost_picos(output_tokens) if comparable else 0, c.max_complexity, c.name))


@dataclass(frozen=True)
class Routed:
    target: Target
    request: GenerateRequest
    prompt_tokens: int


def _usable(pool: dict[str, float], served: dict[str, int] | set[str], principal: Principal) -> list[str]:
    """A key whose allowed models name "auto" may reach the whole pool through it (and only the
    models it names directly); any other limited key routes among the models it names."""
    whole_pool = principal.allowed_models is not None and AUTO in principal.allowed_models
    return sorted(n for n in pool if n in served and (whole_pool or model_allowed(principal, n)))


async def available(router: ModelRouter, engine: EngineClient, principal: Principal) -> bool:
    """Whether "auto" has a model for this key (it is listed in /v1/models only then)."""
    pool = await router.auto_pool()
    return bool(_usable(pool.models, {m.name for m in engine.models()}, principal))


async def route(router: ModelRouter, scorer: Scorer, engine: EngineClient, principal: Principal, text: RequestText,
                request_for: Callable[[str], GenerateRequest], output_tokens: int) -> Routed:
    """Chooses the model for an "auto" request; `request_for(model)` makes the engine request for
    one model (preparing it validates it, so a bad request fails here as it would anywhere). The
    request returned is the chosen model's, prepared."""
    pool = await router.auto_pool()
    served = {m.name: m.max_model_len for m in engine.models()}
    names = _usable(pool.models, served, principal)
    now = utcnow()
    candidates, requests, too_long = [], {}, {}
    for name in names:
        try:
            request = await engine.prepare(request_for(name))  # (tokenized by this model's tokenizer)
        except ModelNotFoundError:  # left the engine since models() was read
            continue
        except ContextLengthExceededError as exc:  # the prompt alone is past this model's context
            too_long[name] = exc
            continue
        requests[name] = request
        tokens = len(request.prompt_token_ids)
        candidates.append(Candidate(name, pool.models[name], served[name], tokens, pool.prices.at(name, now)))
    if not candidates:
        if too_long:  # the error of the longest context
            raise too_long[max(too_long, key=lambda n: (served[n], n))]
        raise model_not_found(AUTO)
    score = await asyncio.get_running_loop().run_in_executor(_SCORER, scorer.score, text)
    best = choose(candidates, score, text.max_tokens, output_tokens)
    return Routed(Target(AUTO, best.name, complexity=score), requests[best.name], best.prompt_tokens)

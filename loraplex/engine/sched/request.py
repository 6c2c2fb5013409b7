"""A request's state inside the engine: its tokens, its progress and its KV blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from loraplex.engine.api import FinishReason, SamplingParams
from loraplex.engine.guided.guide import Guide


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to the CPU swap space; waits to swap back in
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token-count scheduling state (vLLM v1 style): there is no prefill or decode phase, only
    `num_computed` tokens out of `num_tokens`; a step computes some of the rest."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # resolved: never beyond the context length
    stop_ids: frozenset[int]
    priority: str = "standard"
    adapter: str | None = None
    lora_slot: int = -1  # device slot of the adapter while running; -1 = base model
    cache_salt: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # advanced when a step is scheduled (Scheduler.commit), less the drafts it rejects
    # tokens sampled by steps still in flight, not yet in output_ids (asynchronous scheduling: the next step is
    # scheduled before the last one's tokens reach the host; the runner takes them from the device)
    num_pending: int = 0
    # KV state, written by the KV manager only (kv/manager.py):
    num_cached: int = 0  # prompt tokens served from the prefix cache
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # content hashes of its full blocks, in order
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    swap_blocks: list[int] = field(default_factory=list)  # CPU swap blocks while SWAPPED
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request RNG for seeded sampling
    guide: Guide | None = None  # holds the output to `sampling.json_schema`
    # sampling.logit_bias as (ids [n] long, values [n] fp32) on the logits' device, built once (at prepare)
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    # (logprob, top) of prompt tokens 1.. as their positions are computed (appended by Scheduler.update
    # from the step output); None when not asked for
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    spec_ids: list[int] = field(default_factory=list)  # draft tokens this step verifies after its last token

    def __post_init__(self) -> None:
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = []
        if self.sampling.temperature > 0:
            self.generator = torch.Generator()
            if self.sampling.seed is not None:
                self.generator.manual_seed(self.sampling.seed)
            else:
                self.generator.seed()

    @property
    def num_tokens(self) -> int:
        """Prompt, output and pending tokens: what the scheduler computes up to."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_known(self) -> int:
        """Prompt and output tokens: those the host has (token_ids reads only these)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def next_output_index(self) -> int:
        """The output position the next token sampled for it takes (its sampling noise is keyed by it)."""
        return len(self.output_ids) + self.num_pending

    @property
    def ends_with_pending(self) -> bool:
        """Its pending tokens reach max_tokens: it ends when they land, so no step is scheduled for it."""
        return self.num_pending > 0 and self.next_output_index >= self.max_tokens

    @property
    def needs_host_tokens(self) -> bool:
        """Its next step needs its last token on the host: a schema's mask follows the output, and penalties
        count it (such a request's step is not scheduled while its token is in flight)."""
        sp = self.sampling
        return self.guide is not None or sp.presence_penalty != 0 or sp.frequency_penalty != 0

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (end <= num_known)."""
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt:end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt log-probabilities were asked for and some positions are not recorded yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def can_speculate(self) -> bool:
        """Drafts are verified exactly for requests whose next token depends on nothing the drafts would
        change: no penalties over the output, no schema to advance, no prompt logits. A seeded sampled
        request never speculates: verifying draws its random numbers differently, and whether a step
        speculates depends on the batch, so its tokens would depend on what shares its batch."""
        sp = self.sampling
        return (sp.temperature == 0 or sp.seed is None) and not self.needs_host_tokens and not self.needs_prompt_logits

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

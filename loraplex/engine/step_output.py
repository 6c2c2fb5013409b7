"""What one model step computed, handed from the runner to the scheduler and the core (vLLM's
ModelRunnerOutput): the runner and the sampler write nothing onto requests, so every change of a
request's state after a step happens in `Scheduler.update` and `EngineCore.step`, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.sampler import StepLogprobs
from loraplex.engine.sched.request import Request


@dataclass
class StepOutput:
    """Per `batch.sampled()` request, in that order: its new tokens (the drafts the model kept, then
    its own next token), their log-probabilities (None where not asked for) and how many of its drafts
    the model did not keep. Then the prompt log-probabilities computed this step, in prompt order."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[StepLogprobs | None]] = field(default_factory=list)
    num_rejected: list[int] = field(default_factory=list)
    prompt_logprobs: list[tuple[Request, StepLogprobs]] = field(default_factory=list)

"""The engine's whole public surface: what a caller sends, what it gets back, and the errors.

Everything outside `loraplex.engine` imports only this module (import-linter enforces it). It
holds plain dataclasses and a Protocol, no torch, so the platform can import it cheaply.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

PriorityClass = Literal["realtime", "standard", "batch"]
PRIORITY_CLASSES: tuple[str, ...] = ("realtime", "standard", "batch")
FinishReason = Literal["stop", "length", "abort", "error"]


class EngineError(Exception):
    """Base of every error the engine reports to a caller."""

    code = "engine_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(EngineError):
    """A request field is out of range; nothing was queued."""

    code = "invalid_request"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(EngineError):
    code = "model_not_found"


class EngineUnavailableError(EngineError):
    """The engine could not take the request now (a remote replica failed or cannot be reached): retry later."""

    code = "engine_unavailable"


# What `add_adapter` reads: a PEFT LoRA directory with exactly these two files. Pickled weights are
# never read (unpickling runs code), so a directory that holds only those is refused.
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_FILES = (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def missing_weights_reason(directory: Path) -> str:
    """Why a directory without `PEFT_WEIGHTS_FILE` cannot be an adapter: it is missing, or the
    directory holds only pickled weights, which must be converted to safetensors."""
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        return (f"only pickled weights ({', '.join(pickles)}) and no {PEFT_WEIGHTS_FILE}; pickle files are "
                "refused (they can run code), convert the adapter to safetensors")
    return f"{PEFT_WEIGHTS_FILE} is missing"


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
MAX_LOGIT_BIAS = 300  # logit_bias entries per request, as OpenAI allows (each costs every step of the batch)
# A temperature below this samples as greedy: dividing logits by 1e-95 overflows them to inf (NaN
# probabilities), and anything this cold picks the most likely token anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 (or below GREEDY_BELOW_TEMPERATURE) is greedy; the seed
    makes sampling reproducible for this request whatever else shares its batch."""

    # None: up to the model's context length; 0: the prompt is computed (for its log-probabilities,
    # prompt_logprobs) and nothing generated
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # keeps the tokens at least min_p times as likely as the most likely one (after temperature); 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # JSON Schema text the output must follow (engine/guided); '{"type": "object"}' is JSON mode.
    json_schema: str | None = None
    # None: no log-probabilities; k >= 0: each generated token's, with the k most likely at its step.
    logprobs: int | None = None
    # The same for every prompt token (as OpenAI's echo with logprobs reports them); such a request does
    # not reuse the prefix cache, whose blocks hold no logits.
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to the logits before sampling, as OpenAI's logit_bias: -100 bans a
    # token, 100 all but forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if 0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    def validate(self) -> None:
        """Raises InvalidRequestError naming the first bad field."""
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be at least 0, got {self.max_tokens}", "max_tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}", "top_k")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequestError(f"seed must fit in 64 bits, got {self.seed}", "seed")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be >= 0", "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}", "logprobs")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got "
                                      f"{len(self.logit_bias)}", "logit_bias")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequestError("logit_bias names a token id more than once", "logit_bias")
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidRequestError(f"logit_bias token ids must be >= 0, got {token}", "logit_bias")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
        if self.json_schema is not None and self.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be combined with a JSON schema: the schema decides "
                                      "where the output ends", "ignore_eos")


@dataclass(frozen=True)
class GenerateRequest:
    """One generation. Give `prompt` (text) or `prompt_token_ids`; `messages` renders the
    model's chat template. `cache_salt` isolates prefix-cache reuse (the platform derives it
    from the tenant)."""

    request_id: str
    model: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    priority: PriorityClass = "standard"
    cache_salt: str | None = None

    def validate(self) -> None:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of prompt, prompt_token_ids or messages", "prompt")
        if self.prompt is not None and not self.prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids must not be empty", "prompt")
        if self.messages is not None and not self.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        if self.priority not in PRIORITY_CLASSES:
            raise InvalidRequestError(
                f"priority must be one of {', '.join(PRIORITY_CLASSES)}, got {self.priority!r}", "priority")
        self.sampling.validate()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    ttft_s: float | None = None  # submission to first token, None when no token came

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's own distribution (before temperature,
    penalties and a schema's mask change it, as vLLM reports them), and the `top` most likely tokens
    of that step, most likely first, as (id, bytes, logprob)."""

    token_id: int
    token: bytes  # the bytes it adds to the text (a token may hold part of a UTF-8 character)
    logprob: float | None  # None only for a prompt's first token, which nothing before it predicts
    top: tuple[tuple[int, bytes, float], ...] = ()


@dataclass(frozen=True)
class GenerateEvent:
    """One step's news for one request. The last event has `finish_reason` and `usage`."""

    request_id: str
    text: str = ""  # new text since the previous event (stop strings never appear)
    token_ids: tuple[int, ...] = ()  # new generated token ids since the previous event
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when asked, but none for a stop token
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on the first event: one per prompt token, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int


# --- the engine's figures: one record per component that owns them -----------------------------
# Each component fills its own record: the scheduler `requests`, the KV manager `kv`, the adapter slots
# `adapters`, the core `speculation`, the model pool `models`, the memory sizing `memory`. Engines that drive
# several models or replicas add their as_dict() forms up with add_stats and rebuild one with from_dict.


@dataclass(frozen=True)
class RequestStats:
    """The scheduler's queues now, and its totals since start."""

    running: int = 0
    waiting: int = 0
    running_by_class: dict[str, int] = field(default_factory=dict)
    waiting_by_class: dict[str, int] = field(default_factory=dict)
    preemptions_by_class: dict[str, int] = field(default_factory=dict)
    swapped_requests: int = 0  # waiting with their KV blocks swapped out to CPU memory
    num_steps: int = 0
    generated_tokens: int = 0
    prompt_tokens_computed: int = 0


@dataclass(frozen=True)
class KVCacheStats:
    """The KV block pool, its swap space and its prefix cache."""

    blocks_total: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    swap_blocks_used: int = 0
    swapped_out_blocks: int = 0  # totals since start
    swapped_in_blocks: int = 0
    prefix_cached_blocks: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which served from it

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True)
class AdapterStats:
    """The LoRA adapters' device slots and merged copies."""

    loaded: int = 0  # adapters resident in device slots
    slots: int = 0  # device slots for adapters (max_loras of each resident model)
    running: tuple[str, ...] = ()  # adapter ids of the requests running now, each once, sorted
    waiting: tuple[str, ...] = ()  # and of those waiting
    device: tuple[str, ...] = ()  # adapter ids in device slots now, sorted
    cpu: tuple[str, ...] = ()  # adapter ids in the CPU tier now (parsed weights), sorted
    slot_bytes: int = 0  # memory of the slot buffers (at lora_dtype) and the folded adapter copies now
    loads: int = 0
    disk_loads: int = 0  # of loads, those that read the adapter from disk (not the CPU tier)
    load_seconds: float = 0.0  # wall time of every adapter load into a device slot
    evictions: int = 0
    merges: int = 0  # adapters merged into a copy of the weights for steps wholly on them
    merged_bytes: int = 0  # memory of the merged copies held now


@dataclass(frozen=True)
class SpeculationStats:
    """Speculative decoding's drafts."""

    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of which the model agreed with (each saved a step)


@dataclass(frozen=True)
class ModelStats:
    """The base models: resident on the device, or waiting on the CPU tier or disk."""

    resident: int = 0
    weight_bytes: int = 0  # the resident models' weights as loaded, plus the CPU kernels' packed copies
    loads: int = 0
    evictions: int = 0


@dataclass(frozen=True)
class MemoryStats:
    """Memory sizing (engine/memory.py): the KV caches' memory; on CUDA, where the KV cache was sized by
    measurement, the device memory for weights + KV cache + adapter slots that gpu_memory_utilization
    left after other memory and a maximum-size step's activations (peak_step_bytes); those three are
    0 elsewhere."""

    kv_cache_bytes: int = 0
    budget_bytes: int = 0
    gpu_memory_utilization: float = 0.0
    peak_step_bytes: int = 0


@dataclass(frozen=True)
class EngineStats:
    requests: RequestStats = field(default_factory=RequestStats)
    kv: KVCacheStats = field(default_factory=KVCacheStats)
    adapters: AdapterStats = field(default_factory=AdapterStats)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    models: ModelStats = field(default_factory=ModelStats)
    memory: MemoryStats = field(default_factory=MemoryStats)

    def as_dict(self) -> dict[str, dict]:
        """{component: {figure: value}}, as JSON shows it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, dict]) -> EngineStats:
        """The record of an `as_dict()` form (or a sum of them); a missing component or figure is 0."""
        kinds = {f.name: f.default_factory for f in dataclasses.fields(cls)}
        return cls(**{name: kind(**values.get(name, {})) for name, kind in kinds.items()})


# Totals since start (Prometheus counters), by component: they must never go back, so an engine that
# multiplexes models keeps an evicted model's share of them (ModelPool.retired); the other figures are
# what holds now.
ENGINE_COUNTERS = {
    "requests": ("num_steps", "generated_tokens", "prompt_tokens_computed", "preemptions_by_class"),
    "kv": ("swapped_out_blocks", "swapped_in_blocks", "prefix_query_tokens", "prefix_hit_tokens"),
    "adapters": ("loads", "disk_loads", "load_seconds", "evictions", "merges"),
    "speculation": ("draft_tokens", "accepted_tokens"),
}
# Figures that engines on several devices do not add up: a setting and a peak; their maximum stands.
DEVICE_MAXIMA = {"memory": ("gpu_memory_utilization", "peak_step_bytes")}


def counters_of(stats: EngineStats) -> dict[str, dict]:
    """The ENGINE_COUNTERS figures of `stats`, in as_dict() form."""
    values = stats.as_dict()
    return {part: {name: values[part][name] for name in names} for part, names in ENGINE_COUNTERS.items()}


def add_stats(total: dict, values: dict) -> None:
    """Adds as_dict() forms `values` into `total` in place: components and per-class dicts add key
    by key, adapter-id tuples merge as a sorted union (an adapter running on two engines is one
    adapter), numbers add."""
    for key, value in values.items():
        if isinstance(value, dict):
            add_stats(total.setdefault(key, {}), value)
        elif isinstance(value, (tuple, list)):
            total[key] = tuple(sorted({*total.get(key, ()), *value}))
        else:
            total[key] = total.get(key, 0) + value


def keep_maxima(total: dict, parts: list[dict]) -> None:
    """Sets DEVICE_MAXIMA figures of `total` to their largest among the as_dict() forms `parts`."""
    for part, names in DEVICE_MAXIMA.items():
        for name in names:
            total.setdefault(part, {})[name] = max((p.get(part, {}).get(name, 0) for p in parts), default=0)


@dataclass(frozen=True)
class ComputePath:
    """What runs the model on this machine: `ops` "c" (this project's C kernels), "torch" (torch's CPU ops,
    slower; `reason` says why) or "cuda"; the instruction sets the C kernels' build targets, or where it cannot
    be asked, the CPU's (`instruction_sets_of` "build" or "cpu")."""

    device: str
    ops: str
    reason: str
    instruction_sets: tuple[str, ...]
    instruction_sets_of: str
    threads: int
    model_dtype: str
    weight_dtype: str
    kv_cache_dtype: str
    activation_dtype: str  # the default, and whether (with which dot) int8 activations can run here

    def summary(self) -> str:
        """One line, for the startup log."""
        what = {"c": "C kernels", "torch": "torch ops (fallback)", "cuda": "CUDA"}.get(self.ops, self.ops)
        isa = ", ".join(self.instruction_sets) or "no vector extensions"
        return f"compute: {what} on {self.device} ({self.reason}); {isa}; {self.threads} threads"


@dataclass(frozen=True)
class ReplicaInfo:
    """One engine replica behind a client that drives several (Ray Serve), as that client last polled it."""

    replica: str  # its id
    models: tuple[str, ...]
    adapters: tuple[str, ...]  # registered on it
    running: int
    waiting: int
    requests: int  # generations it has started, from every gateway


class EngineClient(Protocol):
    """What the platform needs from an engine (in-process AsyncEngine, or a remote one)."""

    def models(self) -> list[ModelInfo]: ...

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        """Validates the request and tokenizes its prompt off the caller's event loop; raises
        EngineError. Returns it with `prompt_token_ids` (its prompt length is their count) and no
        `prompt` or `messages`, so that generate() of it, or of copies differing in id or sampling
        (the choices of `n`), tokenizes nothing again."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """Validates (raising EngineError before anything is queued) and streams events; cheap for
        a request from prepare()."""
        ...

    async def abort(self, request_id: str) -> Usage | None:
        """Ends the request and returns what it consumed (None when it was not in flight)."""
        ...

    def add_adapter(self, adapter_id: str, path: str, base_model: str | None = None) -> None:
        """Validates and registers a PEFT LoRA directory on `base_model` (default: the engine's
        first model); raises EngineError (code invalid_adapter)."""
        ...

    def has_adapter(self, adapter_id: str, base_model: str | None = None) -> bool: ...

    async def remove_adapter(self, adapter_id: str, base_model: str | None = None) -> None:
        """Refuses new requests for the adapter at once; returns when its running requests are done."""
        ...

    def stats(self) -> EngineStats: ...

    def compute_path(self) -> ComputePath | None:
        """What runs the model where the engine runs (it may build the CPU kernels once: call it off the event
        loop); None when the engine runs elsewhere (replicas: `loraplex doctor` on their machines)."""
        ...

    def replicas(self) -> list[ReplicaInfo]:
        """The engine replicas this client drives; empty for an engine in this process."""
        ...

"""Request validation and tokenization for one model, apart from the engine that runs it.

The multi-model pool keeps a frontend for every registered model, resident or not, so a request
for a model that is still on disk is validated (and refused with a clear error) at once, before it
waits for the load. Nothing here touches engine state: callers may run it on their own thread.
A `FrontendSpec` rebuilds a model's frontend in another process (a gateway before Ray Serve
replicas) from what the engine reports and the model's tokenizer files, without its weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.engine.api import (
    ContextLengthExceededError,
    EngineUnavailableError,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    ModelNotFoundError,
)
from loraplex.engine.config import EngineConfig
from loraplex.engine.guided.grammar import CompileBusy, GrammarCache, GuideLimits, SchemaError
from loraplex.engine.guided.guide import Guide
from loraplex.engine.guided.tokenizer import GuideTokenizer, guide_tokenizer
from loraplex.engine.memory import kv_blocks
from loraplex.engine.models.llama import LlamaConfig
from loraplex.engine.models.loader import ModelSource, load_tokenizer
from loraplex.engine.models.tokenizer import Tokenizer
from loraplex.engine.sampler import bias_tensors
from loraplex.engine.sched.request import Request

MAX_DEFAULT_CONTEXT = 8192
CHARS_PER_TOKEN = 16  # a prompt longer than this many characters per token of context is refused untokenized


def text_chars(messages, stop_after: int) -> int:
    """Characters in every string of `messages` (contents, parts, tool calls), without recursion; stops
    counting once past `stop_after`."""
    total, stack = 0, list(messages)
    while stack and total <= stop_after:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return total


def max_model_len(config: EngineConfig, model: LlamaConfig) -> int:
    limit = config.max_model_len or min(model.max_position_embeddings, MAX_DEFAULT_CONTEXT)
    return min(limit, model.max_position_embeddings)


@dataclass(frozen=True)
class FrontendSpec:
    """What rebuilds a model's RequestFrontend elsewhere: the same limits, tokenizer and KV capacity as the engine's."""

    name: str
    source: ModelSource  # (its tokenizer is read from there, as the engine read it: the same files on every node)
    model: LlamaConfig
    config: EngineConfig
    num_kv_blocks: int

    def build(self, adapter_available: Callable[[str], bool]) -> RequestFrontend:
        """The frontend, on the CPU (it only validates and tokenizes: no tensor of it reaches a device); blocking."""
        config = dataclasses.replace(self.config, device="cpu")
        return RequestFrontend(self.name, load_tokenizer(self.source, self.model), self.model, config,
                               adapter_available, self.num_kv_blocks)


class RequestFrontend:
    def __init__(self, name: str, tokenizer: Tokenizer, model: LlamaConfig, config: EngineConfig,
                 adapter_available: Callable[[str], bool], num_kv_blocks: int | None = None):
        """num_kv_blocks: the engine's KV pool where it was measured (default: kv_blocks, as configured)."""
        self.name = name
        self.tokenizer = tokenizer
        self.model, self.config = model, config
        self.vocab_size = model.vocab_size
        self.max_model_len = max_model_len(config, model)
        self.kv_capacity = (num_kv_blocks or kv_blocks(config, model)) * config.block_size
        self.adapter_available = adapter_available
        self.device = config.torch_device
        self.max_prompt_chars = CHARS_PER_TOKEN * self.max_model_len
        self.guide_limits = GuideLimits.from_config(config)
        self.grammars = GrammarCache(self.guide_vocabulary, self.guide_limits)

    def info(self) -> ModelInfo:
        return ModelInfo(self.name, self.max_model_len, self.vocab_size)

    def spec(self, source: ModelSource) -> FrontendSpec:
        return FrontendSpec(self.name, source, self.model, self.config, self.kv_capacity // self.config.block_size)

    def tokenized(self, req: GenerateRequest) -> GenerateRequest:
        """The request validated (prepare), with its prompt as token ids (EngineClient.prepare's answer)."""
        ids = tuple(self.prepare(req).prompt_ids)
        return dataclasses.replace(req, prompt=None, messages=None, prompt_token_ids=ids)

    def tokenize(self, req: GenerateRequest) -> list[int]:
        req.validate()
        if req.model != self.name:
            raise ModelNotFoundError(f"model {req.model!r} not found", "model")
        if req.adapter is not None and not self.adapter_available(req.adapter):
            raise ModelNotFoundError(f"adapter {req.adapter!r} not found", "model")
        if req.prompt_token_ids is not None:
            bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
            return list(req.prompt_token_ids)
        self._check_length(req)
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(list(req.messages), add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        ids = self.tokenizer.encode(req.prompt)
        if not ids:
            raise InvalidRequestError("prompt encodes to no tokens", "prompt")
        return ids

    def _check_length(self, req: GenerateRequest) -> None:
        """Refuses a prompt too long for any tokenization to fit the context, before templating or
        tokenizing it (both cost time in its length)."""
        limit = self.max_prompt_chars
        n = len(req.prompt) if req.prompt is not None else text_chars(req.messages, limit)
        if n > limit:
            param = "prompt" if req.prompt is not None else "messages"
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the "
                f"{param} {'is' if param == 'prompt' else 'are'} longer than {limit} characters "
                f"({CHARS_PER_TOKEN} per token of context), far more than fits. Please reduce the length of the "
                f"{param}.", param)

    def guide_vocabulary(self) -> GuideTokenizer:
        """The tokenizer as llguidance sees it. The pool builds it when it registers a model, so that the
        first request with a schema does not pay for it on the caller's thread."""
        return guide_tokenizer(self.tokenizer, self.vocab_size)

    def guide(self, schema_text: str, compile: bool = True, owner: str | None = None) -> Guide:
        """A request's guide for its JSON schema, compiled here (cached: preparing the same schema again
        costs a copy); InvalidRequestError names what the schema does wrong or which limit it broke,
        EngineUnavailableError (503) that no compiler was free within the limit, that `owner` (a tenant's
        cache salt) already has its share of compiles running, or, with compile False, that the compiled
        schema is not cached."""
        try:
            matcher = self.grammars.matcher(schema_text, compile, owner)
        except SchemaError as e:
            raise InvalidRequestError(f"invalid JSON schema: {e}", "response_format") from None
        except CompileBusy as e:
            raise EngineUnavailableError(str(e)) from None
        return Guide(self.guide_vocabulary(), matcher, self.guide_limits.mask_timeout_s)

    def prepare(self, req: GenerateRequest, compile_schema: bool = True) -> Request:
        """Validates and tokenizes; raises EngineError (nothing is queued). compile_schema False: a schema is
        only taken from the compiled-grammar cache (a 503 if it left it), for a caller on an event loop."""
        ids = self.tokenize(req)
        limit = self.max_model_len
        sp = req.sampling
        asked = sp.max_tokens or 1
        if len(ids) >= limit or len(ids) + asked > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + asked} tokens ({len(ids)} in the prompt, {asked} for the completion). "
                "Please reduce the length of the prompt or the completion.", "messages")
        if len(ids) + asked > self.kv_capacity:
            raise InvalidRequestError(
                f"this request needs {len(ids) + asked} tokens of KV cache ({len(ids)} prompt + {asked} completion) "
                f"but the whole cache holds {self.kv_capacity}; shorten it or give the engine a larger KV cache",
                "max_tokens" if sp.max_tokens else "messages")
        bad = [t for t, _ in sp.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias names token id {bad[0]}, outside the vocabulary (0..{self.vocab_size - 1})", "logit_bias")
        stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else self.tokenizer.eos_token_ids)
        guide = self.guide(sp.json_schema, compile_schema, req.cache_salt) if sp.json_schema is not None else None
        return Request(
            request_id=req.request_id, prompt_ids=ids, sampling=sp,
            max_tokens=min(limit, self.kv_capacity) - len(ids) if sp.max_tokens is None else sp.max_tokens,
            stop_ids=stop_ids,
            priority=req.priority, adapter=req.adapter, cache_salt=req.cache_salt, guide=guide,
            bias=bias_tensors(sp.logit_bias, self.device) if sp.logit_bias else None)

"""What travels between a worker and the fleet: the engine API's values unchanged, and errors as the
same class with the same code and field."""

from __future__ import annotations

import pytest

from loraplex.engine.api import (
    ContextLengthExceededError,
    EngineError,
    EngineStats,
    GenerateEvent,
    GenerateRequest,
    InvalidRequestError,
    ModelNotFoundError,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from loraplex.engine.lora.peft import AdapterError
from loraplex.fleet import wire


def test_requests_events_and_stats_come_back_equal():
    req = GenerateRequest("r", "m", messages=({"role": "user", "content": "hi"},), adapter="a", priority="batch",
                          cache_salt="t", sampling=SamplingParams(max_tokens=3, temperature=0.5, seed=2**63,
                                                                  stop=("\n",), logit_bias=((5, -100.0),),
                                                                  json_schema='{"type": "object"}', logprobs=2))
    event = GenerateEvent("r", "é", (1, 2), "stop", Usage(3, 2, 1, 0.25),
                          logprobs=(TokenLogprob(1, b"\xc3", -0.5, ((1, b"\xc3", -0.5), (7, b"x", -2.0))),))
    stats = EngineStats(1, 2, 3, 4, 5, running_by_class={"batch": 1}, adapter_load_seconds=0.5)
    for value in (req, event, stats):
        assert wire.decode(wire.encode(value), type(value)) == value


@pytest.mark.parametrize(("exc", "comes_back_as", "status"), [
    (ContextLengthExceededError("too long", "messages"), ContextLengthExceededError, 400),
    (ModelNotFoundError("model 'x' not found", "model"), ModelNotFoundError, 404),
    (InvalidRequestError("top_p must be in (0, 1]", "top_p"), InvalidRequestError, 400),
    # an engine-internal subclass travels as its public base, keeping its own code
    (AdapterError("adapter '/p': rank 128 is above max_lora_rank 64"), InvalidRequestError, 400),
    (EngineError("the engine failed"), EngineError, 500),
])
def test_an_engine_error_comes_back_as_its_class_with_its_code_and_param(exc, comes_back_as, status):
    sent_status, body = wire.error_body(exc)
    back = wire.error_from(sent_status, body)
    assert sent_status == status and type(back) is comes_back_as
    assert (back.code, back.message, back.param) == (exc.code, exc.message, exc.param)


def test_an_answer_that_is_not_ours_is_an_engine_error_naming_the_status():
    back = wire.error_from(502, b"<html>Bad Gateway</html>")
    assert type(back) is EngineError and "HTTP 502" in back.message and "Bad Gateway" in back.message


def test_a_body_that_does_not_decode_names_what_was_expected():
    with pytest.raises(wire.WireError, match="GenerateRequest"):
        wire.decode(b'{"request_id": 1}', GenerateRequest)

"""`tool_choice: "auto"` through the tenant API: the model's answer decides between a call and text.

Which answer a model gives is up to its weights, so the answers here come from an engine that
writes a scripted text (in pieces, as a model would), through the real app, its database and
counters; and the real tiny engine shows what reaches a model: the tools listed, no schema."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from loraplex.cli.bench.gateway import FixedEngine
from loraplex.engine.api import GenerateEvent, GenerateRequest, ModelInfo, Usage
from tests.integration.billing_support import app_client, new_tenant
from tests.integration.test_openai_api import sse_events
from tests.integration.test_tool_calls_api import ADD, WEATHER

MODEL = "scripted-text"


class TextEngine(FixedEngine):
    """Answers every request with `answer`, a few characters per event."""

    def __init__(self, answer: str):
        super().__init__()
        self.answer = answer
        self.requests: list[GenerateRequest] = []

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(MODEL, 4096, 256)]

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        self.requests.append(request)  # (as asked: the prepared one holds token ids)
        return await super().prepare(request)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        return self._pieces(request)

    async def _pieces(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        pieces = [self.answer[i:i + 3] for i in range(0, len(self.answer), 3)]
        for piece in pieces:
            await asyncio.sleep(0)
            yield GenerateEvent(request.request_id, piece, (65,))
        yield GenerateEvent(request.request_id, finish_reason="stop", usage=Usage(9, len(pieces)))


def _chat(client, key, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": [WEATHER, ADD],
            **fields}
    return client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


@pytest.mark.parametrize("choice", [None, "auto"])
def test_an_answer_that_is_a_call_becomes_tool_calls_whole_and_streamed(postgres_backend, choice):
    engine = TextEngine(CALL)
    with app_client(postgres_backend, engine) as client:
        _, _, key = new_tenant(client, "auto")
        fields = {} if choice is None else {"tool_choice": choice}
        r = _chat(client, key, **fields)
        assert r.status_code == 200, r.text
        (answer,) = r.json()["choices"]
        assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
        (call,) = answer["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
        sent = engine.requests[-1]
        assert sent.sampling.json_schema is None and '"get_weather"' in sent.messages[0]["content"]
        chunks = sse_events(_chat(client, key, stream=True, **fields).text)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert not any(d.get("content") for d in deltas)
        (streamed,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in streamed] == \
            [("get_weather", {"city": "Oslo"})]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_an_answer_in_words_is_content_streamed_as_it_comes(postgres_backend):
    answer = "It is sunny in Oslo, as far as I know."
    with app_client(postgres_backend, TextEngine(answer)) as client:
        _, _, key = new_tenant(client, "auto-text")
        whole = _chat(client, key).json()["choices"][0]
        assert whole["message"] == {"role": "assistant", "content": answer, "refusal": None}
        assert whole["finish_reason"] == "stop"
        chunks = sse_events(_chat(client, key, stream=True).text)
        contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"][0]["delta"].get("content")]
        assert "".join(contents) == answer and len(contents) > 5


def test_the_tiny_model_gets_the_tools_listed_and_answers_freely(api):
    key = api.key(api.tenant())
    r = api.chat(key, "what now?", max_tokens=6, tools=[WEATHER, ADD])
    assert r.status_code == 200, r.text
    sent = api.backend.engine.requests[-1]
    assert sent.sampling.json_schema is None
    assert sent.messages[0]["role"] == "system" and "answer normally" in sent.messages[0]["content"]
    assert "list of such objects" in sent.messages[0]["content"]
    api.chat(key, "what now?", max_tokens=2, tools=[WEATHER, ADD], parallel_tool_calls=False)
    assert "list of such objects" not in api.backend.engine.requests[-1].messages[0]["content"]
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")

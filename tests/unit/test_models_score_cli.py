"""`loraplex models score`: one request with what drove its score, and `--input` JSON lines scored
in order without a server or a model, with bounded lines and one-line errors."""

from __future__ import annotations

import json

import pytest

from loraplex.cli.main import main
from loraplex.platform.routing.complexity import RequestText
from loraplex.platform.routing.learned import requests
from loraplex.platform.routing.learned.scorer import LearnedScorer

SHIPPED = LearnedScorer.load()
LINES = [
    {"prompt": "Hello"},
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "Prove Fermat's little theorem"}], "max_tokens": 512},
    {"prompt": "Which is a mammal?\nA. shark\nB. whale\nAnswer:", "max_tokens": 1},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                               {"type": "text", "text": "two"}]}]},
]


@pytest.fixture(autouse=True)
def learned(monkeypatch):
    monkeypatch.delenv("LORAPLEX_ROUTER", raising=False)
    monkeypatch.delenv("LORAPLEX_ROUTER_WEIGHTS", raising=False)


def test_input_lines_are_scored_in_order(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in LINES) + "\n\n")
    assert main(["models", "score", "--input", str(path)]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = [SHIPPED.score(requests.parse_request(x)) for x in LINES]
    assert out == [{"score": s} for s in expected] and len(set(expected)) == len(LINES)
    assert requests.parse_request(LINES[1]) == RequestText("Prove Fermat's little theorem", 37, 1, 512)
    assert requests.parse_request(LINES[3]).last_user == "part one, two"


@pytest.mark.parametrize("line,error", [
    ("{", "line 2: not JSON"),
    ('"text"', "line 2: not a JSON object"),
    ('{"prompt": 5}', "line 2: needs a string 'prompt' or 'messages'"),
    ('{"messages": []}', "line 2: needs a string 'prompt' or 'messages'"),
    ('{"messages": [{"content": "x"}]}', "line 2: each message needs a string 'role'"),
    ('{"messages": [{"role": "user", "content": {"a": 1}}]}', "line 2: a message's content must be"),
    ('{"prompt": "x", "max_tokens": -1}', "line 2: max_tokens must be"),
    ('{"prompt": "x", "max_tokens": true}', "line 2: max_tokens must be"),
    ("[" * 100_000 + "]" * 100_000, "line 2: not JSON"),
])
def test_a_bad_line_is_one_error_line_naming_it(tmp_path, capsys, line, error):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(LINES[0]) + "\n" + line + "\n")
    assert main(["models", "score", "--input", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"loraplex: error: {error}") and captured.err.count("\n") == 1
    assert len(captured.out.splitlines()) == 1  # the good line before it was scored


def test_lines_and_their_count_are_bounded(tmp_path, capsys):
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"prompt": "x" * (requests.MAX_LINE_BYTES + 10)}) + "\n")
    assert main(["models", "score", "--input", str(path)]) == 2
    assert f"line 1: longer than {requests.MAX_LINE_BYTES} bytes" in capsys.readouterr().err
    path.write_text("\n".join(json.dumps(x) for x in LINES) + "\n")
    with open(path, "rb") as stream, pytest.raises(requests.BadLine, match="line 4: more than 3 lines"):
        list(requests.read_requests(stream, 3))


def test_one_prompt_shows_its_score_and_drivers(capsys):
    assert main(["models", "score", "--prompt", "Prove Fermat's little theorem", "--max-tokens", "512"]) == 0
    lines = capsys.readouterr().out.splitlines()
    asked = RequestText("Prove Fermat's little theorem", 29, 1, 512)
    assert lines[0] == f"score\t{SHIPPED.score(asked):.4f}"
    drivers = [line.split("\t") for line in lines[2:]]
    assert len(drivers) == 8 and all(float(value) != 0 for _, value in drivers)
    assert main(["models", "score", "--router", "heuristic", "--prompt", "fix the sql query in my python script"]) == 0
    assert "code\t1.00 x 0.25" in capsys.readouterr().out

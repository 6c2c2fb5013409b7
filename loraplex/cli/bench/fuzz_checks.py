"""What the fuzzer holds every answer to, as schemathesis checks, and how a failure is written down
(a reproducing curl and Python call with the secrets replaced by environment variables)."""

from __future__ import annotations

import json
import re

import schemathesis
from schemathesis.checks import not_a_server_error

ERROR_FIELDS = {"message": str, "type": str, "param": (str, type(None)), "code": (str, type(None))}
REPRO_MAX_CHARS = 20_000
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)[\w]*)(: .*)?$")
_FRAME_LINE = re.compile(r'^\s*File "([^"]*loraplex[^"]*)", line \d+, in \S+')


def error_problem(status: int, content: bytes) -> str | None:
    """Why an error answer is not the documented {"error": {"message", "type", "param", "code"}}, or
    None when it is (or the status is no error)."""
    if status < 400:
        return None
    try:
        body = json.loads(content)
    except ValueError:
        return f"{status} body is not JSON: {content[:200]!r}"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"{status} body is not {{\"error\": {{...}}}}: {content[:200]!r}"
    error = body["error"]
    if set(error) != set(ERROR_FIELDS):
        return f"{status} error has fields {sorted(error)}, expected {sorted(ERROR_FIELDS)}"
    wrong = [k for k, kinds in ERROR_FIELDS.items() if not isinstance(error[k], kinds)]
    if wrong:
        return f"{status} error fields of the wrong type: {', '.join(wrong)}"
    return None


@schemathesis.check
def openai_error_format(ctx, response, case) -> None:
    """Every 4xx/5xx body is the documented OpenAI error object."""
    problem = error_problem(response.status_code, response.content)
    if problem is not None:
        raise AssertionError(f"error body not in the OpenAI format: {problem}")


CHECKS = [not_a_server_error, openai_error_format]


def redact(text: str, secrets: dict[str, str]) -> str:
    """`text` with each secret value replaced by its name (`$LORAPLEX_KEY`...)."""
    for name, value in secrets.items():
        text = text.replace(value, name)
    return text


def python_repro(case, base_url: str, headers: dict[str, str]) -> str:
    """A `requests` call that sends what the case sent."""
    args = [repr(case.method.upper()), repr(base_url + case.formatted_path)]
    if case.query:
        args.append(f"params={case.query!r}")
    if case.body is not None and not _is_not_set(case.body):
        args.append(f"json={case.body!r}")
    args.append(f"headers={headers!r}")
    return f"requests.request({', '.join(args)}, timeout=60)"


def _is_not_set(value) -> bool:
    """Whether schemathesis left the body out (its NotSet marker)."""
    return type(value).__name__ == "NotSet"


def clip(text: str) -> str:
    """`text`, cut to REPRO_MAX_CHARS with its length noted."""
    return text if len(text) <= REPRO_MAX_CHARS else text[:REPRO_MAX_CHARS] + f"... ({len(text)} chars)"


def signature_of(text: str) -> str:
    """A failure's cause without what varies between inputs (numbers, quoted values, timestamps)."""
    text = re.sub(r"^\S+ - \d{4}-\d\d-\d\d [\d:,]+ - ", "", text.strip())  # a log line's level and time
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", text)
    return re.sub(r"\d+", "N", text)[:200]


def server_traceback(lines: list[str]) -> dict | None:
    """What the server logged last about a failure in `lines`: the exception's final line and its
    innermost loraplex frame when it logged a traceback, else its last error line."""
    exc_at = next((i for i in range(len(lines) - 1, -1, -1) if _EXCEPTION_LINE.match(lines[i].strip())
                   and any(line.startswith("Traceback") for line in lines[:i])), None)
    if exc_at is None:
        logged = next((line for line in reversed(lines) if " ERROR " in line or "error" in line.lower()), None)
        return {"exception": None, "frame": None, "logged": logged.strip()[:300]} if logged else None
    start = max(i for i in range(exc_at) if lines[i].startswith("Traceback"))
    frames = [lines[i].strip() for i in range(start, exc_at) if _FRAME_LINE.match(lines[i])]
    first = next((lines[i] for i in range(start - 1, max(-1, start - 5), -1) if "error" in lines[i].lower()), None)
    return {"exception": lines[exc_at].strip()[:500], "frame": frames[-1] if frames else None,
            "logged": first.strip()[:300] if first else None}

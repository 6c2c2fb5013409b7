"""`loraplex bench fuzz`: schemathesis over the server's own OpenAPI, so no request gets a 5xx or an off-format error.

- Reads /schema/openapi.json; covers the tenant API (/v1) with a valid tenant key and the admin API (/admin/api) with
  the admin token.
- Each operation gets a share of the cases (the generation endpoints the most), half of them valid by the schema and
  half not (where it has a body or a query).
- Steering, so that the fuzzer reaches past the 404s and 400s: a share of the tenant bodies name a model the tenant
  can use (the base model, its adapter, `auto`), some keep only the core fields or get messages with real roles; a
  share of the paths name the fuzz tenant, its adapter and the served model; and one case in five puts a classic
  hostile string (NASTY: NUL, control characters, a trailing newline...) in the model or in every path and
  name-like query parameter.
- Every answer is held to two checks (fuzz_checks.py): no 5xx, and every error body in the documented format.
- Nothing is excluded; the three operations that would end the run on the fuzz tenant's own names (disable the
  tenant, revoke a key, delete the adapter) never get them.
- The server runs on loopback with the synthetic tiny model and a short context (max_tokens cannot ask for more than
  it holds), so generations stay short whatever max_tokens the fuzzer sends.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import requests
from schemathesis.core.failures import FailureGroup

from loraplex.cli.bench import fuzz_checks as fc

SERVE_ARGS = ["--model", "synthetic:tiny", "--device", "cpu", "--kv-cache-mb", "16", "--max-model-len", "128"]
MODEL = "synthetic:tiny"
TENANT = "fuzz"
ADAPTER = "fuzz-adapter"
# method, path: never given the fuzz tenant's own names (they would end the run)
DESTRUCTIVE = {("POST", "/admin/api/tenants/{name}/disable"), ("POST", "/admin/api/keys/{prefix}/revoke"),
               ("DELETE", "/admin/api/tenants/{name}/adapters/{adapter}")}
WEIGHTS = {("POST", "/v1/chat/completions"): 10, ("POST", "/v1/completions"): 6}
DEPRECATED = frozenset({"functions", "function_call"})
CORE = frozenset({"model", "messages", "prompt", "max_tokens", "stream", "n", "temperature", "seed"})
# Classic hostile identifiers (NUL, control and bidi characters, a trailing newline, a path, long):
# put in for names (models, path and query names) in a share of the cases, where a generator's random
# text would reach them only rarely.
NASTY = ("a\x00b", "\x00", "acme\n", " ", "\t\r", "\u202eevil", "../../etc/passwd", "%00", "x" * 300,
         "\U0001f600", "null", "-1")
NAME_QUERIES = ("tenant", "model", "key", "period")
MAX_REPORTED = 25  # distinct failures written out with their reproductions
CALL_TIMEOUT_S = 60


@dataclass(frozen=True)
class Target:
    """The server under test and the names that reach past its 404s."""

    base_url: str
    tenant_key: str
    admin_token: str
    tenant: str = TENANT
    model: str = MODEL
    adapter: str = ADAPTER


def prepare_target(base_url: str, admin_token: str, workdir: Path) -> Target:
    """Makes the fuzz tenant (a default max_tokens of 16), its key, an adapter of the served model,
    and puts the model in `auto`'s pool."""
    from loraplex.cli.bench.synthetic_adapters import model_config, write_adapter

    def admin(method: str, path: str, **kwargs) -> dict:
        """An admin call that must succeed; its JSON."""
        r = requests.request(method, f"{base_url}/admin/api{path}", timeout=60,
                             headers={"authorization": f"Bearer {admin_token}"}, **kwargs)
        if r.status_code >= 300:
            raise RuntimeError(f"admin {method} {path}: {r.status_code} {r.text[:500]}")
        return r.json()

    admin("POST", "/tenants", json={"name": TENANT, "default_max_tokens": 16})
    key = admin("POST", f"/tenants/{TENANT}/keys", json={"name": "fuzz", "max_priority": "realtime"})["key"]
    path = write_adapter(workdir / ADAPTER, model_config(MODEL), rank=4, seed=1)
    admin("POST", f"/tenants/{TENANT}/adapters", json={"name": ADAPTER, "base_model": MODEL, "path": str(path)})
    admin("PATCH", f"/models/{MODEL}", json={"auto_max_complexity": 1.0})
    return Target(base_url, key, admin_token)


def run_fuzz(target: Target, cases: int, *, server_output=None, seed: int = 0) -> dict:
    """At least `cases` generated requests over every operation; returns the report (see module doc).
    `server_output(mark)`, when given, returns the server's output lines after line `mark` and the
    next mark (LiveServer.output_since): what it logged about a 5xx goes into the report."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{target.base_url}/schema/openapi.json", timeout=60)
    ops = [r.ok() for r in schema.get_all_operations()]
    schema.config.output.sanitization.enabled = False  # reproductions keep `max_tokens`; secrets are redacted here
    run = _Run(target, server_output)
    started = time.perf_counter()
    active, round_no = ops, 0
    while run.cases < cases and active:
        quotas = _quotas(active, cases - run.cases)
        for op in active:
            before = run.by_op[op.label]["cases"]
            run.operation(op, quotas[op.label], seed + round_no)
            if run.by_op[op.label]["cases"] - before < quotas[op.label]:
                run.exhausted.add(op.label)  # hypothesis ran out of distinct inputs for it
        active = [op for op in active if op.label not in run.exhausted]
        round_no += 1
    return run.report(time.perf_counter() - started, cases)


def _quotas(ops, cases: int) -> dict[str, int]:
    """Cases per operation for `cases` in all: by weight, the generation endpoints the most."""
    weights = {op.label: WEIGHTS.get((op.method.upper(), op.path), 3 if op.body else 1) for op in ops}
    total = sum(weights.values())
    return {label: max(2, -(-cases * w // total)) for label, w in weights.items()}


class _Run:
    """The counts and failures of one fuzz run."""

    def __init__(self, target: Target, server_output):
        """Nothing sent yet."""
        self.target, self.server_output = target, server_output
        self.cases = 0
        self.exhausted: set[str] = set()
        self.by_op: dict[str, dict] = defaultdict(lambda: {"cases": 0, "statuses": Counter(), "seconds": 0.0,
                                                                   "codes": Counter(), "examples": {}})
        self.failures: dict[str, Counter] = defaultdict(Counter)
        self.signatures: Counter = Counter()  # (operation, status, what the server logged) of each failure
        self.mark = 0  # server output lines already read
        self.harness_errors: Counter = Counter()
        self.distinct: dict[tuple, dict] = {}
        self.session = requests.Session()
        self.secrets = {"$LORAPLEX_KEY": target.tenant_key, "$LORAPLEX_ADMIN_TOKEN": target.admin_token}

    def operation(self, op, examples: int, seed: int) -> None:
        """`examples` cases of `op`, half valid by the schema and half not."""
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hseed
        from hypothesis.errors import HypothesisException
        from schemathesis import GenerationMode

        # A path parameter is any string: only a body or a query can be sent invalid by the schema
        negative = examples // 2 if op.body or op.query else 0
        for mode, share in ((GenerationMode.POSITIVE, examples - negative), (GenerationMode.NEGATIVE, negative)):
            if share == 0:
                continue
            strategy = self._steered(op, mode)

            @hseed(seed)
            @settings(max_examples=share, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck), print_blob=False)
            @given(case=strategy)
            def one(case) -> None:
                """One generated case."""
                self.call(op, case)

            try:
                one()
            except HypothesisException:  # e.g. Unsatisfiable: no invalid value for this operation
                pass
            except Exception as exc:  # the harness's own failure (it ends this operation's turn): reported
                self.harness_errors[f"{op.label} {mode.value}: {type(exc).__name__}: {exc}"[:300]] += 1

    def _steered(self, op, mode):
        """The operation's cases, some with the fuzz tenant's names put in (module doc)."""
        from hypothesis import strategies as st

        t = self.target
        base = op.as_strategy(generation_mode=mode)
        if op.path.startswith("/v1/") and op.body:
            trims = st.sampled_from([None, DEPRECATED, CORE])
            models = _mostly(st.sampled_from([None, t.model, t.adapter, "auto"]), st.sampled_from(NASTY))
            return st.tuples(base, models, trims, st.booleans()).map(_with_model)
        names = {"name": t.tenant, "adapter": t.adapter, "model_id": t.model}
        if op.path.startswith("/admin/api/models/"):
            names["name"] = t.model
        if op.path.startswith("/v1/models/"):
            names["model_id"] = t.adapter
        wanted = [p for p in names if "{" + p + "}" in op.path]
        if "{" not in op.path and not any(p.name in NAME_QUERIES for p in op.query or ()):
            return base  # no name to put anything in
        if (op.method.upper(), op.path) in DESTRUCTIVE:
            wanted = []  # generated or nasty names only
        real = {k: names[k] for k in wanted}
        # per case: generated names, the real ones (where safe), or a nasty one in each name
        choice = _mostly(st.sampled_from([None, *([real] if real else [])]), st.sampled_from(NASTY))
        return st.tuples(base, choice).map(_with_names)

    def call(self, op, case) -> None:
        """Sends one case with the right credentials and holds its answer to the checks."""
        admin = op.path.startswith("/admin/")
        headers = {"authorization": f"Bearer {self.target.admin_token if admin else self.target.tenant_key}"}
        self.cases += 1
        stats = self.by_op[op.label]
        stats["cases"] += 1
        if self.server_output is not None:
            self.mark = self.server_output(self.mark)[1]
        sent = time.perf_counter()
        try:
            response = case.call(base_url=self.target.base_url, headers=dict(headers), session=self.session,
                                 timeout=CALL_TIMEOUT_S)
        except requests.RequestException as exc:
            stats["statuses"][type(exc).__name__] += 1
            self._record(op, case, headers, type(exc).__name__, f"no answer: {exc!r}"[:500], None)
            return
        stats["statuses"][str(response.status_code)] += 1
        stats["seconds"] += time.perf_counter() - sent
        if response.status_code >= 400:
            code = _error_code(response)
            stats["codes"][code] += 1
            stats["examples"].setdefault(code, response.text[:300])
        try:
            case.validate_response(response, checks=fc.CHECKS, headers=headers)
        except FailureGroup as exc:  # the checks that failed
            message = "; ".join(f"{f.title}: {f.message}".strip(": ") for f in exc.exceptions)
            self._record(op, case, headers, str(response.status_code), message, response)

    def _record(self, op, case, headers: dict, status: str, message: str, response) -> None:
        """Counts a failure; the first of each signature is kept with what the server logged and a repro."""
        self.failures[op.label][status] += 1
        logged = None
        if status.startswith("5") and self.server_output is not None:
            time.sleep(0.1)  # the server logs after it answers
            lines, self.mark = self.server_output(self.mark)
            logged = fc.server_traceback(lines)
        problem = fc.error_problem(response.status_code, response.content) if response is not None else None
        what = (logged or {}).get("exception") or (logged or {}).get("logged") or message
        what = what.replace(case.formatted_path, op.path)  # one signature whatever the path's values
        signature = (op.label, status, problem is None, fc.signature_of(what))
        self.signatures[signature] += 1
        if signature in self.distinct or len(self.distinct) >= MAX_REPORTED:
            return
        self.distinct[signature] = {
            "operation": op.label, "status": status, "check": message[:1000],
            "body": response.text[:1000] if response is not None else None,
            "server_log": logged,
            "curl": fc.clip(fc.redact(case.as_curl_command(headers=dict(headers)), self.secrets)),
            "python": fc.clip(fc.redact(fc.python_repro(case, self.target.base_url, headers), self.secrets)),
        }

    def report(self, seconds: float, asked: int) -> dict:
        """The run as JSON (module doc)."""
        return {
            "cases": self.cases, "cases_asked": asked, "seconds": round(seconds, 1),
            "failed_cases": sum(sum(c.values()) for c in self.failures.values()),
            "failures_by_endpoint": {op: dict(c) for op, c in sorted(self.failures.items())},
            "distinct_failures": list(self.distinct.values()),
            "failure_signatures": [{"operation": op, "status": status, "format_ok": ok, "cause": cause, "count": n}
                                   for (op, status, ok, cause), n in self.signatures.most_common()],
            "harness_errors": dict(self.harness_errors),
            "by_operation": {op: {"cases": s["cases"], "statuses": dict(s["statuses"]),
                                  "error_codes": dict(s["codes"]), "error_examples": s["examples"],
                                  "answer_seconds": round(s["seconds"], 2)}
                             for op, s in sorted(self.by_op.items())},
        }


def _mostly(usual, rare, rare_share: int = 5):
    """`usual`, and `rare` in one case out of `rare_share`."""
    from hypothesis import strategies as st

    return st.integers(0, rare_share - 1).flatmap(lambda i: rare if i == 0 else usual)


def _error_code(response) -> str:
    """The error body's `code` (a label for the report), or a note that the body is not OpenAI's."""
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "(not the OpenAI format)"


def _with_model(args):
    """A generation body with the tenant's model put in and, for some, the fields that stop it short
    (the deprecated functions) taken out, or only the core fields kept, or the messages' roles made
    ones that exist (the rest of the body as generated: it then reaches guided decoding, tools...)."""
    case, model, trim, fix_roles = args
    if isinstance(case.body, dict):
        body = {**case.body, **({"model": model} if model is not None else {})}
        if trim is DEPRECATED:
            body = {k: v for k, v in body.items() if k not in DEPRECATED}
        elif trim is CORE:
            body = {k: v for k, v in body.items() if k in CORE}
        if fix_roles and isinstance(body.get("messages"), list):
            body["messages"] = [_well_formed(m) if isinstance(m, dict) else m for m in body["messages"]]
        case.body = body
    return case


def _well_formed(message: dict) -> dict:
    """The message with a role that exists and, for a list of content parts, text parts."""
    role = "tool" if message.get("tool_call_id") is not None else "assistant" if message.get("tool_calls") else "user"
    content = message.get("content")
    if isinstance(content, list):
        content = [{"type": "text", "text": p.get("text") if isinstance(p, dict) and isinstance(p.get("text"), str)
                    else ""} for p in content]
    return {**message, "role": role, "content": content}


def _with_names(pair):
    """Path parameters (and name-like query parameters) as generated, the fuzz tenant's real names,
    or one nasty string in all of them."""
    case, choice = pair
    if choice is None:
        return case
    if isinstance(choice, dict):
        case.path_parameters = {**(case.path_parameters or {}), **choice}
        return case
    if case.path_parameters:
        case.path_parameters = {k: choice for k in case.path_parameters}
    if isinstance(case.query, dict) and any(k in case.query for k in NAME_QUERIES):
        case.query = {k: choice if k in NAME_QUERIES else v for k, v in case.query.items()}
    return case


def run_fuzz_bench(cases: int) -> dict:
    """The long run: its own server on loopback (a scratch Postgres database and Redis prefix)."""
    import tempfile

    from loraplex.cli.bench.live_server import live_server

    with tempfile.TemporaryDirectory() as tmp, live_server(SERVE_ARGS) as server:
        target = prepare_target(server.base_url, server.admin_token, Path(tmp))
        report = run_fuzz(target, cases, server_output=server.output_since)
        report["server_alive_after"] = server.proc.poll() is None
    _print_summary(report)
    return report


def _print_summary(report: dict) -> None:
    """One line for the run and one per endpoint that failed."""
    print(f"fuzz: {report['cases']} cases in {report['seconds']} s, {report['failed_cases']} failed")
    for op, statuses in report["failures_by_endpoint"].items():
        print(f"  {op}: {', '.join(f'{s} x{n}' for s, n in sorted(statuses.items()))}")

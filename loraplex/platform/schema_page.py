"""/schema: the API's operations as a plain HTML page rendered here, with no script and nothing fetched
from another host (Litestar's Redoc and Swagger pages load theirs from a CDN, so they are blank offline).

- /schema/openapi.json is the full OpenAPI document; /schema and /schema/swagger both show this page.
"""

from __future__ import annotations

from html import escape
from typing import Any

from litestar import Request
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin

METHODS = ("get", "post", "put", "patch", "delete")
STYLE = """<style>
body { font: 15px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 70em; padding: 0 1em; color: #222 }
h2 { border-bottom: 1px solid #ccc; margin-top: 2em }
table { border-collapse: collapse; width: 100% }
td { padding: .3em .6em; border-bottom: 1px solid #eee; vertical-align: top }
td.method { font-weight: bold; text-transform: uppercase; width: 5em }
code { font-size: 95% }
</style>"""


class SchemaPage(OpenAPIRenderPlugin):
    """The operations grouped by tag: method, path, summary; a link to the JSON for the details."""

    def __init__(self, path: str | list[str] = ("/", "/swagger")) -> None:
        super().__init__(path=list(path), favicon="", style=STYLE)

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        info = openapi_schema.get("info", {})
        title = escape(f"{info.get('title', 'API')} {info.get('version', '')}".strip())
        json_url = escape(self.get_openapi_json_route(request))
        sections = "".join(_section(tag, rows) for tag, rows in _by_tag(openapi_schema).items())
        page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{title}</title>{self.style}"
                f"</head><body><h1>{title}</h1><p>{escape(info.get('description', ''))}</p>"
                f"<p>The whole OpenAPI document: <a href='{json_url}'>{json_url}</a></p>{sections}</body></html>")
        return page.encode()


def _by_tag(schema: dict[str, Any]) -> dict[str, list[tuple[str, str, str]]]:
    """(method, path, summary) of every operation under its first tag, tags in first-seen order."""
    groups: dict[str, list[tuple[str, str, str]]] = {}
    for path, item in sorted(schema.get("paths", {}).items()):
        for method in METHODS:
            op = item.get(method)
            if op is not None:
                tag = (op.get("tags") or ["other"])[0]
                summary = op.get("summary") or op.get("description", "").split("\n")[0]
                groups.setdefault(tag, []).append((method, path, summary))
    return groups


def _section(tag: str, rows: list[tuple[str, str, str]]) -> str:
    body = "".join(f"<tr><td class='method'>{escape(m)}</td><td><code>{escape(p)}</code></td><td>{escape(s)}</td></tr>"
                   for m, p, s in rows)
    return f"<h2>{escape(tag)}</h2><table>{body}</table>"


def openapi_config() -> OpenAPIConfig:
    """The app's OpenAPI config: the JSON document and this page, no CDN-backed UI."""
    return OpenAPIConfig(title="loraplex", version="0.1.0", path="/schema",
                         description="OpenAI-compatible tenant API and admin API",
                         render_plugins=[JsonRenderPlugin(), SchemaPage()])

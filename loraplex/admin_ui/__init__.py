"""The admin web UI: server-rendered pages under /admin (Jinja templates, this package's own CSS
and scripts, SVG charts drawn on the server and live ones redrawn from /admin/live.json) over the
same platform functions as the admin API.

`AdminUI()` is a Litestar plugin; `create_app(..., plugins=[AdminUI()])` mounts it (`loraplex serve`
does). The platform does not import this package: the UI sits above it (the layers contract in pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

from litestar import Router
from litestar.config.app import AppConfig
from litestar.plugins import InitPluginProtocol
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

_HERE = Path(__file__).parent


class AdminUI(InitPluginProtocol):
    def __init__(self, sample_interval_s: float = 5.0):
        """`sample_interval_s`: how often the overview's live charts read the metrics."""
        self.sample_interval_s = sample_interval_s

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        from loraplex.admin_ui.actions import action_handlers
        from loraplex.admin_ui.live import lifespan_hooks, live_json
        from loraplex.admin_ui.pages import page_handlers
        from loraplex.admin_ui.web import LoginRequired, handle_error, handle_login_required, ui_guard

        ui = Router(path="/admin", guards=[ui_guard], include_in_schema=False,
                    route_handlers=[*page_handlers, *action_handlers, live_json],
                    exception_handlers={LoginRequired: handle_login_required, Exception: handle_error})
        static = create_static_files_router(path="/admin/static", directories=[_HERE / "static"],
                                            include_in_schema=False)
        app_config.route_handlers.extend([ui, static])
        start, stop = lifespan_hooks(self.sample_interval_s)
        app_config.on_startup.append(start)
        app_config.on_shutdown.insert(0, stop)
        app_config.template_config = TemplateConfig(directory=_HERE / "templates", engine=JinjaTemplateEngine)
        return app_config

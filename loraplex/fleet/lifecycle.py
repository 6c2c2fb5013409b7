"""Ties a fleet's health polling to the serving app's life: started with it, stopped after it."""

from __future__ import annotations

from litestar.config.app import AppConfig
from litestar.plugins import InitPluginProtocol

from loraplex.fleet.fleet import EngineFleet


class FleetLifecycle(InitPluginProtocol):
    def __init__(self, fleet: EngineFleet):
        self.fleet = fleet

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        app_config.on_startup.append(self.fleet.start)
        app_config.on_shutdown.append(self.fleet.close)  # after the app's own shutdown has drained its requests
        return app_config

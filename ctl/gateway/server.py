"""The gateway's HTTP server: uvicorn, configured with the gateway's bounds (``limits``).

``serve`` runs it until SIGTERM; ``make_server`` builds it (tests run it in a thread on a free
port, with smaller limits).
"""

from __future__ import annotations

import uvicorn
from starlette.applications import Starlette

from ntx.ctl.gateway.limits import LISTEN_BACKLOG, GatewayLimits


def make_server(app: Starlette, host: str, port: int, limits: GatewayLimits, log_level: str = "info") -> uvicorn.Server:
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2,
        loop="asyncio", backlog=LISTEN_BACKLOG,
    )
    return uvicorn.Server(config)


def serve(app: Starlette, host: str, port: int, limits: GatewayLimits, log_level: str = "info") -> None:
    make_server(app, host, port, limits, log_level).run()

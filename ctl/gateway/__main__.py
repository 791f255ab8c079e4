"""``python -m ntx.ctl.gateway --pipeline tcp://127.0.0.1:5555 --http 127.0.0.1:8080
[--api-key-file PATH]``: serve the gateway until SIGTERM (uvicorn's own signal handling shuts it
down cleanly). The API key comes from the file (read once and deleted) or ``NTX_API_KEY``."""

from __future__ import annotations

import argparse
import sys

from ntx.ctl.gateway.address import check_exposure, parse_http_address
from ntx.ctl.gateway.api_key import api_key as read_api_key
from ntx.shared.config import LOG_LEVELS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ntx-gateway")
    ap.add_argument("--pipeline", required=True, help="the pipeline's client address (ZeroMQ)")
    ap.add_argument("--http", required=True, help="HOST:PORT to serve HTTP on")
    ap.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    ap.add_argument("--api-key-file", help="a file of this user, mode 0600, holding the API key: read once and "
                                           "deleted (without it: the environment's NTX_API_KEY)")
    args = ap.parse_args(argv)
    from ntx.shared.daemon import die_with_parent

    die_with_parent()  # a supervisor killed outright takes its gateway with it
    try:
        api_key = read_api_key(args.api_key_file)
        host, port = parse_http_address(args.http)
        check_exposure(host, api_key)
    except ValueError as e:
        print(f"ntx-gateway: error: {e}", file=sys.stderr)
        sys.exit(2)
    from ntx.ctl.gateway.app import create_app
    from ntx.ctl.gateway.limits import GatewayLimits
    from ntx.ctl.gateway.server import raise_descriptor_limit, serve

    limits = GatewayLimits().for_descriptors(raise_descriptor_limit())
    serve(create_app(args.pipeline, api_key, limits), host, port, limits, args.log_level)


if __name__ == "__main__":
    main()

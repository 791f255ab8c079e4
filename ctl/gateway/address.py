"""The gateway's HTTP address: its syntax, and the rule that only loopback may go without a key.

ntxctl checks these before starting anything (one clear line instead of a gateway that dies in
the background); the gateway checks them again for a direct ``python -m ntx.ctl.gateway``.
"""

from __future__ import annotations

import ipaddress


def parse_http_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6) -> (host, port); ValueError with the reason."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ValueError(f"--http {text!r}: expected HOST:PORT (example: 127.0.0.1:8080)")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    """Listening beyond this machine needs an API key: the gateway runs anybody's prompts."""
    if not is_loopback(host) and not api_key:
        raise ValueError(f"--http on {host} listens beyond this machine: give --api-key KEY (or set NTX_API_KEY); "
                         "clients then send Authorization: Bearer KEY")

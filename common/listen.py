"""The HTTP port, checked before anything slow starts."""

from __future__ import annotations

import socket


def probe_bind(host: str, port: int) -> int:
    """Bind (``host``, ``port``) with a plain socket and let it go: the port it got (port 0
    becomes a concrete one); OSError where the address is taken or not this host's. Plain, not
    SO_REUSEPORT: such a bind would silently join another server's group on the same port."""
    with socket.socket(address_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        return probe.getsockname()[1]


def address_family(host: str) -> socket.AddressFamily:
    """IPv6 for a host with a colon in it, else IPv4."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET

"""The server's ports, checked or claimed before anything starts: a port taken is one line naming its option, and a
claimed one cannot be taken by another process while the instances start."""

from __future__ import annotations

import socket

from dlrm_lab.errors import FieldError, UserError


def _bound(host: str, port: int, field: str | None) -> socket.socket:
    """A socket bound to host:port (SO_REUSEADDR, as servers bind: TIME_WAIT is no conflict), not listening."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        why = f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        raise (FieldError(field, f"{port}: {why}") if field else UserError(why)) from None
    return sock


def check_port(host: str, port: int, field: str | None = None) -> None:
    """Refuse a port this host cannot listen on now (for a server that binds its own socket later: gRPC's)."""
    _bound(host, port, field).close()


def claim_port(host: str, port: int, field: str) -> socket.socket:
    """The port, bound now and held for the server that will listen on this very socket (the REST front's)."""
    return _bound(host, port, field)

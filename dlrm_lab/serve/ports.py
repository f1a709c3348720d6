"""The server's ports, checked or claimed before anything starts: a port taken is one line naming its option, and a
claimed one cannot be taken by another process while the instances start."""

from __future__ import annotations

import socket

from dlrm_lab.errors import FieldError, UserError

CLAIM_BACKLOG = 128  # connections a claimed port queues before its server serves


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


def claim_port(host: str, port: int, field: str) -> socket.socket:
    """The port, bound and listening now, held for the server that will serve on this very socket (the REST front's,
    /metrics') or until the one that binds its own is about to (gRPC's: `release_to`). Listening, it is exclusive:
    Linux lets two SO_REUSEADDR sockets share a port while neither listens, so a claim bound alone was not held
    against another server starting meanwhile. Connections made before the server starts wait in its backlog."""
    sock = _bound(host, port, field)
    sock.listen(CLAIM_BACKLOG)
    return sock


def release_to(claim: socket.socket) -> int:
    """Give a claimed port up to a server that binds it itself next (gRPC's): its number (a claim of port 0 got a
    free one, which that server must take)."""
    port = int(claim.getsockname()[1])
    claim.close()
    return port

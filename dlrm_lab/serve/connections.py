"""How many connections `serve` accepts: its file descriptors, shared out between its protocols.

A server that accepts until the process's file-descriptor limit stops answering everyone, the clients it already
had included (2,000 idle connections: HTTP and gRPC both stopped, and asyncio logged 63,459 "accept out of
resources" tracebacks in 25 s). So the soft limit is raised to the hard one at start, and each protocol accepts at
most its share of the descriptors left beyond a reserve for the server's own files (its tables, its logs, the body
parser's pipes, `/metrics`' scrapers): past its share a REST client is answered 503 and its connection closed, and
gRPC closes a new connection before its handshake (`grpc.max_allowed_incoming_connections`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

RESERVE_FDS = 128  # the server's own: tables and logs being written, 64 scrapers at most, the body parser's pipes


@dataclass(frozen=True)
class ConnectionBudget:
    per_protocol: int  # connections each protocol (gRPC, HTTP/REST) accepts at once
    fd_limit: int  # the process's soft limit, raised to the hard one where it was lower
    fds_at_start: int  # open when the budget was made (the model, its instances' pipes, the listening sockets)


def connection_budget(protocols: int = 2) -> ConnectionBudget:
    """Raise the soft descriptor limit to the hard one, then share what is left beyond RESERVE_FDS over `protocols`."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may refuse: the soft limit it gave is then the budget's
            pass
    limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    share = max(1, (limit - in_use - RESERVE_FDS) // max(1, protocols))
    return ConnectionBudget(per_protocol=share, fd_limit=limit, fds_at_start=in_use)

"""What `dlrm-lab serve` and `dlrm-lab client` are given beyond the options they share with `infer run`.

Each field is declared once (`config.options.option`): `dlrm_lab.commands` composes the two commands from
these, `infer.options.ServingOptions` and `InferConfig`, and their Typer signatures are generated from that.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlrm_lab.config.options import REQUIRED, OptionChange, option
from dlrm_lab.errors import FieldError


def check_ports(port: int, http_port: int | None = None, metrics_port: int | None = None) -> None:
    """The server's ports, each a TCP port (0: any free one), the HTTP one not gRPC's: one line naming the first
    wrong (the command's options and the library's `serve` alike)."""
    for field, value in (("port", port), ("http_port", http_port), ("metrics_port", metrics_port)):
        if value is not None and not 0 <= value <= 65535:
            raise FieldError(field, f"{value}: must be in [0, 65535] (0: any free port)")
    if http_port is not None and http_port == port and port:
        raise FieldError("http_port", f"{http_port}: must be in [0, 65535] and not --port (0: any free port)")


@dataclass(frozen=True)
class ServeOptions:
    """The gRPC front of `dlrm-lab serve` (`serve.server.serve` takes these by name)."""

    host: str = option("0.0.0.0", "Address to listen on (0.0.0.0: every IPv4 interface).")
    port: int = option(50051, "TCP port (0: any free port; the start line names it).")
    seed: int = option(0, "Seed of the weights and of the sample library Describe announces.")
    grace_s: float = option(
        10.0, "On SIGTERM/Ctrl-C, seconds queries in flight may take to finish.", flags=("--grace",)
    )
    http_port: int | None = option(
        None, "Also answer the Open Inference Protocol over HTTP/REST (KServe v2) on this port (0: any free port)."
    )
    metrics_port: int | None = option(
        None, "Serve live metrics in Prometheus's format at /metrics on this port (0: any free port; default: off)."
    )

    def __post_init__(self) -> None:
        check_ports(self.port, self.http_port, self.metrics_port)
        if not 0 <= self.grace_s <= 3600:
            raise FieldError("grace_s", f"{self.grace_s:g}: must be in [0, 3600] seconds")


@dataclass(frozen=True)
class ClientOptions:
    """`dlrm-lab client`: `infer run --target grpc://HOST:PORT` under its former name, with its own
    words for the load (one served model, one rate or a closed loop, one query size and bound)."""

    target: str = option(REQUIRED, "The server, HOST:PORT.")
    qps: float | None = option(None, "Open loop: total target queries/s.")
    closed_loop: bool = option(
        False, "Closed loop: each connection keeps one query outstanding.", flags=("--closed-loop",), negatable=False
    )
    query_size: str = option(
        "fixed:1", "Samples per query: fixed:N, normal:MEAN,STD, lognormal:MEDIAN,SIGMA, uniform:LO,HI, mlperf."
    )
    model: str | None = option(None, "Served model to query (default: the first served).")
    sla_ms: float = option(10.0, "Latency bound in ms.")
    rpc: str = option(
        "stream",
        "stream: one bidirectional InferStream per connection; unary: one Infer call per query; oip: one ModelInfer "
        "call per query, the Open Inference Protocol (KServe v2).",
    )


# `client`'s own words (and duration) for the options it passes on to `infer run` unchanged
CLIENT_CHANGES: dict[str, OptionChange] = {
    "concurrency": {"help": "Client connections, each beyond one a process of its own."},
    "duration": {"default": 10.0},
    "seed": {"help": "Seed of the load."},
    "timeout": {"help": "Seconds a query may take before DEADLINE_EXCEEDED."},
    "unavailable_s": {"help": "Give up when the server has been UNAVAILABLE this many seconds."},
    "connect_timeout": {"help": "Seconds to wait for the server at start."},
    "scenario": {"help": "open-loop, or an MLPerf LoadGen scenario: server, offline, single- or multi-stream."},
}

"""`dlrm-lab serve`, and `dlrm-lab client` (an alias of `infer run --target`): inference over gRPC (docs/serving.md)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import cast

from dlrm_lab.cli.format import console
from dlrm_lab.cli.options import METRICS_DIR, command
from dlrm_lab.commands import CLIENT, INFER_RUN, SERVE
from dlrm_lab.config.options import build
from dlrm_lab.config.values import OptionValues
from dlrm_lab.errors import UserError, raise_on_sigterm
from dlrm_lab.serve.options import ClientOptions

RPCS = ("stream", "unary", "oip")


@command(*SERVE, METRICS_DIR)
def serve_command(options: OptionValues) -> None:
    """Serve models over gRPC until SIGTERM or Ctrl-C (every query recorded in a `serve` run)."""
    from dlrm_lab.commands import serve_setup
    from dlrm_lab.serve.server import serve

    served, front = serve_setup(options)
    raise_on_sigterm()  # during start-up; serving installs its own graceful handler
    out = console(stderr=True)

    def log(msg: str) -> None:
        out.print(msg, highlight=False, soft_wrap=True)

    run_dir = serve(
        served,
        **asdict(front),
        device=cast(str, options["device"]),  # --device: a string option
        pin_cores=cast(bool, options["pin_cores"]),  # --pin-cores: a flag
        metrics_dir=cast(str, options["metrics_dir"]),  # --metrics-dir: a directory
        argv=["dlrm-lab", *sys.argv[1:]],
        log=log,
    )
    console().print(f"run directory: {run_dir}")


@command(*CLIENT, METRICS_DIR)
def client_command(options: OptionValues) -> None:
    """`infer run --target grpc://HOST:PORT` (kserve:// with --rpc oip) under its former name: drive a remote
    `dlrm-lab serve` and record every query's stages."""
    from dlrm_lab.cli.infer import run_command
    from dlrm_lab.infer.options import InferConfig
    from dlrm_lab.infer.targets import parse_target
    from dlrm_lab.serve.connect import describe_server

    o = build(ClientOptions, CLIENT, options)
    if (o.qps is None) == (not o.closed_loop):
        raise UserError("give either --qps Q (open loop) or --closed-loop")
    if o.rpc not in RPCS:
        raise UserError(f"--rpc {o.rpc!r}: allowed: {', '.join(RPCS)}")
    # infer run's options as given (the client shares their declarations), and the client's load in its words
    run = {d.name: options[d.name] for d in CLIENT if d.owner is not ClientOptions}
    run |= {
        "target": f"{'kserve' if o.rpc == 'oip' else 'grpc'}://{o.target}",
        "scenario": "closed-loop" if o.closed_loop else options["scenario"],
        "rpc": None if o.rpc == "oip" else o.rpc,
        "qps": None if o.qps is None else [str(o.qps)],
        "query_size": [o.query_size],
        "sla_ms": [str(o.sla_ms)],
    }
    build(InferConfig, INFER_RUN, run, sla_ms=o.sla_ms)  # the rules, before the server is asked
    connect_timeout = cast(float, run["connect_timeout"])  # --connect-timeout: seconds
    served = describe_server(parse_target(f"grpc://{o.target}"), connect_timeout)
    names = [m.name for m in served]
    if o.model is not None and o.model not in names:
        raise UserError(f"--model {o.model!r}: not served at {o.target}; served: {', '.join(names)}")
    info = served[names.index(o.model)] if o.model else served[0]
    if o.rpc == "oip":
        run["target"] = cast(str, run["target"]) + f"/{info.name}"  # the grpc:// or kserve:// target above
    run_command(
        **run,
        model=[info.preset],
        max_rows=info.max_rows or None,
        table_scale=info.table_scale or None,
        metrics_dir=options["metrics_dir"],
        progress=False,
    )

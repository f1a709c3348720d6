"""`dlrm-lab machine probe|show`: the measured peaks every run is placed against."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from dlrm_lab.cli.format import console
from dlrm_lab.errors import UserError

app = typer.Typer(help="Machine profile: measured GEMM, memory, gather and collective peaks.", no_args_is_help=True)

_DEVICES = ("auto", "cpu", "cuda")


@app.command("probe")
def probe_command(
    quick: Annotated[
        bool, typer.Option("--quick", help="Small sizes, few repeats: seconds instead of minutes.")
    ] = False,
    device: Annotated[str, typer.Option(help="auto (cpu, and every GPU where present), cpu or cuda.")] = "auto",
    comms_only: Annotated[
        bool, typer.Option("--comms-only", help="Under a launcher: measure only the collectives, keep device peaks.")
    ] = False,
    timeout: Annotated[float, typer.Option(help="Seconds a rank waits for the others (multi-rank probes).")] = 600.0,
    if_missing: Annotated[
        bool, typer.Option("--if-missing", help="Probe only if this machine has no stored profile yet.")
    ] = False,
) -> None:
    """Measure this machine's peaks and store them under its hardware fingerprint.

    Under torchrun, mpiexec or SLURM with several ranks, all-to-all and all-reduce
    bandwidths across sizes are measured as well (rank 0 alone measures the devices).
    """
    import torch

    from dlrm_lab.distributed.context import detect_launch, init_distributed, shutdown_distributed
    from dlrm_lab.metrics.probe import probe_machine
    from dlrm_lab.metrics.roofline import save_profile

    if device not in _DEVICES:
        raise UserError(f"--device {device!r}: allowed: {', '.join(_DEVICES)}")
    if if_missing:
        from dlrm_lab.metrics.roofline import load_profile, profile_path

        stored = load_profile()
        if stored is not None and stored.get("devices"):
            kind = "quick profile" if stored.get("quick") else "profile"
            where = profile_path(stored["fingerprint_id"])
            console().print(f"machine {kind} of {stored.get('probed_at')} in {where}: not probing again (--if-missing)")
            return
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device cuda: no CUDA device is visible to this torch build (torch {torch.__version__})")
    launch = detect_launch()
    if comms_only and launch.world_size < 2:
        raise UserError(
            "--comms-only: needs a launch with several ranks (e.g. dlrm-lab launch --nproc 2 -- machine probe)"
        )
    devices = None if device == "auto" else [device]
    rank = 0
    if launch.world_size > 1:
        comm_device = "cuda" if torch.cuda.is_available() and device != "cpu" else "cpu"
        rank = init_distributed(comm_device, timeout).rank
    say = console().print if rank == 0 else None
    try:
        profile = probe_machine(quick=quick, devices=[] if comms_only else devices, log=say)
    finally:
        shutdown_distributed()
    if rank == 0:
        path = save_profile(profile)
        console().print(f"machine profile {profile['fingerprint_id']} written to {path}")


def _gb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e9:,.2f}"


@app.command("show")
def show_command(
    fingerprint: Annotated[Optional[str], typer.Argument(help="A fingerprint id (default: this machine's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the stored profile as JSON.")] = False,
) -> None:
    """Print a stored machine profile."""
    from dlrm_lab.metrics.roofline import load_profile, profile_path

    profile = load_profile(fingerprint)
    if profile is None:
        which = fingerprint or "this machine"
        raise UserError(f"no machine profile for {which} (looked for {profile_path(fingerprint or '<id>').parent}); "
                        "run 'dlrm-lab machine probe'")  # fmt: skip
    if as_json:
        typer.echo(json.dumps(profile, indent=2))
        return
    out = console()
    hw = profile.get("hardware", {})
    quick = " (quick)" if profile.get("quick") else ""
    out.print(f"machine {profile['fingerprint_id']}: {hw.get('cpu_model')}, {hw.get('logical_cores')} cores, "
              f"probed {profile.get('probed_at')}{quick}")  # fmt: skip
    table = Table(title="peaks")
    for col in ("device", "GEMM fp32 GFLOP/s", "bf16", "fp16", "tf32", "copy GB/s", "gather GB/s", "H2D GB/s"):
        table.add_column(col, justify="left" if col == "device" else "right")
    rows = []
    for name, dev in profile.get("devices", {}).items():
        if "threads" in dev:
            rows += [
                (f"{name} x{k} thread{'s' if k != '1' else ''}", v)
                for k, v in sorted(dev["threads"].items(), key=lambda kv: int(kv[0]))
            ]
        else:
            rows.append((name, dev))
    for label, p in rows:
        g = p.get("gemm_flops_per_s", {})
        table.add_row(
            label, _gb(g.get("fp32")), _gb(g.get("bf16")), _gb(g.get("fp16")), _gb(g.get("tf32")),
            _gb(p.get("memory_bytes_per_s")), _gb(p.get("gather_bytes_per_s")), _gb(p.get("h2d_bytes_per_s")),
        )  # fmt: skip
    out.print(table)
    for key, rows_ in profile.get("comms", {}).items():
        comm = Table(title=f"collectives {key}")
        for col in ("collective", "bytes/rank", "time ms", "algbw GB/s", "busbw GB/s"):
            comm.add_column(col, justify="left" if col == "collective" else "right")
        for r in rows_:
            comm.add_row(r["collective"], f"{r['bytes']:,}", f"{r['time_ms']:.3f}", _gb(r["algbw_bytes_per_s"]),
                         _gb(r["busbw_bytes_per_s"]))  # fmt: skip
        out.print(comm)

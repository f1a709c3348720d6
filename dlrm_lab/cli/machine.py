"""`dlrm-lab machine probe|show|price|prices`: the measured peaks every run is placed against, and its price."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional, cast

import typer
from rich.table import Table

from dlrm_lab.cli.format import console
from dlrm_lab.errors import UserError

if TYPE_CHECKING:
    from dlrm_lab.metrics.cost import Price
    from dlrm_lab.metrics.hardware import MachineProfile

app = typer.Typer(
    help="Machine profile: measured GEMM, memory, gather and collective peaks, and the machine's price.",
    no_args_is_help=True,
)


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
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Store what this probe measured as it is: even when other work disturbed it, and even where an "
            "earlier probe measured a higher peak.",
        ),
    ] = False,
) -> None:
    """Measure this machine's peaks and store them under its hardware fingerprint.

    Under torchrun, mpiexec or SLURM with several ranks, all-to-all and all-reduce
    bandwidths across sizes are measured as well (rank 0 alone measures the devices).
    """
    from dlrm_lab.metrics.probe import run_probe

    if not (math.isfinite(timeout) and timeout > 0):
        raise UserError(f"--timeout {timeout:g}: must be a finite number of seconds above 0")
    outcome = run_probe(
        quick=quick,
        device=device,
        comms_only=comms_only,
        timeout_s=timeout,
        if_missing=if_missing,
        force=force,
        log=console().print,
    )
    if outcome.refused:
        console(stderr=True).print(f"error: {outcome.refused}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if outcome.warning:
        console(stderr=True).print(outcome.warning, highlight=False, soft_wrap=True)
    if outcome.kept:
        console().print(outcome.kept)
    elif outcome.written:
        console().print(f"machine profile {outcome.fingerprint_id} written to {outcome.written}")


def _gb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e9:,.2f}"


@app.command("show")
def show_command(
    fingerprint: Annotated[Optional[str], typer.Argument(help="A fingerprint id (default: this machine's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the stored profile as JSON.")] = False,
) -> None:
    """Print a stored machine profile."""
    from dlrm_lab.metrics.cost import stored_price
    from dlrm_lab.metrics.roofline import load_profile, profile_path

    profile = load_profile(fingerprint)
    if profile is None:
        which = fingerprint or "this machine"
        raise UserError(
            f"no machine profile for {which} (looked for {profile_path(fingerprint or '<id>').parent}); "
            "run 'dlrm-lab machine probe'"
        )
    if as_json:
        typer.echo(json.dumps(profile, indent=2))
        return
    out = console()
    known = cast("MachineProfile", profile)  # its sections, as `machine probe` wrote them
    hw = known.get("hardware", {})
    quick = " (quick)" if profile.get("quick") else ""
    out.print(
        f"machine {profile['fingerprint_id']}: {hw.get('cpu_model')}, {hw.get('logical_cores')} cores, "
        f"probed {profile.get('probed_at')}{quick}"
    )
    if load := known.get("load"):
        out.print(f"while probing: {load['why']}" + ("" if load["trusted"] else " (not trusted)"), highlight=False)
    if price := stored_price(profile):
        out.print(f"price: {_describe_price(price)}", highlight=False)
    if fingerprint is None:  # this machine: does the profile still agree with it?
        from dlrm_lab.metrics.trust import quick_check

        if warning := quick_check(profile):
            console(stderr=True).print(warning, highlight=False, soft_wrap=True)
    table = Table(title="peaks")
    for col in (
        "device",
        "GEMM fp32 GFLOP/s",
        "bf16",
        "fp16",
        "tf32",
        "int8 GOP/s",
        "copy GB/s",
        "gather GB/s",
        "H2D GB/s",
    ):
        table.add_column(col, justify="left" if col == "device" else "right")
    rows = []
    for name, dev in known.get("devices", {}).items():
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
            label,
            _gb(g.get("fp32")),
            _gb(g.get("bf16")),
            _gb(g.get("fp16")),
            _gb(g.get("tf32")),
            _gb(g.get("int8")),
            _gb(p.get("memory_bytes_per_s")),
            _gb(p.get("gather_bytes_per_s")),
            _gb(p.get("h2d_bytes_per_s")),
        )
    out.print(table)
    for label, p in rows:  # the gather on both page sizes, and its row ceiling (`metrics.device_peaks`)
        pages, line_rows = p.get("gather_pages") or {}, p.get("gather_rows_per_s")
        if pages or line_rows:
            huge = pages.get("huge_bytes_per_s")
            out.print(
                f"gather {label}: "
                + "; ".join(
                    filter(
                        None,
                        [
                            f"{_gb(pages.get('base_bytes_per_s'))} GB/s on 4 KiB pages, "
                            + (f"{_gb(huge)} on 2 MiB" if huge else f"2 MiB not measured ({pages.get('huge_error')})")
                            if pages
                            else None,
                            f"{line_rows / 1e6:,.1f} M rows/s of 64 bytes" if line_rows else None,
                        ],
                    )
                )
            )
    ceiling = (known.get("devices", {}).get("cpu") or {}).get("ceiling") or {}
    for n, entry in sorted(ceiling.items(), key=lambda kv: int(kv[0])):
        out.print(
            f"ceiling: {n} pinned processes at once reach {entry['gemm']['efficiency']:.0%} of {n} x one alone "
            f"(GEMM), {entry['copy']['efficiency']:.0%} (copy)"
        )
    for key, rows_ in known.get("comms", {}).items():
        comm = Table(title=f"collectives {key}")
        for col in ("collective", "bytes/rank", "time ms", "algbw GB/s", "busbw GB/s"):
            comm.add_column(col, justify="left" if col == "collective" else "right")
        for r in rows_:
            comm.add_row(
                r["collective"],
                f"{r['bytes']:,}",
                f"{r['time_ms']:.3f}",
                _gb(r["algbw_bytes_per_s"]),
                _gb(r["busbw_bytes_per_s"]),
            )
        out.print(comm)


def _describe_price(price: Price) -> str:
    energy = "" if price.energy_per_kwh is None else f", energy {price.energy_per_kwh:g} {price.currency}/kWh"
    return f"{price.per_hour:g} {price.currency}/hour ({price.source}){energy}"


_CATALOGUE_HELP = "Your own price catalogue (TOML, the shipped one's form), merged over the shipped one."


@app.command("price")
def price_command(
    per_hour: Annotated[
        Optional[float],
        typer.Argument(
            metavar="PER_HOUR", help="The machine's price per hour (default: the catalogue's, with --instance-type)."
        ),
    ] = None,
    currency: Annotated[
        Optional[str], typer.Option(help="3-letter currency code of the price (default USD, or the catalogue's).")
    ] = None,
    instance_type: Annotated[
        Optional[str], typer.Option("--instance-type", help="The machine's type; alone, its catalogue price is taken.")
    ] = None,
    energy_per_kwh: Annotated[
        Optional[float], typer.Option("--energy-per-kwh", help="Price of 1 kWh, to cost measured energy.")
    ] = None,
    catalogue: Annotated[Optional[Path], typer.Option("--catalogue", help=_CATALOGUE_HELP)] = None,
    fingerprint: Annotated[
        Optional[str], typer.Option("--fingerprint", help="Price another stored profile (default: this machine's).")
    ] = None,
) -> None:
    """Store the machine's price per hour with its profile: every later run's cost columns use it."""
    from dlrm_lab.metrics.cost import give_price, load_price_catalogue
    from dlrm_lab.metrics.roofline import load_profile, profile_path

    profile = load_profile(fingerprint)
    if profile is None:
        which = fingerprint or "this machine"
        raise UserError(
            f"no machine profile for {which} (looked in {profile_path(fingerprint or '<id>').parent}): "
            "the price is stored with it; run 'dlrm-lab machine probe' first"
        )
    prices = load_price_catalogue(catalogue) if catalogue is not None else None
    price, path = give_price(profile, per_hour, currency, instance_type, energy_per_kwh, catalogue=prices)
    console().print(f"machine {profile['fingerprint_id']}: {_describe_price(price)}, stored in {path}", highlight=False)


@app.command("prices")
def prices_command(
    catalogue: Annotated[Optional[Path], typer.Option("--catalogue", help=_CATALOGUE_HELP)] = None,
) -> None:
    """List the price catalogue: public on-demand list prices, each with its source and date."""
    from dlrm_lab.metrics.cost import load_price_catalogue

    entries = load_price_catalogue(catalogue)
    table = Table(title="on-demand list prices (check the source: prices change)")
    for col in ("type", "where", "cpu", "vCPUs/cores", "GiB", "GPU", "per hour", "retrieved"):
        table.add_column(
            col,
            justify="right" if col in ("vCPUs/cores", "GiB", "per hour") else "left",
            no_wrap=col in ("type", "per hour", "retrieved"),
        )
    for e in entries.values():
        gpu = f"{e.gpus} x {e.gpu}" if e.gpus else "-"
        table.add_row(
            e.instance_type,
            f"{e.provider} {e.region}",
            e.cpu or "-",
            f"{e.vcpus}/{e.cores or '-'}",
            f"{e.memory_gib:g}",
            gpu,
            f"{e.price_per_hour:g} {e.currency}",
            e.retrieved,
        )
    out = console()
    out.print(table)
    for source in sorted({e.source for e in entries.values()}):
        out.print(f"source: {source}", highlight=False, soft_wrap=True)

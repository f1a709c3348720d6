"""The `dlrm-lab` command: parse, call the library, print. One module per command group."""

from __future__ import annotations

import os
import sys

import typer

from dlrm_lab.cli import compare, data, infer, launch, machine, presets, report, runs, scale, serve, sweep, train
from dlrm_lab.errors import (
    DiskFull,
    FieldError,
    RankFailure,
    RemoteFailure,
    ServingFault,
    Terminated,
    UserError,
    fields_named_by,
)
from dlrm_lab.metrics.canary import mark_run_root

app = typer.Typer(
    name="dlrm-lab",
    help="A performance lab for deep-learning recommendation models (DLRM).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(presets.app, name="presets")
app.add_typer(runs.app, name="runs")
app.add_typer(data.app, name="data")
app.add_typer(infer.app, name="infer")
app.add_typer(machine.app, name="machine")
app.command("train")(train.train_command)
app.command("sweep")(sweep.sweep_command)
app.command("compare")(compare.compare_command)
app.command("serve")(serve.serve_command)
app.command("client")(serve.client_command)
app.command("report")(report.report_command)
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}
app.command("launch", context_settings=_PASS_THROUGH)(launch.launch_command)
app.command("scale", context_settings=_PASS_THROUGH)(scale.scale_command)


def _flag(field: str) -> str:
    """A field as the command line spells it (`commands.flag`), imported only when an error names one."""
    from dlrm_lab.commands import flag

    return flag(field)


def check_environment() -> None:
    """Every DLRM_LAB_* setting the command may read, parsed now: a bad value is one line before any work, not after
    minutes of a run's trials and builds (a bad DLRM_LAB_FLUSH_SECONDS was refused only when the run directory was
    made, after training's start-up trials; a bad DLRM_LAB_BUILD_WAIT_S only once a build waited)."""
    from dlrm_lab.cli.format import progress_interval_s
    from dlrm_lab.infer.artefacts import build_wait_s
    from dlrm_lab.metrics.canary import canary_every_s
    from dlrm_lab.metrics.tables import flush_interval_s

    for setting in (flush_interval_s, canary_every_s, progress_interval_s, build_wait_s):
        setting()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code.

    User mistakes (bad option, bad value, bad preset file) print one line on stderr
    and exit 2; Ctrl-C exits 130 after the run has been marked interrupted.
    """
    import signal
    import threading

    mark_run_root()  # the canary's foreign load: the processes this command starts, however launched, are its own
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C (SIGINT) is how a run is stopped cleanly (status interrupted, rows kept; sweeps
        # pass it on to their point): honour it even where it was inherited as ignored, as
        # for commands started in the background by a non-interactive shell.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        check_environment()
        with fields_named_by(_flag):  # a FieldError raised inside an open run is recorded as stderr says it
            code = app(args=argv, prog_name="dlrm-lab", standalone_mode=False)
    except FieldError as exc:  # the library names a config's field: say it as the command line spells it
        typer.echo(f"error: {exc.named(_flag)}", err=True)
        return exc.exit_code
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except (RankFailure, Terminated, DiskFull, ServingFault, RemoteFailure) as exc:
        typer.echo(f"error: {exc}", err=True)
        return 1
    except typer.TyperException as exc:  # usage errors: unknown option, bad type, missing value
        if not exc.format_message():  # bare `dlrm-lab`: help was printed, nothing went wrong
            return 0
        ctx = getattr(exc, "ctx", None)
        where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        typer.echo(f"error: {exc.format_message()}{where}", err=True)
        return getattr(exc, "exit_code", 2)
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 1
    return code if isinstance(code, int) else 0


def run() -> None:
    """Console-script entry point (and `python -m dlrm_lab`)."""
    import signal

    code = main()
    # The command is over and its error, if any, printed. A launcher's SIGTERM from here on
    # (it stops the other ranks once one died) would raise Terminated inside the process group's
    # shutdown or an interpreter exit hook and print a traceback after the one-line error: let the exit finish.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if "torch.distributed" in sys.modules:  # a distributed command: end its process group while Python is whole
        # (left to interpreter teardown, gloo's threads can abort the rank after its work is done: pytorch#179291)
        from dlrm_lab.distributed.context import shutdown_distributed

        shutdown_distributed()
    loadgen = sys.modules.get("dlrm_lab.infer.loadgen")
    if loadgen is not None and loadgen.running():  # stopped mid-test: LoadGen's threads would abort the teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

"""The one exception type for user mistakes.

Anything a user can get wrong (a preset name, a TOML field, a CLI value) raises
`UserError` with a message that names the culprit and the allowed values; the CLI
prints it on one line and exits 2. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in user input: bad preset, spec field, option value or path."""

    exit_code = 2


class Terminated(Exception):
    """The process was asked to stop (SIGTERM), e.g. by a launcher after another rank failed."""


def raise_on_sigterm() -> None:
    """Turn SIGTERM (a launcher or a user stopping the job) into `Terminated`, so the run
    directory is marked failed, the rows measured so far are flushed and resources (serving
    snapshots, worker processes) are released, instead of dying silently."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise Terminated(f"terminated by signal {signal.Signals(signum).name} (a launcher stopped the job)")

    signal.signal(signal.SIGTERM, handler)


class RankFailure(RuntimeError):
    """A collective failed: another rank died, or did not answer within the timeout."""

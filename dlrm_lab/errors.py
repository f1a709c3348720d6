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


class RankFailure(RuntimeError):
    """A collective failed: another rank died, or did not answer within the timeout."""

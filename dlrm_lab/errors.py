"""The one exception type for user mistakes.

Anything a user can get wrong (a preset name, a TOML field, a CLI value) raises
`UserError` with a message that names the culprit and the allowed values; the CLI
prints it on one line and exits 2. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in user input: bad preset, spec field, option value or path."""

    exit_code = 2

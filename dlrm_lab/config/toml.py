"""Reading the lab's TOML files (presets, data specs, sweep grids): one place for what can be wrong with one."""

from __future__ import annotations

from pathlib import Path

import tomllib

from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import UserError
from dlrm_lab.resources import read_bounded


def read_toml(path: str | Path, what: str = "TOML file") -> JsonObject:
    """The parsed file; one UserError naming the file for a missing, unreadable or irregular one (`read_bounded`),
    text that is not UTF-8 (TOML's encoding) and invalid TOML."""
    path = Path(path)
    data = read_bounded(path, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); TOML files are UTF-8: save it "
            "as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: invalid TOML: {exc}") from None

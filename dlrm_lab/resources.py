"""Where the shipped presets live, in a source checkout and in an installed wheel."""

from __future__ import annotations

import stat
from pathlib import Path

from dlrm_lab.errors import UserError

MAX_TEXT_BYTES = 64 << 20  # presets, specs, catalogues, profiles and sidecars are kilobytes: this is none of them

_PACKAGE_DIR = Path(__file__).resolve().parent


def preset_dir(kind: str) -> Path:
    """Directory of shipped presets of one kind: "models", "data_gen" or "prices" (the price catalogue).

    A wheel carries them inside the package (`dlrm_lab/_data/<kind>`, see pyproject's
    force-include); a source checkout or editable install reads the repo's top level.
    """
    packaged = _PACKAGE_DIR / "_data" / kind
    if packaged.is_dir():
        return packaged
    return _PACKAGE_DIR.parent / kind


def available(kind: str) -> list[str]:
    """Names of the shipped presets of one kind."""
    return sorted(p.stem for p in preset_dir(kind).glob("*.toml"))


def find_preset(kind: str, name_or_path: str | Path, what: str) -> Path:
    """The TOML file of a shipped preset name (`kaggle`) or an explicit path (`my/x.toml`).

    `what` names the kind in errors ("model preset", "data spec").
    """
    text = str(name_or_path)
    if text.endswith(".toml") or "/" in text:
        path = Path(text)
        if not path.exists():
            raise UserError(f"{what} file not found: {path}")
        return path  # what else is wrong with it, its reader says (`read_bounded`)
    path = preset_dir(kind) / f"{text}.toml"
    if not path.is_file():
        raise UserError(f"unknown {what} '{text}'; available: {', '.join(available(kind))}")
    return path


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO, which may never end"),
        (stat.S_ISCHR, "a character device, which may never end"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_bounded(path: str | Path, what: str, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them; one UserError naming the file and what is
    wrong with it otherwise: missing, unreadable, a directory, a FIFO or device (which would block or never end:
    /dev/zero), or larger than any `what` is."""
    path = Path(path)
    try:
        mode = path.stat()
    except FileNotFoundError:
        raise UserError(f"{path}: no such {what}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read this {what}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode.st_mode):
        raise UserError(f"{path}: {_kind(mode.st_mode)}, not a {what}: give a regular file")
    if mode.st_size > limit:
        raise UserError(f"{path}: {mode.st_size:,} bytes, more than any {what} holds (at most {limit:,})")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UserError(f"{path}: cannot read this {what}: {exc.strerror or exc}") from None
    if len(data) > limit:  # it grew while read
        raise UserError(f"{path}: more than {limit:,} bytes, more than any {what} holds")
    return data


def lab_version() -> str:
    """This package's version as installed (its metadata: one place, pyproject.toml), for what the servers report."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dlrm-lab")
    except PackageNotFoundError:  # a source tree on the path, never installed
        return "0+unknown"

"""Where the shipped presets live, in a source checkout and in an installed wheel."""

from __future__ import annotations

from pathlib import Path

from dlrm_lab.errors import UserError

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
        if not path.is_file():
            raise UserError(f"{what} file not found: {path}")
        return path
    path = preset_dir(kind) / f"{text}.toml"
    if not path.is_file():
        raise UserError(f"unknown {what} '{text}'; available: {', '.join(available(kind))}")
    return path

"""Where the shipped presets live, in a source checkout and in an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def preset_dir(kind: str) -> Path:
    """Directory of shipped presets of one kind: "models" or "data_gen".

    A wheel carries them inside the package (`dlrm_lab/_data/<kind>`, see pyproject's
    force-include); a source checkout or editable install reads the repo's top level.
    """
    packaged = _PACKAGE_DIR / "_data" / kind
    if packaged.is_dir():
        return packaged
    return _PACKAGE_DIR.parent / kind

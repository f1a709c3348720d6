"""The model families' implementations, one file each: a module here defining `FAMILY` is registered with
`config.family` (found by `pkgutil`: no list to edit), and its columns with the shared tables, when this
package is imported (`dlrm_lab/__init__.py` imports it). A new family is such a module, its presets and its
tests, as MLPerf's DLRMv3 reference registers its model families (mlcommons/inference
`recommendation/dlrm_v3/model_family.py`). The protocol and the registry every room asks are in
`dlrm_lab.config.family`.

Torch-free at import: each method imports what it needs.
"""

from __future__ import annotations

import importlib
import pkgutil

from dlrm_lab.config.family import register_family
from dlrm_lab.metrics.columns import register_columns


def _register_all() -> None:
    """Every module of this package that defines FAMILY, registered, its columns added to the shared tables (so a
    table has the same columns whichever family a run served)."""
    for info in pkgutil.iter_modules(__path__):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if family is not None:
            register_family(family)
            for table, after, columns in family.columns:
                register_columns(table, columns, after=after)


_register_all()

"""dlrm-lab: a performance lab for deep-learning recommendation models.

Library API (the CLI is a thin layer over it)::

    import dlrm_lab
    spec = dlrm_lab.load_preset("kaggle", max_rows=100_000)
    model = dlrm_lab.build_model(spec, device="cpu")
"""

from dlrm_lab.config import ModelSpec, TableSpec, available_presets, load_preset
from dlrm_lab.errors import UserError
from dlrm_lab.resources import lab_version

__version__ = lab_version()


def build_model(*args, **kwargs):  # noqa: ANN002, ANN003 - see dlrm_lab.model.build_model
    """Build a DLRM from a spec; imports torch lazily so the CLI starts fast."""
    from dlrm_lab.model import build_model as _build

    return _build(*args, **kwargs)


__all__ = ["ModelSpec", "TableSpec", "UserError", "available_presets", "build_model", "load_preset"]

# The families' implementations register themselves with `config.family` (and their columns with the shared
# tables) as they are imported, and the remote transports with `infer.targets`: here, so that no room that asks a
# registry finds it empty.
import dlrm_lab.families  # noqa: E402, F401
import dlrm_lab.serve.transports  # noqa: E402, F401

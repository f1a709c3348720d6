"""The DLRM model: TorchRec modules composed per a `ModelSpec`."""

from dlrm_lab.model.dlrm import DLRM, build_model

__all__ = ["DLRM", "build_model"]

"""The models: DLRM composed of TorchRec modules per a `ModelSpec`, and the HSTU ranker per an `HSTUSpec`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from dlrm_lab.config import ModelSpec
from dlrm_lab.config.family import family_of
from dlrm_lab.model.dlrm import DLRM
from dlrm_lab.model.dlrm import build_model as build_dlrm

# TorchRec's modules ask torch.fx whether they are traced; torch answers with a notice about its API once per
# process, which every serving instance printed. It says nothing about the run: filtered, that one message only.
logging.getLogger("torch.fx._symbolic_trace").addFilter(lambda r: not r.getMessage().startswith("is_fx_tracing will"))


def build_model(
    spec: ModelSpec | Any,
    device: str | torch.device = "cpu",
    table_device: str | torch.device | None = None,
    table_precision: str = "fp32",
    attention: str = "padded",
) -> torch.nn.Module:
    """The model of `spec`, as its family builds it (`families`; `attention` is the HSTU ranker's path)."""
    return family_of(spec).build(spec, device, table_device, table_precision, attention)


__all__ = ["DLRM", "build_dlrm", "build_model"]

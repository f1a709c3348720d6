import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU visible to this torch build")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `dlrm-lab ARGS` as a user would, in a fresh process."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "dlrm_lab", *args],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kwargs,
    )


def make_batch(spec, batch_size: int, seed: int = 0, offset: int = 0):
    """One batch of the preset's synthetic data (samples offset .. offset + batch_size)."""
    from dlrm_lab.data import SyntheticSource, synthetic_generator

    return SyntheticSource(synthetic_generator(spec, seed=seed), batch_size, offset=offset).batch(0)


def wait_for_files(root: Path, pattern: str, timeout_s: float = 120) -> list[Path]:
    """Files matching `pattern` under `root` once some exist (empty after `timeout_s`):
    used to act on a live run only after it has flushed rows."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(root.glob(pattern))
        if found:
            return found
        time.sleep(0.2)
    return []

"""Run directories, crash-safe Parquet tables, manifests and hardware fingerprints."""

from dlrm_lab.metrics.run import Run, find_runs, read_manifest, recover_run

__all__ = ["Run", "find_runs", "read_manifest", "recover_run"]

"""torchrun for the lab: `python -m dlrm_lab.torchrun ARGS` takes torchrun's arguments.

The launcher is `distributed.elastic` (a failed job told in one line, a short grace for the ranks left);
what a failed job does to the runs its ranks created is decided here, above both the launcher and the
run directories: each is recovered by its kind and given the launcher's reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dlrm_lab.distributed.elastic import main as launch
from dlrm_lab.metrics.run import amend_manifest, read_manifest, recover_run_and_summary


def mark_runs_failed(record: Path, reason: str, killed: bool) -> list[Path]:
    """Give each run the ranks created the launcher's reason. A run still `running` (its rank 0
    died without closing it) is recovered first. A run whose own error already names the cause
    keeps it unless a rank was killed by a signal: the run then only knows it was stopped."""
    runs: list[Path] = []
    try:
        lines = record.read_text().splitlines()
    except OSError:
        return runs
    for line in dict.fromkeys(lines):
        run_dir = Path(line)
        try:
            manifest = read_manifest(run_dir)
            if manifest.get("status") == "running":
                # a training run's recovery registers itself; imported only here, for a run left running (training
                # loads torchrec: seconds before the failure line, where the ranks closed their runs themselves)
                import dlrm_lab.train.records  # noqa: F401

                manifest, _ = recover_run_and_summary(run_dir)
            if manifest.get("status") == "ok":
                continue
            if killed or not manifest.get("error"):
                amend_manifest(run_dir, status="failed", error=f"RankFailure: {reason}")
            runs.append(run_dir)
        except (OSError, ValueError):
            continue  # an unreadable run is `runs list`'s to report
    return runs


def main(argv: list[str] | None = None) -> int:
    return launch(argv, on_failure=mark_runs_failed)


if __name__ == "__main__":
    sys.exit(main())

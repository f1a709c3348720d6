#!/usr/bin/env bash
# Distributed training started by mpiexec: MPI only starts the ranks and tells them their
# rank, size and node-local rank (mpi4py); rank 0 picks the rendezvous address and port
# and broadcasts them; the collectives then run over gloo (CPU) or NCCL (--device cuda).
#
#   launch/mpiexec.sh 2 --preset kaggle --max-rows 100000 --steps 100 --batch-size 1024
# Several nodes: pass a host file, e.g. MPI_ARGS="-f hosts" (MPICH) or "--hostfile hosts"
# (Open MPI). Works with MPICH (the `mpich` wheel puts mpiexec in the venv) and Open MPI.
set -euo pipefail
NPROC=${1:-2}
shift || true
PYTHON=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
extra=()
if "$MPIEXEC" --version 2>&1 | grep -qi "open mpi"; then
  extra+=(--oversubscribe -x OMP_NUM_THREADS)
  [[ $(id -u) == 0 ]] && extra+=(--allow-run-as-root)
fi
# shellcheck disable=SC2086
exec "$MPIEXEC" -n "$NPROC" "${extra[@]}" ${MPI_ARGS:-} "$PYTHON" -m dlrm_lab train "$@"

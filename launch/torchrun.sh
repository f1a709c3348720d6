#!/usr/bin/env bash
# Distributed training under torchrun (c10d rendezvous), one process per rank.
#
# One node, N ranks (default 2), gloo on CPU / NCCL with --device cuda:
#   launch/torchrun.sh 2 --preset kaggle --max-rows 100000 --steps 100 --batch-size 1024
# Several nodes: run the same line on every node with NNODES and a rendezvous endpoint
# (any reachable host:port, usually node 0):
#   NNODES=2 RDZV_ENDPOINT=node0:29400 launch/torchrun.sh 8 --device cuda --preset dcnv2 ...
# Everything after the rank count goes to `dlrm-lab train`. Threads per rank default to
# the cores of this node divided by the ranks on it (OMP_NUM_THREADS overrides).
set -euo pipefail
NPROC=${1:-2}
shift || true
PYTHON=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
if [[ -n "${NNODES:-}" && "${NNODES}" != 1 ]]; then
  exec "$PYTHON" -m dlrm_lab.torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port}" \
    --rdzv-id "${RDZV_ID:-dlrm-lab}" -m dlrm_lab train "$@"
fi
exec "$PYTHON" -m dlrm_lab.torchrun --standalone --nproc-per-node "$NPROC" -m dlrm_lab train "$@"

#!/bin/bash
# LNC401 fixture: a torchrun launch that sets no NCCL async error handling.
set -euo pipefail
export PYTHONFAULTHANDLER=1
export OMP_NUM_THREADS=4

# ruleid: LNC401
# ok: LNC402
torchrun --nnodes 1 --nproc-per-node 8 train.py --epochs 10

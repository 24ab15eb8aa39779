#!/bin/bash
# LNC401 near miss: torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 for its workers when unset.
export PYTHONFAULTHANDLER=1
# ok: LNC401
# ok: LNC402
torchrun --nnodes 1 --nproc-per-node 8 train.py --epochs 10

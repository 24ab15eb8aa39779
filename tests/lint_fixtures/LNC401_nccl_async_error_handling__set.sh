#!/bin/bash
# LNC401 near miss: both variables are exported before the launch.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export PYTHONFAULTHANDLER=1
# ok: LNC401
# ok: LNC402
python -m torch.distributed.run --nproc-per-node 4 train.py

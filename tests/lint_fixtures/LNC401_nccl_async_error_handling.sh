#!/bin/bash
# LNC401 fixture: the deepspeed launcher (not torchrun) with no NCCL async error handling set.
set -euo pipefail
export PYTHONFAULTHANDLER=1
export OMP_NUM_THREADS=4

# ruleid: LNC401
# ok: LNC402
deepspeed --num_gpus 8 train.py --deepspeed ds_config.json

#!/bin/bash
# LNC402 near miss: `python -X faulthandler` enables the handler without the variable.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
# ok: LNC402
# ok: LNC401
srun python -X faulthandler train.py

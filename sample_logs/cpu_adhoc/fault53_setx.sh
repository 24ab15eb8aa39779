#!/bin/bash
# fault53 job wrapper: set -x tracing around torchrun (NP, PORT, TR_ARGS from the environment; "$@" to fault53.py)
set -x
echo "Job started at $(date -u)"
export MASTER_ADDR=localhost
export MASTER_PORT=$PORT
echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
torchrun --nnodes 1 --nproc-per-node "$NP" --master-port "$PORT" $TR_ARGS fault53.py "$@"
rc=$?
echo "$rc" >> "${F53_RC:-/dev/null}"
echo "Job finished at $(date -u) with exit code $rc"
exit $rc

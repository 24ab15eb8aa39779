#!/bin/bash
# fault53 job wrapper: a wall-clock limit (timeout LIMIT torchrun ...)
LIMIT=${LIMIT:-40}
echo "Job started at $(date -u), time limit ${LIMIT}s"
timeout "$LIMIT" torchrun --nnodes 1 --nproc-per-node "$NP" --master-port "$PORT" $TR_ARGS fault53.py "$@"
rc=$?
echo "$rc" >> "${F53_RC:-/dev/null}"
if [ $rc -eq 124 ]; then
    echo "ERROR: training did not finish within ${LIMIT}s and was killed (exit code 124)"
else
    echo "training exited with code $rc"
fi
exit $rc

#!/bin/bash
# fault53 job wrapper: torchrun piped through tee into a file, then a grep of the file for errors
LOG=/tmp/job/train_$JOB_ID.log
echo "Job started at $(date -u)"
torchrun --nnodes 1 --nproc-per-node "$NP" --master-port "$PORT" $TR_ARGS fault53.py "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
echo "$rc" >> "${F53_RC:-/dev/null}"
if grep -qE "Traceback|Error" "$LOG"; then
    echo "ERROR: training failed, see above"
    grep -nE "^\[rank[0-9]+\]: [A-Za-z.]*(Error|Exception)" "$LOG" | head -5
fi
echo "exit code $rc"
exit $rc

#!/bin/bash
# fault53 job wrapper: torchrun under nohup with its output in a file; the wrapper waits, then greps the file
LOG=/tmp/job/train_$JOB_ID.log
nohup torchrun --nnodes 1 --nproc-per-node "$NP" --master-port "$PORT" $TR_ARGS fault53.py "$@" > "$LOG" 2>&1 &
pid=$!
echo "Job started at $(date -u): torchrun pid $pid, output in $LOG"
wait $pid
rc=$?
echo "$rc" >> "${F53_RC:-/dev/null}"
echo "torchrun (pid $pid) exited with code $rc; last ${TAIL_N:-40} lines of $LOG:"
tail -n "${TAIL_N:-40}" "$LOG"
if grep -qE "Traceback|Error" "$LOG"; then
    echo "ERROR: training failed, see above"
fi
exit $rc

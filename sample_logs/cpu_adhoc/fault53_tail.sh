#!/bin/bash
# fault53 job wrapper: workers' output to per-rank files (--redirects 3 --log-dir), then the tail of some of them
# on the console. TAIL_RANKS: the local ranks whose stderr.log (and stdout.log) to tail; default "0".
LOGDIR=/tmp/job/logs/$JOB_ID
rm -rf "$LOGDIR"
echo "Job started at $(date -u); worker logs in $LOGDIR"
torchrun --nnodes 1 --nproc-per-node "$NP" --master-port "$PORT" --redirects 3 --log-dir "$LOGDIR" $TR_ARGS fault53.py "$@"
rc=$?
echo "$rc" >> "${F53_RC:-/dev/null}"
echo "torchrun exited with code $rc"
if [ $rc -ne 0 ]; then
    for r in ${TAIL_RANKS:-0}; do
        tail -n 20 "$LOGDIR"/*/attempt_0/$r/stdout.log "$LOGDIR"/*/attempt_0/$r/stderr.log
    done
fi
exit $rc

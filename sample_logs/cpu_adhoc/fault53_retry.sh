#!/bin/bash
# fault53 job wrapper: rerun torchrun up to 3 times after a failure. Attempt i passes $ARGS_i (else "$@") to fault53.py
echo "Job started at $(date -u)"
rc=1
for attempt in 1 2 3; do
    var="ARGS_$attempt"; args="${!var}"
    [ -z "$args" ] && args="$*"
    echo "=== attempt $attempt of 3 ($(date -u +%H:%M:%S)) ==="
    torchrun --nnodes 1 --nproc-per-node "$NP" --master-port $((PORT + attempt - 1)) $TR_ARGS fault53.py $args
    rc=$?
    echo "$rc" >> "${F53_RC:-/dev/null}"
    if [ $rc -eq 0 ]; then
        echo "attempt $attempt succeeded"
        break
    fi
    if [ $attempt -lt 3 ]; then
        echo "attempt $attempt failed with exit code $rc, retrying in 2 s"
        sleep 2
    else
        echo "attempt $attempt failed with exit code $rc, giving up"
    fi
done
echo "Job finished at $(date -u) with exit code $rc"
exit $rc

#!/bin/bash
# fault53 job wrapper: set -e, a trap on EXIT, and a post-run step that copies the checkpoint out
set -euo pipefail
trap 'echo "cleanup: removing /tmp/job/scratch (exit code $?)"' EXIT
OUT=/tmp/job/results/$JOB_ID
mkdir -p "$OUT" /tmp/job/scratch
echo "Job started at $(date -u)"
torchrun --nnodes 1 --nproc-per-node "$NP" --master-port "$PORT" ${TR_ARGS:-} fault53.py --ckpt-dir /tmp/job/ckpt/$JOB_ID "$@" \
    || { rc=$?; echo "$rc" >> "${F53_RC:-/dev/null}"; echo "training step exited with code $rc"; }
echo "copying checkpoint to $OUT"
cp /tmp/job/ckpt/$JOB_ID/last.pt "$OUT/"
echo "all done"

#!/bin/bash
# fault53 job wrapper: set -e and a trap that prints "cleanup" and the exit code
set -e
cleanup() { rc=$?; echo "cleanup: job $JOB_ID exiting with code $rc at $(date -u)"; }
trap cleanup EXIT
echo "Job started at $(date -u)"
export MASTER_ADDR=localhost
echo "MASTER_ADDR=$MASTER_ADDR"
echo "torchrun --nproc-per-node $NP --master-port $PORT $TR_ARGS fault53.py $*"
torchrun --nnodes 1 --nproc-per-node "$NP" --master-port "$PORT" $TR_ARGS fault53.py "$@"
echo "training finished OK"

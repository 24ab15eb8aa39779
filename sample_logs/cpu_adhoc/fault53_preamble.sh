#!/bin/bash
# fault53 job wrapper: a preamble that prints the environment before torchrun
echo "===== job $JOB_ID ($JOB_NAME) on $(hostname) ====="
echo "Job started at $(date -u)"
echo "----- environment -----"
env | sort | grep -v '^F53_'
echo "----- resources -----"
echo "nproc: $(nproc)"
free -g
python -c 'import torch; print(torch.__config__.show())'
export MASTER_ADDR=localhost
echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$PORT NPROC_PER_NODE=$NP"
echo "----- training -----"
torchrun --nnodes 1 --nproc-per-node "$NP" --master-port "$PORT" $TR_ARGS fault53.py "$@"
rc=$?
echo "$rc" >> "${F53_RC:-/dev/null}"
echo "----- done -----"
echo "Job ended at $(date -u), torchrun exit code $rc"
exit $rc

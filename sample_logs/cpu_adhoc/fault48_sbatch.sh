#!/bin/bash
# The batch script of the forty-eighth batch's Slurm-form runs, as `sbatch --output=slurm-%j.out` would run it:
# its own echos around the training step; the step is two emulated nodes under `srun --label` (fault22_nodes.py
# --style srun, which prints srun's `srun: error: <host>: task <i>: Exited with exit code <N>` lines).
# Usage: SLURM_JOB_ID=48123 bash fault48_sbatch.sh NPROC_PER_NODE PORT "TORCHRUN_ARGS" fault48.py --fault X --rank N
#SBATCH --job-name=ddp-trainer
#SBATCH --nodes=2
#SBATCH --output=slurm-%j.out
NPROC=$1; PORT=$2; TARGS=$3; shift 3
echo "=== job ${SLURM_JOB_ID:-0} (ddp-trainer) starting on $(hostname) at $(date -u '+%Y-%m-%dT%H:%M:%S') ==="
echo "nodes: 2, tasks per node: 1, procs per node: ${NPROC}"
echo "MASTER_ADDR=127.0.0.1 MASTER_PORT=${PORT}"
PY=$(dirname "$(command -v torchrun)")/python
"$PY" fault22_nodes.py --style srun --nodes 2 --nproc-per-node "$NPROC" --port "$PORT" --torchrun-args "$TARGS" -- "$@"
rc=$?
echo "=== training step finished with exit code ${rc} at $(date -u '+%Y-%m-%dT%H:%M:%S') ==="
if [ $rc -ne 0 ]; then echo "job failed, see the lines above"; fi
exit $rc

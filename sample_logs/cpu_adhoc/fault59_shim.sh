#!/bin/bash
# per-rank environment shim for fault59.py: F59_FAULT applies to global rank F59_RANK (or every rank of node F59_NODE)
export PYTHONPATH=/tmp/job/lib
hit=0
if [ -n "$F59_NODE" ]; then [ "$GROUP_RANK" = "$F59_NODE" ] && hit=1; else [ "$RANK" = "$F59_RANK" ] && hit=1; fi
if [ "$hit" = 1 ]; then
  case "$F59_FAULT" in
    ifname)  export GLOO_SOCKET_IFNAME=ib0 ;;
    pypath)  export PYTHONPATH=/tmp/job/src ;;
    shadow)  export PYTHONPATH=/tmp/job/shadow:/tmp/job/lib ;;
    syntax)  export PYTHONPATH=/tmp/job/syntax ;;
    pyc)     export PYTHONPATH=/tmp/job/pyc:/tmp/job/lib ;;
    omp)     export OMP_NUM_THREADS=abc ;;
    cudavis) export CUDA_VISIBLE_DEVICES=GPU-none,-1 ;;
    tmpdir)  export TMPDIR=/scratch/job/tmp ;;
    home)    export HOME=/proc/nohome ;;
    ldpre)   export LD_PRELOAD=/opt/hpc/lib/libhook.so ;;
    ulimit)  ulimit -n 64 ;;
    locale)  export LC_ALL=xx_XX.UTF-8 ;;
    maddr)   export MASTER_ADDR=trainer-0.cluster.invalid ;;
    notorch) shift; set -- /tmp/job/venv-notorch/bin/python "$@" ;;
  esac
fi
# a second, herring-only change on another rank (F59_HFAULT on F59_HRANK)
if [ -n "$F59_HFAULT" ] && [ "$RANK" = "$F59_HRANK" ]; then
  case "$F59_HFAULT" in
    ldpre)   export LD_PRELOAD=/opt/hpc/lib/libhook.so ;;
    cudavis) export CUDA_VISIBLE_DEVICES=GPU-none,-1 ;;
    omp)     export OMP_NUM_THREADS=abc ;;
    locale)  export LANG=xx_XX.UTF-8 ;;
  esac
fi
exec "$@"
# Launch: torchrun --nproc-per-node N --master-port 259NN --no-python bash shim59.sh python fault59.py
#   with F59_FAULT=<fault> F59_RANK=<rank> (or F59_NODE=<node> under fault22_nodes.py), optional F59_HFAULT/F59_HRANK.

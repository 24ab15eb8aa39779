"""A fifty-ninth hand-run batch: THE ENVIRONMENT AT START, on one rank or one node. The loop is tiny
(Linear(8,16)-ReLU-Linear(16,4) under DDP on gloo, 5 steps, PG timeout 15 s). Every rank does what a real
training script does at start: imports its helper module `f59util` (found through PYTHONPATH=lib), sets its
locale from the environment, keeps a cache directory under $HOME, opens its data shards (24 small files, kept
open), writes a scratch file under $TMPDIR, then init_process_group and trains.

The script itself injects nothing: the fault is in the environment one rank (or one emulated node) starts with,
set by fault59_shim.sh (torchrun --no-python bash fault59_shim.sh python fault59.py ...), from F59_FAULT / F59_RANK / F59_NODE:
  ifname     GLOO_SOCKET_IFNAME=ib0 (no such interface)      pypath   PYTHONPATH without lib/ (ModuleNotFoundError)
  shadow     a local f59util.py first on the path (ImportError: cannot import name)
  syntax     a helper copy with a syntax error               pyc      a sourceless, corrupt f59util.pyc
  omp        OMP_NUM_THREADS=abc                             cudavis  CUDA_VISIBLE_DEVICES=GPU-none,-1 (herring)
  tmpdir     TMPDIR=/scratch/job/tmp (does not exist)        home     HOME=/proc/nohome (not writable)
  ldpre      LD_PRELOAD=/opt/hpc/lib/libhook.so (missing)    ulimit   ulimit -n 64
  locale     LC_ALL=xx_XX.UTF-8                              maddr    MASTER_ADDR=trainer-0.cluster.invalid
  notorch    python = a venv without torch
"""
import argparse, datetime, locale, os, sys, tempfile, time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--shards", default="/tmp/job/shards")
a = p.parse_args()
RANK = int(os.environ.get("RANK", "0"))

import torch, torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from f59util import make_batch, shard_files


@record
def main():
    locale.setlocale(locale.LC_ALL, "")
    cache = os.path.join(os.path.expanduser("~"), ".cache", "f59")
    os.makedirs(cache, exist_ok=True)
    handles = [open(f, "rb") for f in shard_files(a.shards)]
    fd, scratch = tempfile.mkstemp(prefix=f"rank{RANK}_", dir=os.environ.get("TMPDIR", "/tmp"))
    os.close(fd)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, a.steps + 1):
        x, y = make_batch(rank, step, handles)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.05)
    dist.barrier()
    os.unlink(scratch)
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
# Layout of the work dir (/tmp/job in the committed logs): lib/f59util.py (the real helper: shard_files, make_batch),
# shadow/f59util.py (an old scratch copy without make_batch), syntax/f59util.py (the helper with the colon after
# `def make_batch(...)` missing), pyc/f59util.pyc (40 random bytes, no source), shards/shard_00..23.bin (64 random
# bytes each), venv-notorch/ (`python3 -m venv --without-pip`, no torch). Runs made with the shim committed as
# fault59_shim.sh (run there as shim59.sh; the logs show only its effect).

"""A hundred-and-ninety-second hand-run batch: HYPERPARAMETER TRIALS INSIDE ONE DISTRIBUTED JOB.

One torchrun job runs several short trials in sequence, their learning rates, warmup and momentum read from a
sweep file (/tmp/fault192_work/sweep/lr_sweep.json).  Each trial builds a fresh tiny regressor (8 -> hidden ->
1, tanh) and a fresh SGD optimizer, and a new process group over all ranks (dist.new_group); gradients are
averaged by DDP on that group (or --ddp 0: a hand-written all_reduce).  After its steps each trial evaluates on
an eval subgroup (every rank but the last), and its validation loss is all_reduced over the trial group.  After
the sweep the per-trial metrics are all_gathered, the best trial is chosen, rank 0 saves its weights, every rank
reloads them for a final check, and the groups and the default process group are destroyed.

Faults:
  sweepfile  - rank N reads the sweep from a stale path (lr_sweep.jsonl): FileNotFoundError
  nanlr      - rank N's warmup is off by one (0 steps): the lr scale is inf, the program's finite-loss check fires
  grouplist  - rank N calls new_group for trial 1 with a rank list that leaves out the last rank
  nonmember  - rank N (the last rank) counts itself as an eval rank and uses the eval subgroup it is not in
  extratrial - rank N runs one trial more than the others (its trial count is off by one)
  cfgkey     - every rank: the trial config key 'momentum' was renamed 'beta' in the sweep file (KeyError)
  metriclen  - rank N all_gathers its per-trial metrics with the warmup trial included (one entry more)
  ckptwidth  - rank N rebuilds the best trial with the sweep's default width 32 instead of 16 (size mismatch)
  doubleinit - every rank: the per-trial setup calls init_process_group again (ValueError)
  stall      - rank N waits --stall seconds for a sweep lock before trial 1's group
  sigkill    - rank N sends itself SIGKILL in trial 1, step 2
  exit4      - rank N prints its own error line (empty eval shard) after trial 0 and exits with code 4
  none       - control, clean run

What happened (filled in after the runs):
  sweepfile  - rank N: FileNotFoundError lr_sweep.jsonl; with two c10d agents the other node's ranks waited until timeout
  nanlr      - rank N: FloatingPointError loss is nan at trial 1 step 1 (lr nan); DETAIL: peers' monitoredBarrier errors
  grouplist  - no error from any rank: every rank waited in trial 1's new_group until timeout 100 killed torchrun
  nonmember  - rank N: AttributeError 'int' object has no attribute 'size' (the NON_GROUP_MEMBER placeholder)
  extratrial - rank N silent in its 4th trial's new_group; peers gloo timeout 12000ms in the metrics all_gather
  cfgkey     - every rank: KeyError 'momentum' building trial 0's optimizer
  metriclen  - another rank aborts on gloo EnforceNotMet 8 vs 6 'Received data size doesn't match' (SIGABRT)
  ckptwidth  - rank N: RuntimeError loading state_dict for Sequential: size mismatch [16, 8] vs [32, 8]
  doubleinit - every rank: ValueError trying to initialize the default process group twice!
  stall      - rank N prints its sweep-lock line and sleeps; PG 300 s, timeout 60 killed torchrun (exit 124)
  sigkill    - rank N: exitcode -9 (SIGKILL) in trial 1; peers Connection reset/closed by peer
  exit4      - rank N prints its ERROR eval shard empty line after trial 0, exitcode 4
  none       - clean, exit 0, rank 0 saved best/best_trial.pt (trial 0, lr 0.05)
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault192_work"


def build_model(hidden, seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def batch(rank, step, trial, n=32):
    g = torch.Generator().manual_seed(1000 * trial + 10 * step + rank)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :3].sum(dim=1, keepdim=True) * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def load_sweep(rank, a):
    name = "lr_sweep.json"
    if a.fault == "sweepfile" and rank == a.rank:
        name = "lr_sweep.jsonl"
    with open(os.path.join(WORK, "sweep", name)) as f:
        return json.load(f)


def run_trial(t, cfg, rank, world, a, eval_group):
    ranks = list(range(world))
    if a.fault == "stall" and t == 1 and rank == a.rank:
        print(f"rank {rank}: waiting for sweep lock {WORK}/sweep/.lock", flush=True)
        time.sleep(a.stall)
    if a.fault == "grouplist" and t == 1 and rank == a.rank:
        ranks = list(range(world - 1))
    if a.fault == "doubleinit":
        dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    pg = dist.new_group(ranks=ranks)
    hidden = cfg["hidden"]
    model = build_model(hidden, seed=t)
    if a.ddp:
        model = DDP(model, process_group=pg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    warmup = cfg["warmup"]
    if a.fault == "nanlr" and t == 1 and rank == a.rank:
        warmup = warmup - 1
    lossfn = nn.MSELoss()
    for step in range(a.steps):
        scale = torch.tensor(min(step + 1, warmup), dtype=torch.float32) / torch.tensor(float(warmup))
        for grp in opt.param_groups:
            grp["lr"] = cfg["lr"] * float(scale)
        x, y = batch(rank, step, t)
        out = model(x)
        loss = lossfn(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"rank {rank} trial {t}: loss is {loss.item()} at step {step} (lr {opt.param_groups[0]['lr']})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=pg)
                p.grad /= world
        opt.step()
        if a.fault == "sigkill" and t == 1 and step == 2 and rank == a.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        rep = loss.detach().clone()
        dist.all_reduce(rep, group=pg)
        print(f"rank {rank} trial {t} step {step} loss {rep.item() / world:.4f}", flush=True)
    # evaluation on the eval subgroup (every rank but the last)
    in_eval = rank < world - 1
    if a.fault == "nonmember" and rank == a.rank:
        in_eval = rank <= world - 1
    val = torch.zeros(1)
    if in_eval:
        xv, yv = batch(rank, 99, t)
        with torch.no_grad():
            v = lossfn(model(xv), yv).reshape(1)
        dist.all_reduce(v, group=eval_group)
        val = v / eval_group.size()
    dist.all_reduce(val, group=pg)
    val = val / (world - 1)
    unwrapped = model.module if a.ddp else model
    state = {k: p.detach().clone() for k, p in unwrapped.state_dict().items()}
    return val.item(), state


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.rank == -1:
        a.rank = rank
    sweep = load_sweep(rank, a)
    trials = sweep["trials"]
    if a.fault == "cfgkey":
        trials = [dict((("beta" if k == "momentum" else k), v) for k, v in c.items()) for c in trials]
    eval_group = dist.new_group(ranks=list(range(world - 1)))
    n_trials = len(trials)
    if a.fault == "extratrial" and rank == a.rank:
        n_trials = len(trials) + 1
    if rank == 0:
        print(f"sweep: {len(trials)} trials, world {world}, lrs {[c['lr'] for c in trials]}", flush=True)
    metrics, states = [], []
    for t in range(n_trials):
        cfg = trials[t % len(trials)]
        val, state = run_trial(t, cfg, rank, world, a, eval_group)
        metrics.append(val)
        states.append(state)
        print(f"rank {rank} trial {t} lr {cfg['lr']} val {val:.4f}", flush=True)
        if a.fault == "exit4" and t == 0 and rank == a.rank:
            print(f"ERROR rank {rank}: eval shard for trial {t} is empty (0 of 32 batches); aborting sweep",
                  flush=True)
            sys.exit(4)
    mine = torch.tensor(metrics)
    if a.fault == "metriclen" and rank == a.rank:
        mine = torch.cat([torch.tensor([metrics[0]]), mine])
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    mean = torch.stack(gathered).mean(dim=0)
    best = int(torch.argmin(mean))
    os.makedirs(os.path.join(WORK, "best"), exist_ok=True)
    path = os.path.join(WORK, "best", "best_trial.pt")
    if rank == 0:
        torch.save(states[best], path)
        print(f"best trial {best} lr {trials[best]['lr']} val {mean[best].item():.4f}; saved {path}", flush=True)
    dist.barrier()
    hidden = trials[best]["hidden"]
    if a.fault == "ckptwidth" and rank == a.rank:
        hidden = sweep["default_hidden"]
    model = build_model(hidden, seed=0)
    model.load_state_dict(torch.load(path))
    xv, yv = batch(rank, 99, best)
    with torch.no_grad():
        final = nn.functional.mse_loss(model(xv), yv).reshape(1)
    dist.all_reduce(final)
    if rank == 0:
        print(f"final check of trial {best}: loss {final.item() / world:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

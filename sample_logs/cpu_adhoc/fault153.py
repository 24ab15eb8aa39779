"""A hundred-and-fifty-third hand-run batch: ACTIVATION CHECKPOINTING AND MEMORY-SAVING TRAINING.

A deep MLP stack (residual blocks) trained with DDP (or hand all-reduce with --ddp 0) on the gloo backend.
Every block runs under torch.utils.checkpoint.checkpoint (use_reentrant False or True), gradients are
accumulated over ACCUM_STEPS micro-steps (no_sync on the inner ones), and each step prints the loss and the
process max RSS / tracemalloc peak.  Can resume from per-rank shards in --ckpt-dir.

Faults:
  dropout   - a block's dropout is re-seeded per call on rank N; the program's recompute check raises RuntimeError
  nontensor - the checkpointed function returns a dict instead of a tensor on every rank (checkpoint raises)
  nograd    - use_reentrant=True over an input that does not require grad on every rank: backward has no grad
  nosync    - rank N keeps no_sync on for the last micro-step too, so it all-reduces fewer times (others time out)
  budget    - rank N's memory budget check (tracemalloc peak over --mem-budget-kb) raises MemoryError
  accumenv  - ACCUM_STEPS is "2x" on rank N (a bad per-rank override), int() raises ValueError
  shard     - resume: rank N's shard file is missing from --ckpt-dir (FileNotFoundError in torch.load)
  blocks    - rank N builds one block more (depth off by one), DDP construction finds mismatched parameters
  nan       - the custom activation returns NaN on rank N at step 3; the program's finite check raises
  sigkill   - rank N sends itself SIGKILL at step 2
  wait      - rank N sleeps before the step-2 loss all_reduce (the others wait in it)
  none      - control, clean run

What happened (filled in after the runs):
  dropout   - rank N RuntimeError 'recompute check failed' (line 153) before step 0; peers Connection closed by peer
  nontensor - every rank TypeError 'linear(): argument 'input' ... must be Tensor, not dict' in the first forward
  nograd    - every rank DDP RuntimeError 'Expected to have finished reduction in the prior iteration' at step 1
  nosync    - rank N aborts in gloo at step 1 (EnforceNotMet 'Received data size doesn't match expected size'), exitcode -6
  budget    - rank N MemoryError 'activation memory ~64800 KiB over budget 32768 KiB at step 0' (line 176)
  accumenv  - rank N ValueError: invalid literal for int() with base 10: '2x' (line 112) before step 0
  shard     - rank N FileNotFoundError for /tmp/job_work/ckpt/shard_rankN_of_3.pt in torch.load; others resumed
  blocks    - every rank RuntimeError 'DDP expects same model across all ranks ... rank N has inconsistent 24 params'
  nan       - rank N FloatingPointError 'non-finite activations at step 3 micro 0: 32 values' (line 156)
  sigkill   - rank N exitcode -9 (SIGKILL) after step 2's optimizer step; peers Connection closed by peer
  wait      - pg 12 s: peers 'Timed out waiting 12000ms'; pg 300 s under timeout 60: hung after step 1, exit 124
  none      - clean, exit 0, 4 steps on every rank; wrote the per-rank shards used by the shard runs
"""
import argparse
import os
import resource
import signal
import sys
import time
import tracemalloc
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--depth", type=int, default=4)
p.add_argument("--width", type=int, default=64)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--reentrant", type=int, default=0)
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--mem-budget-kb", type=int, default=262144)
p.add_argument("--ckpt-dir", default="")
a = p.parse_args()


def hit(rank):
    return a.rank == -1 or a.rank == rank


class Act(nn.Module):
    """Custom gated activation x * sigmoid(1.702 x)."""
    def __init__(self):
        super().__init__()
        self.scale = 1.702
    def forward(self, x):
        return x * torch.sigmoid(self.scale * x)


class Block(nn.Module):
    def __init__(self, w, p_drop=0.0):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(w, 2 * w), nn.Linear(2 * w, w), Act()
        self.drop = nn.Dropout(p_drop)
        self.reseed = False
    def forward(self, x):
        if self.reseed:
            torch.manual_seed(int(time.time() * 1e6) % 100000)
        return x + self.drop(self.fc2(self.act(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, w, depth, reentrant, returns_dict=False):
        super().__init__()
        self.inp = nn.Linear(16, w)
        self.blocks = nn.ModuleList([Block(w, 0.1 if i == 1 else 0.0) for i in range(depth)])
        self.head = nn.Linear(w, 1)
        self.reentrant, self.returns_dict, self.skip_inp = reentrant, returns_dict, False
    def forward(self, x):
        h = x if self.skip_inp else self.inp(x)
        for b in self.blocks:
            fn = (lambda t, b=b: {"h": b(t)}) if self.returns_dict else b
            h = checkpoint(fn, h, use_reentrant=bool(self.reentrant))
        return self.head(h)


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    tracemalloc.start()
    accum = int(os.environ.get("ACCUM_STEPS", "2"))
    if a.fault == "accumenv" and hit(rank):
        os.environ["ACCUM_STEPS"] = "2x"  # per-rank override from the node's job env
        accum = int(os.environ["ACCUM_STEPS"])
    depth = a.depth + (1 if a.fault == "blocks" and hit(rank) else 0)
    torch.manual_seed(0)
    net = Net(a.width, depth, a.reentrant or a.fault == "nograd", returns_dict=(a.fault == "nontensor"))
    if a.fault == "nograd":
        net.inp.requires_grad_(False)  # "freeze the stem" to save memory
    if a.fault == "dropout" and hit(rank):
        net.blocks[1].reseed = True
    opt_params = [q for q in net.parameters() if q.requires_grad]
    if a.ckpt_dir:
        shard = os.path.join(a.ckpt_dir, f"shard_rank{rank}.pt")
        if a.fault == "shard" and hit(rank):
            shard = os.path.join(a.ckpt_dir, f"shard_rank{rank}_of_{world}.pt")
        net.load_state_dict(torch.load(shard, map_location="cpu"))
        print(f"rank {rank} resumed from {shard}", flush=True)
    model = DDP(net) if a.ddp else net
    if not a.ddp:
        for q in net.parameters():
            dist.broadcast(q.data, 0)
    opt = torch.optim.SGD(opt_params, lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    print(f"rank {rank}/{world} depth {depth} accum {accum} reentrant {int(net.reentrant)}", flush=True)
    for step in range(a.steps):
        opt.zero_grad()
        tot = 0.0
        for micro in range(accum):
            x = torch.randn(32, 16, generator=g)
            y = x.sum(1, keepdim=True).tanh()
            if a.fault == "nan" and hit(rank) and step == 3:
                net.blocks[2].act.scale = float("nan")
            last = micro == accum - 1
            if a.fault == "nosync" and hit(rank) and step == 1:
                last = False
            ctx = model.no_sync() if (a.ddp and not last) else torch.enable_grad()
            with ctx:
                if a.fault == "dropout" and micro == 0:
                    with torch.no_grad():
                        torch.manual_seed(step); o1 = net(x)
                        torch.manual_seed(step); o2 = net(x)
                    if not torch.equal(o1, o2):
                        diff = (o1 - o2).abs().max().item()
                        raise RuntimeError(f"recompute check failed: checkpointed forward is not deterministic (max diff {diff:.3e})")
                out = model(x)
                if not torch.isfinite(out).all():
                    raise FloatingPointError(f"non-finite activations at step {step} micro {micro}: {int((~torch.isfinite(out)).sum())} values")
                loss = ((out - y) ** 2).mean() / accum
                loss.backward()
            tot += loss.item()
        if not a.ddp:
            for q in opt_params:
                dist.all_reduce(q.grad)
                q.grad /= world
        opt.step()
        if a.fault == "sigkill" and hit(rank) and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.fault == "wait" and hit(rank) and step == 2:
            time.sleep(400)
        lt = torch.tensor([tot])
        dist.all_reduce(lt)
        cur, peak = tracemalloc.get_traced_memory()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f} maxrss {rss // 1024} MiB traced_peak {peak // 1024} KiB", flush=True)
        budget = a.mem_budget_kb // (8 if a.fault == "budget" and hit(rank) else 1)
        if peak // 1024 > budget:
            raise MemoryError(f"activation memory {peak // 1024} KiB over budget {budget} KiB at step {step}")
    if rank == 0 and a.fault == "none" and a.ckpt_dir == "":
        os.makedirs("/tmp/fault153_work/ckpt", exist_ok=True)
    dist.barrier()
    torch.save(net.state_dict(), f"/tmp/fault153_work/ckpt/shard_rank{rank}.pt") if os.path.isdir("/tmp/fault153_work/ckpt") else None
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()

"""A hundred-and-ninety-fourth hand-run batch: SHARPNESS-AWARE MINIMISATION AND GRADIENT ACCUMULATION UNDER DDP.

Every rank trains a small CNN (two 3x3 convs, global pooling, a linear classifier and an auxiliary head used
for the warm-up consistency loss) with SAM: each micro-batch is run twice, first under model.no_sync() to
find the ascent direction (e = rho * g / ||g||), then, from the perturbed weights, a second synced pass whose
gradient SGD applies after the weights are restored.  A batch of 24 is split into --accum micro-batches, all
but the last under no_sync.  The learning rate warms up linearly.  Gradients are averaged by DDP on gloo (or
--ddp 0: a hand-written all_reduce of every gradient); the loss is all_reduced for the log.  Each rank reads
its shard from /tmp/fault194_work/data/shard_R.pt and restores the SAM state from ckpt/sam_warm_v2.pt.

Faults:
  nosync   - rank N forgets model.no_sync() on the first (ascent) pass: one extra gradient all_reduce per step
  unused   - every rank: the aux head is used only in the ascent pass, DDP built with find_unused_parameters=False
  rhozero  - rank N zeroes the gradients before taking their norm: ascent scale rho/0 = inf, program's check
  accum    - every rank: config accum=5 does not divide the batch of 24 (the program's assert)
  shape    - rank N's shard loader keeps the images channels-last (N,8,8,3): conv raises on the channel count
  nodata   - rank N reads the shard from the 'trian' split directory (FileNotFoundError)
  ckpt     - rank N restores from ckpt/sam_warm_v1.pt, saved without the SAM state (missing keys)
  keyerr   - every rank: the config spells the warm-up key 'warmup_iters', the code reads 'warmup_steps'
  segv     - rank N sends itself SIGSEGV at step 2
  exit2    - rank N prints its own 'sharpness estimate diverged' error line and exits with code 2
  stall    - rank N waits --stall seconds for a data lock before the synced pass of step 1
  none     - control, clean run

What happened (filled in after the runs):
  nosync   - not kept: the only run was stopped by the helper's time limit before it finished
  unused   - every rank: RuntimeError Expected to have finished reduction in the prior iteration (step 1)
  rhozero  - rank N: FloatingPointError SAM ascent scale inf (grad norm 0.0); DETAIL: monitoredBarrier
  accum    - not run (time limit)
  shape    - rank N: RuntimeError expected input[6, 8, 8, 3] to have 3 channels, but got 8; peers closed
  nodata   - rank N: FileNotFoundError .../data/trian/shard_N.pt (in the --redirects stderr.log)
  ckpt     - not run (time limit)
  keyerr   - every rank: KeyError 'warmup_steps' at the warm-up line, before DDP
  segv     - rank N: exitcode -11 (SIGSEGV) after step 2; peers Connection closed/reset by peer
  exit2    - rank N: prints its ERROR sharpness estimate diverged line, exitcode 2; peers closed
  stall    - not run (time limit)
  none     - clean, exit 0, rank 0 saved ckpt/sam_final.pt
"""
import argparse
import contextlib
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault194_work"


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 4)

    def forward(self, x, with_aux=True):
        h = F.relu(self.c1(x))
        h = F.relu(self.c2(h))
        h = h.mean(dim=(2, 3))
        out = self.fc(h)
        if with_aux:
            out = out + 0.1 * self.aux(h)
        return out


class SAMState(nn.Module):
    def __init__(self, rho):
        super().__init__()
        self.register_buffer("rho", torch.tensor(float(rho)))
        self.register_buffer("ascents", torch.tensor(0))


def write_ckpts():
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/data/train", exist_ok=True)
    torch.manual_seed(0)
    m, s = SmallCNN(), SAMState(0.05)
    torch.save({"model": m.state_dict()}, f"{WORK}/ckpt/sam_warm_v1.pt")
    torch.save({"model": m.state_dict(), "sam": s.state_dict()}, f"{WORK}/ckpt/sam_warm_v2.pt")
    for r in range(8):
        g = torch.Generator().manual_seed(100 + r)
        torch.save({"x": torch.randn(48, 8, 8, 3, generator=g), "y": torch.randint(0, 4, (48,), generator=g)},
                   f"{WORK}/data/train/shard_{r}.pt")
    print("wrote", f"{WORK}/ckpt", f"{WORK}/data/train")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--write-ckpts", action="store_true")
    a = p.parse_args()
    if a.write_ckpts:
        return write_ckpts()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.fault != "none" and a.rank in (-1, rank)
    cfg = {"batch": 24, "accum": 4, "rho": 0.05, "lr": 0.05, "warmup_iters": 3, "split": "train"}
    if me and a.fault == "accum":
        cfg["accum"] = 5
    if me and a.fault == "nodata":
        cfg["split"] = "trian"
    torch.manual_seed(0)
    model = SmallCNN()
    ck_name = "sam_warm_v1.pt" if me and a.fault == "ckpt" else "sam_warm_v2.pt"
    ck = torch.load(f"{WORK}/ckpt/{ck_name}", weights_only=True)
    model.load_state_dict(ck["model"])
    sam_state = SAMState(cfg["rho"])
    sam_state.load_state_dict(ck.get("sam", {}))
    shard = torch.load(f"{WORK}/data/{cfg['split']}/shard_{rank}.pt", weights_only=True)
    x_all = shard["x"] if (me and a.fault == "shape") else shard["x"].permute(0, 3, 1, 2).contiguous()
    y_all = shard["y"]
    if a.ddp:
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    else:
        ddp = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    params = [q for q in model.parameters()]
    opt = torch.optim.SGD(params, lr=cfg["lr"], momentum=0.9)
    assert cfg["batch"] % cfg["accum"] == 0, f"batch {cfg['batch']} not divisible by accum {cfg['accum']}"
    micro = cfg["batch"] // cfg["accum"]
    warm = cfg["warmup_steps"] if (me and a.fault == "keyerr") else cfg["warmup_iters"]
    rho = float(sam_state.rho)
    print(f"rank {rank}/{world} SAM rho={rho:g} batch={cfg['batch']} accum={cfg['accum']} micro={micro}", flush=True)

    def sync_grads():
        if not a.ddp:
            for q in params:
                dist.all_reduce(q.grad)
                q.grad /= world

    for step in range(a.steps):
        for gq in opt.param_groups:
            gq["lr"] = cfg["lr"] * min(1.0, (step + 1) / warm)
        opt.zero_grad()
        off = (step * cfg["batch"]) % x_all.shape[0]
        xb, yb = x_all[off:off + cfg["batch"]], y_all[off:off + cfg["batch"]]
        tot = 0.0
        for k in range(cfg["accum"]):
            xm, ym = xb[k * micro:(k + 1) * micro], yb[k * micro:(k + 1) * micro]
            last = k == cfg["accum"] - 1
            # first SAM pass: ascent direction, never synced
            saved = [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in params]
            for q in params:
                q.grad = None
            ctx = contextlib.nullcontext() if (me and a.fault == "nosync") or not a.ddp else ddp.no_sync()
            with ctx:
                F.cross_entropy(ddp(xm, with_aux=True), ym).backward()
            if me and a.fault == "rhozero":
                for q in params:
                    q.grad.zero_()
            gnorm = torch.norm(torch.stack([q.grad.norm() for q in params if q.grad is not None]))
            scale = rho / gnorm
            if not torch.isfinite(scale):
                raise FloatingPointError(f"rank {rank}: SAM ascent scale {scale.item()} is not finite "
                                         f"(grad norm {gnorm.item()}) at step {step} micro-batch {k}")
            eps = []
            with torch.no_grad():
                for q in params:
                    e = q.grad * scale if q.grad is not None else torch.zeros_like(q)
                    q.add_(e)
                    eps.append(e)
            for q, g in zip(params, saved):
                q.grad = g
            if me and a.fault == "stall" and step == 1 and k == cfg["accum"] - 1:
                print(f"rank {rank}: waiting for data lock {WORK}/data/.lock", flush=True)
                time.sleep(a.stall)
            # second SAM pass: sharpness-aware gradient, synced on the last micro-batch only
            ctx2 = contextlib.nullcontext() if last or not a.ddp else ddp.no_sync()
            with_aux = not (a.fault == "unused" and me)
            with ctx2:
                loss = F.cross_entropy(ddp(xm, with_aux=with_aux), ym) / cfg["accum"]
                loss.backward()
            with torch.no_grad():
                for q, e in zip(params, eps):
                    q.sub_(e)
            tot += loss.item()
        sync_grads()
        opt.step()
        sam_state.ascents += cfg["accum"]
        lt = torch.tensor([tot])
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f} lr {opt.param_groups[0]['lr']:.4f}", flush=True)
        if me and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(0.05)
    if me and a.fault == "exit2":
        print(f"ERROR rank {rank}: sharpness estimate diverged (ascent/descent loss ratio 7.3 > 5.0); aborting",
              flush=True)
        sys.exit(2)
    dist.barrier()
    if rank == 0:
        torch.save({"model": model.state_dict(), "sam": sam_state.state_dict()}, f"{WORK}/ckpt/sam_final.pt")
        print(f"rank 0 saved {WORK}/ckpt/sam_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

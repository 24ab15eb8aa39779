"""A hundred-and-fifty-sixth hand-run batch: LARGE-BATCH OPTIMIZERS WRITTEN BY HAND (LAMB / LARS STYLE) AND LR WARMUP.

A small MLP (Linear, LayerNorm, GELU, Linear) trained with DDP (or hand all-reduced gradients with --ddp 0) on
gloo, with a hand-written LAMB optimizer (torch.optim.Optimizer subclass: Adam moments, per-layer trust ratio
||w|| / ||u||, weight decay excluded for biases and norm weights by parameter name), a warmup + cosine schedule
as a LambdaLR, and the global gradient norm all_reduced and logged every step.  Optionally resumes model and
optimizer state from --resume and saves to --save.

Faults:
  trust    - rank N freezes the norm weights (grads zeroed), so ||u|| is 0; the ratio guard only checks ||w||: inf
  groups   - every rank: the no-decay name filter also matches '0.bias' already in the decay group (ValueError)
  lambda   - every rank: the warmup lambda returns None at step == warmup (TypeError inside LambdaLR)
  resume   - rank N builds its groups without the norm exclusion, then loads the saved optimizer state (ValueError)
  warmenv  - rank N's WARMUP_STEPS is '2.5' (a per-rank override), int() raises ValueError
  gnorm    - rank N all_reduces a per-layer grad-norm vector one entry longer (gloo size mismatch)
  pause    - rank N sleeps in a 'profiling pause' before step 2's grad-norm all_reduce (others time out)
  momdev   - rank N restores the momentum buffers with device 'gpu' (RuntimeError from the device string)
  lrexit   - rank N finds its peak lr invalid, prints an error and calls sys.exit(2)
  sigabrt  - rank N sends itself SIGABRT after step 1
  feat     - rank N's data shard has 12 features instead of 16 (shape error in the first Linear)
  none     - control, clean run

What happened (filled in after the runs):
  trust    - rank N FloatingPointError 'non-finite trust ratio for 1.weight: inf (|w|=5.6569 |u|=0.0000)' (line 94)
  groups   - every rank ValueError 'some parameters appear in more than one parameter group' before step 0
  lambda   - every rank TypeError in LambdaLR "unsupported operand type(s) for *: 'float' and 'NoneType'" (line 168)
  resume   - rank N ValueError 'loaded state dict contains a parameter group that doesn't match the size ...' (line 141)
  warmenv  - rank N ValueError: invalid literal for int() with base 10: '2.5' (line 117) before DDP
  gnorm    - no gloo size error: rank N never finishes step 0, then every rank 'Timed out waiting 12000ms' at step 1
  pause    - pg 12 s: peers 'Timed out waiting 12000ms'; pg 300 s under timeout 60: hung after step 1, exit 124
  momdev   - rank N RuntimeError '... device type at start of device string: gpu' (line 144); peers Connection closed
  lrexit   - rank N prints 'error: lr schedule invalid: peak lr -0.02 ...' and exits 2; agent 'failed (exitcode: 2)'
  sigabrt  - rank N exitcode -6 after step 1; peers Connection reset; the restart dies in Gloo connectFullMesh
  feat     - rank N RuntimeError 'mat1 and mat2 shapes cannot be multiplied (64x12 and 16x32)' (line 151)
  none     - clean, exit 0, 5 steps on every rank; rank 0 saved /tmp/job_work/lamb.pt (used by resume and momdev)
"""
import argparse
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--lr", type=float, default=0.02)
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--resume", default="")
p.add_argument("--save", default="")
a = p.parse_args()


def here(rank):
    return a.rank == -1 or a.rank == rank


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        ratios = []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for prm, name in zip(group["params"], group["names"]):
                if prm.grad is None:
                    continue
                st = self.state[prm]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(prm)
                    st["exp_avg_sq"] = torch.zeros_like(prm)
                st["step"] += 1
                st["exp_avg"].mul_(b1).add_(prm.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(prm.grad, prm.grad, value=1 - b2)
                m_hat = st["exp_avg"] / (1 - b1 ** st["step"])
                v_hat = st["exp_avg_sq"] / (1 - b2 ** st["step"])
                upd = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    upd = upd + group["weight_decay"] * prm
                w_norm, u_norm = prm.norm(), upd.norm()
                ratio = (w_norm / u_norm).item() if w_norm > 0 else 1.0
                if not math.isfinite(ratio):
                    raise FloatingPointError(f"non-finite trust ratio for {name}: {ratio} (|w|={w_norm:.4f} |u|={u_norm:.4f})")
                ratios.append(ratio)
                prm.add_(upd, alpha=-group["lr"] * ratio)
        return ratios


def param_groups(model, exclude_norm=True):
    named = list(model.named_parameters())
    decay = [(n, q) for n, q in named if not n.endswith("bias") and not (exclude_norm and n.startswith("1."))]
    no_decay = [(n, q) for n, q in named if n.endswith("bias") or (exclude_norm and n.startswith("1."))]
    if a.fault == "groups" and here(dist.get_rank()):
        decay = [(n, q) for n, q in named if not n.startswith("1.")]
    return [dict(params=[q for _, q in decay], names=[n for n, _ in decay], weight_decay=0.01),
            dict(params=[q for _, q in no_decay], names=[n for n, _ in no_decay], weight_decay=0.0)]


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    feats = 12 if (a.fault == "feat" and here(rank)) else 16
    if a.fault == "warmenv" and here(rank):
        os.environ["WARMUP_STEPS"] = "2.5"
    warmup = int(os.environ.get("WARMUP_STEPS", "2"))
    peak_lr = a.lr * world / 4
    if a.fault == "lrexit" and here(rank):
        peak_lr = -peak_lr
    if not (0 < peak_lr < 1):
        print(f"[rank {rank}] error: lr schedule invalid: peak lr {peak_lr} for world {world} (warmup {warmup})", file=sys.stderr, flush=True)
        sys.exit(2)
    net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    model = DDP(net) if a.ddp else net
    if not a.ddp:
        for q in net.parameters():
            dist.broadcast(q.data, src=0)
    opt = Lamb(param_groups(net, exclude_norm=not (a.fault == "resume" and here(rank))), lr=peak_lr)

    def lr_lambda(step):
        if step < warmup:
            return (step + 1) / warmup
        if step > warmup or a.fault != "lambda":
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, a.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    if a.resume:
        ck = torch.load(a.resume, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        if a.fault == "momdev" and here(rank):
            for st in opt.state.values():
                st["exp_avg"] = st["exp_avg"].to(ck.get("device", "gpu"))
        print(f"rank {rank} resumed from {a.resume} at step {ck['step']}", flush=True)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, feats, generator=g)
    y = torch.randn(64, 4, generator=g)
    for step in range(a.steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not a.ddp:
            for q in net.parameters():
                dist.all_reduce(q.grad)
                q.grad /= world
        if a.fault == "trust" and here(rank):
            net[1].weight.grad.zero_()
        norms = torch.stack([q.grad.norm() for q in net.parameters()])
        if a.fault == "gnorm" and here(rank):
            norms = torch.cat([norms, loss.detach().reshape(1)])
        if a.fault == "pause" and here(rank) and step == 2:
            print(f"rank {rank} profiling pause before grad-norm reduce", flush=True)
            time.sleep(a.pg_timeout * 10)
        dist.all_reduce(norms)
        gnorm = (norms / world).pow(2).sum().sqrt().item()
        ratios = opt.step()
        sched.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} gnorm {gnorm:.4f} lr {sched.get_last_lr()[0]:.5f} "
              f"trust min {min(ratios):.3f} max {max(ratios):.3f}", flush=True)
        if a.fault == "sigabrt" and here(rank) and step == 1:
            os.kill(os.getpid(), signal.SIGABRT)
    if a.save and rank == 0:
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": a.steps}, a.save)
        print(f"rank 0 saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-eighty-ninth hand-run batch: CUSTOM AUTOGRAD FUNCTIONS AND HOOKS.

Every rank builds a small domain-adversarial regressor: a QuantLinear layer whose weight goes through a
hand-written straight-through quantiser (STEQuant, a torch.autograd.Function with per-channel scale buffers
loaded from a calibration file), a tanh feature layer, a regression head and a domain head behind a
gradient-reversal layer (GradReverse, another autograd.Function, alpha from the usual DANN schedule).  A tensor
hook on the features clips the activation gradient and records its norm (checked for NaN/inf); a full backward
hook on the head clips grad_input.  Gradients are averaged by DDP on gloo (or --ddp 0: a hand-written
all_reduce); the loss and gradient norm are all_reduced for the log, and after training the per-layer gradient
norms are all_gathered for logging and rank 0 saves the quantiser calibration.

Faults:
  nargs      - every rank: STEQuant.backward returns two gradients (the old two-input form) for three inputs
  inplace    - rank N clamps the tanh features in place (the tanh output is saved for backward)
  hookshape  - rank N's activation-clipping hook returns the per-feature mean (wrong shape)
  twice      - rank N calls loss.backward() a second time for a 'gradient accumulation' pass
  nangrad    - rank N's DANN schedule divides by a zero step count: alpha NaN, NaN activation gradients
  normlen    - rank N all_gathers its per-layer grad norms including the scale buffer (one extra entry)
  ckpt       - rank N loads the calibration file of the 16-channel model (scale buffer shape mismatch)
  stall      - rank N waits --stall seconds for a calibration lock before its first step
  sigkill    - rank N gets SIGKILL (sent to itself) at step 3
  exit2      - rank N prints its own 'quantiser scale collapsed' error line and exits with code 2
  extraparam - rank N's config makes the GRL alpha a learnable parameter (one extra param for DDP)
  none       - control, clean run

What happened (filled in after the runs):
  nargs      - every rank: RuntimeError function STEQuantBackward returned an incorrect number of gradients (3 vs 2)
  inplace    - rank N: RuntimeError variable needed for gradient computation modified by an inplace op (Tanh)
  hookshape  - rank N: RuntimeError hook 'clip_act_grad' has changed the size of value; peers Connection closed
  twice      - rank N: RuntimeError Trying to backward through the graph a second time at step 1
  nangrad    - rank N: FloatingPointError non-finite activation gradient norm nan at step 0; DETAIL: monitoredBarrier
  normlen    - rank 0 aborts on gloo EnforceNotMet 14 vs 12 'Received data size doesn't match' (SIGABRT)
  ckpt       - rank N: RuntimeError loading state_dict for QuantLinear: size mismatch for scale [16,1] vs [32,1]
  stall      - wait 40 s: peers gloo timeout 12000ms in DDP's param check; wait 1000 s / PG 300 s: see README
  sigkill    - rank N: exitcode -9 (SIGKILL) at step 3; with --max-restarts 1 both attempts die the same way
  exit2      - rank N: prints its ERROR quantiser scale collapsed line after training, exitcode 2
  extraparam - every rank: RuntimeError DDP expects same model across all ranks (rank N has 7 params vs 6)
  none       - clean, exit 0, rank 0 saved calib/q1_scale_trained.pt
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault189_work"


class STEQuant(torch.autograd.Function):
    """Symmetric per-channel fake quantisation with a straight-through gradient."""

    @staticmethod
    def forward(ctx, w, scale, bits):
        qmax = 2 ** (bits - 1) - 1
        ctx.save_for_backward(w, scale)
        ctx.qmax = qmax
        return torch.clamp(torch.round(w / scale), -qmax, qmax) * scale

    @staticmethod
    def backward(ctx, g):
        w, scale = ctx.saved_tensors
        mask = (w.abs() <= scale * ctx.qmax).to(g.dtype)
        if ctx.legacy_two_arg:
            return g * mask, None
        return g * mask, None, None


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(alpha)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (alpha,) = ctx.saved_tensors
        return -alpha * g, None


class QuantLinear(nn.Module):
    def __init__(self, fin, fout, bits=8, legacy=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fout, fin) / math.sqrt(fin))
        self.bias = nn.Parameter(torch.zeros(fout))
        self.register_buffer("scale", torch.ones(fout, 1))
        self.bits, self.legacy = bits, legacy

    def forward(self, x):
        wq = STEQuant.apply(self.weight, self.scale, self.bits)
        wq.grad_fn.legacy_two_arg = self.legacy  # the pre-'bits' backward of the old two-input forward
        return F.linear(x, wq, self.bias)


class Net(nn.Module):
    def __init__(self, fin=8, hid=32, legacy=False, learn_alpha=False):
        super().__init__()
        self.q1 = QuantLinear(fin, hid, legacy=legacy)
        self.head = nn.Linear(hid, 1)
        self.dom = nn.Linear(hid, 2)
        if learn_alpha:
            self.alpha = nn.Parameter(torch.tensor(1.0))
        self.act_gnorm = 0.0
        self.clip = 1.0
        self.bad_hook = False
        self.inplace_clamp = False

    def clip_act_grad(self, g):
        self.act_gnorm = float(g.norm())
        if self.bad_hook:
            return g.clamp(-self.clip, self.clip).mean(0)
        return g.clamp(-self.clip, self.clip)

    def forward(self, x, alpha):
        feat = torch.tanh(self.q1(x))
        if self.inplace_clamp:
            feat.clamp_(-0.999, 0.999)
        if feat.requires_grad:
            feat.register_hook(self.clip_act_grad)
        y = self.head(feat)
        d = self.dom(GradReverse.apply(feat, alpha))
        return y, d


def head_clip_hook(module, grad_input, grad_output):
    return tuple(None if g is None else g.clamp(-5.0, 5.0) for g in grad_input)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank == -1 or a.rank == rank
    f = a.fault if hit else "none"
    torch.manual_seed(1234)
    hid = 32
    net = Net(hid=hid, legacy=(f == "nargs"), learn_alpha=(f == "extraparam"))
    calib = os.path.join(WORK, "calib", "q1_scale_h16.pt" if f == "ckpt" else "q1_scale_h32.pt")
    print(f"rank {rank}: loading quantiser calibration {calib}", flush=True)
    net.q1.load_state_dict(torch.load(calib), strict=False)
    net.head.register_full_backward_hook(head_clip_hook)
    net.bad_hook = f == "hookshape"
    net.inplace_clamp = f == "inplace"
    if f == "stall":
        print(f"rank {rank}: waiting for calibration lock {WORK}/calib/.lock", flush=True)
        time.sleep(a.stall)
    model = DDP(net) if a.ddp else net
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    total = 0 if f == "nangrad" else a.steps
    for step in range(a.steps):
        x = torch.randn(16, 8, generator=g)
        t = x[:, :1] * 0.5 + 0.1 * torch.randn(16, 1, generator=g)
        dlab = torch.full((16,), rank % 2, dtype=torch.long)
        prog = torch.tensor(float(step)) / torch.tensor(float(total))
        alpha = 2.0 / (1.0 + torch.exp(-10.0 * prog)) - 1.0
        y, d = model(x, alpha)
        loss = F.mse_loss(y, t) + 0.1 * F.cross_entropy(d, dlab)
        opt.zero_grad()
        loss.backward()
        if f == "twice" and step == 1:
            loss.backward()
        if not math.isfinite(net.act_gnorm):
            raise FloatingPointError(f"rank {rank}: non-finite activation gradient norm {net.act_gnorm} at step {step} (alpha {float(alpha)})")
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        if f == "sigkill" and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        gn = torch.stack([prm.grad.norm() for prm in net.parameters()]).norm()
        stats = torch.stack([loss.detach(), gn])
        dist.all_reduce(stats)
        stats /= world
        print(f"rank {rank} step {step} loss {stats[0]:.4f} gnorm {stats[1]:.4f}", flush=True)
    if f == "exit2":
        print(f"ERROR rank {rank}: quantiser scale collapsed to 0 in layer q1 (bits=8, 7 of {hid} channels); aborting", flush=True)
        sys.exit(2)
    norms = [prm.grad.norm() for prm in net.parameters()]
    if f == "normlen":
        norms.append(net.q1.scale.norm())
    mine = torch.stack(norms)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    if rank == 0:
        print("per-layer grad norms:", [round(float(v), 4) for v in out[0]], flush=True)
        torch.save(net.q1.state_dict(), os.path.join(WORK, "calib", "q1_scale_trained.pt"))
        print(f"rank 0: saved {WORK}/calib/q1_scale_trained.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

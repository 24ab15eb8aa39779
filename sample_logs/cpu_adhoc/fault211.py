"""A two-hundred-and-eleventh hand-run batch: NORMALIZING FLOW FOR DENSITY ESTIMATION.

A RealNVP-style flow on synthetic 8-D data (a correlated two-component Gaussian mixture): K steps of an
affine coupling layer (alternating binary masks, a small MLP giving log-scale and shift) followed by an
invertible 1x1 mixing layer (an 8x8 matrix, log|det W| from slogdet).  Log-determinants are summed by hand,
the base is a standard Gaussian.  Every rank reads its shard from /tmp/fault211_work/data/shards/shard_R.pt,
the flow config from config/flow.json and the initial weights from ckpt/flow_init.pt, checks that every
mixing matrix is invertible, wraps the flow in DDP (gloo; `--ddp 0` all_reduces the gradients by hand),
trains on the negative log-likelihood and all_reduces NLL and bits-per-dim for the log.  At the end the
per-sample eval log-likelihoods are all_gathered and rank 0 saves the flow to out/flow_final.pt.

Faults:
  logdet    - rank N reads a scale multiplier of 1000 (meant 1.0): exp(s) overflows, the log-det check raises
  maskwidth - every rank: the coupling masks are built with width dim+1 (shape error in the coupling)
  noshard   - rank N reads its shard from data/shards_v2/ which does not exist (FileNotFoundError)
  singular  - rank N sets mixing layer 1 to a reversal permutation built off by one (singular, linalg.inv)
  stepsstr  - every rank: config/flow_v2.json gives flow_steps as the string "4" (TypeError)
  lllen     - rank N all_gathers 65 eval log-likelihoods instead of 64 (gloo size mismatch)
  ckptkeys  - rank N starts from ckpt/flow_init_v0.pt, saved without coupling layer 3 (missing keys)
  plot      - rank N samples 100k points for a density plot at step 2 and reaches the all_reduce --stall s late
  segv      - rank N sends itself SIGSEGV after step 2
  exit2     - rank N prints its own error line about NaN coordinates in its shard and calls os._exit(2)
  dimassert - rank N's shard has a dead (constant) column, dropped by preprocessing: the dim assert fails
  none      - control, clean run

What happened (filled in after the runs):
  logdet    - rank N: FloatingPointError log-det is nan at step 0 (scales overflowed); peers closed by peer
  maskwidth - every rank: RuntimeError size of tensor a (8) must match tensor b (9) at x * self.mask
  noshard   - rank N: FileNotFoundError .../data/shards_v2/shard_N.pt before the flow was built; peers SIGTERMed
  singular  - rank N: torch._C._LinAlgError linalg.inv ... input matrix is singular, before DDP; peers SIGTERMed
  stepsstr  - every rank: TypeError 'str' object cannot be interpreted as an integer in RealNVP.__init__
  lllen     - rank N: RuntimeError ProcessGroupGloo::allgather invalid tensor size (expected (65), got (64)); peers closed
  ckptkeys  - rank N: RuntimeError Missing key(s) in state_dict: couplings.3.net.*; peers SIGTERMed
  plot      - rank N stalled after sampling: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  segv      - rank N: exitcode -11 (SIGSEGV) after step 2; peers closed/reset by peer
  exit2     - rank N logs its ERROR NaN-coordinates line, exitcode 2; peers reset by peer; restart: connectFullMesh refused
  dimassert - rank N: AssertionError data has 7 dims after dropping constant columns, flow expects 8; peers SIGTERMed
  none      - clean, exit 0, rank 0 printed the eval NLL/bpd and saved out/flow_final.pt
"""
import argparse
import json
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

WORK = "/tmp/fault211_work"
N_PER_RANK = 512
EVAL_N = 64


class Coupling(nn.Module):
    def __init__(self, dim, mask, hidden):
        super().__init__()
        self.register_buffer("mask", mask, persistent=False)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 2 * dim))
        self.scale_mult = 1.0

    def forward(self, x):
        xm = x * self.mask
        s, t = self.net(xm).chunk(2, dim=-1)
        s = torch.tanh(s) * self.scale_mult * (1 - self.mask)
        t = t * (1 - self.mask)
        scale = torch.exp(s)
        y = xm + (1 - self.mask) * (x * scale + t)
        return y, torch.log(scale).sum(-1)

    def inverse(self, y):
        ym = y * self.mask
        s, t = self.net(ym).chunk(2, dim=-1)
        s = torch.tanh(s) * self.scale_mult * (1 - self.mask)
        return ym + (1 - self.mask) * (y - t * (1 - self.mask)) * torch.exp(-s)


class Mix(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.linalg.qr(torch.randn(dim, dim))[0])

    def forward(self, x):
        return x @ self.weight.T, torch.linalg.slogdet(self.weight)[1].expand(x.shape[0])

    def inverse(self, y):
        return y @ torch.linalg.inv(self.weight).T


class RealNVP(nn.Module):
    def __init__(self, dim, steps, hidden, mask_width):
        super().__init__()
        masks = [(torch.arange(mask_width) % 2 == k % 2).float() for k in range(steps)]
        self.couplings = nn.ModuleList(Coupling(dim, m, hidden) for m in masks)
        self.mixes = nn.ModuleList(Mix(dim) for _ in range(steps))

    def forward(self, x):
        logdet = torch.zeros(x.shape[0])
        for c, m in zip(self.couplings, self.mixes):
            x, ld = c(x)
            logdet = logdet + ld
            x, ld = m(x)
            logdet = logdet + ld
        return x, logdet

    def sample(self, n):
        z = torch.randn(n, self.mixes[0].weight.shape[0])
        for c, m in zip(reversed(self.couplings), reversed(self.mixes)):
            z = c.inverse(m.inverse(z))
        return z


def log_prob(flow, x):
    z, logdet = flow(x)
    log_pz = -0.5 * (z ** 2 + math.log(2 * math.pi)).sum(-1)
    return log_pz + logdet, logdet


def prepare():
    g = torch.Generator().manual_seed(0)
    os.makedirs(f"{WORK}/data/shards", exist_ok=True)
    os.makedirs(f"{WORK}/config", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    A = torch.randn(8, 8, generator=g) * 0.5
    for r in range(8):
        comp = torch.randint(0, 2, (N_PER_RANK, 1), generator=g).float()
        x = torch.randn(N_PER_RANK, 8, generator=g) @ A + (comp * 2 - 1) * 1.5
        torch.save({"x": x}, f"{WORK}/data/shards/shard_{r}.pt")
    cfg = {"dim": 8, "flow_steps": 4, "hidden": 32, "lr": 1e-3, "batch": 64}
    json.dump(cfg, open(f"{WORK}/config/flow.json", "w"), indent=1)
    json.dump(dict(cfg, flow_steps="4"), open(f"{WORK}/config/flow_v2.json", "w"), indent=1)
    torch.manual_seed(0)
    sd = RealNVP(8, 4, 32, 8).state_dict()
    torch.save(sd, f"{WORK}/ckpt/flow_init.pt")
    torch.save({k: v for k, v in sd.items() if not k.startswith("couplings.3.")}, f"{WORK}/ckpt/flow_init_v0.pt")
    print(f"prepared shards, config and checkpoint in {WORK}")


def train(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)

    cfg_name = "flow_v2.json" if a.fault == "stepsstr" else "flow.json"
    cfg = json.load(open(os.path.join(WORK, "config", cfg_name)))
    D = cfg["dim"]
    split = "shards_v2" if (a.fault == "noshard" and bad) else "shards"
    x_all = torch.load(os.path.join(WORK, "data", split, f"shard_{rank}.pt"))["x"]
    if a.fault == "dimassert" and bad:
        x_all[:, 5] = 0.25
    x_all = x_all[:, x_all.std(0) > 1e-6]
    x_all = (x_all - x_all.mean(0)) / x_all.std(0)
    print(f"rank {rank}: loaded {x_all.shape[0]} samples of dim {x_all.shape[1]} from {split}/shard_{rank}.pt", flush=True)
    assert x_all.shape[1] == D, f"rank {rank}: data has {x_all.shape[1]} dims after dropping constant columns, flow expects {D}"
    x_train, x_eval = x_all[:-EVAL_N], x_all[-EVAL_N:]

    mask_width = D + 1 if a.fault == "maskwidth" else D
    flow = RealNVP(D, cfg["flow_steps"], cfg["hidden"], mask_width)
    ck = "flow_init_v0.pt" if (a.fault == "ckptkeys" and bad) else "flow_init.pt"
    flow.load_state_dict(torch.load(os.path.join(WORK, "ckpt", ck)))
    if a.fault == "logdet" and bad:
        for c in flow.couplings:
            c.scale_mult = 1000.0
    if a.fault == "singular" and bad:
        perm = [(D - 1 - i) % (D - 1) for i in range(D)]
        flow.mixes[1].weight.data = torch.eye(D)[perm]
        print(f"rank {rank}: mixing layer 1 set to a channel-reversal permutation", flush=True)
    for k, m in enumerate(flow.mixes):
        inv = torch.linalg.inv(m.weight.detach())
        err = (inv @ m.weight.detach() - torch.eye(D)).abs().max().item()
        if err > 1e-3:
            raise RuntimeError(f"rank {rank}: mixing layer {k} inverse check failed (err {err:.3g})")
    print(f"rank {rank}: flow with {len(flow.couplings)} coupling steps, mixing layers invertible", flush=True)

    model = DDP(flow) if a.ddp else flow
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    for step in range(a.steps):
        idx = torch.randint(0, x_train.shape[0], (cfg["batch"],))
        if step == 1 and a.fault == "exit2" and bad:
            n_bad = 3
            print(f"ERROR rank {rank}: {n_bad} rows of shard_{rank}.pt have NaN coordinates; refusing to train on a corrupt shard", file=sys.stderr, flush=True)
            os._exit(2)
        lp, logdet = log_prob(model, x_train[idx])
        if not torch.isfinite(logdet).all():
            raise FloatingPointError(f"rank {rank}: log-det is {logdet[~torch.isfinite(logdet)][0].item()} at step {step}; the coupling scales overflowed")
        nll = -lp.mean()
        opt.zero_grad()
        nll.backward()
        if not a.ddp:
            for p in flow.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if step == 2 and a.fault == "plot" and bad:
            print(f"rank {rank}: sampling 100000 points for the density plot", flush=True)
            with torch.no_grad():
                pts = flow.sample(100000)
            time.sleep(a.stall)
            print(f"rank {rank}: plot written ({pts.shape[0]} points)", flush=True)
        t = torch.tensor([nll.item()])
        dist.all_reduce(t)
        t /= world
        print(f"rank {rank} step {step} loss {t.item():.4f} bpd {t.item() / (D * math.log(2)):.4f}", flush=True)
        if step == 2 and a.fault == "segv" and bad:
            os.kill(os.getpid(), signal.SIGSEGV)

    with torch.no_grad():
        ll, _ = log_prob(flow, x_eval)
        if a.fault == "lllen" and bad:
            ll = torch.cat([ll, log_prob(flow, x_train[:1])[0]])
        gathered = [torch.zeros(EVAL_N) for _ in range(world)]
        dist.all_gather(gathered, ll)
        tot = torch.tensor([-ll.sum().item(), float(ll.numel())])
        dist.all_reduce(tot)
    nll_eval = tot[0].item() / tot[1].item()
    if rank == 0:
        os.makedirs(os.path.join(WORK, "out"), exist_ok=True)
        torch.save(flow.state_dict(), os.path.join(WORK, "out", "flow_final.pt"))
        print(f"rank 0: eval NLL {nll_eval:.4f} bpd {nll_eval / (D * math.log(2)):.4f} over {int(tot[1].item())} samples; "
              f"saved flow to {WORK}/out/flow_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
    else:
        train(a)

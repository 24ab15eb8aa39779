"""A hundred-and-seventy-third hand-run batch: PROBABILISTIC FORECASTING WITH MIXTURE DENSITY NETWORKS.

Every rank writes its synthetic seasonal series (series/series_rR.npy: a daily sine plus a trend plus noise,
--length points) and reads it back, cuts it into windows of --window past values and the next value, and
trains a small MLP that outputs the parameters of a Gaussian mixture (K logits, K means, K log-scales) over
the next value.  The loss is the negative log-likelihood of torch.distributions.MixtureSameFamily of Normals
(argument validation on).  Training runs under DDP on gloo (or --ddp 0: gradients all-reduced by hand); each
step the NLL, the MAE of the mixture mean and a CRPS-like sample score are all_reduced; at the end rank 0
saves --save.

Faults:
  zeroscale     - rank N reads log_scale_offset -1000 and no log-scale floor; scale exp() is 0 (ValueError)
  ncomp         - every rank builds the logits head with n_components+1 outputs (MixtureSameFamily ValueError)
  nanloss       - rank N uses lr 1e12 (a typo'd config); the params blow up and the program's check raises
  seriesmissing - rank N reads its series from a node-local dir that was never synced (FileNotFoundError)
  window        - rank N's window (64) is longer than its series (48): no windows (the program's ValueError)
  metriclen     - rank N all_reduces its metric sums with an extra entry (length 4 against 3)
  seasonal      - rank N recomputes seasonal features for a long time before the first all_reduce
  ckptcomp      - rank N resumes a checkpoint saved with 5 mixture components into a 3-component model
  horizon       - rank N reads MDN_HORIZON="24h" from its environment; int() raises ValueError
  gaps          - rank N prints its own 'series has gaps' error line and exits with code 1
  sigterm       - rank N sends SIGTERM to itself at step 2
  none          - control, clean run

What happened (filled in after the runs):
  zeroscale     - Normal's scale-validation ValueError (GreaterThan(lower_bound=0.0)) on rank N; peers Connection closed
  ncomp         - MixtureSameFamily ValueError `mixture_distribution component` (4) != 3 on every rank
  nanloss       - program's FloatingPointError 'NLL is inf at step 2' on rank N (DETAIL run: rank 0 monitoredBarrier)
  seriesmissing - FileNotFoundError series_local/series_rN.npy on rank N (redirects run: only in stderr.log)
  window        - program's ValueError 'no training windows: window 64 + horizon 1 > series length 48' on rank N
  metriclen     - no size error: both shown ranks 'Timed out waiting 12000ms for send' in the metric all_reduce
  seasonal      - peers time out after 12 s (send/recv), rank N SIGTERMed; PG 300 s run killed by timeout 60 (124)
  ckptcomp      - load_state_dict RuntimeError: size mismatch for logit_head/param_head (5 vs 3 components)
  horizon       - ValueError invalid literal for int() '24h' on rank N; restart attempt dies in connectFullMesh
  gaps          - rank N's 'ERROR rank N: series has gaps' line, exit 1, no traceback
  sigterm       - rank N exitcode -15 (SIGTERM) at step 2; peers Connection closed by peer
  none          - clean, exit 0, rank 0 saved ckpt/mdn.pt
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions import Categorical, MixtureSameFamily, Normal
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--components", type=int, default=3)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--length", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--sleep", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--workdir", default="/tmp/fault173_work")
    p.add_argument("--save", default="ckpt/mdn.pt")
    p.add_argument("--resume", default="")
    return p.parse_args()


class MDN(nn.Module):
    def __init__(self, window, hidden, cfg):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(window, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.logit_head = nn.Linear(hidden, cfg["n_logits"])
        self.param_head = nn.Linear(hidden, 2 * cfg["n_components"])
        self.offset, self.floor = cfg["log_scale_offset"], float(cfg["log_scale_floor"])

    def forward(self, x):
        h = self.body(x)
        mu, log_s = self.param_head(h).chunk(2, dim=-1)
        return self.logit_head(h), mu, (log_s + self.offset).clamp(min=self.floor, max=7.0)


def mixture(logits, mu, log_s):
    comp = Normal(mu, torch.exp(log_s), validate_args=True)
    return MixtureSameFamily(Categorical(logits=logits, validate_args=True), comp, validate_args=True)


def make_series(rank, path, length):
    g = np.random.default_rng(300 + rank)
    t = np.arange(length)
    y = np.sin(2 * np.pi * t / 24) + 0.01 * t + 0.2 * g.normal(size=length)
    np.save(path, np.stack([t, y], axis=1).astype(np.float32))


def seasonal_features(y, period, rounds):
    out = y
    for _ in range(rounds):
        out = np.convolve(out, np.ones(period) / period, mode="same")
    return out


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    for d in ("series", "ckpt", "config"):
        os.makedirs(os.path.join(a.workdir, d), exist_ok=True)
    cfg = {"n_components": a.components, "n_logits": a.components, "log_scale_offset": 0.0,
           "log_scale_floor": -7.0, "lr": a.lr,
           "window": a.window}
    if bad and a.fault == "zeroscale":
        cfg["log_scale_offset"], cfg["log_scale_floor"] = -1000.0, "-inf"
    if bad and a.fault == "ncomp":
        cfg["n_logits"] = a.components + 1
    if bad and a.fault == "nanloss":
        cfg["lr"] = 1e12
    if bad and a.fault == "window":
        cfg["window"] = 64
    cfg_path = os.path.join(a.workdir, "config", f"mdn_r{rank}.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    if bad and a.fault == "horizon":
        os.environ["MDN_HORIZON"] = "24h"
    horizon = int(os.environ.get("MDN_HORIZON", "1"))
    series_dir = os.path.join(a.workdir, "series")
    make_series(rank, os.path.join(series_dir, f"series_r{rank}.npy"), a.length)
    if bad and a.fault == "seriesmissing":
        series_dir = os.path.join(a.workdir, "series_local")
    arr = np.load(os.path.join(series_dir, f"series_r{rank}.npy"))
    t, y = arr[:, 0], arr[:, 1]
    if bad and a.fault == "gaps":
        print(f"ERROR rank {rank}: series has gaps: 7 missing timestamps between t={int(t[17])} and t={int(t[25])}"
              f" in series_r{rank}.npy; refusing to interpolate", flush=True)
        sys.exit(1)
    w = cfg["window"]
    n = len(y) - w - horizon + 1
    if n <= 0:
        raise ValueError(f"no training windows: window {w} + horizon {horizon} > series length {len(y)} "
                         f"(series_r{rank}.npy)")
    X = torch.tensor(np.stack([y[i:i + w] for i in range(n)]))
    Y = torch.tensor(np.array([y[i + w + horizon - 1] for i in range(n)]))
    if bad and a.fault == "seasonal":
        print(f"rank {rank} recomputing seasonal features (period 24)", flush=True)
        deadline = time.time() + a.sleep
        while time.time() < deadline:
            seasonal_features(y, 24, 50)
            time.sleep(0.05)
    model = MDN(w, a.hidden, cfg)
    if bad and a.fault == "ckptcomp":
        old = MDN(w, a.hidden, dict(cfg, n_components=5, n_logits=5))
        torch.save(old.state_dict(), os.path.join(a.workdir, f"ckpt/mdn_k5_r{rank}.pt"))
        a.resume = os.path.join(a.workdir, f"ckpt/mdn_k5_r{rank}.pt")
    if a.resume:
        model.load_state_dict(torch.load(a.resume, map_location="cpu"))
        print(f"rank {rank} resumed from {a.resume}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    print(f"rank {rank}/{world} K={cfg['n_components']} window={w} horizon={horizon} windows={n} lr={cfg['lr']}",
          flush=True)
    for step in range(a.steps):
        logits, mu, log_s = net(X)
        if not (torch.isfinite(logits).all() and torch.isfinite(mu).all() and torch.isfinite(log_s).all()):
            raise FloatingPointError(f"NLL is nan at step {step} (rank {rank}): non-finite mixture parameters, "
                                     f"max |mu| = {float(mu.detach().abs().nan_to_num(float('inf')).max()):.3e}")
        dist_ = mixture(logits, mu, log_s)
        loss = -dist_.log_prob(Y).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"NLL is {loss.item()} at step {step} (rank {rank})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "sigterm" and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        with torch.no_grad():
            mean = dist_.mean
            samples = dist_.sample((16,))
            crps = (samples - Y).abs().mean() - 0.5 * (samples[:8] - samples[8:]).abs().mean()
            metrics = torch.tensor([loss.item(), float((mean - Y).abs().mean()), float(crps)])
        if bad and a.fault == "metriclen":
            metrics = torch.cat([metrics, torch.tensor([float(n)])])
        dist.all_reduce(metrics)
        print(f"rank {rank} step {step} loss {loss.item():.4f} nll {metrics[0] / world:.4f} "
              f"mae {metrics[1] / world:.4f} crps {metrics[2] / world:.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.workdir, a.save))
        print(f"saved {a.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

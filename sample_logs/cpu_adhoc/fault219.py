"""A two-hundred-and-nineteenth hand-run batch: KOLMOGOROV-ARNOLD NETWORK FOR SYMBOLIC REGRESSION. A small KAN
(2 -> 4 -> 1) with a learnable B-spline activation on every edge (grid size, spline order and grid range read from a
per-rank JSON config) fits a synthetic formula read from per-rank formula shard files; gradients are all_reduced by
hand, the grid is refined (5 -> 10 intervals, coefficients refitted by least squares) at step 4, the refined
coefficients are all_gathered for a consistency check, the RMSE is all_reduced every step, rank 0 checkpoints every
other step, each rank reloads the best checkpoint at the end, small edges are pruned and a final RMSE is all_reduced.

Faults:
- grid: the config's grid_size is 2 with spline order 3 on --rank (-1 every rank); the program raises ValueError.
- formula: --rank opens its formula shard with the wrong extension (.txt instead of .json): FileNotFoundError.
- outgrid: after refinement --rank samples inputs on [-2.5, 2.5], outside the spline grid; basis sums are 0, NaN.
- var: --rank names its inputs from x0 instead of x1, so the formula's x2 is missing (KeyError).
- gather: --rank refines its grid to 11 intervals instead of 10; the all_gathered coefficients have another length.
- ckpt: --rank reloads the step-3 checkpoint, saved before the grid refinement (size mismatch in load_state_dict).
- prune: the pruning threshold is 100.0 on --rank (-1 every rank); every edge is pruned and the program raises.
- plot: --rank plots every edge activation for --slow-s seconds before the RMSE all_reduce; the others time out.
- abort: --rank sends itself SIGABRT after step 2.
- exit6: --rank logs an error about symbolic snapping at step 5 and calls os._exit(6).
- zerodiv: --rank's grid_range is [-1.0, -1.0] (zero width); 1.0 / h raises ZeroDivisionError.
- none: control.

What happened (filled in after the runs):
- grid: every rank ValueError 'grid_size=2 gives 3 grid points, too few for B-splines of order k=3' at model build (np4).
- formula: rank N FileNotFoundError on /tmp/job_work/formulas/shardNN.txt; peers Connection closed in the broadcast (np4 r2, np3 r0).
- outgrid: rank N FloatingPointError 'KAN output has 39/64 non-finite values at step 4 (grid 10 intervals)' (np3 r1, np5 r3).
- var: rank N KeyError 'x2' in target() at step 0; peers Connection closed in all_reduce (np4 r1, spawn np3 r2).
- gather: a peer aborts on gloo EnforceNotMet '336 vs 312 ... size mismatch' in all_gather; others Connection reset (np4 r2).
- ckpt: rank N RuntimeError loading state_dict: size mismatch for layers.0.coef [4, 2, 8] vs [4, 2, 13] (np3 r1, np4 r3).
- prune: every rank RuntimeError 'pruning at threshold 100.0 removed all 8 edges of layer 0' after 8 steps (np3).
- plot: PG 12 s: peers 'Timed out waiting 12000ms' in the RMSE all_reduce (np4 r1); PG 300 s under timeout 60: exit 124.
- abort: rank N exitcode -6 (SIGABRT) after step 2; peers Connection reset/closed by peer (np4 r2 pdsh2, np3 r1).
- exit6: rank N prints 'ERROR rank N: symbolic snapping of edge ... giving up' and exits 6; peers Connection closed.
- zerodiv: rank N ZeroDivisionError 'float division by zero' at inv_h = 1.0 / h while building the grid (spawn np4 r3).
- none: exit 0; rank 0 prints 'symbolic regression done: final rmse ..., kept 8/8 edges'.
"""
import argparse
import json
import logging
import math
import os
import re
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault219_work"
FORMULA = "sin(pi*x1) + x2**2"
FUNCS = {"sin": torch.sin, "exp": torch.exp, "tanh": torch.tanh, "pi": math.pi}
LOG = None


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    a, _ = p.parse_known_args()
    return a


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def out(msg, err=False):
    if LOG is not None:
        (LOG.error if err else LOG.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def make_grid(lo, hi, G, k):
    if G < k:
        raise ValueError(f"grid_size={G} gives {G + 1} grid points, too few for B-splines of order k={k}")
    h = (hi - lo) / G
    inv_h = 1.0 / h
    return torch.linspace(lo - k * h, hi + k * h, G + 2 * k + 1), inv_h


def bspline_basis(x, t, k):
    x = x.unsqueeze(-1)
    B = ((x >= t[:-1]) & (x < t[1:])).to(x.dtype)
    for p in range(1, k + 1):
        left = (x - t[:-(p + 1)]) / (t[p:-1] - t[:-(p + 1)]) * B[..., :-1]
        right = (t[p + 1:] - x) / (t[p + 1:] - t[1:-p]) * B[..., 1:]
        B = left + right
    return B / B.sum(-1, keepdim=True)  # partition of unity


class KANLayer(nn.Module):
    def __init__(self, d_in, d_out, G, k, lo, hi):
        super().__init__()
        self.k, self.lo, self.hi, self.G = k, lo, hi, G
        t, self.inv_h = make_grid(lo, hi, G, k)
        self.register_buffer("grid", t)
        self.coef = nn.Parameter(torch.randn(d_out, d_in, G + k) * 0.1)
        self.base = nn.Parameter(torch.randn(d_out, d_in) * 0.3)

    def edges(self, x):
        B = bspline_basis(x, self.grid, self.k)
        return torch.einsum("nib,oib->noi", B, self.coef) + self.base * F.silu(x).unsqueeze(1)

    def forward(self, x):
        return self.edges(x).sum(-1)

    @torch.no_grad()
    def refine(self, G2):
        d_out, d_in, _ = self.coef.shape
        xs = torch.linspace(self.lo, self.hi, 64).unsqueeze(1).expand(64, d_in)
        t2, inv_h2 = make_grid(self.lo, self.hi, G2, self.k)
        B_old = bspline_basis(xs, self.grid, self.k)
        B_new = bspline_basis(xs, t2, self.k)
        new = torch.empty(d_out, d_in, G2 + self.k)
        for i in range(d_in):
            y = B_old[:, i, :] @ self.coef[:, i, :].T
            new[:, i, :] = torch.linalg.lstsq(B_new[:, i, :], y).solution.T
        self.grid, self.inv_h, self.G = t2, inv_h2, G2
        self.coef = nn.Parameter(new)


class KAN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        lo, hi = cfg["grid_range"]
        self.layers = nn.ModuleList([KANLayer(2, 4, cfg["grid_size"], cfg["spline_order"], lo, hi),
                                     KANLayer(4, 1, cfg["grid_size"], cfg["spline_order"], lo, hi)])

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x))).squeeze(-1)


def load_config(a, r):
    cfg = {"grid_size": 5, "spline_order": 3, "grid_range": [-1.0, 1.0], "x_range_after_refine": [-1.0, 1.0],
           "refine_at": 4, "lr": 0.02, "batch": 64, "prune_threshold": 0.01, "best_step": 7}
    hit = a.rank in (-1, r)
    if a.fault == "grid" and hit:
        cfg["grid_size"] = 2
    if a.fault == "zerodiv" and hit:
        cfg["grid_range"] = [-1.0, -1.0]
    if a.fault == "outgrid" and hit:
        cfg["x_range_after_refine"] = [-2.5, 2.5]
    if a.fault == "prune" and hit:
        cfg["prune_threshold"] = 100.0
    if a.fault == "ckpt" and hit:
        cfg["best_step"] = 3
    os.makedirs(f"{WORK}/cfg", exist_ok=True)
    path = f"{WORK}/cfg/kan_rank{r}.json"
    with open(path, "w") as f:
        json.dump(cfg, f)
    with open(path) as f:
        return json.load(f)


def target(expr, x, names):
    inputs = {n: x[:, j] for j, n in enumerate(names)}
    ns = dict(FUNCS)
    for v in sorted(set(re.findall(r"\bx\d+\b", expr))):
        ns[v] = inputs[v]
    return eval(expr, {"__builtins__": {}}, ns)


def main(a):
    global LOG
    r, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.logfmt:
        LOG = logging.getLogger("kan")
        h = logging.StreamHandler(sys.stdout)
        h.addFilter(RankFilter(r))
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        LOG.addHandler(h)
        LOG.setLevel(logging.INFO)
        LOG.propagate = False
    hit = a.rank in (-1, r)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    cfg = load_config(a, r)
    if r == 0:
        os.makedirs(f"{WORK}/formulas", exist_ok=True)
        for i in range(W):
            with open(f"{WORK}/formulas/shard{i:02d}.json", "w") as f:
                json.dump({"formula": FORMULA, "seed": 100 + i, "n_vars": 2}, f)
    dist.barrier()
    ext = "txt" if (a.fault == "formula" and hit) else "json"
    with open(f"{WORK}/formulas/shard{r:02d}.{ext}") as f:
        shard = json.load(f)
    names = [f"x{j + (0 if (a.fault == 'var' and hit) else 1)}" for j in range(shard["n_vars"])]
    torch.manual_seed(0)
    model = KAN(cfg)
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(shard["seed"])
    out(f"rank {r}/{W} fitting '{shard['formula']}' with KAN [2, 4, 1], grid {cfg['grid_size']}, k={cfg['spline_order']}")
    for step in range(a.steps):
        lo, hi = -1.0, 1.0
        if step == cfg["refine_at"]:
            G2 = 2 * cfg["grid_size"] + (1 if (a.fault == "gather" and hit) else 0)
            for layer in model.layers:
                layer.refine(G2)
            opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
            flat = torch.cat([l.coef.detach().flatten() for l in model.layers])
            got = [torch.empty_like(flat) for _ in range(W)]
            dist.all_gather(got, flat)
            drift = max((g - got[0]).abs().max().item() for g in got)
            out(f"rank {r} refined grid {cfg['grid_size']} -> {G2} intervals; max coefficient drift across ranks {drift:.2e}")
        if step >= cfg["refine_at"]:
            lo, hi = cfg["x_range_after_refine"]
        x = lo + (hi - lo) * torch.rand(cfg["batch"], 2, generator=gen)
        y = target(shard["formula"], x, names)
        pred = model(x)
        if not torch.isfinite(pred).all():
            n = int((~torch.isfinite(pred)).sum())
            raise FloatingPointError(f"KAN output has {n}/{pred.numel()} non-finite values at step {step} "
                                     f"(grid {model.layers[0].G} intervals)")
        loss = F.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= W
        opt.step()
        if a.fault == "exit6" and hit and step == 5:
            out(f"ERROR rank {r}: symbolic snapping of edge (0,{r % 2},0) found no candidate with r2 > 0.90; giving up", True)
            os._exit(6)
        if a.fault == "plot" and hit and step == 5:
            out(f"rank {r}: plotting all 12 edge activations to {WORK}/activations_step{step}/ ...")
            time.sleep(a.slow_s)
        rmse = loss.detach().sqrt().reshape(1)
        dist.all_reduce(rmse)
        out(f"rank {r} step {step} loss {loss.item():.4f} rmse(all) {rmse.item() / W:.4f}")
        if r == 0 and step % 2 == 1:
            torch.save(model.state_dict(), f"{WORK}/kan_step{step}.pt")
        if a.fault == "abort" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
    dist.barrier()
    model.load_state_dict(torch.load(f"{WORK}/kan_step{cfg['best_step']}.pt"))
    with torch.no_grad():
        xe = -1 + 2 * torch.rand(256, 2, generator=gen)
        imp = model.layers[0].edges(xe).abs().mean(0)
        keep = imp > cfg["prune_threshold"]
        if not keep.any():
            raise RuntimeError(f"pruning at threshold {cfg['prune_threshold']} removed all {keep.numel()} edges "
                               f"of layer 0; nothing left to fit '{shard['formula']}'")
        model.layers[0].coef.mul_(keep.unsqueeze(-1))
        model.layers[0].base.mul_(keep)
        err = (F.mse_loss(model(xe), target(shard["formula"], xe, names)).sqrt()).reshape(1)
    dist.all_reduce(err)
    if r == 0:
        out(f"symbolic regression done: final rmse {err.item() / W:.4f}, kept {int(keep.sum())}/{keep.numel()} edges")
    dist.destroy_process_group()


def spawned(i, n, a):
    os.environ.update(RANK=str(i), WORLD_SIZE=str(n), LOCAL_RANK=str(i))
    main(a)


if __name__ == "__main__":
    args = parse()
    if args.spawn:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        mp.spawn(spawned, args=(args.spawn, args), nprocs=args.spawn)
    else:
        main(args)

"""A hundred-and-eighty-third hand-run batch: DIFFERENTIABLE ARCHITECTURE SEARCH (DARTS-STYLE).

A tiny supernet of cells; every cell has a chain of edges and every edge is a mixed operation over the candidate
ops of the search space (identity, linear, relu_linear, tanh_linear, zero), weighted by the softmax of the
architecture parameters (alphas, shape [edges, ops], divided by a temperature).  Bilevel optimisation: the network
weights step on the train split (SGD, under DDP on gloo, or --ddp 0: gradients all-reduced by hand), the alphas
step on the val split with a second optimizer (Adam) and are all_reduced by hand (they are not in DDP).  Every
rank reads its search config (cfg/search_rR.json), warm-starts from a supernet export (ckpt/supernet_c2.pt, written
by rank 0) and an initial genotype (genotype_init.json); rank 0 prints the chosen genotype each epoch and saves it.

Faults:
  alphashape - every rank's config counts 6 candidate ops while the space has 5; alphas [E,6] vs 5 op outputs
  opmissing  - rank N's config lists a candidate op "sep_conv_5x5" that the op registry does not have (KeyError)
  alphanan   - rank N's temperature decay is 0.0; at epoch 1 alphas/tau are inf, the weights NaN (program check)
  valempty   - rank N's val fraction is 0.0; the train/val pairing generator raises StopIteration (RuntimeError)
  alphalen   - rank N all_reduces its alphas together with a second (reduce-cell) copy; another length
  slowval    - rank N evaluates the derived genotype on the whole val set before the alpha all_reduce (late)
  genotype   - every rank warm-starts from a genotype file of another search space (ValueError not in list)
  ckptcells  - rank N resumes the 3-cell supernet export into a 2-cell supernet (unexpected keys)
  cfgmissing - rank N reads its search config from a node-local dir that was never written (FileNotFoundError)
  sigkill    - rank N sends itself SIGKILL at epoch 1 step 1
  exit2      - rank N prints an error line about a collapsed genotype at epoch 1 and exits with code 2
  none       - control, clean run

What happened (filled in after the runs):
  alphashape - RuntimeError size of tensor a (6) must match b (5) in MixedOp.forward on every rank (np3 tee, np4 pymodule)
  opmissing  - KeyError 'sep_conv_5x5' in MixedOp.__init__ on rank 2 (np4 plain) and rank 1 (np3 tee trainer)
  alphanan   - FloatingPointError weights not finite at epoch 1 (tau=0.0) on rank 1 (np4 prefix), rank 2 (np3 detail, SIGABRT)
  valempty   - RuntimeError generator raised StopIteration on rank 1 (np3 loglevel), rank 3 (np5 redirects)
  alphalen   - gloo enforce 'Received data size doesn't match' aborts a peer (SIGABRT): np3 r1 filter, np4 r2 tee
  slowval    - np3 r1: peers gloo Timed out 12000ms, Root Cause rank 0; np4 r2 PG 300 s: killed by timeout 60, exit 124
  genotype   - ValueError 'nor_conv_3x3' is not in list on every rank (np4 wrapper)
  ckptcells  - Unexpected key(s) cells.2.* in load_state_dict on rank 3 (np4 pdsh2) and rank 2 (np3 restart)
  cfgmissing - FileNotFoundError node_cfg/search_r2.json on rank 2 (np3 plain)
  sigkill    - rank 3 exitcode -9, Root Cause Signal 9 (SIGKILL) (np4 tee)
  exit2      - ERROR genotype collapsed line, exitcode 2 on rank 2 (np3 prefix) and rank 1 (np4 tee trainer)
  none       - clean, exit 0, rank 0 saved genotype_final.json (np3 plain)
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

PRIMITIVES = ["zero", "identity", "linear", "relu_linear", "tanh_linear"]
OPS = {
    "zero": lambda d: Zero(),
    "identity": lambda d: nn.Identity(),
    "linear": lambda d: nn.Linear(d, d),
    "relu_linear": lambda d: nn.Sequential(nn.ReLU(), nn.Linear(d, d)),
    "tanh_linear": lambda d: nn.Sequential(nn.Tanh(), nn.Linear(d, d)),
}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cells", type=int, default=2)
    p.add_argument("--edges", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--val-batches", type=int, default=600)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--workdir", default="/tmp/fault183_work")
    return p.parse_args()


class Zero(nn.Module):
    def forward(self, x):
        return x * 0.0


class MixedOp(nn.Module):
    def __init__(self, names, d):
        super().__init__()
        self.ops = nn.ModuleList([OPS[n](d) for n in names])

    def forward(self, x, w):
        out = torch.stack([op(x) for op in self.ops])
        return (w[:, None, None] * out).sum(0)


class Supernet(nn.Module):
    def __init__(self, names, d, cells, edges):
        super().__init__()
        self.stem = nn.Linear(8, d)
        self.cells = nn.ModuleList([nn.ModuleList([MixedOp(names, d) for _ in range(edges)]) for _ in range(cells)])
        self.head = nn.Linear(d, 4)

    def forward(self, x, weights):
        h = self.stem(x)
        k = 0
        for cell in self.cells:
            for edge in cell:
                h = h + edge(h, weights[k])
                k += 1
        return self.head(h)


def paired(train, val):
    val_it = iter(val)
    for xb, yb in train:
        vx, vy = next(val_it)
        yield xb, yb, vx, vy


def genotype(alphas, names):
    return [names[1 + int(a[1:].argmax())] for a in alphas]


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    for d in ("cfg", "ckpt"):
        os.makedirs(os.path.join(a.workdir, d), exist_ok=True)
    cfg = {"primitives": PRIMITIVES, "n_ops": len(PRIMITIVES), "w_lr": 0.05, "arch_lr": 3e-3, "tau0": 1.0,
           "tau_decay": 0.7, "val_frac": 0.5, "resume": "ckpt/supernet_c2.pt", "genotype_init": "genotype_init.json"}
    if bad and a.fault == "alphashape":
        cfg["n_ops"] = len(PRIMITIVES) + 1
    if bad and a.fault == "opmissing":
        cfg["primitives"] = PRIMITIVES[:4] + ["sep_conv_5x5"]
    if bad and a.fault == "alphanan":
        cfg["tau_decay"] = 0.0
    if bad and a.fault == "valempty":
        cfg["val_frac"] = 0.0
    if bad and a.fault == "ckptcells":
        cfg["resume"] = "ckpt/supernet_c3.pt"
    if bad and a.fault == "genotype":
        cfg["genotype_init"] = "genotype_nb201.json"
    cfg_path = os.path.join(a.workdir, "cfg", f"search_r{rank}.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    if bad and a.fault == "cfgmissing":
        cfg_path = os.path.join(a.workdir, "node_cfg", f"search_r{rank}.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    names = cfg["primitives"]
    n_edges = a.cells * a.edges
    if rank == 0:
        torch.save(Supernet(PRIMITIVES, a.dim, 2, a.edges).state_dict(), os.path.join(a.workdir, "ckpt/supernet_c2.pt"))
        torch.save(Supernet(PRIMITIVES, a.dim, 3, a.edges).state_dict(), os.path.join(a.workdir, "ckpt/supernet_c3.pt"))
        with open(os.path.join(a.workdir, "genotype_init.json"), "w") as fh:
            json.dump(["linear"] * n_edges, fh)
        with open(os.path.join(a.workdir, "genotype_nb201.json"), "w") as fh:
            json.dump(["nor_conv_3x3", "skip_connect", "avg_pool_3x3", "nor_conv_1x1"], fh)
    dist.barrier()
    model = Supernet(names, a.dim, a.cells, a.edges)
    model.load_state_dict(torch.load(os.path.join(a.workdir, cfg["resume"]), map_location="cpu"))
    with open(os.path.join(a.workdir, cfg["genotype_init"])) as fh:
        init = json.load(fh)
    alphas = torch.zeros(n_edges, cfg["n_ops"])
    for e, op in enumerate(init):
        alphas[e, PRIMITIVES.index(op)] = 0.5
    alphas = nn.Parameter(alphas)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    w_opt = torch.optim.SGD(model.parameters(), lr=cfg["w_lr"], momentum=0.9)
    a_opt = torch.optim.Adam([alphas], lr=cfg["arch_lr"], betas=(0.5, 0.999))
    g = torch.Generator().manual_seed(100 + rank)
    teacher = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    n = a.batch * a.steps * 2
    x = torch.randn(n, 8, generator=g)
    y = (x @ teacher).argmax(1)
    n_val = int(n * cfg["val_frac"])
    tr = [(x[i:i + a.batch], y[i:i + a.batch]) for i in range(n_val, n, a.batch)][:a.steps]
    va = [(x[i:i + a.batch], y[i:i + a.batch]) for i in range(0, n_val, a.batch)]
    print(f"rank {rank}/{world} supernet cells={a.cells} edges={n_edges} ops={len(names)} train={len(tr)} val={len(va)}", flush=True)
    lossf = nn.CrossEntropyLoss()
    for epoch in range(a.epochs):
        tau = cfg["tau0"] * cfg["tau_decay"] ** epoch
        for step, (xb, yb, vx, vy) in enumerate(paired(tr, va)):
            w = torch.softmax(alphas / tau, dim=-1)
            if not torch.isfinite(w).all():
                raise FloatingPointError(f"architecture weights are not finite at epoch {epoch} step {step} (tau={tau})")
            a_opt.zero_grad()
            vloss = lossf(net(vx, w), vy)
            vloss.backward()
            a_opt.step()
            w_opt.zero_grad()
            loss = lossf(net(xb, torch.softmax(alphas / tau, dim=-1).detach()), yb)
            loss.backward()
            if not a.ddp:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            w_opt.step()
            if bad and a.fault == "sigkill" and epoch == 1 and step == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if bad and a.fault == "slowval" and epoch == 1 and step == 1:
                print(f"rank {rank} evaluating derived genotype on the full val split ({a.val_batches} batches)", flush=True)
                with torch.no_grad():
                    for _ in range(a.val_batches):
                        net(vx, w)
                        time.sleep(0.05)
            buf = alphas.detach().flatten().clone()
            if bad and a.fault == "alphalen":
                buf = torch.cat([buf, alphas.detach().flatten()])
            dist.all_reduce(buf)
            alphas.data.copy_(buf[:alphas.numel()].view_as(alphas) / world)
            stats = torch.tensor([loss.item(), vloss.item()])
            dist.all_reduce(stats)
            print(f"rank {rank} epoch {epoch} step {step} loss {loss.item():.4f} val_loss {vloss.item():.4f} "
                  f"mean {stats[0] / world:.4f}/{stats[1] / world:.4f}", flush=True)
        geno = genotype(alphas.detach(), PRIMITIVES)
        if bad and a.fault == "exit2" and epoch == 1:
            print(f"ERROR rank {rank}: genotype collapsed to a single op ({geno[0]}) on {n_edges}/{n_edges} edges "
                  f"after epoch {epoch}; aborting the search", flush=True)
            sys.exit(2)
        if rank == 0:
            print(f"epoch {epoch} tau {tau:.3f} genotype {geno}", flush=True)
    if rank == 0:
        with open(os.path.join(a.workdir, "genotype_final.json"), "w") as fh:
            json.dump(genotype(alphas.detach(), PRIMITIVES), fh)
        print("saved genotype_final.json", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

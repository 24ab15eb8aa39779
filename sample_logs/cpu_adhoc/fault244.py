"""A two-hundred-and-forty-fourth hand-run batch: EQUIVARIANT MESSAGE PASSING FOR MOLECULAR FORCES (A SMALL SCHNET-LIKE MODEL).

A SchNet-like model on synthetic molecules: every rank loads its conformer shard (data/conf_train_rR.pt: element
symbols and 3-D positions of 8 six-atom molecules), maps the symbols to atomic numbers, expands interatomic
distances in Gaussian radial basis functions under a cosine cutoff (SCHN_CUTOFF), and runs two continuous-filter
convolutions.  The energy is a sum of atomwise outputs; forces are the negative gradient of the energy with
respect to the positions (autograd, create_graph).  Parameters come from ckpt/schnet_init.pt and are broadcast
from rank 0; gradients are all_reduced by hand; per-molecule atom counts are all_gathered; at the end the force
MAE is all_reduced and rank 0 saves the model.  --spawn N runs the ranks with torch.multiprocessing.spawn,
--logfmt 1 logs through Python logging with the rank in the format.  Run once with --prepare to write the files.

Faults:
  zerodist  - rank N's shard has two atoms of molecule 5 at the same position: zero distance, NaN force (check)
  natoms    - rank N all_gathers its per-molecule atom counts with one extra entry (gloo size mismatch)
  nofile    - rank N reads its conformers from the train_dedup split, whose shard does not exist
  zbig      - rank N's shard holds a sulfur atom (Z=16), beyond the 10-row embedding table (IndexError)
  elem      - rank N's shard holds a chlorine atom, missing from the element map (KeyError)
  cutoff    - every rank: the cutoff default is the string "5.0 A" (ValueError in float())
  rbfckpt   - rank N loads ckpt/schnet_init_rbf32.pt, saved with 32 radial basis functions (size mismatch)
  allpairs  - rank N builds its neighbour list over every pair without a cutoff (--stall s) before the all_reduce
  segv      - rank N sends itself SIGSEGV after step 2
  exit3     - rank N prints its own neighbour-buffer overflow error line and calls os._exit(3)
  forcegrad - every rank: forces taken without create_graph, the loss backward hits the freed graph
  none      - control, clean run

What happened (filled in after the runs):
  zerodist  - rank N: its own check raised FloatingPointError non-finite forces (6 of 72 NaN) at step 1; peers closed
  natoms    - a peer (rank 3 / rank 2) aborted: gloo EnforceNotMet 36 vs 32 size mismatch, SIGABRT; others reset/closed
  nofile    - rank N: FileNotFoundError data/conf_train_dedup_rN.pt at startup; peers closed in the broadcast
  zbig      - rank N: IndexError index out of range in self in self.emb(z) at step 0 (spawn: ProcessRaisedException)
  elem      - rank N: KeyError 'Cl' while mapping symbols at startup; peers closed in the broadcast or SIGTERMed
  cutoff    - every rank: ValueError could not convert string to float: '5.0 A' before any step
  rbfckpt   - rank N: RuntimeError size mismatch for mu [32] vs [16] and the filter weights; peers closed
  allpairs  - rank N stalled: peers gloo Timed out waiting 12000ms in the all_reduce; with PG 300 s killed by timeout (124)
  segv      - rank N: SIGSEGV after step 2 (exitcode -11 / spawn ProcessExitedException); peers reset/closed
  exit3     - rank N printed its neighbour buffer overflow line at step 1 and exited 3; peers Connection closed by peer
  forcegrad - every rank: RuntimeError Trying to backward through the graph a second time at step 0
  none      - clean, exit 0, rank 0 printed the force MAE and saved schnet_final.pt
"""
import argparse
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

PERIODIC = {"H": 1, "C": 6, "N": 7, "O": 8, "F": 9, "S": 16}
SYMBOLS = ["C", "C", "O", "N", "H", "H"]
N_MOL, N_ATOM = 8, 6


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class CFConv(nn.Module):
    def __init__(self, n_rbf, feat):
        super().__init__()
        self.filt = nn.Sequential(nn.Linear(n_rbf, feat), nn.Tanh(), nn.Linear(feat, feat))
        self.lin_in = nn.Linear(feat, feat, bias=False)
        self.lin_out = nn.Sequential(nn.Linear(feat, feat), nn.Tanh(), nn.Linear(feat, feat))

    def forward(self, x, rbf, fcut):
        w = self.filt(rbf) * fcut.unsqueeze(-1)             # [B, n, n, F]
        h = self.lin_in(x)                                   # [B, n, F]
        msg = (w * h.unsqueeze(1)).sum(2)                    # sum over neighbours j
        return x + self.lin_out(msg)


class SchNet(nn.Module):
    def __init__(self, n_rbf=16, feat=32, max_z=10, cutoff=5.0):
        super().__init__()
        self.emb = nn.Embedding(max_z, feat)
        self.convs = nn.ModuleList([CFConv(n_rbf, feat) for _ in range(2)])
        self.out = nn.Sequential(nn.Linear(feat, feat // 2), nn.Tanh(), nn.Linear(feat // 2, 1))
        self.register_buffer("mu", torch.linspace(0.0, cutoff, n_rbf))
        self.gamma = 10.0 / cutoff
        self.cutoff = cutoff

    def forward(self, z, pos):
        n = pos.shape[1]
        eye = torch.eye(n, dtype=pos.dtype)
        diff = pos.unsqueeze(2) - pos.unsqueeze(1)
        d = torch.sqrt((diff ** 2).sum(-1) + eye)            # diagonal set to 1 before the sqrt
        rbf = torch.exp(-self.gamma * (d.unsqueeze(-1) - self.mu) ** 2)
        fcut = 0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0) * (d < self.cutoff) * (1 - eye)
        x = self.emb(z)
        for conv in self.convs:
            x = conv(x, rbf, fcut)
        return self.out(x).squeeze(-1).sum(1)                # energy per molecule


def reference(pos):
    r2 = ((pos.unsqueeze(2) - pos.unsqueeze(1)) ** 2).sum(-1)
    return (torch.exp(-r2) - 0.1 * torch.exp(-0.25 * r2)).sum((1, 2)) * 0.5


def prepare(a):
    os.makedirs("data", exist_ok=True)
    os.makedirs("ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for r in range(8):
        pos = torch.randn(N_MOL, N_ATOM, 3, generator=g) * 1.2
        torch.save({"symbols": [list(SYMBOLS) for _ in range(N_MOL)], "pos": pos}, f"data/conf_train_r{r}.pt")
    torch.manual_seed(0)
    torch.save(SchNet(n_rbf=16).state_dict(), "ckpt/schnet_init.pt")
    torch.save(SchNet(n_rbf=32).state_dict(), "ckpt/schnet_init_rbf32.pt")
    print("wrote data/conf_train_r0..7.pt, ckpt/schnet_init.pt, ckpt/schnet_init_rbf32.pt")


def train(rank, world, a):
    bad = a.rank in (rank, -1)
    if a.logfmt:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        h.addFilter(RankFilter(rank))
        logging.basicConfig(level=logging.INFO, handlers=[h])
    log = logging.getLogger("schnet")

    def say(msg, err=False):
        if a.logfmt:
            (log.error if err else log.info)(msg)
        else:
            print(msg, file=sys.stderr if err else sys.stdout, flush=True)

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    cfg = {"split": "train", "init": "ckpt/schnet_init.pt", "cutoff": "5.0", "create_graph": True}
    if bad and a.fault == "nofile":
        cfg["split"] = "train_dedup"
    if bad and a.fault == "rbfckpt":
        cfg["init"] = "ckpt/schnet_init_rbf32.pt"
    if a.fault == "cutoff":
        cfg["cutoff"] = "5.0 A"
    if a.fault == "forcegrad":
        cfg["create_graph"] = False
    cutoff = float(os.environ.get("SCHN_CUTOFF", cfg["cutoff"]))
    say(f"rank {rank}/{world} start: cutoff {cutoff} A, split {cfg['split']}")

    shard = torch.load(f"data/conf_{cfg['split']}_r{rank}.pt")
    symbols, pos_all = shard["symbols"], shard["pos"]
    if bad and a.fault == "zbig":
        symbols[3][5] = "S"
    if bad and a.fault == "elem":
        symbols[6][4] = "Cl"
    if bad and a.fault == "zerodist":
        pos_all[5, 4] = pos_all[5, 1]
    z_all = torch.tensor([[PERIODIC[s] for s in mol] for mol in symbols], dtype=torch.long)
    say(f"rank {rank} loaded {len(symbols)} conformers, {int(z_all.numel())} atoms")

    torch.manual_seed(0)
    model = SchNet(n_rbf=16, cutoff=cutoff)
    state = torch.load(cfg["init"])
    model.load_state_dict(state)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    counts = torch.full((len(symbols),), N_ATOM, dtype=torch.long)
    if bad and a.fault == "natoms":
        counts = torch.cat([counts, torch.tensor([N_ATOM])])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    say(f"rank {rank} atoms per rank {[int(c.sum()) for c in gathered]}")

    if bad and a.fault == "allpairs":
        flat = pos_all.reshape(-1, 3)
        pairs, t0 = [], time.time()
        for i in range(flat.shape[0]):
            for j in range(flat.shape[0]):
                if i != j:
                    pairs.append((i, j, float((flat[i] - flat[j]).norm())))
            time.sleep(a.stall / flat.shape[0])
        say(f"rank {rank} neighbour list: {len(pairs)} pairs in {time.time() - t0:.1f} s")

    mae_sum, n_f = torch.zeros(1), torch.zeros(1)
    for step in range(a.steps):
        idx = [(step * 4 + k) % N_MOL for k in range(4)]
        z, pos = z_all[idx], pos_all[idx].clone().requires_grad_(True)
        if bad and a.fault == "exit3" and step == 1:
            say(f"rank {rank}: neighbour buffer overflow: molecule {idx[2]} has 7 neighbours within "
                f"{cutoff} A, buffer holds 6; aborting", err=True)
            os._exit(3)
        e = model(z, pos)
        f = -torch.autograd.grad(e.sum(), pos, create_graph=cfg["create_graph"])[0]
        if not torch.isfinite(f).all():
            raise FloatingPointError(f"non-finite forces on rank {rank} at step {step}: "
                                     f"{int((~torch.isfinite(f)).sum())} of {f.numel()} components are NaN/inf")
        pos_ref = pos.detach().clone().requires_grad_(True)
        e_ref = reference(pos_ref)
        f_ref = -torch.autograd.grad(e_ref.sum(), pos_ref)[0]
        loss = ((e - e_ref.detach()) ** 2).mean() + 10.0 * ((f - f_ref) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        mae_sum += (f.detach() - f_ref).abs().sum()
        n_f += f.numel()
        say(f"rank {rank} step {step} loss {loss.item():.4f}")
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    dist.all_reduce(mae_sum)
    dist.all_reduce(n_f)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(a.out, "schnet_final.pt"))
        say(f"rank 0: force MAE {float(mae_sum / n_f):.4f} eV/A over {int(n_f)} components; "
            f"saved {os.path.join(a.out, 'schnet_final.pt')}")
    dist.destroy_process_group()


def spawned(rank, world, a):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    train(rank, world, a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", dest="pg_timeout", type=float, default=12.0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--out", default="/tmp/fault244_work/ckpt")
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare(a)
    if a.spawn:
        mp.spawn(spawned, args=(a.spawn, a), nprocs=a.spawn)
    else:
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

"""A two-hundred-and-ninety-fourth hand-run batch: RELATIONAL GNN FOR MOLECULE PROPERTY REGRESSION WITH EDGE TYPES.

Synthetic molecules as graphs: atoms carry an element symbol (looked up in an 8-entry atom table), a degree
and a charge; bonds carry a type (single, double, triple, aromatic = 4 relations).  Every rank reads its
molecules from /tmp/fault294_work/mols/mols_R.pt, standardises the property by its mean and std, and trains
an R-GCN (per-relation weights, messages summed with index_add_, a sum readout, a linear head) on an MSE
loss, wrapped in DDP (gloo).  The model is initialised from ckpt/rgcn_r4.pt.  Per-rank atom counts are
all_gathered at the start, the MAE is all_reduced every step, and rank 0 saves export/rgcn.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  bondtype   - rank N decodes aromatic bonds as type 4: a relation index beyond the 4 weights (IndexError)
  zerostd    - rank N's property column is constant: std 0, standardised targets NaN, the program's check
  atomgather - rank N all_gathers its atom counts per element plus a hydrogen count (9 vs 8 entries)
  nomols     - rank N reads its molecules from mols/test/ which does not exist (FileNotFoundError)
  element    - rank N's molecules contain selenium "Se", missing from the atom table (KeyError)
  featwidth  - every rank: atom features are 12 wide (two extra flags), the first layer expects 10 (shape error)
  ckptrel    - rank N initialises from ckpt/rgcn_r5.pt, saved with 5 relations (size mismatch)
  rings      - rank N enumerates every ring of every molecule in Python before the step-2 all_reduce
  sigkill    - rank N sends itself SIGKILL after step 2
  inplace    - rank N rescales the embedding weight in place outside no_grad (RuntimeError, leaf requires grad)
  exit3      - rank N prints its own error line about a valence violation and calls sys.exit(3)
  none       - control, clean run

What happened (filled in after the runs):
  bondtype   - IndexError 'index 4 is out of bounds for dimension 0 with size 4' in the first forward; peers Connection closed by peer (np4 r2 bashloop, np3 r1 spawn)
  zerostd    - the program's check prints 64 non-finite values (std 0.000) and raises FloatingPointError; peers closed (np4 r1 ranklabel, np3 r2 logfmt)
  atomgather - rank N: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))'; peers closed (np3 r1 srunlabel)
  nomols     - FileNotFoundError for mols/test/mols_N.pt before the first all_gather; peers closed (np4 r3 mpitag)
  element    - KeyError: 'Se' in featurise; peers closed in all_gather (np3 r1 mpitag, np5 r2 tee)
  featwidth  - every rank: 'mat1 and mat2 shapes cannot be multiplied (Nx12 and 10x16)'; Root Cause rank 0 (np3 legacy)
  ckptrel    - load_state_dict size mismatch for l1.weight/l2.weight [5,16,16] vs [4,16,16] (np4 r1 pdsh2, np3 r2 legacy)
  rings      - 12 s PG timeout: a peer's recv 'Timed out waiting 12000ms' (np3 r2 bashloop); 300 s: silent, killed at 60 s, exit 124 (np4 r1 srunlabel)
  sigkill    - no traceback from rank N after step 2; bash 'Killed' exit 137 (np4 r3 ranklabel); ProcessExitedException SIGKILL (np3 r1 spawn)
  inplace    - 'a leaf Variable that requires grad is being used in an in-place operation.' (np4 r2 files; np3 r0 logfmt, Root Cause rank 1 SIGABRT)
  exit3      - rank N's valence ERROR line and exit 3; Root Cause names rank 2 exitcode 3 (np3 r2 tee); loop exit 3 (np4 r1 srunlabel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/rgcn.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault294_work"
ATOMS = {"C": 0, "N": 1, "O": 2, "F": 3, "S": 4, "Cl": 5, "P": 6, "Br": 7}
NREL = 4
FEAT = 10
DIM = 16
log = None


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("rgnn")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class RGCNLayer(nn.Module):
    def __init__(self, nrel, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nrel, dim, dim) * 0.1)
        self.self_loop = nn.Linear(dim, dim)

    def forward(self, h, src, dst, etype):
        msg = torch.bmm(h[src].unsqueeze(1), self.weight[etype]).squeeze(1)
        out = self.self_loop(h)
        return torch.relu(out.index_add(0, dst, msg))


class RGCN(nn.Module):
    def __init__(self, nrel=NREL, feat=FEAT, dim=DIM):
        super().__init__()
        self.emb = nn.Linear(feat, dim)
        self.l1 = RGCNLayer(nrel, dim)
        self.l2 = RGCNLayer(nrel, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x, src, dst, etype, mol, nmol):
        h = torch.relu(self.emb(x))
        h = self.l2(self.l1(h, src, dst, etype), src, dst, etype)
        g = torch.zeros(nmol, h.shape[1]).index_add_(0, mol, h)
        return self.head(g).squeeze(1)


def make_mols(n, seed):
    g = torch.Generator().manual_seed(seed)
    syms = list(ATOMS)
    mols = []
    for _ in range(n):
        na = int(torch.randint(4, 10, (1,), generator=g))
        atoms = [syms[int(i)] for i in torch.randint(0, 8, (na,), generator=g)]
        bonds = [(i, i + 1, int(torch.randint(0, 3, (1,), generator=g))) for i in range(na - 1)]
        if na > 5:
            bonds.append((na - 1, 0, 3))
        charge = torch.randint(-1, 2, (na,), generator=g).tolist()
        y = sum(ATOMS[s] for s in atoms) * 0.3 + len(bonds) * 0.5 + float(torch.randn(1, generator=g))
        mols.append({"atoms": atoms, "bonds": bonds, "charge": charge, "y": y})
    return mols


def prepare():
    os.makedirs(f"{WORK}/mols", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_mols(64, 100 + r), f"{WORK}/mols/mols_{r}.pt")
    torch.manual_seed(0)
    torch.save(RGCN(4).state_dict(), f"{WORK}/ckpt/rgcn_r4.pt")
    torch.save(RGCN(5).state_dict(), f"{WORK}/ckpt/rgcn_r5.pt")
    print("prepared", WORK)


def featurise(mols, a, bad):
    xs, src, dst, et, mol = [], [], [], [], []
    off = 0
    width = 12 if a.fault == "featwidth" else FEAT
    for m_i, m in enumerate(mols):
        deg = [0] * len(m["atoms"])
        for i, j, t in m["bonds"]:
            deg[i] += 1
            deg[j] += 1
            if t == 3 and bad and a.fault == "bondtype":
                t = 4
            src += [off + i, off + j]
            dst += [off + j, off + i]
            et += [t, t]
        for k, s in enumerate(m["atoms"]):
            f = torch.zeros(width)
            f[ATOMS[s]] = 1.0
            f[8] = deg[k] / 4.0
            f[9] = m["charge"][k]
            xs.append(f)
            mol.append(m_i)
        off += len(m["atoms"])
    return (torch.stack(xs), torch.tensor(src), torch.tensor(dst), torch.tensor(et), torch.tensor(mol))


def count_rings(mols):
    total = 0
    for m in mols:
        n = len(m["atoms"])
        adj = {i: set() for i in range(n)}
        for i, j, _ in m["bonds"]:
            adj[i].add(j)
            adj[j].add(i)
        for full in range(n):
            for i in range(n):
                adj[i] |= {(i + full + 2) % n}
        stack = [(s, [s]) for s in range(n)]
        while stack:
            v, path = stack.pop()
            for w in adj[v]:
                if w == path[0] and len(path) > 2:
                    total += 1
                elif w not in path and w > path[0]:
                    stack.append((w, path + [w]))
    return total


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading molecules")
    split = "test/" if bad and a.fault == "nomols" else ""
    mols = torch.load(f"{WORK}/mols/{split}mols_{rank}.pt")
    if bad and a.fault == "element":
        mols[5]["atoms"][2] = "Se"
    if bad and a.fault == "zerostd":
        for m in mols:
            m["y"] = 2.75
    ys = torch.tensor([m["y"] for m in mols])
    yt = (ys - ys.mean()) / ys.std()
    if not torch.isfinite(yt).all():
        say(f"rank {rank}: standardised property has {int((~torch.isfinite(yt)).sum())} non-finite values "
            f"(mean {ys.mean():.3f}, std {ys.std():.3f})", err=True)
        raise FloatingPointError(f"non-finite standardised targets on rank {rank}")
    if bad and a.fault == "exit3":
        say(f"rank {rank}: ERROR molecule 17 atom 3 (N) has valence 5 > 3, refusing to train on invalid molecules",
            err=True)
        sys.exit(3)
    x, src, dst, et, mol = featurise(mols, a, bad)
    counts = torch.bincount(x[:, :8].argmax(1), minlength=8).float()
    if bad and a.fault == "atomgather":
        counts = torch.cat([counts, torch.tensor([float(len(mols) * 6)])])
    allc = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} atoms {int(counts.sum())} global {int(sum(c.sum() for c in allc))}")
    model = RGCN()
    ck = "rgcn_r5.pt" if bad and a.fault == "ckptrel" else "rgcn_r4.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    ddp = DDP(model)
    if bad and a.fault == "inplace":
        ddp.module.emb.weight.mul_(0.5)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    nmol = len(mols)
    for step in range(a.steps):
        pred = ddp(x, src, dst, et, mol, nmol)
        loss = ((pred - yt) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bad and a.fault == "rings" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.ring_budget:
                n += count_rings(mols)
            say(f"rank {rank} ring census: {n} rings")
        mae = (pred.detach() - yt).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.4f}")
        if bad and a.fault == "sigkill" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/rgcn.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/rgcn.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ring-budget", type=int, default=45)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()

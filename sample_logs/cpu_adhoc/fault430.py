"""Batch 430 of hand-run faults: PROTEIN-LIGAND DOCKING SCORE REGRESSION.

Synthetic docked complexes: a ligand (heavy atoms with element symbols looked up in a 10-entry element table,
3-D coordinates, a list of hydrogen-bond donor atoms) in a protein pocket (residues with three-letter names
looked up in the 20-entry residue table, C-alpha coordinates).  The target is the binding affinity pKd =
-log10(Kd), read from the measured Kd stored with each complex.  Every rank reads its ligands from
/tmp/fault430_work/data/ligands_R.pt and its pockets from /tmp/fault430_work/pockets/pocket_R.pt, and trains
a small pairwise interaction scorer (element and residue embeddings, a radial-basis expansion of every
ligand-atom/residue distance gating their product, a donor term, a linear head) on an MSE loss, wrapped in
DDP (gloo), or with gradients all_reduced by hand (--ddp 0).  The model starts from ckpt/scorer_d32.pt.
The MAE is all_reduced every step; at the end each rank's histogram of predicted scores is all_gathered and
rank 0 saves export/scorer.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1
(progress and errors through logging).

Faults:
  restype     - rank N's pocket contains selenocysteine "SEC", missing from the residue table (KeyError, start-up)
  atomidx     - rank N's complex in the step-3 batch lists a donor with a 1-based index (IndexError at step 3)
  nopocket    - rank N reads pockets/pocket_N_holo.pt, which was never written (FileNotFoundError, start-up)
  ckptsize    - rank N initialises from ckpt/scorer_d48.pt (hidden size 48; size mismatch in load_state_dict)
  ckptpickle  - rank N initialises from ckpt/scorer_full.pt, which pickles a DockConfig object (weights_only refusal)
  gathershape - rank N's score histogram at the end has 11 bins, the others 10 (all_gather size mismatch)
  slowpose    - rank N enumerates ligand poses in Python before the step-2 all_reduce (--pose-budget seconds)
  nanscore    - rank N's complex in the step-2 batch has Kd = 0, pKd = inf; the program's loss check raises
  segv        - rank N sends itself SIGSEGV after step 3
  exit2       - rank N prints its own error line about an empty pocket after step 1 and calls sys.exit(2)
  distdim     - every rank: the distance expansion has 24 radial centres, the gate layer expects 16 (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  restype     - KeyError: 'SEC' in featurise at start-up; peers Connection closed in DDP init (np4 r2 ranklabel), torchrun SIGTERMs them (np6 r0 logfmt)
  atomidx     - IndexError 'index 6 is out of bounds for dimension 0 with size 6' in the step-3 forward (np3 r1 srunlabel; np4 r3 spawn, process 3)
  nopocket    - FileNotFoundError for pockets/pocket_N_holo.pt at start-up (np4 r1 mpitag, peers closed; np3 r2 tee, Root Cause rank 2)
  ckptsize    - load_state_dict size mismatch [10, 48] vs [10, 32] ... at start-up (np4 r2 pdsh2; np3 r1 legacy)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.DockConfig' (np5 r3 bashloop --ddp 0; np3 r0 files)
  gathershape - after 6 steps 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))'; peers closed (np6 r4 srunlabel; np3 r1 tee)
  slowpose    - 12 s: peers 'Timed out waiting 12000ms for recv', rank N then Connection closed (np3 r2 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 ranklabel)
  nanscore    - 'non-finite loss inf (1 of 8 targets non-finite)', FloatingPointError at step 2 (np8 r5 mpitag; np3 r0 spawn)
  segv        - rank N's output stops after step 3; peers Connection closed/reset; loop exit 139 (np4 r2 files); Root Cause exitcode -11 (np3 r1 legacy)
  exit2       - rank 0's empty-pocket ERROR line after step 1, exit 2; Root Cause rank 0 exitcode 2 (np4 r0 logfmt)
  distdim     - every rank: 'mat1 and mat2 shapes cannot be multiplied (117x24 and 16x32)' in the first forward (np4 rall pdsh2)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/scorer.pt, exit 0 (np3 bashloop)
"""
import argparse
import dataclasses
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault430_work"
ELEMENTS = {"C": 0, "N": 1, "O": 2, "S": 3, "P": 4, "F": 5, "Cl": 6, "Br": 7, "I": 8, "B": 9}
RESIDUES = {r: i for i, r in enumerate("ALA ARG ASN ASP CYS GLN GLU GLY HIS ILE LEU LYS MET PHE PRO SER THR "
                                       "TRP TYR VAL".split())}
NRBF = 16
HID = 32
BATCH = 8
log = None


@dataclasses.dataclass
class DockConfig:
    hidden: int = 32
    rbf: int = 16
    cutoff: float = 8.0


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
    log = logging.getLogger("dock")
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


class Scorer(nn.Module):
    def __init__(self, hid=HID, nrbf=NRBF):
        super().__init__()
        self.elem = nn.Embedding(len(ELEMENTS), hid)
        self.res = nn.Embedding(len(RESIDUES), hid)
        self.gate = nn.Linear(nrbf, hid)
        self.donor = nn.Linear(hid, 1)
        self.head = nn.Linear(hid, 1)

    def forward(self, cplx):
        out = []
        for c in cplx:
            h = self.elem(c["el"])
            r = self.res(c["rt"])
            g = torch.sigmoid(self.gate(c["rbf"].reshape(-1, c["rbf"].shape[-1]))).reshape(h.shape[0], r.shape[0], -1)
            inter = (h.unsqueeze(1) * r.unsqueeze(0) * g).sum((0, 1)) / h.shape[0]
            don = self.donor(h[c["donors"]]).sum()
            out.append(self.head(torch.tanh(inter)).squeeze() + 0.1 * don)
        return torch.stack(out)


def rbf(d, n):
    centres = torch.linspace(2.0, 12.0, n)
    return torch.exp(-((d.unsqueeze(-1) - centres) ** 2) / 2.0)


def make_complexes(n, seed):
    g = torch.Generator().manual_seed(seed)
    els, ress = list(ELEMENTS), list(RESIDUES)
    ligs, pockets = [], []
    for i in range(n):
        na = int(torch.randint(6, 16, (1,), generator=g))
        nr = int(torch.randint(8, 20, (1,), generator=g))
        atoms = [els[int(k)] for k in torch.randint(0, 6, (na,), generator=g)]
        xyz = torch.randn(na, 3, generator=g) * 2.0
        donors = [k for k, a in enumerate(atoms) if a in ("N", "O")][:4] or [0]
        res = [ress[int(k)] for k in torch.randint(0, 20, (nr,), generator=g)]
        ca = torch.randn(nr, 3, generator=g) * 5.0
        pkd = 4.0 + 0.2 * len(donors) + 0.1 * na + float(torch.randn(1, generator=g)) * 0.5
        ligs.append({"id": f"{seed:02d}{i:03d}", "atoms": atoms, "xyz": xyz, "donors": donors, "kd": 10 ** (-pkd)})
        pockets.append({"id": f"{seed:02d}{i:03d}", "res": res, "ca": ca})
    return ligs, pockets


def prepare():
    for d in ("data", "pockets", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        ligs, pockets = make_complexes(64, 30 + r)
        torch.save(ligs, f"{WORK}/data/ligands_{r}.pt")
        torch.save(pockets, f"{WORK}/pockets/pocket_{r}.pt")
    torch.manual_seed(0)
    torch.save(Scorer(32).state_dict(), f"{WORK}/ckpt/scorer_d32.pt")
    torch.save(Scorer(48).state_dict(), f"{WORK}/ckpt/scorer_d48.pt")
    torch.save({"model": Scorer(32).state_dict(), "config": DockConfig()}, f"{WORK}/ckpt/scorer_full.pt")
    print("prepared", WORK)


def featurise(ligs, pockets, a):
    nrbf = 24 if a.fault == "distdim" else NRBF
    out = []
    for lg, pk in zip(ligs, pockets):
        el = torch.tensor([ELEMENTS[s] for s in lg["atoms"]])
        rt = torch.tensor([RESIDUES[s] for s in pk["res"]])
        d = torch.cdist(lg["xyz"], pk["ca"])
        out.append({"el": el, "rt": rt, "rbf": rbf(d, nrbf), "donors": torch.tensor(lg["donors"])})
    return out


def pose_scan(lig, budget):
    t0, best, n = time.time(), math.inf, 0
    xyz = lig["xyz"].tolist()
    while time.time() - t0 < budget:
        for ang in range(0, 360, 5):
            c, s = math.cos(math.radians(ang)), math.sin(math.radians(ang))
            e = 0.0
            for i, (x, y, z) in enumerate(xyz):
                for (x2, y2, z2) in xyz[i + 1:]:
                    dx = (c * x - s * y) - (c * x2 - s * y2)
                    e += 1.0 / (dx * dx + (z - z2) ** 2 + 1.0)
            best, n = min(best, e), n + 1
    return n, best


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4300 + rank)
    say(f"rank {rank}/{world} up, loading complexes")
    ligs = torch.load(f"{WORK}/data/ligands_{rank}.pt")
    pfile = f"pocket_{rank}_holo.pt" if bad and a.fault == "nopocket" else f"pocket_{rank}.pt"
    pockets = torch.load(f"{WORK}/pockets/{pfile}")
    if bad and a.fault == "restype":
        pockets[11]["res"][4] = "SEC"
    if bad and a.fault == "atomidx":
        lg = ligs[3 * BATCH + 5]
        lg["donors"] = [k + 1 for k in lg["donors"]] + [len(lg["atoms"])]
    if bad and a.fault == "nanscore":
        ligs[2 * BATCH + 3]["kd"] = 0.0
    feats = featurise(ligs, pockets, a)
    y = torch.tensor([-math.log10(lg["kd"]) if lg["kd"] > 0 else math.inf for lg in ligs])
    say(f"rank {rank} complexes {len(feats)} ligand atoms {sum(len(lg['atoms']) for lg in ligs)} "
        f"pocket residues {sum(len(p['res']) for p in pockets)}")
    model = Scorer()
    ck = {"ckptsize": "scorer_d48.pt", "ckptpickle": "scorer_full.pt"}.get(a.fault, "scorer_d32.pt")
    sd = torch.load(f"{WORK}/ckpt/{ck if bad else 'scorer_d32.pt'}")
    model.load_state_dict(sd.get("model", sd) if isinstance(sd, dict) and "model" in sd else sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for step in range(a.steps):
        idx = slice((step * BATCH) % len(feats), (step * BATCH) % len(feats) + BATCH)
        pred = net(feats[idx])
        loss = ((pred - y[idx]) ** 2).mean()
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(y[idx])).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({nbad} of {BATCH} targets non-finite)",
                err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowpose" and step == 2:
            n, best = pose_scan(ligs[0], a.pose_budget)
            say(f"rank {rank} pose scan: {n} poses, best clash energy {best:.3f}")
        mae = (pred.detach() - y[idx]).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.4f}")
        if bad and a.fault == "exit2" and step == 1:
            say(f"rank {rank}: ERROR complex {ligs[7]['id']}: pocket has no residues within 8.0 A of the ligand "
                f"after re-centring; refusing to score an empty pocket", err=True)
            sys.exit(2)
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        allp = net(feats[:32])
    nb = 11 if bad and a.fault == "gathershape" else 10
    hist = torch.histc(allp, bins=nb, min=0.0, max=12.0)
    hists = [torch.zeros(10) for _ in range(world)]
    dist.all_gather(hists, hist)
    say(f"rank {rank} score histogram gathered: {int(sum(h.sum() for h in hists))} predictions")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/scorer.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/scorer.pt")
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
    p.add_argument("--pose-budget", type=int, default=45)
    p.add_argument("--ddp", type=int, default=1)
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

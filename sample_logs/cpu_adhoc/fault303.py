"""A three-hundred-and-third hand-run batch: PROTEIN-LIGAND BINDING AFFINITY WITH A GRAPH-PLUS-SEQUENCE MODEL.

Synthetic complexes: a ligand as a small molecular graph (atoms looked up in a 9-entry element table, bonds as
an edge list) and a protein pocket as an amino-acid sequence (one-hot over the 20 standard residues, looked up
in a residue table).  Every rank reads its complexes from /tmp/fault303_work/complexes/cplx_R.pt (Kd values in
nM, turned into pKd = 9 - log10(Kd)), encodes the ligand with two message-passing layers (sum readout) and the
pocket with a 1-D convolution (max pool), and regresses pKd from the concatenation with an MLP head on an MSE
loss, wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model is initialised
from ckpt/plaf_v20.pt.  Per-rank complex statistics are all_gathered at the start, the MAE is all_reduced every
step, and rank 0 saves export/plaf.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  residue    - rank N's pocket sequences contain selenocysteine "U", missing from the residue table (KeyError)
  pocketidx  - rank N's step-3 pocket window starts past the end of the sequence tensor (IndexError)
  nosplit    - rank N reads its complexes from complexes/core2016/ which does not exist (FileNotFoundError)
  ckptvocab  - rank N initialises from ckpt/plaf_v25.pt, saved with a 25-residue vocabulary (size mismatch)
  ckptpickle - rank N loads ckpt/plaf_norm.pt, which pickles an AffinityScaler object (weights_only refusal)
  statgather - rank N all_gathers its statistics plus a mean-pocket-length entry (5 vs 4 entries)
  docking    - rank N enumerates ligand poses in Python before the step-2 all_reduce (timeout, or hang at 300 s)
  kdzero     - rank N has a complex with Kd = 0 nM: pKd is inf, the program's own finite check raises
  segv       - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error line about a ligand with no heavy atoms and calls sys.exit(5)
  seqwidth   - every rank: the pocket one-hot has 21 channels (a gap token), the conv expects 20 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  residue    - KeyError: 'U' in featurise before the first all_gather; peers Connection closed (np4 r2 ranklabel); np3 r0 spawn hides it: ProcessRaisedException names process 2's Connection closed
  pocketidx  - IndexError 'index 28 is out of bounds for dimension 0 with size 24' at step 3; peers closed in backward (np5 r3 srunlabel, exit 134 from a peer's SIGABRT; np3 r1 tee)
  nosplit    - FileNotFoundError for complexes/core2016/cplx_N.pt at start-up; peers closed in all_gather (np4 r1 mpitag, np3 r2 legacy)
  ckptvocab  - load_state_dict size mismatch for poc.conv.weight [16,25,5] vs [16,20,5] (np4 r1 pdsh2, np3 r2 logfmt)
  ckptpickle - UnpicklingError 'Weights only load failed' (GLOBAL __main__.AffinityScaler); peers closed in DDP's param check (np5 r4 files)
  statgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))'; peers closed (np3 r1 mpitag, np4 r2 legacy)
  docking    - 12 s: ranks 0, 2 'Timed out waiting 12000ms', rank 1 later closed (np3 r1 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 srunlabel)
  kdzero     - '1 non-finite pKd values (min Kd 0 nM)', FloatingPointError at start-up; peers closed (np4 r3 logfmt, np5 r0 ranklabel)
  segv       - silent after step 3; Root Cause rank 1 exitcode -11 SIGSEGV (np4 r1 tee); rank2.log just stops, loop exit 139 (np3 r2 files)
  exit5      - rank N's ERROR line and exit 5; ProcessExitedException process 2 exit code 5 (np5 r2 spawn); worker-1 Root Cause rank 3 exitcode 5 (np4 r3 pdsh2)
  seqwidth   - every rank: conv1d 'expected input[48, 21, 24] to have 20 channels, but got 21 channels instead' in the first forward (np3 bashloop)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/plaf.pt, exit 0 (np3 bashloop)
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault303_work"
ELEMENTS = {"C": 0, "N": 1, "O": 2, "S": 3, "F": 4, "Cl": 5, "Br": 6, "P": 7, "I": 8}
RESIDUES = {r: i for i, r in enumerate("ACDEFGHIKLMNPQRSTVWY")}
DIM = 16
POCKET = 24
log = None


class AffinityScaler:
    def __init__(self, mean, std):
        self.mean = mean
        self.std = std


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("plaf")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    base.addHandler(h)
    base.setLevel(logging.INFO)
    log = RankAdapter(base, {"rank": rank})


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class LigandGNN(nn.Module):
    def __init__(self, feat=len(ELEMENTS) + 1, dim=DIM):
        super().__init__()
        self.emb = nn.Linear(feat, dim)
        self.m1 = nn.Linear(dim, dim)
        self.m2 = nn.Linear(dim, dim)

    def forward(self, x, src, dst, lig, nlig):
        h = torch.relu(self.emb(x))
        for m in (self.m1, self.m2):
            h = torch.relu(h + m(torch.zeros_like(h).index_add(0, dst, h[src])))
        return torch.zeros(nlig, h.shape[1]).index_add(0, lig, h)


class PocketCNN(nn.Module):
    def __init__(self, vocab=20, dim=DIM):
        super().__init__()
        self.conv = nn.Conv1d(vocab, dim, kernel_size=5, padding=2)

    def forward(self, seq):
        return torch.relu(self.conv(seq)).amax(2)


class AffinityModel(nn.Module):
    def __init__(self, vocab=20):
        super().__init__()
        self.lig = LigandGNN()
        self.poc = PocketCNN(vocab)
        self.head = nn.Sequential(nn.Linear(2 * DIM, DIM), nn.ReLU(), nn.Linear(DIM, 1))

    def forward(self, x, src, dst, lig, nlig, seq):
        return self.head(torch.cat([self.lig(x, src, dst, lig, nlig), self.poc(seq)], 1)).squeeze(1)


def make_complexes(n, seed):
    g = torch.Generator().manual_seed(seed)
    els, res = list(ELEMENTS), list(RESIDUES)
    out = []
    for _ in range(n):
        na = int(torch.randint(5, 12, (1,), generator=g))
        atoms = [els[int(i)] for i in torch.randint(0, 9, (na,), generator=g)]
        bonds = [(i, i + 1) for i in range(na - 1)] + ([(na - 1, 0)] if na > 6 else [])
        seq = "".join(res[int(i)] for i in torch.randint(0, 20, (POCKET,), generator=g))
        kd = float(10 ** (torch.rand(1, generator=g) * 4 + 0.5))
        out.append({"atoms": atoms, "bonds": bonds, "pocket": seq, "kd_nM": kd})
    return out


def prepare():
    os.makedirs(f"{WORK}/complexes", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_complexes(48, 300 + r), f"{WORK}/complexes/cplx_{r}.pt")
    torch.manual_seed(0)
    torch.save(AffinityModel(20).state_dict(), f"{WORK}/ckpt/plaf_v20.pt")
    torch.save(AffinityModel(25).state_dict(), f"{WORK}/ckpt/plaf_v25.pt")
    torch.save({"model": AffinityModel(20).state_dict(), "scaler": AffinityScaler(6.1, 1.2)},
               f"{WORK}/ckpt/plaf_norm.pt")
    print("prepared", WORK)


def featurise(cplx, a, bad):
    xs, src, dst, lig, seqs = [], [], [], [], []
    off = 0
    vocab = 21 if a.fault == "seqwidth" else 20
    for c_i, c in enumerate(cplx):
        for i, j in c["bonds"]:
            src += [off + i, off + j]
            dst += [off + j, off + i]
        for s in c["atoms"]:
            f = torch.zeros(len(ELEMENTS) + 1)
            f[ELEMENTS[s]] = 1.0
            f[-1] = 1.0 if s in ("N", "O") else 0.0
            xs.append(f)
            lig.append(c_i)
        off += len(c["atoms"])
        oh = torch.zeros(vocab, POCKET)
        for k, r in enumerate(c["pocket"]):
            oh[RESIDUES[r], k] = 1.0
        seqs.append(oh)
    return torch.stack(xs), torch.tensor(src), torch.tensor(dst), torch.tensor(lig), torch.stack(seqs)


def enumerate_poses(cplx):
    best = 0.0
    for c in cplx:
        n = len(c["atoms"])
        for rot in range(36):
            for t in range(n * 8):
                e = 0.0
                for i in range(n):
                    for j in range(i + 1, n):
                        e += math.cos(rot * 0.17 + t * 0.05 + i - j) / (1 + abs(i - j))
                best = min(best, e)
    return best


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading complexes")
    split = "core2016/" if bad and a.fault == "nosplit" else ""
    cplx = torch.load(f"{WORK}/complexes/{split}cplx_{rank}.pt")
    if bad and a.fault == "residue":
        cplx[11]["pocket"] = cplx[11]["pocket"][:7] + "U" + cplx[11]["pocket"][8:]
    if bad and a.fault == "kdzero":
        cplx[29]["kd_nM"] = 0.0
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR complex 23 ligand has no heavy atoms after protonation cleanup, aborting",
            err=True)
        sys.exit(5)
    kd = torch.tensor([c["kd_nM"] for c in cplx], dtype=torch.float64)
    pkd = (9.0 - torch.log10(kd)).float()
    if not torch.isfinite(pkd).all():
        say(f"rank {rank}: {int((~torch.isfinite(pkd)).sum())} non-finite pKd values "
            f"(min Kd {kd.min().item():.3g} nM)", err=True)
        raise FloatingPointError(f"non-finite pKd labels on rank {rank}")
    x, src, dst, lig, seq = featurise(cplx, a, bad)
    stats = torch.tensor([float(len(cplx)), float(x.shape[0]), pkd.mean().item(), pkd.std().item()])
    if bad and a.fault == "statgather":
        stats = torch.cat([stats, torch.tensor([float(POCKET)])])
    alls = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(alls, stats)
    say(f"rank {rank} complexes {int(stats[0])} atoms {int(stats[1])} "
        f"global complexes {int(sum(s[0] for s in alls))}")
    model = AffinityModel()
    if bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/plaf_norm.pt")["model"])
    else:
        ck = "plaf_v25.pt" if bad and a.fault == "ckptvocab" else "plaf_v20.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    nlig = len(cplx)
    for step in range(a.steps):
        s = seq
        if bad and a.fault == "pocketidx" and step == 3:
            start = POCKET + 4
            s = seq[:, :, torch.arange(start, start + 16)]
        pred = net(x, src, dst, lig, nlig, s)
        loss = ((pred - pkd) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "docking" and step == 2:
            t0 = time.time()
            best = 0.0
            while time.time() - t0 < a.dock_budget:
                best = min(best, enumerate_poses(cplx[:4]))
            say(f"rank {rank} pose search: best score {best:.2f}")
        mae = (pred.detach() - pkd).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae_pKd {mae.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/plaf.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/plaf.pt")
    dist.barrier()
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
    p.add_argument("--dock-budget", type=int, default=30)
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

"""Batch 333 hand-run fault script: MOLECULAR PROPERTY PREDICTION WITH A MESSAGE-PASSING GNN.

Synthetic molecules (element symbols, bonds with a bond order, 3-D coordinates, one scalar property) are
written by --prepare into /tmp/fault333_work/shards/mols_R.pt, one shard per rank.  Each rank featurises its
shard (an atom table of 9 elements, degree, formal charge), trains an MPNN: edge messages from
[h_src, bond one-hot, 1/distance] through a small MLP, summed with index_add_, a residual GRU-free update, a
sum readout per molecule and a linear head, MSE on the standardised property.  DDP over gloo (or --ddp 0:
gradients all_reduced by hand).  The model starts from ckpt/mpnn_h32.pt.  Per-rank element counts are
all_gathered at start-up, the MAE is all_reduced every step, a validation MAE is all_reduced at the end and
rank 0 saves export/mpnn.pt.  --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging lines).

Faults (--fault NAME --rank R, R = -1 for every rank):
  atomtype   - rank R's shard holds a boron atom "B", missing from the atom table (KeyError, start-up)
  bondidx    - rank R's step-3 batch has a bond to atom 999 of a small molecule (IndexError in gather)
  nofile     - rank R reads shards/val/mols_R.pt which does not exist (FileNotFoundError, start-up)
  ckptshape  - rank R initialises from ckpt/mpnn_h48.pt, saved with hidden size 48 (size mismatch)
  weightsonly- rank R initialises from ckpt/mpnn_full.pt, pickled with an MPNNConfig object (weights_only)
  gathershape- rank R all_gathers 10 element counts (an extra "other" bin) instead of 9
  slow       - rank R enumerates conformers in pure Python before the step-2 all_reduce (PG timeout)
  overlap    - rank R's step-4 batch has two atoms at the same position: 1/d = inf, the loss check raises
  segv       - rank R sends itself SIGSEGV after step 3
  exit5      - rank R's final validation check prints its own ERROR line and calls sys.exit(5)
  readoutdim - every rank: the readout concatenates sum and mean pooling (2H) into a head built for H
  none       - control, clean run

What happened (filled in after the runs):
  atomtype   - KeyError: 'B' in featurise at start-up; peers Connection closed in the all_gather (np4 r2 bashloop, np6 r0 tee)
  bondidx    - IndexError 'index 1035/1036 is out of bounds for dimension 0 with size 122/132' at step 3 after 3 good steps; peers closed in backward (np3 r1 ranklabel, exit 134 from a peer's terminate; np4 r3 logfmt)
  nofile     - FileNotFoundError for shards/val/mols_R.pt at start-up; peers closed in the all_gather (np3 r2 mpitag, np8 r5 srunlabel)
  ckptshape  - load_state_dict size mismatch torch.Size([48, 11]) vs [32, 11]; peers closed in DDP construction or SIGTERMed (np4 r1 pdsh2, np3 r0 legacy)
  weightsonly- UnpicklingError 'Weights only load failed', Unsupported global __main__.MPNNConfig (np3 r1 spawn, np6 r4 files)
  gathershape- 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (10), got (9))'; peers closed (np3 r2 srunlabel, np5 r0 legacy)
  slow       - 12 s: ranks 0/2 'Timed out waiting 12000ms' (recv/send) in the step-2 all_reduce (np3 r1 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 ranklabel)
  overlap    - the program's check: 'non-finite loss nan (min interatomic distance 0.000 in batch)', FloatingPointError at step 4 (np4 r0 mpitag, np3 r2 spawn --ddp 0)
  segv       - no traceback after step 3; Root Cause exitcode -11 SIGSEGV (np4 r1 tee); rank2.log just stops, loop exit 139 (np3 r2 files)
  exit5      - '[rank=3] ERROR ... disconnected fragments ... aborting', exit 5; peers closed in the validation all_reduce; Root Cause exitcode 5 (np6 r3 logfmt)
  readoutdim - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x64 and 32x1)' in the first forward; two Root Causes (np4 pdsh2)
  none       - clean: 6 steps on 3 ranks, 'rank 0 done: 6 steps, saved export/mpnn.pt', exit 0 (np3 bashloop)
"""
import argparse
import dataclasses
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

WORK = "/tmp/fault333_work"
ATOMS = {"H": 0, "C": 1, "N": 2, "O": 3, "F": 4, "S": 5, "Cl": 6, "P": 7, "Br": 8}
NEL = len(ATOMS)
FEAT = NEL + 2
NBOND = 4
HID = 32
BATCH = 16
log = None


@dataclasses.dataclass
class MPNNConfig:
    hidden: int = HID
    layers: int = 3
    readout: str = "sum"


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("mpnn")
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


class MPLayer(nn.Module):
    def __init__(self, hid):
        super().__init__()
        self.msg = nn.Sequential(nn.Linear(hid + NBOND + 1, hid), nn.SiLU(), nn.Linear(hid, hid))
        self.upd = nn.Linear(2 * hid, hid)

    def forward(self, h, src, dst, e):
        m = self.msg(torch.cat([h[src], e], dim=1))
        agg = torch.zeros_like(h).index_add_(0, dst, m)
        return h + torch.relu(self.upd(torch.cat([h, agg], dim=1)))


class MPNN(nn.Module):
    def __init__(self, hid=HID, layers=3, readout="sum"):
        super().__init__()
        self.readout = readout
        self.embed = nn.Linear(FEAT, hid)
        self.layers = nn.ModuleList(MPLayer(hid) for _ in range(layers))
        self.head = nn.Linear(hid, 1)

    def forward(self, x, src, dst, e, mol, nmol):
        h = torch.relu(self.embed(x))
        for layer in self.layers:
            h = layer(h, src, dst, e)
        g = torch.zeros(nmol, h.shape[1]).index_add_(0, mol, h)
        if self.readout == "sum+mean":
            cnt = torch.bincount(mol, minlength=nmol).clamp(min=1).unsqueeze(1)
            g = torch.cat([g, g / cnt], dim=1)
        return self.head(g).squeeze(1)


def make_mols(n, seed):
    g = torch.Generator().manual_seed(seed)
    syms = [s for s in ATOMS if s != "H"]
    mols = []
    for _ in range(n):
        na = int(torch.randint(5, 12, (1,), generator=g))
        atoms = [syms[int(i)] for i in torch.randint(0, len(syms), (na,), generator=g)]
        bonds = [(i, i + 1, int(torch.randint(0, 3, (1,), generator=g))) for i in range(na - 1)]
        if na > 6:
            bonds.append((na - 1, 0, 3))
        pos = (torch.arange(na).float().unsqueeze(1) * 1.4 + torch.randn(na, 3, generator=g) * 0.2).tolist()
        charge = torch.randint(-1, 2, (na,), generator=g).tolist()
        y = sum(ATOMS[s] for s in atoms) * 0.25 + len(bonds) * 0.4 + float(torch.randn(1, generator=g))
        mols.append({"atoms": atoms, "bonds": bonds, "pos": pos, "charge": charge, "y": y})
    return mols


def prepare():
    for d in ("shards", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_mols(6 * BATCH + 32, 333 + r), f"{WORK}/shards/mols_{r}.pt")
    torch.manual_seed(0)
    torch.save(MPNN(HID).state_dict(), f"{WORK}/ckpt/mpnn_h32.pt")
    torch.save(MPNN(48).state_dict(), f"{WORK}/ckpt/mpnn_h48.pt")
    torch.save({"config": MPNNConfig(), "state_dict": MPNN(HID).state_dict()}, f"{WORK}/ckpt/mpnn_full.pt")
    print("prepared", WORK)


def featurise(mols):
    xs, src, dst, ef, mol = [], [], [], [], []
    off = 0
    for m_i, m in enumerate(mols):
        pos = torch.tensor(m["pos"])
        deg = [0] * len(m["atoms"])
        for i, j, t in m["bonds"]:
            if j < len(deg):
                deg[i] += 1
                deg[j] += 1
            d = float((pos[i] - pos[j]).norm()) if j < len(deg) else 1.5
            e = torch.zeros(NBOND + 1)
            e[t] = 1.0
            e[NBOND] = 1.0 / d if d > 0 else float("inf")
            src += [off + i, off + j]
            dst += [off + j, off + i]
            ef += [e, e]
        for k, s in enumerate(m["atoms"]):
            f = torch.zeros(FEAT)
            f[ATOMS[s]] = 1.0
            f[NEL] = deg[k] / 4.0
            f[NEL + 1] = m["charge"][k]
            xs.append(f)
            mol.append(m_i)
        off += len(m["atoms"])
    return torch.stack(xs), torch.tensor(src), torch.tensor(dst), torch.stack(ef), torch.tensor(mol)


def conformer_search(mols, budget):
    t0, tried = time.time(), 0
    while time.time() - t0 < budget:
        for m in mols:
            pts = [list(p) for p in m["pos"]]
            for a in range(len(pts)):
                for b in range(len(pts)):
                    tried += sum((pts[a][k] - pts[b][k]) ** 2 for k in range(3)) > 0
    return tried


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, reading shard mols_{rank}.pt")
    sub = "val/" if bad and a.fault == "nofile" else ""
    mols = torch.load(f"{WORK}/shards/{sub}mols_{rank}.pt")
    if bad and a.fault == "atomtype":
        mols[11]["atoms"][3] = "B"
    if bad and a.fault == "bondidx":
        m = mols[3 * BATCH + 5]
        m["bonds"].append((2, 999, 0))
    if bad and a.fault == "overlap":
        m = mols[4 * BATCH + 2]
        m["pos"][1] = list(m["pos"][0])
    ys = torch.tensor([m["y"] for m in mols])
    ymean, ystd = ys.mean(), ys.std()
    batches = [featurise(mols[i * BATCH:(i + 1) * BATCH]) for i in range(len(mols) // BATCH)]
    counts = sum(torch.bincount(b[0][:, :NEL].argmax(1), minlength=NEL) for b in batches).float()
    if bad and a.fault == "gathershape":
        counts = torch.cat([counts, torch.tensor([0.0])])
    allc = [torch.zeros(NEL) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} atoms {int(counts.sum())} global {int(sum(c.sum() for c in allc))} "
        f"carbon share {float(sum(c[1] for c in allc) / sum(c.sum() for c in allc)):.3f}")
    readout = "sum+mean" if a.fault == "readoutdim" else "sum"
    model = MPNN(HID, readout=readout)
    ck = {"ckptshape": "mpnn_h48.pt", "weightsonly": "mpnn_full.pt"}.get(a.fault, "mpnn_h32.pt") if bad \
        else "mpnn_h32.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        x, src, dst, e, mol = batches[step % len(batches)]
        yt = (ys[(step % len(batches)) * BATCH:][:BATCH] - ymean) / ystd
        pred = net(x, src, dst, e, mol, BATCH)
        loss = ((pred - yt) ** 2).mean()
        if not torch.isfinite(loss):
            dmin = float(1.0 / e[:, NBOND].max())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} (min interatomic distance {dmin:.3f} "
                f"in batch)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slow" and step == 2:
            n = conformer_search(mols, a.slow_s)
            say(f"rank {rank} conformer search tried {n} pairs")
        mae = (pred.detach() - yt).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        x, src, dst, e, mol = batches[-1]
        vmae = (model(x, src, dst, e, mol, BATCH) - (ys[-BATCH:] - ymean) / ystd).abs().mean().reshape(1)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR validation shard has 3 molecules with disconnected fragments "
            f"(mae {vmae.item():.4f} not comparable), aborting", err=True)
        sys.exit(5)
    dist.all_reduce(vmae)
    say(f"rank {rank} validation mae {vmae.item() / world:.4f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/mpnn.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/mpnn.pt")
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(a.spawn), LOCAL_RANK=str(rank))
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=int, default=40)
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

"""A three-hundred-and-thirty-second hand-run batch: TABULAR INSURANCE CLAIM RISK MODEL WITH EMBEDDINGS.

Synthetic motor policies: every row has a region code (looked up in a 24-entry region table), a vehicle
class (6 entries), a vehicle-age bucket (0-11), driver age, bonus-malus, annual premium, exposure (years)
and a claim count.  Every rank reads its policies from /tmp/fault332_work/policies/book_R.pt, encodes the
categorical columns through the lookup tables, and trains a Poisson frequency model (region, vehicle-class
and vehicle-age embeddings concatenated with 8 standardised numeric columns, a two-layer MLP, log-exposure
offset) wrapped in DDP (gloo), or with gradients all_reduced by hand (--ddp 0).  The model is initialised
from ckpt/freq_init.pt and the numeric scaler comes from ckpt/scaler.pt.  The loss and the claim frequency
are all_reduced every step; at the end every rank all_gathers its claim-count histogram (5 bins) and rank 0
saves export/freq.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and
errors through logging).

Faults:
  region     - rank N's book contains region "ZZ9" (a new territory) missing from the region table (KeyError)
  vehage     - rank N's step-3 batch holds a vehicle-age bucket of 12, past the 12-row embedding (IndexError)
  nopolicy   - rank N reads its book from policies/2025Q4/ which does not exist (FileNotFoundError)
  ckptemb    - rank N initialises from ckpt/freq_r32.pt, saved with a 32-row region table (size mismatch)
  ckptpickle - rank N loads ckpt/scaler_obj.pt, a pickled ClaimScaler object: torch.load's weights_only refuses
  histbins   - rank N all_gathers a 6-bin claim histogram (the others 5) at the end (collective size mismatch)
  slowrisk   - rank N rebuilds a chain-ladder triangle in pure Python before the step-2 all_reduce
  zeroexp    - rank N's step-1 batch has zero exposures: log offset -inf, the program's finite-loss check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own reconciliation error line at the end and calls sys.exit(5)
  numwidth   - every rank: 9 numeric columns (a telematics flag added), the MLP expects 8 + embeddings (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  region     - KeyError: 'ZZ9' in encode at start-up; peers Connection closed in DDP's parameter check (np4 r2 bashloop); Root Cause rank 0 (np6 r0 tee)
  vehage     - 'IndexError: index out of range in self' in the vehicle-age embedding at step 3; peers closed (np3 r1 ranklabel --ddp 0; np8 r5 mpitag, rank 3 also aborted, exit 134)
  nopolicy   - FileNotFoundError for policies/2025Q4/book_N.pt before DDP; peers closed in DDP's parameter check (np4 r3 srunlabel, np3 r0 files)
  ckptemb    - load_state_dict size mismatch for region.weight [32, 6] vs [24, 6] (np4 r1 pdsh2, node 1 agent RendezvousConnectionError; np3 r2 legacy)
  ckptpickle - 'Weights only load failed' ... 'Unsupported global: GLOBAL __main__.ClaimScaler' (UnpicklingError) (np5 r3 logfmt)
  histbins   - after 6 steps 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (5))' (np3 r1 spawn, np6 r4 bashloop)
  slowrisk   - 12 s: ranks 0-1 'Timed out waiting 12000ms for recv' at step 2 (np3 r2 srunlabel); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 ranklabel)
  zeroexp    - the check's 'non-finite Poisson loss nan at step 1' and FloatingPointError; peers closed (np4 r0 logfmt, np3 r2 mpitag --ddp 0)
  sigsegv    - no traceback after step 3; spawn 'process 2 terminated with signal SIGSEGV' (np5 r2 spawn); loop exit 139 (np4 r3 files)
  exit5      - rank N's reconciliation ERROR line after step 5 and exit 5; Root Cause rank 1 exitcode 5 (np3 r1 tee); loop exit 5 (np6 r3 srunlabel)
  numwidth   - every rank: 'mat1 and mat2 shapes cannot be multiplied (128x21 and 20x32)' in the first forward; Root Cause rank 0 (np4 legacy)
  none       - clean: 6 steps on 3 ranks, histogram all_gather, rank 0 saved export/freq.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault332_work"
REGIONS = [f"R{i:02d}" for i in range(24)]
REGION_IDX = {r: i for i, r in enumerate(REGIONS)}
VCLASS = {"hatch": 0, "sedan": 1, "suv": 2, "van": 3, "sport": 4, "ev": 5}
NVAGE = 12
NUM = 8
BATCH = 128
log = None


class ClaimScaler:
    """Mean/std of the numeric columns (pickled as an object in one legacy checkpoint)."""

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
    base = logging.getLogger("claimrisk")
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


class FreqModel(nn.Module):
    def __init__(self, nregion=len(REGIONS), num=NUM):
        super().__init__()
        self.region = nn.Embedding(nregion, 6)
        self.vclass = nn.Embedding(len(VCLASS), 3)
        self.vage = nn.Embedding(NVAGE, 3)
        self.mlp = nn.Sequential(nn.Linear(6 + 3 + 3 + NUM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, reg, vcl, vag, xnum, log_exp):
        h = torch.cat([self.region(reg), self.vclass(vcl), self.vage(vag), xnum], dim=1)
        return self.mlp(h).squeeze(1) + log_exp


def make_book(n, seed):
    g = torch.Generator().manual_seed(seed)
    vcl = list(VCLASS)
    rows = []
    for _ in range(n):
        rows.append({
            "region": REGIONS[int(torch.randint(0, 24, (1,), generator=g))],
            "vclass": vcl[int(torch.randint(0, 6, (1,), generator=g))],
            "vage": int(torch.randint(0, NVAGE, (1,), generator=g)),
            "num": torch.randn(NUM, generator=g).tolist(),
            "exposure": float(torch.rand(1, generator=g) * 0.9 + 0.1),
        })
    for r in rows:
        lam = r["exposure"] * 0.12 * (1.0 + 0.3 * abs(r["num"][0]))
        r["claims"] = int(torch.poisson(torch.tensor([lam]), generator=g))
    return rows


def prepare():
    os.makedirs(f"{WORK}/policies", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_book(6 * BATCH, 500 + r), f"{WORK}/policies/book_{r}.pt")
    torch.manual_seed(0)
    torch.save(FreqModel().state_dict(), f"{WORK}/ckpt/freq_init.pt")
    torch.save(FreqModel(nregion=32).state_dict(), f"{WORK}/ckpt/freq_r32.pt")
    torch.save({"mean": torch.zeros(NUM), "std": torch.ones(NUM)}, f"{WORK}/ckpt/scaler.pt")
    torch.save({"scaler": ClaimScaler(torch.zeros(NUM), torch.ones(NUM)), "version": 1},
               f"{WORK}/ckpt/scaler_obj.pt")
    print("prepared", WORK)


def encode(book, a, bad):
    reg = torch.tensor([REGION_IDX[r["region"]] for r in book])
    vcl = torch.tensor([VCLASS[r["vclass"]] for r in book])
    vag = torch.tensor([r["vage"] for r in book])
    width = NUM + 1 if a.fault == "numwidth" else NUM
    xnum = torch.tensor([r["num"] + [0.0] * (width - NUM) for r in book])
    expo = torch.tensor([r["exposure"] for r in book])
    y = torch.tensor([float(r["claims"]) for r in book])
    return reg, vcl, vag, xnum, expo, y


def chain_ladder(book):
    """Pure-Python development triangle over the book (deliberately slow)."""
    tri = {}
    for i, r in enumerate(book):
        for dev in range(12):
            for acc in range(12):
                key = (r["region"], acc, dev)
                tri[key] = tri.get(key, 0.0) + r["claims"] * (dev + 1) / (acc + 1) + i * 1e-9
    return sum(tri.values())


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, reading policy book")
    sub = "2025Q4/" if bad and a.fault == "nopolicy" else ""
    book = torch.load(f"{WORK}/policies/{sub}book_{rank}.pt")
    if bad and a.fault == "region":
        book[77]["region"] = "ZZ9"
    reg, vcl, vag, xnum, expo, y = encode(book, a, bad)
    if bad and a.fault == "ckptpickle":
        sc = torch.load(f"{WORK}/ckpt/scaler_obj.pt")["scaler"]
        mean, std = sc.mean, sc.std
    else:
        sc = torch.load(f"{WORK}/ckpt/scaler.pt")
        mean, std = sc["mean"], sc["std"]
    xnum[:, :NUM] = (xnum[:, :NUM] - mean) / std
    say(f"rank {rank} policies {len(book)} exposure {expo.sum():.1f} claims {int(y.sum())}")
    model = FreqModel()
    ck = "freq_r32.pt" if bad and a.fault == "ckptemb" else "freq_init.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=5e-3)
    nb = len(book) // BATCH
    for step in range(a.steps):
        s = slice((step % nb) * BATCH, (step % nb + 1) * BATCH)
        rb, cb, ab, xb, eb, yb = reg[s], vcl[s], vag[s].clone(), xnum[s], expo[s].clone(), y[s]
        if bad and a.fault == "vehage" and step == 3:
            ab[19] = NVAGE
        if bad and a.fault == "zeroexp" and step == 1:
            eb[40:56] = 0.0
        eta = net(rb, cb, ab, xb, torch.log(eb))
        loss = (torch.exp(eta) - yb * eta).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite Poisson loss {loss.item()} at step {step} "
                f"(min exposure {eb.min():.3f})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowrisk" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.risk_budget:
                chain_ladder(book)
                n += 1
            say(f"rank {rank} chain-ladder reserve rebuilt {n} times")
        stats = torch.stack([loss.detach(), (yb.sum() / eb.sum()).detach()])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} freq {stats[1].item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR exposure reconciliation failed: book {expo.sum():.2f} years vs ledger "
            f"{expo.sum() * 1.013:.2f} years, refusing to export", err=True)
        sys.exit(5)
    nbins = 6 if bad and a.fault == "histbins" else 5
    hist = torch.bincount(y.long().clamp(max=nbins - 1), minlength=nbins).float()
    allh = [torch.zeros(5) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} claim histogram {hist.tolist()} global {[int(v) for v in sum(allh).tolist()]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/freq.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/freq.pt")
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
    p.add_argument("--risk-budget", type=int, default=40)
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

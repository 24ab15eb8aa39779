"""Batch 335 hand-run fault script: CHEMICAL REACTION YIELD PREDICTION FROM REACTION FINGERPRINTS.

Synthetic reactions as exported from an electronic lab notebook: each reaction carries the on-bits of a
folded 512-bit Morgan fingerprint for its reactants and for its product, a solvent name (looked up in a
6-entry solvent table), a temperature, a catalyst loading and an isolated yield stored as a string ("73.4").
Every rank reads its shard from /tmp/fault335_work/rxn/shard_R.pt, builds condition vectors for all its
reactions at start-up, and parses fingerprints and yields lazily, one batch of 32 per step.  The model
(YieldNet) embeds [reactant fp, product fp - reactant fp] with an MLP, adds an 8-wide condition vector and
predicts the logit of yield/100 under an MSE loss.  It is wrapped in DDP over gloo (or, with --ddp 0, its
gradients are all_reduced by hand) and initialised from ckpt/yieldnet_fp512.pt.  The batch MAE (in yield
percent) is all_reduced every step, per-rank yield statistics are all_gathered at the end, and rank 0
saves results/yieldnet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1.

Faults (--fault NAME --rank R, R = -1 for all ranks):
  solvent    - rank R's shard names solvent "HFIP", missing from the solvent table (KeyError at start-up)
  yieldstr   - rank R's batch at step 3 holds the yield "n/a" (ValueError while parsing)
  fpindex    - rank R's step-1 batch has a reaction folded to 1024 bits: on-bit 731 (IndexError)
  nodata     - rank R reads its shard from rxn/val/, which does not exist (FileNotFoundError)
  ckptwidth  - rank R initialises from ckpt/yieldnet_fp1024.pt (1024-bit model: size mismatch)
  ckptpickle - rank R initialises from ckpt/yieldnet_full.pt, a pickled TrainState (weights_only refusal)
  statgather - rank R all_gathers [mean, std, max, n] against 3-entry buffers at the end (gloo size error)
  slowsim    - rank R computes a pairwise Tanimoto matrix in Python before the step-3 all_reduce
  nanyield   - rank R's step-2 batch has a yield of 100.0: logit target inf, the program's finite check
  sigsegv    - rank R sends itself SIGSEGV after step 3
  exit4      - rank R prints its own error about an unmapped product atom at step 4 and calls sys.exit(4)
  condwidth  - every rank: condition vectors get two extra flags (10 wide, the layer expects 8)
  none       - control, clean run

What happened (filled in after the runs):
  solvent    - KeyError: 'HFIP' in condition_vector at start-up; others SIGTERMed (np4 r2 tee, np6 r0 prefix)
  yieldstr   - ValueError: could not convert string to float: 'n/a' at step 3; peers Connection closed (np3 r1 pymodule, np8 r5 loglevel)
  fpindex    - IndexError 'index 731 is out of bounds for dimension 0 with size 512' at step 1 (np4 r3 filter)
  nodata     - FileNotFoundError for rxn/val/shard_2.pt at start-up, after the job banner (np3 r2 wrapper)
  ckptwidth  - load_state_dict size mismatch fp.0.weight [64, 2048] vs [64, 1024]; worker-1 RendezvousConnectionError (np4 r1 pdsh2)
  ckptpickle - UnpicklingError: Weights only load failed, __main__.TrainState (np3 r0 tee_trainer; np4 r2 restart: attempt 1 connectFullMesh)
  statgather - DETAIL: collective fingerprint mismatch, rank 1 ALLGATHER [4] vs [3] (np3 r1); gloo invalid tensor size (np6 r4 filter)
  slowsim    - 12 s: rank 1 'Timed out waiting 12000ms' for recv (np3 r2 plain); 300 s: silent after step 2, timeout 60 s, exit 124 (np4 r1 tee)
  nanyield   - 'step 2 loss is inf (1 non-finite logit targets)', FloatingPointError (np3 r2 redirects; np4 r0 detail: monitoredBarrier)
  sigsegv    - no traceback after step 3; exitcode -11 (SIGSEGV) (np6 r3 plain; np3 r1 restart: attempt 1 connectFullMesh)
  exit4      - rank 2's unmapped-atoms ERROR line at step 4, exit 4; Root Cause exitcode 4 (np3 r2 tee_trainer)
  condwidth  - every rank: 'mat1 and mat2 shapes cannot be multiplied (32x10 and 8x64)' in the first forward (np8 wrapper)
  none       - clean: 6 steps on 3 ranks, rank 0 saved results/yieldnet.pt, exit 0 (np3 plain)
"""
import argparse
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault335_work"
NBITS = 512
COND = 8
HID = 64
BATCH = 32
SOLVENTS = {"DMF": 0, "THF": 1, "toluene": 2, "MeCN": 3, "dioxane": 4, "EtOH": 5}
log = None


@dataclass
class TrainState:
    epoch: int = 0
    best_mae: float = 99.0
    model: dict = field(default_factory=dict)


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("rxnyield")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter(f"%(asctime)s [rank={rank}] %(levelname)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class YieldNet(nn.Module):
    def __init__(self, nbits=NBITS, cond=COND, hid=HID):
        super().__init__()
        self.fp = nn.Sequential(nn.Linear(2 * nbits, hid), nn.ReLU(), nn.Linear(hid, hid))
        self.cond = nn.Linear(cond, hid)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(hid, 1))

    def forward(self, rfp, pfp, c):
        h = self.fp(torch.cat([rfp, pfp - rfp], 1)) + self.cond(c)
        return self.head(h).squeeze(1)


def make_shard(n, seed):
    g = torch.Generator().manual_seed(seed)
    sols = list(SOLVENTS)
    rxns = []
    for _ in range(n):
        rb = torch.randperm(NBITS, generator=g)[:40].tolist()
        pb = sorted(set(rb[:30] + torch.randint(0, NBITS, (12,), generator=g).tolist()))
        sol = sols[int(torch.randint(0, 6, (1,), generator=g))]
        temp = float(torch.randint(20, 140, (1,), generator=g))
        cat = float(torch.rand(1, generator=g)) * 5
        y = 15 + 0.3 * (temp - 20) + 6 * cat + 4 * SOLVENTS[sol] + 5 * float(torch.randn(1, generator=g))
        y = min(max(y, 2.0), 97.0)
        rxns.append({"r_bits": sorted(rb), "p_bits": pb, "solvent": sol, "temp_c": temp,
                     "cat_mol_pct": cat, "yield": f"{y:.1f}"})
    return rxns


def prepare():
    os.makedirs(f"{WORK}/rxn", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(256, 500 + r), f"{WORK}/rxn/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(YieldNet().state_dict(), f"{WORK}/ckpt/yieldnet_fp512.pt")
    torch.save(YieldNet(nbits=1024).state_dict(), f"{WORK}/ckpt/yieldnet_fp1024.pt")
    torch.save(TrainState(3, 11.2, YieldNet().state_dict()), f"{WORK}/ckpt/yieldnet_full.pt")
    print("prepared", WORK)


def condition_vector(r, a, bad):
    width = COND + 2 if a.fault == "condwidth" else COND
    c = torch.zeros(width)
    c[SOLVENTS[r["solvent"]]] = 1.0
    c[6] = (r["temp_c"] - 80.0) / 40.0
    c[7] = r["cat_mol_pct"] / 5.0
    return c


def fp_tensor(bits):
    v = torch.zeros(NBITS)
    v[torch.tensor(bits, dtype=torch.long)] = 1.0
    return v


def make_batch(rxns, conds, step, rank, a, bad):
    lo = (step * BATCH) % len(rxns)
    idx = list(range(lo, lo + BATCH))
    if bad and a.fault == "yieldstr" and step == 3:
        rxns[idx[7]]["yield"] = "n/a"
    if bad and a.fault == "fpindex" and step == 1:
        rxns[idx[11]]["r_bits"] = rxns[idx[11]]["r_bits"][:-1] + [731]
    if bad and a.fault == "nanyield" and step == 2:
        rxns[idx[4]]["yield"] = "100.0"
    rfp = torch.stack([fp_tensor(rxns[i]["r_bits"]) for i in idx])
    pfp = torch.stack([fp_tensor(rxns[i]["p_bits"]) for i in idx])
    y = torch.tensor([float(rxns[i]["yield"]) for i in idx])
    return rfp, pfp, conds[idx], y


def tanimoto_matrix(rxns, budget):
    t0 = time.time()
    rows = 0
    sets = [set(r["p_bits"]) for r in rxns]
    while time.time() - t0 < budget:
        for s in sets:
            row = [len(s & t) / max(1, len(s | t)) for t in sets]
            rows += 1
            if max(row) > 1.0:
                raise ValueError("similarity above 1")
    return rows


def logit_yield(y):
    p = y / 100.0
    return torch.log(p) - torch.log1p(-p)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading reaction shard")
    split = "val/" if bad and a.fault == "nodata" else ""
    rxns = torch.load(f"{WORK}/rxn/{split}shard_{rank}.pt")
    if bad and a.fault == "solvent":
        rxns[19]["solvent"] = "HFIP"
    conds = torch.stack([condition_vector(r, a, bad) for r in rxns])
    model = YieldNet()
    ck = {"ckptwidth": "yieldnet_fp1024.pt", "ckptpickle": "yieldnet_full.pt"}.get(a.fault, "yieldnet_fp512.pt")
    if not bad:
        ck = "yieldnet_fp512.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    say(f"rank {rank}: {len(rxns)} reactions, model from ckpt/{ck}")
    maes = []
    for step in range(a.steps):
        rfp, pfp, c, y = make_batch(rxns, conds, step, rank, a, bad)
        target = logit_yield(y)
        pred = net(rfp, pfp, c)
        loss = ((pred - target) ** 2).mean()
        if not torch.isfinite(loss):
            n = int((~torch.isfinite(target)).sum())
            say(f"rank {rank}: step {step} loss is {loss.item()} ({n} non-finite logit targets, "
                f"max yield {y.max().item():.1f})", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowsim" and step == 3:
            rows = tanimoto_matrix(rxns, a.sim_budget)
            say(f"rank {rank} tanimoto rows computed: {rows}")
        mae = (torch.sigmoid(pred.detach()) * 100 - y).abs().mean().reshape(1)
        dist.all_reduce(mae)
        maes.append(mae.item() / world)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae_yield {mae.item() / world:.2f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bad and a.fault == "exit4" and step == 4:
            say(f"rank {rank}: ERROR reaction {step * BATCH + 9} has 3 unmapped product atoms "
                f"(atom mapping incomplete); aborting this shard", err=True)
            sys.exit(4)
    ys = torch.tensor([float(r["yield"]) for r in rxns])
    stats = torch.tensor([ys.mean(), ys.std(), float(len(rxns))])
    if bad and a.fault == "statgather":
        stats = torch.tensor([ys.mean(), ys.std(), ys.max(), float(len(rxns))])
    gathered = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(gathered, stats)
    say(f"rank {rank} yield stats mean {stats[0]:.1f} std {stats[1]:.1f}; "
        f"global mean {sum(s[0] for s in gathered) / world:.1f}")
    if rank == 0:
        os.makedirs(f"{WORK}/results", exist_ok=True)
        torch.save({"model": model.state_dict(), "mae": maes}, f"{WORK}/results/yieldnet.pt")
        say(f"rank 0 done: {a.steps} steps, final mae {maes[-1]:.2f}, saved results/yieldnet.pt")
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
    p = argparse.ArgumentParser(description="reaction yield prediction from reaction fingerprints (DDP, gloo)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--sim-budget", type=int, default=40)
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

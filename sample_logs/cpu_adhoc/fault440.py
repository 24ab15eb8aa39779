"""Batch 440 hand-run fault script: LEDGER ANOMALY DETECTION IN BANK TRANSACTIONS.

Synthetic bank ledgers: each transaction has an account id (0-63), a merchant category code (looked up in an
8-entry MCC table), a channel (card, wire, ach, atm), a currency (converted to USD with an FX table), an amount
stored as text, an hour and a balance delta, and a label (1 = anomalous posting).  Every rank reads its ledger
from /tmp/fault440_work/ledger/ledger_R.pt and trains a small classifier (account, MCC and channel embeddings
plus 6 numeric features, a 2-layer MLP, BCE loss) in batches of 64, wrapped in DDP over gloo (or, with --ddp 0,
gradients all_reduced by hand).  The model starts from ckpt/ledger_n6.pt.  Per-rank flag counts per channel are
all_gathered at start-up, the loss and flag precision are all_reduced every step, the flag totals are
all_reduced at the end, and rank 0 saves export/ledger_clf.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults (--fault NAME --rank R; R = -1 means every rank):
  mcc        - rank N's ledger has MCC "7995" (betting), not in the MCC table (KeyError at start-up)
  amount     - rank N's ledger has an amount written "1,250.00" (ValueError in float() at start-up)
  acctidx    - rank N's ledger has account 64, newly opened, beyond the 64-row embedding (IndexError, step 0)
  noledger   - rank N reads ledger/2026-12/ledger_N.pt, which does not exist (FileNotFoundError)
  ckptwidth  - rank N initialises from ckpt/ledger_n8.pt, saved with 8 numeric features (size mismatch)
  ckptmeta   - rank N initialises from ckpt/ledger_meta.pt, which pickles a LedgerMeta object (weights_only)
  flaggather - rank N all_gathers its flag counts with a fifth "crypto" channel (5 vs 4 entries)
  reconcile  - rank N re-reconciles every account balance in Python before the step-3 all_reduce (slow)
  fxzero     - rank N's FX refresh at step 3 has JPY = 0.0: amounts become inf, the loss check raises
  sigsegv    - rank N sends itself SIGSEGV after step 2
  exit5      - after the last step rank N's balance audit prints its own ERROR line and calls sys.exit(5)
  featwidth  - every rank: 8 numeric features (two extra flags), the MLP expects 6 (shape error, step 0)
  none       - control, clean run

What happened (filled in after the runs):
  mcc        - KeyError: '7995' in featurise before the first all_gather; peers Connection closed (np4 r2 bashloop exit 1,
               np6 r0 tee: Root Cause rank 0)
  amount     - ValueError: could not convert string to float: '1,250.00'; peers Connection closed (np3 r1 mpitag, port 20521;
               the first try on 20502 was dropped: my mpitag wrapper double-tagged stderr and exited 0)
  acctidx    - IndexError: index out of range in self at step 0; np5 r3 ranklabel: peers Connection closed, rank 0 a 12 s send
               timeout, loop exit 0 (sed's status); np3 r0 spawn: ProcessRaisedException for process 0
  noledger   - rank1.log FileNotFoundError for ledger/2026-12/ledger_1.pt; the other rank files Connection closed (np4 r1 files)
  ckptwidth  - size mismatch for mlp.0.weight [32,30] vs [32,28] after the all_gather; np4 r2 pdsh2: worker-1's ranks Connection
               closed, its Root Cause rank 1 (cascade); np3 r1 legacy: peers SIGTERMed, Root Cause rank 1
  ckptmeta   - UnpicklingError 'Weights only load failed', Unsupported global __main__.LedgerMeta; 5 peers closed (np6 r5 srunlabel)
  flaggather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank N; peers closed
               (np3 r2 logfmt, np8 r6 bashloop)
  reconcile  - np3 r1 srunlabel (budget 25 s): ranks 0, 2 'Timed out waiting 12000ms' in the step-3 all_reduce, rank 1 then
               Connection closed; np4 r2 bashloop (PG 300 s): silent after step 2, killed by timeout at 60 s, exit 124
  fxzero     - 'non-finite loss at step 3 (N non-finite amount features)', FloatingPointError; peers closed (np4 r3 logfmt
               --ddp 0, np5 r0 mpitag)
  sigsegv    - no traceback after step 2; spawn 'process 1 terminated with signal SIGSEGV' (np4 r1); bash 'Segmentation
               fault', loop exit 139 (np6 r4 ranklabel)
  exit5      - 'ERROR rank N: ledger does not balance ...' and exit 5; peers closed in the final all_reduce (np3 r2 tee: Root
               Cause rank 2 exitcode 5; np4 r1 pdsh2: worker-1 Root Cause rank 1 exitcode 5, worker-0 rank 2 exitcode 1)
  featwidth  - every rank: 'mat1 and mat2 shapes cannot be multiplied (64x30 and 28x32)' at step 0; Root Cause rank 1 (np3 legacy)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/ledger_clf.pt, exit 0 (np3 files)
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

WORK = "/tmp/fault440_work"
MCC = {"5411": 0, "5812": 1, "5541": 2, "4829": 3, "6011": 4, "5999": 5, "4900": 6, "7011": 7}
CHANNELS = ["card", "wire", "ach", "atm"]
FX = {"USD": 1.0, "EUR": 1.08, "GBP": 1.27, "JPY": 0.0067}
NACCT = 64
NUM = 6
BATCH = 64
log = None


class LedgerMeta:
    def __init__(self, version, cutoff):
        self.version = version
        self.cutoff = cutoff


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
    log = logging.getLogger("ledger")
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


class LedgerNet(nn.Module):
    def __init__(self, num=NUM):
        super().__init__()
        self.acct = nn.Embedding(NACCT, 8)
        self.mcc = nn.Embedding(len(MCC), 8)
        self.chan = nn.Embedding(len(CHANNELS), 6)
        self.mlp = nn.Sequential(nn.Linear(22 + num, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, acct, mcc, chan, num):
        h = torch.cat([self.acct(acct), self.mcc(mcc), self.chan(chan), num], 1)
        return self.mlp(h).squeeze(1)


def make_ledger(n, seed):
    g = torch.Generator().manual_seed(seed)
    codes, curs = list(MCC), list(FX)
    txns = []
    for _ in range(n):
        amt = float(torch.rand(1, generator=g)) * 900 + 5
        anom = bool(torch.rand(1, generator=g) < 0.12)
        if anom:
            amt *= 8
        txns.append({"acct": int(torch.randint(0, NACCT, (1,), generator=g)),
                     "mcc": codes[int(torch.randint(0, 8, (1,), generator=g))],
                     "channel": CHANNELS[int(torch.randint(0, 4, (1,), generator=g))],
                     "cur": curs[int(torch.randint(0, 4, (1,), generator=g))],
                     "amount": f"{amt:.2f}", "hour": int(torch.randint(0, 24, (1,), generator=g)),
                     "dbal": float(torch.randn(1, generator=g)), "label": int(anom)})
    return txns


def prepare():
    os.makedirs(f"{WORK}/ledger", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_ledger(256, 440 + r), f"{WORK}/ledger/ledger_{r}.pt")
    torch.manual_seed(0)
    torch.save(LedgerNet(6).state_dict(), f"{WORK}/ckpt/ledger_n6.pt")
    torch.save(LedgerNet(8).state_dict(), f"{WORK}/ckpt/ledger_n8.pt")
    torch.save({"state": LedgerNet(6).state_dict(), "meta": LedgerMeta(3, "2026-11-30")},
               f"{WORK}/ckpt/ledger_meta.pt")
    print("prepared", WORK)


def featurise(txns, fx, extra):
    acct, mcc, chan, num, y = [], [], [], [], []
    for t in txns:
        rate = fx[t["cur"]]
        usd = float(t["amount"]) * rate if rate > 0 else float("inf")
        row = [math.log1p(usd) / 8, math.sin(t["hour"] / 24 * 2 * math.pi), math.cos(t["hour"] / 24 * 2 * math.pi),
               t["dbal"], float(t["cur"] != "USD"), float(t["hour"] < 6)]
        if extra:
            row += [float(t["channel"] == "wire"), float(usd > 5000)]
        acct.append(t["acct"])
        mcc.append(MCC[t["mcc"]])
        chan.append(CHANNELS.index(t["channel"]))
        num.append(row)
        y.append(float(t["label"]))
    return (torch.tensor(acct), torch.tensor(mcc), torch.tensor(chan), torch.tensor(num), torch.tensor(y))


def reconcile(txns, budget):
    t0 = time.time()
    passes = 0
    while time.time() - t0 < budget:
        bal = {}
        for t in txns:
            for k in range(200):
                bal[t["acct"]] = bal.get(t["acct"], 0.0) + float(t["amount"]) * (1 if k % 2 else -1)
        passes += 1
    return passes


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4400 + rank)
    say(f"rank {rank}/{world} up, loading ledger")
    sub = "2026-12/" if bad and a.fault == "noledger" else ""
    txns = torch.load(f"{WORK}/ledger/{sub}ledger_{rank}.pt")
    if bad and a.fault == "mcc":
        txns[37]["mcc"] = "7995"
    if bad and a.fault == "amount":
        txns[112]["amount"] = "1,250.00"
    if bad and a.fault == "acctidx":
        txns[9]["acct"] = NACCT
    fx = dict(FX)
    feats = featurise(txns, fx, a.fault == "featwidth")
    counts = torch.tensor([float(sum(t["label"] for t in txns if t["channel"] == c)) for c in CHANNELS])
    if bad and a.fault == "flaggather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} flagged {int(counts.sum())} of {len(txns)} global {int(sum(c.sum() for c in allc))}")
    model = LedgerNet()
    ck = {"ckptwidth": "ledger_n8.pt", "ckptmeta": "ledger_meta.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'ledger_n6.pt'}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    lossf = nn.BCEWithLogitsLoss()
    for step in range(a.steps):
        if bad and a.fault == "fxzero" and step == 3:
            fx["JPY"] = 0.0
            say(f"rank {rank} FX refresh at step {step}: {fx}")
            feats = featurise(txns, fx, False)
        sl = slice((step % 4) * BATCH, (step % 4 + 1) * BATCH)
        acct, mcc, chan, num, y = (f[sl] for f in feats)
        logit = net(acct, mcc, chan, num)
        loss = lossf(logit, y)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss at step {step} ({int((~torch.isfinite(num)).sum())} non-finite "
                f"amount features)", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "reconcile" and step == 3:
            n = reconcile(txns, a.slow_budget)
            say(f"rank {rank} reconciliation: {n} passes")
        flags = (logit.detach() > 0).float()
        prec = ((flags * y).sum() / flags.sum().clamp(min=1)).reshape(1)
        stat = torch.cat([loss.detach().reshape(1), prec])
        dist.all_reduce(stat)
        say(f"rank {rank} step {step} loss {stat[0].item() / world:.4f} precision {stat[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"ERROR rank {rank}: ledger does not balance: debits 1,204,331.17 != credits 1,204,329.95 "
            f"(diff 1.22) on account 41; refusing to publish flags", err=True)
        sys.exit(5)
    tot = counts.reshape(-1)[:4].clone()
    dist.all_reduce(tot)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/ledger_clf.pt")
        say(f"rank 0 done: {a.steps} steps, {int(tot.sum())} flagged postings, saved export/ledger_clf.pt")
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
    p.add_argument("--slow-budget", type=int, default=40)
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

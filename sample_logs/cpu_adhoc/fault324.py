"""A three-hundred-and-twenty-fourth hand-run batch: STOCK RETURN RANKING WITH A CROSS-SECTIONAL TRANSFORMER.

Synthetic daily return panels: every rank reads /tmp/fault324_work/panel/panel_R.pt (80 days x 48 stocks of
returns from a one-factor model, plus each stock's ticker and GICS sector name).  For a trading day d the
features of a stock are its last 12 daily returns; the target is the next day's return, z-scored across the
stocks of that day.  A cross-sectional transformer (a feature projection plus a sector embedding, two encoder
layers attending over the 48 stocks of a day, a linear scoring head) is trained with a listwise softmax
ranking loss, wrapped in DDP (gloo) or with gradients all_reduced by hand (--ddp 0).  The model starts from
ckpt/xsformer_d24.pt.  Per-rank universe statistics are all_gathered at the start, the loss and the
information coefficient (IC) are all_reduced every step, a final evaluation IC is all_reduced at the end and
rank 0 saves export/xsformer.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  sector    - rank N's panel has a ticker reclassified to sector "Crypto", missing from the sector table (KeyError)
  nopanel   - rank N reads panel/adjusted/panel_N.pt, which was never written (FileNotFoundError)
  ckptdim   - rank N initialises from ckpt/xsformer_d32.pt, saved with d_model 32 (size mismatch)
  ckptmeta  - rank N initialises from ckpt/xsformer_meta.pt, which pickles a RunConfig object (weights_only refusal)
  universe  - rank N all_gathers 5 universe statistics (an extra delisted count) instead of 4
  backtest  - rank N runs a Python walk-forward backtest before the step-2 all_reduce (slow; the others time out)
  zerovol   - rank N's step-4 batch holds a market-halt day (all returns 0): z-scored targets NaN, the program's check
  sigsegv   - rank N sends itself SIGSEGV after step 3
  halt      - rank N prints its own error line about a trading halt at the final evaluation and calls sys.exit(4)
  lookback  - every rank: features built from a 14-day lookback, the projection expects 12 (shape error)
  dayidx    - rank N's step-3 sampler draws the last day, whose next-day target is past the panel (IndexError)
  none      - control, clean run

What happened (filled in after the runs):
  sector    - KeyError: 'Crypto' in the sector lookup at start-up; peers Connection closed in all_gather (np4 r2 ranklabel, np3 r0 spawn)
  nopanel   - FileNotFoundError for panel/adjusted/panel_N.pt at start-up; peers closed (np5 r3 srunlabel, np3 r1 logfmt)
  ckptdim   - load_state_dict size mismatch proj.weight [32, 12] vs [24, 12] and the rest (np4 r1 pdsh2, np3 r2 legacy)
  ckptmeta  - UnpicklingError 'Weights only load failed ... GLOBAL __main__.RunConfig'; peers closed in DDP init (np3 r1 mpitag, np4 r0 tee)
  universe  - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))'; peers closed (np4 r1 bashloop, np5 r4 files)
  backtest  - 12 s: ranks 0, 2 'Timed out waiting 12000ms' (np3 r1 mpitag); 300 s: output stops after step 1, killed at 60 s, 124 (np4 r2 ranklabel)
  zerovol   - the check: '48 non-finite targets', FloatingPointError at step 4 (np4 r3 spawn; np3 r0 tee, Root Cause rank 1 SIGABRT)
  sigsegv   - no traceback after step 3; bash 'Segmentation fault', exit 139 (np4 r1 srunlabel); Root Cause rank 2 -11 SIGSEGV (np3 r2 legacy)
  halt      - rank N's trading-halt ERROR line and exit 4 at the end; peers closed in the final all_reduce (np5 r2 logfmt, np4 r0 files)
  lookback  - every rank: 'mat1 and mat2 shapes cannot be multiplied (384x14 and 12x24)' in the first forward (np4 pdsh2)
  dayidx    - IndexError 'index 80 is out of bounds for dimension 0 with size 80' at step 3; peers closed (np3 r0 bashloop, --ddp 0)
  none      - clean: 6 steps on 3 ranks, final eval, rank 0 saved export/xsformer.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault324_work"
SECTORS = {"Energy": 0, "Materials": 1, "Industrials": 2, "ConsumerDisc": 3, "ConsumerStaples": 4,
           "HealthCare": 5, "Financials": 6, "InfoTech": 7, "CommServices": 8, "Utilities": 9, "RealEstate": 10}
NDAYS, NSTOCK, LOOKBACK, DMODEL, BATCH_DAYS = 80, 48, 12, 24, 8
log = None


@dataclass
class RunConfig:
    d_model: int = DMODEL
    lookback: int = LOOKBACK
    universe: str = "synthetic-48"


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
    log = logging.getLogger("xsrank")
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


class XSFormer(nn.Module):
    """Scores every stock of a day by attending over the whole cross-section."""

    def __init__(self, feat=LOOKBACK, d=DMODEL, nsec=len(SECTORS)):
        super().__init__()
        self.proj = nn.Linear(feat, d)
        self.sector = nn.Embedding(nsec, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)

    def forward(self, x, sec):
        h = self.proj(x) + self.sector(sec).unsqueeze(0)
        return self.head(self.encoder(h)).squeeze(-1)


def make_panel(seed):
    g = torch.Generator().manual_seed(seed)
    market = torch.randn(NDAYS, 1, generator=g) * 0.01
    beta = 0.6 + 0.8 * torch.rand(1, NSTOCK, generator=g)
    ret = market * beta + torch.randn(NDAYS, NSTOCK, generator=g) * 0.02
    ret[1:] += 0.05 * ret[:-1]
    names = list(SECTORS)
    sectors = [names[int(i)] for i in torch.randint(0, len(names), (NSTOCK,), generator=g)]
    tickers = [f"S{seed % 100:02d}{k:03d}" for k in range(NSTOCK)]
    return {"ret": ret, "tickers": tickers, "sectors": sectors}


def prepare():
    for sub in ("panel", "ckpt"):
        os.makedirs(f"{WORK}/{sub}", exist_ok=True)
    for r in range(8):
        torch.save(make_panel(300 + r), f"{WORK}/panel/panel_{r}.pt")
    torch.manual_seed(0)
    sd = XSFormer().state_dict()
    torch.save(sd, f"{WORK}/ckpt/xsformer_d24.pt")
    torch.save(XSFormer(d=32).state_dict(), f"{WORK}/ckpt/xsformer_d32.pt")
    torch.save({"model": sd, "config": RunConfig()}, f"{WORK}/ckpt/xsformer_meta.pt")
    print("prepared", WORK)


def build_batch(ret, days, lookback):
    x = torch.stack([ret[d - lookback:d].T for d in days]) * 50.0
    y = torch.stack([ret[d + 1] for d in days])
    return x, y


def zscore(y):
    return (y - y.mean(1, keepdim=True)) / y.std(1, keepdim=True)


def rank_ic(score, y):
    s = score - score.mean(1, keepdim=True)
    t = y - y.mean(1, keepdim=True)
    return ((s * t).sum(1) / (s.norm(dim=1) * t.norm(dim=1) + 1e-8)).mean()


def walk_forward_backtest(ret, budget):
    """Pure-Python long-short backtest, re-sorting the universe every day (deliberately slow)."""
    rows = ret.tolist()
    t0, pnl, passes = time.time(), 0.0, 0
    while time.time() - t0 < budget:
        for d in range(LOOKBACK, len(rows) - 1):
            mom = [sum(rows[k][j] for k in range(d - LOOKBACK, d)) for j in range(NSTOCK)]
            order = sorted(range(NSTOCK), key=lambda j: mom[j])
            pnl += sum(rows[d + 1][j] for j in order[-10:]) - sum(rows[d + 1][j] for j in order[:10])
        passes += 1
    return pnl, passes


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading return panel")
    sub = "adjusted/" if bad and a.fault == "nopanel" else ""
    panel = torch.load(f"{WORK}/panel/{sub}panel_{rank}.pt")
    if bad and a.fault == "sector":
        panel["sectors"][17] = "Crypto"
    sec = torch.tensor([SECTORS[s] for s in panel["sectors"]])
    ret = panel["ret"]
    lookback = 14 if a.fault == "lookback" else LOOKBACK
    stats = torch.tensor([float(NSTOCK), float(NDAYS), ret.mean().item() * 1e4, ret.std().item() * 1e2])
    if bad and a.fault == "universe":
        stats = torch.cat([stats, torch.tensor([3.0])])
    allstats = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allstats, stats)
    say(f"rank {rank} universe {NSTOCK} stocks x {NDAYS} days, global {int(sum(s[0] for s in allstats))} stocks")
    model = XSFormer()
    ck = {"ckptdim": "xsformer_d32.pt", "ckptmeta": "xsformer_meta.pt"}.get(a.fault if bad else "", "xsformer_d24.pt")
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4)
    g = torch.Generator().manual_seed(77 + rank)
    for step in range(a.steps):
        days = (lookback + torch.randint(0, NDAYS - lookback - 1, (BATCH_DAYS,), generator=g)).tolist()
        if bad and a.fault == "dayidx" and step == 3:
            days[-1] = NDAYS - 1
        x, y = build_batch(ret, days, lookback)
        if bad and a.fault == "zerovol" and step == 4:
            y[2] = 0.0
        target = zscore(y)
        score = net(x, sec)
        loss = -(F.softmax(target / 0.5, dim=1) * F.log_softmax(score, dim=1)).sum(1).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite ranking loss at step {step} ({int((~torch.isfinite(target)).sum())} "
                f"non-finite targets, min cross-sectional std {y.std(1).min():.2e})", err=True)
            raise FloatingPointError(f"ranking loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "backtest" and step == 2:
            pnl, passes = walk_forward_backtest(ret, a.bt_budget)
            say(f"rank {rank} walk-forward backtest: {passes} passes, long-short pnl {pnl:.4f}")
        m = torch.tensor([loss.item(), rank_ic(score.detach(), y).item()])
        dist.all_reduce(m)
        say(f"rank {rank} step {step} loss {m[0].item() / world:.4f} ic {m[1].item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "halt":
        say(f"rank {rank}: ERROR trading halt on the evaluation day: 37 of {NSTOCK} tickers have no closing "
            f"price, refusing to score a partial cross-section", err=True)
        sys.exit(4)
    with torch.no_grad():
        x, y = build_batch(ret, list(range(NDAYS - 9, NDAYS - 1)), lookback)
        ev = rank_ic(model(x, sec), y).reshape(1)
    dist.all_reduce(ev)
    say(f"rank {rank} final eval ic {ev.item() / world:.4f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/xsformer.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/xsformer.pt")
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
    p.add_argument("--bt-budget", type=int, default=30)
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

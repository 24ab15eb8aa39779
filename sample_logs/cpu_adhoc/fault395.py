"""A three-hundred-and-ninety-fifth hand-run batch: FRAUD RING DETECTION ON TRANSACTION GRAPHS.

Synthetic payment ledgers as graphs: accounts are nodes (age, KYC tier, country risk), transactions are
directed edges carrying an amount, an hour and a merchant category code (looked up in a 10-entry MCC table).
Accounts in planted rings pass money around short cycles and are labelled fraud.  Every rank reads its
ledger shard from /tmp/fault395_work/ledger/shard_R.pt, builds node and edge features, and trains a small
edge-aware GraphSAGE (mean aggregation of edge-conditioned messages, two layers, a linear scorer) with a
weighted BCE loss, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model
starts from ckpt/sage_h16.pt.  Each rank all_gathers a 10-bin histogram of its accounts' risk scores at the
start, the loss and recall@k are all_reduced every step, and rank 0 saves export/ringsage.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  mcc        - rank N's shard has a transaction with MCC "6051x" (crypto ATM), missing from the MCC table (KeyError)
  nodeidx    - rank N's shard has a transaction to account 10_000, beyond its accounts (IndexError, first forward)
  noshard    - rank N reads its shard from ledger/day2/ which does not exist (FileNotFoundError, start-up)
  ckptsize   - rank N starts from ckpt/sage_h24.pt, saved with hidden size 24 (load_state_dict size mismatch)
  ckptpickle - rank N starts from ckpt/sage_meta.pt, a checkpoint pickled with a LedgerMeta object (weights_only)
  histbins   - rank N all_gathers a risk histogram with 11 bins instead of 10 (gloo allgather size error)
  cycles     - rank N enumerates every simple cycle up to length 7 in Python before the step-2 all_reduce
  nanloss    - rank N log-scales a refund (negative amount) at step 3: NaN loss, the program's own check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own reconciliation ERROR line at the end and calls sys.exit(4)
  edgefeat   - every rank: edge features 5 wide (a new chargeback flag), the message layer expects 4 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  mcc        - KeyError: '6051x' in featurise at start-up; peers 'Connection closed by peer' in the all_gather (np4 r2 plain, np6 r0 tee)
  nodeidx    - RuntimeError 'index 10000 is out of bounds for dimension 0 with size 120' in index_add_ of the first forward (np3 r1 tee_trainer, np4 r3 pdsh2)
  noshard    - FileNotFoundError ledger/day2/shard_N.pt at start-up; the redirects console shows only Root Cause rank 4 exitcode 1 (np5 r4 redirects, np3 r1 pymodule)
  ckptsize   - load_state_dict size mismatch [24, 7] vs [16, 7]; peers SIGTERMed; the restart fails the same way (np4 r1 loglevel, np3 r0 restart)
  ckptpickle - weights_only UnpicklingError (GLOBAL __main__.LedgerMeta), then 'terminate called', exitcode -6 (np6 r3 filter)
  histbins   - DETAIL: 'Detected mismatch between collectives' TensorShape [10] vs [11] on every rank (np4 r2 detail); plain gloo: the faulty rank's 'allgather: invalid tensor size' (np3 r1 wrapper)
  cycles     - 12 s: rank 1 'Timed out waiting 12000ms for recv' (np3 r2 prefix); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 plain)
  nanloss    - 'non-finite loss nan at step 3 (N non-finite edge features)' and FloatingPointError (np8 r5 tee, np3 r0 detail with monitoredBarrier errors on peers)
  sigsegv    - exitcode -11 after step 3, no traceback (np4 r2 wrapper); with --max-restarts 1 the restart failed at Gloo connectFullMesh (np3 r1 restart)
  exit4      - all 6 steps and rank 0's save, then rank 4's reconciliation ERROR line, Root Cause exitcode 4 (np6 r4 prefix)
  edgefeat   - every rank 'mat1 and mat2 shapes cannot be multiplied (424x8 and 7x16)'; Root Cause rank 0 (np3 loglevel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/ringsage.pt, exit 0 (np3 pymodule)
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

WORK = "/tmp/fault395_work"
MCC = {"5411": 0, "5812": 1, "5999": 2, "4829": 3, "6011": 4, "7995": 5, "5732": 6, "4111": 7, "5311": 8, "6540": 9}
NODE_F = 3
EDGE_F = 4
HID = 16
NACC = 120
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
    log = logging.getLogger("fraudring")
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


class EdgeSAGE(nn.Module):
    def __init__(self, din, dout, edim=EDGE_F):
        super().__init__()
        self.msg = nn.Linear(din + edim, dout)
        self.self_lin = nn.Linear(din, dout)

    def forward(self, h, src, dst, e):
        m = torch.relu(self.msg(torch.cat([h[src], e], 1)))
        agg = torch.zeros(h.shape[0], m.shape[1]).index_add_(0, dst, m)
        deg = torch.zeros(h.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0])).clamp(min=1)
        return torch.relu(self.self_lin(h) + agg / deg.unsqueeze(1))


class RingSAGE(nn.Module):
    def __init__(self, hid=HID):
        super().__init__()
        self.l1 = EdgeSAGE(NODE_F, hid)
        self.l2 = EdgeSAGE(hid, hid)
        self.score = nn.Linear(hid, 1)

    def forward(self, x, src, dst, e):
        h = self.l2(self.l1(x, src, dst, e), src, dst, e)
        return self.score(h).squeeze(1)


class LedgerMeta:
    def __init__(self, day, rows):
        self.day, self.rows = day, rows


def make_ledger(seed):
    g = torch.Generator().manual_seed(seed)
    codes = list(MCC)
    acc = {"age": torch.rand(NACC, generator=g).tolist(), "tier": torch.randint(0, 3, (NACC,), generator=g).tolist(),
           "crisk": torch.rand(NACC, generator=g).tolist()}
    label = [0] * NACC
    tx = []
    for _ in range(400):
        s, d = torch.randint(0, NACC, (2,), generator=g).tolist()
        tx.append({"src": s, "dst": d, "amount": float(torch.rand(1, generator=g)) * 300 + 1,
                   "hour": int(torch.randint(0, 24, (1,), generator=g)), "mcc": codes[int(torch.randint(0, 10, (1,), generator=g))]})
    for r in range(6):
        ring = torch.randperm(NACC, generator=g)[:4].tolist()
        for i, a in enumerate(ring):
            label[a] = 1
            tx.append({"src": a, "dst": ring[(i + 1) % 4], "amount": 950.0 + r, "hour": 3, "mcc": "4829"})
    return {"accounts": acc, "label": label, "tx": tx}


def prepare():
    for d in ("ledger", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_ledger(500 + r), f"{WORK}/ledger/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(RingSAGE(16).state_dict(), f"{WORK}/ckpt/sage_h16.pt")
    torch.save(RingSAGE(24).state_dict(), f"{WORK}/ckpt/sage_h24.pt")
    torch.save({"model": RingSAGE(16).state_dict(), "meta": LedgerMeta(2, 400)}, f"{WORK}/ckpt/sage_meta.pt")
    print("prepared", WORK)


def featurise(led, a, bad, step=None):
    acc = led["accounts"]
    x = torch.tensor([acc["age"], [t / 2 for t in acc["tier"]], acc["crisk"]]).t()
    src, dst, e = [], [], []
    for t in led["tx"]:
        amt = t["amount"]
        if bad and a.fault == "nanloss" and step == 3 and t["mcc"] == "6011":
            amt = -amt  # refunds arrive as negative amounts in day-2 data
        row = [math.log(amt) / 7 if amt > 0 else float(torch.log(torch.tensor(amt))),
               t["hour"] / 23, MCC[t["mcc"]] / 9, 1.0 if t["hour"] < 5 else 0.0]
        if a.fault == "edgefeat":
            row.append(0.0)
        src.append(t["src"])
        dst.append(t["dst"])
        e.append(row)
    return x, torch.tensor(src), torch.tensor(dst), torch.tensor(e)


def count_cycles(src, dst, maxlen=7):
    adj = {}
    for s, d in zip(src.tolist(), dst.tolist()):
        adj.setdefault(s, set()).add(d)
    total = 0
    for start in list(adj):
        stack = [(start, (start,))]
        while stack:
            v, path = stack.pop()
            for w in adj.get(v, ()):
                if w == start and len(path) > 2:
                    total += 1
                elif w > start and w not in path and len(path) < maxlen:
                    stack.append((w, path + (w,)))
    return total


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, loading ledger shard")
    day = "day2/" if bad and a.fault == "noshard" else ""
    led = torch.load(f"{WORK}/ledger/{day}shard_{rank}.pt")
    if bad and a.fault == "mcc":
        led["tx"][37]["mcc"] = "6051x"
    if bad and a.fault == "nodeidx":
        led["tx"][12]["dst"] = 10_000
    x, src, dst, e = featurise(led, a, bad)
    y = torch.tensor(led["label"], dtype=torch.float)
    risk = x[:, 2]
    hist = torch.histc(risk, bins=11 if bad and a.fault == "histbins" else 10, min=0, max=1)
    allh = [torch.zeros(10) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} accounts {NACC} tx {len(led['tx'])} ring accounts {int(y.sum())} "
        f"global high-risk {int(sum(h[8:].sum() for h in allh))}")
    model = RingSAGE()
    ck = {"ckptsize": "sage_h24.pt", "ckptpickle": "sage_meta.pt"}.get(a.fault, "sage_h16.pt") if bad else "sage_h16.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=5e-3)
    posw = (NACC - y.sum()) / y.sum().clamp(min=1)
    for step in range(a.steps):
        if bad and a.fault == "nanloss" and step == 3:
            x, src, dst, e = featurise(led, a, bad, step=step)
        logit = net(x, src, dst, e)
        loss = nn.functional.binary_cross_entropy_with_logits(logit, y, pos_weight=posw)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(e)).sum())} non-finite edge features)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "cycles" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.cycle_budget:
                n += count_cycles(src, dst)
            say(f"rank {rank} cycle census: {n} cycles")
        k = int(y.sum()) or 1
        top = logit.detach().topk(k).indices
        stats = torch.tensor([loss.item(), float(y[top].sum() / k)])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} recall@k {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR ledger reconciliation failed: shard {rank} debits 18432.77 != credits 18401.12 "
            f"after {a.steps} steps, refusing to export ring scores", err=True)
        sys.exit(4)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/ringsage.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/ringsage.pt")
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
    p.add_argument("--cycle-budget", type=int, default=45)
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

"""A three-hundred-and-fifty-second hand-run batch: MARKET BASKET NEXT-ITEM RECOMMENDATION.

Synthetic shopping baskets: each example is a history of 5 SKUs (strings such as "SKU-0042", looked up in a
200-entry item table, items.json) plus an 8-wide context (day-of-week one-hot and the hour scaled to [0,1]);
the target is the next SKU bought.  Every rank reads its baskets from /tmp/fault352_work/baskets/baskets_R.json
and trains BasketRec (item embeddings mean-pooled over the history, the context concatenated, a linear
layer, scores against the tied item embeddings) on a cross-entropy loss, wrapped in DDP over gloo (or, with
--ddp 0, gradients all_reduced by hand).  The model is initialised from ckpt/basketrec_v200.pt.  Per-rank
basket counts are all_gathered at the start, the loss and hit@10 are all_reduced every step, the per-rank
top-10 item counts are all_gathered at the end, and rank 0 saves export/basketrec.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badsku     - rank N merges its late-arrival delta file, which holds a discontinued SKU (KeyError, start-up)
  nobaskets  - rank N reads its baskets from baskets/holdout/, which does not exist (FileNotFoundError)
  ckptvocab  - rank N initialises from ckpt/basketrec_v240.pt, saved with a 240-item table (size mismatch)
  ckptpickle - rank N loads ckpt/basketrec_meta.pt, which pickles a VocabMeta object (weights_only refusal)
  topkgather - rank N all_gathers its top-11 item counts instead of top-10 at the end (collective mismatch)
  cooccur    - rank N rebuilds the item co-occurrence table in pure Python before the step-3 all_reduce
  stuck      - rank N waits at step 2 for a promo-calendar lock file that never appears (hang)
  lognan     - from step 4 rank N adds a log-popularity prior; some items have 0 sales: -inf logits, NaN loss
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N finds basket timestamps out of order after step 1, prints its own ERROR and exits 4
  ctxwidth   - every rank appends a 4-wide store one-hot to the context (12 wide, the layer expects 8)
  none       - control, clean run

What happened (filled in after the runs):
  badsku     - KeyError: 'SKU-9013' in load_baskets at start-up; peers Connection closed by peer in the first all_gather (np4 r2 plain, np6 r0 tee)
  nobaskets  - FileNotFoundError for baskets/holdout/baskets_N.json at start-up; peers Connection closed (np3 r1 pymodule, np4 r3 wrapper)
  ckptvocab  - load_state_dict size mismatch for bias [240] vs [200] and item_emb.weight; others SIGTERM (np4 r1 pdsh2, np3 r2 loglevel)
  ckptpickle - UnpicklingError 'Weights only load failed' (GLOBAL __main__.VocabMeta) on rank 0 at start-up (np3 r0 tee_trainer)
  topkgather - DETAIL: 'Detected mismatch between collectives' [11] vs [10] (np4 r1 detail); gloo 'invalid tensor size (expected (11), got (10))' (np6 r4 filter)
  cooccur    - slow rank silent after step 2; peers 'Timed out waiting 12000ms' at step 3 (np3 r2 plain, np4 r1 prefix)
  stuck      - all ranks print step 1 then nothing; killed by timeout at 60 s, SignalException signal 15, exit 124 (np4 r2 tee)
  lognan     - ERROR 'non-finite loss inf' then FloatingPointError at step 4 (np5 r3 redirects); restart attempt died in a start-up gloo timeout (np3 r1 restart)
  sigsegv    - no traceback after step 3; peers Connection reset; Root Cause exitcode -11 SIGSEGV (np4 r3 loglevel, np3 r0 pymodule)
  exit4      - rank N's ERROR line on out-of-order timestamps after step 1, Root Cause exitcode 4 (np6 r5 wrapper, np3 r2 tee_trainer)
  ctxwidth   - every rank 'mat1 and mat2 shapes cannot be multiplied (32x44 and 40x32)' in the first forward (np6 rall prefix)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/basketrec.pt, exit 0 (np3 filter)
"""
import argparse
import json
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault352_work"
NITEM = 200
HIST = 5
CTX = 8
DIM = 32
log = None


class VocabMeta:
    """Item-table metadata that an older exporter pickled next to the weights."""

    def __init__(self, n, version):
        self.n = n
        self.version = version


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
    log = logging.getLogger("basket")
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


class BasketRec(nn.Module):
    def __init__(self, nitem=NITEM, ctx=CTX, dim=DIM):
        super().__init__()
        self.item_emb = nn.Embedding(nitem, dim)
        self.mix = nn.Linear(dim + ctx, dim)
        self.bias = nn.Parameter(torch.zeros(nitem))

    def forward(self, hist, ctx, prior=None):
        h = self.item_emb(hist).mean(1)
        u = torch.tanh(self.mix(torch.cat([h, ctx], 1)))
        logits = u @ self.item_emb.weight.t() + self.bias
        if prior is not None:
            logits = logits + prior
        return logits


def sku(i):
    return "SKU-%04d" % i


def prepare():
    g = torch.Generator().manual_seed(352)
    os.makedirs(WORK + "/baskets", exist_ok=True)
    os.makedirs(WORK + "/deltas", exist_ok=True)
    os.makedirs(WORK + "/ckpt", exist_ok=True)
    with open(WORK + "/items.json", "w") as f:
        json.dump({sku(i): i for i in range(NITEM)}, f)
    for r in range(8):
        items = torch.randint(0, NITEM, (256, HIST + 1), generator=g)
        rows = []
        for k in range(256):
            rows.append({"hist": [sku(int(i)) for i in items[k, :HIST]], "next": sku(int(items[k, HIST])),
                         "dow": int(torch.randint(0, 7, (1,), generator=g)), "hour": int(torch.randint(0, 24, (1,), generator=g)),
                         "ts": 1700000000 + 60 * k})
        with open(WORK + "/baskets/baskets_%d.json" % r, "w") as f:
            json.dump(rows, f)
        delta = [dict(rows[0], hist=[sku(3), sku(17), "SKU-9013", sku(44), sku(5)])]
        with open(WORK + "/deltas/delta_%d.json" % r, "w") as f:
            json.dump(delta, f)
    torch.manual_seed(0)
    torch.save(BasketRec().state_dict(), WORK + "/ckpt/basketrec_v200.pt")
    torch.save(BasketRec(nitem=240).state_dict(), WORK + "/ckpt/basketrec_v240.pt")
    torch.save({"model": BasketRec().state_dict(), "meta": VocabMeta(NITEM, "2024.3")}, WORK + "/ckpt/basketrec_meta.pt")
    print("prepared", WORK)


def load_baskets(path, table, a, rank, fault):
    with open(path) as f:
        rows = json.load(f)
    if fault == "badsku":
        with open(WORK + "/deltas/delta_%d.json" % rank) as f:
            rows = rows + json.load(f)
    hist = torch.tensor([[table[s] for s in r["hist"]] for r in rows])
    nxt = torch.tensor([table[r["next"]] for r in rows])
    ctx = torch.zeros(len(rows), CTX + (4 if a.fault == "ctxwidth" else 0))
    for k, r in enumerate(rows):
        ctx[k, r["dow"]] = 1.0
        ctx[k, 7] = r["hour"] / 23.0
        if a.fault == "ctxwidth":
            ctx[k, CTX + k % 4] = 1.0
    return hist, nxt, ctx, rows


def cooccurrence(rows):
    table = {}
    t0 = time.time()
    passes = 0
    while time.time() - t0 < 30:
        for r in rows:
            items = r["hist"] + [r["next"]]
            for i in items:
                for j in items:
                    if i != j:
                        table[(i, j)] = table.get((i, j), 0) + 1
        passes += 1
    return table, passes


def run(a, rank, world):
    setup_log(rank, a.logfmt)
    mine = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    fault = a.fault if mine else "none"
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(1234 + rank)
    with open(WORK + "/items.json") as f:
        table = json.load(f)
    sub = "baskets/holdout" if fault == "nobaskets" else "baskets"
    hist, nxt, ctx, rows = load_baskets("%s/%s/baskets_%d.json" % (WORK, sub, rank), table, a, rank, fault)
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([len(rows)]))
    if rank == 0:
        say("baskets per rank: %s" % [int(c) for c in counts])

    model = BasketRec()
    if fault == "ckptvocab":
        state = torch.load(WORK + "/ckpt/basketrec_v240.pt")
    elif fault == "ckptpickle":
        state = torch.load(WORK + "/ckpt/basketrec_meta.pt")["model"]
    else:
        state = torch.load(WORK + "/ckpt/basketrec_v200.pt")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sales = torch.bincount(nxt[:64], minlength=NITEM).float()  # last week's sales: the first 64 baskets
    bs = 32
    for step in range(1, a.steps + 1):
        if fault == "cooccur" and step == 3:
            tab, passes = cooccurrence(rows)
            say("rank %d co-occurrence table: %d pairs after %d passes" % (rank, len(tab), passes))
        if fault == "stuck" and step == 2:
            lock = WORK + "/promo_calendar.lock"
            while not os.path.exists(lock):
                time.sleep(0.5)
        lo = ((step - 1) * bs) % len(rows)
        hb, cb, yb = hist[lo:lo + bs], ctx[lo:lo + bs], nxt[lo:lo + bs]
        prior = torch.log(sales / sales.sum()) if (fault == "lognan" and step >= 4) else None
        logits = net(hb, cb, prior)
        loss = F.cross_entropy(logits, yb)
        if not torch.isfinite(loss):
            bad = int((~torch.isfinite(logits)).sum())
            say("rank %d step %d: non-finite loss %s (%d non-finite logits, %d items with zero sales)"
                % (rank, step, float(loss), bad, int((sales == 0).sum())), err=True)
            raise FloatingPointError("non-finite loss at step %d on rank %d" % (step, rank))
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        hit = (logits.topk(10, 1).indices == yb[:, None]).any(1).float().mean()
        stats = torch.tensor([loss.item(), hit.item()])
        dist.all_reduce(stats)
        stats /= world
        say("rank %d step %d loss %.4f hit@10 %.3f" % (rank, step, stats[0], stats[1]))
        if fault == "exit4" and step == 1:
            ts = [r["ts"] for r in rows]
            say("ERROR rank %d: basket timestamps out of order in baskets_%d.json (row 17: %d < %d); refusing to train"
                % (rank, rank, ts[16] - 7200, ts[16]), err=True)
            sys.exit(4)
        if fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)

    k = 11 if fault == "topkgather" else 10
    top = torch.bincount(hist.flatten(), minlength=NITEM).topk(k).values
    gathered = [torch.zeros(10, dtype=torch.long) for _ in range(world)]
    dist.all_gather(gathered, top)
    if rank == 0:
        os.makedirs(WORK + "/export", exist_ok=True)
        torch.save(model.state_dict(), WORK + "/export/basketrec.pt")
        say("rank 0 done: %d steps, top-item counts %s, saved export/basketrec.pt"
            % (a.steps, [int(t[0]) for t in gathered]))
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    try:
        run(a, rank, world)
    except Exception:
        if log is not None:
            log.exception("rank %d failed", rank)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser(description="next-item recommendation over market baskets")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()

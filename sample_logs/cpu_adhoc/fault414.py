"""A four-hundred-and-fourteenth hand-run batch: ORDER BOOK MID-PRICE FORECASTING.

Synthetic limit order books: every rank reads its snapshots from /tmp/fault414_work/books/book_R.pt (10 bid and
10 ask levels of price and size, a venue code per snapshot, the symbol's tick size).  Prices are turned into
tick distances from the mid, sizes into log1p, and a window of 8 snapshots feeds a small LSTM (plus a venue
embedding looked up in a 4-entry venue table) that forecasts the mid-price move in ticks at 3 horizons
(MSE loss).  The model is initialised from ckpt/lob_l10.pt and wrapped in DDP over gloo (or, with --ddp 0,
its gradients are all_reduced by hand).  The loss and the directional hit rate are all_reduced every step;
at the end each rank's spread histogram (8 buckets, in ticks) is all_gathered and rank 0 saves
export/lob_forecaster.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  venue        - rank N's feed contains snapshots from venue "XBAT", missing from the venue table (KeyError, start-up)
  nobook       - rank N reads books/archive/book_N.pt, which does not exist (FileNotFoundError, start-up)
  ckptlevels   - rank N initialises from ckpt/lob_l20.pt, trained on 20 levels (size mismatch, start-up)
  ckptpickle   - rank N loads ckpt/lob_l10_full.pt, which pickles a LobNormaliser object (weights_only refusal)
  horizon      - every rank builds targets for 5 horizons, the head forecasts 3 (shape error in the loss, step 0)
  level        - rank N computes the microprice from depth level 10 of a 10-level book at step 2 (IndexError)
  replay       - rank N replays the whole message queue in pure Python before the step-3 all_reduce (slow rank)
  segv         - rank N sends itself SIGSEGV after step 3
  zerotick     - rank N reloads its tick table at step 4 with tick size 0: inf features, the program's check
  spreadgather - rank N all_gathers a 9-bucket spread histogram at the end (the others 8)
  halt         - rank N prints its own error about a trading halt at the end and calls sys.exit(4)
  none         - control, clean run

What happened (filled in after the runs):
  venue        - KeyError: 'XBAT' in the venue lookup at start-up; peers SIGTERMed in DDP's first broadcast (np4 r2 plain, np6 r0 tee)
  nobook       - FileNotFoundError for books/archive/book_N.pt at start-up (np5 r4 pymodule); console only Root Cause rank 1 exitcode 1, the traceback in rank 1's stderr.log (np3 r1 redirects)
  ckptlevels   - load_state_dict size mismatch for inp.weight [24, 84] vs [24, 44] (np3 r2 restart: both attempts; np4 r1 pdsh2: node 1's agent then RendezvousConnectionError)
  ckptpickle   - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.LobNormaliser' (np4 r3 loglevel, np3 r0 tee_trainer)
  horizon      - every rank 'The size of tensor a (3) must match the size of tensor b (5) at non-singleton dimension 1' at step 0; Root Cause rank 1 (np3 plain)
  level        - IndexError 'index 10 is out of bounds for dimension 1 with size 10' at step 2; peers Connection closed by peer (np8 r5 prefix, np3 r0 loglevel)
  replay       - 12 s: ranks 0/2 'Timed out waiting 12000ms' for recv/send in the step-3 all_reduce, rank 1 SIGTERMed, Root Cause rank 0 (np3 r1 plain); 300 s: silent after step 2, timeout at 60 s, exit 124 (np4 r2 wrapper)
  segv         - no traceback; peers 'Connection reset by peer' at step 4; Root Cause rank 2 exitcode -11 (SIGSEGV) (np4 r2 tee)
  zerotick     - '21120 non-finite book features after tick reload (tick size 0.0)', FloatingPointError at step 4 (np5 r3 tee_trainer)
  spreadgather - DETAIL: every rank 'Detected mismatch between collectives', rank 3 TensorShape=[9], Root Cause rank 1 (np6 r3 detail); 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' (np3 r1 filter)
  halt         - rank N's LULD-halt ERROR line and exit 4 after 6 steps; peers Connection closed in the final all_gather; Root Cause exitcode 4 (np6 r4 pymodule, np3 r2 filter)
  none         - clean: 6 steps on 3 ranks, rank 0 saved export/lob_forecaster.pt, exit 0 (np3 prefix)
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

WORK = "/tmp/fault414_work"
VENUES = {"XNAS": 0, "ARCX": 1, "BATS": 2, "IEXG": 3}
LEVELS = 10
WIN = 8
HORIZONS = (1, 5, 20)
HID = 24
NBUCKET = 8
log = None


class LobNormaliser:
    def __init__(self, tick, size_scale):
        self.tick = tick
        self.size_scale = size_scale


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
    log = logging.getLogger("lob")
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


class LobForecaster(nn.Module):
    def __init__(self, levels=LEVELS, hid=HID, nout=len(HORIZONS)):
        super().__init__()
        self.venue = nn.Embedding(len(VENUES), 4)
        self.inp = nn.Linear(4 * levels + 4, hid)
        self.lstm = nn.LSTM(hid, hid, batch_first=True)
        self.head = nn.Linear(hid, nout)

    def forward(self, x, v):
        h = torch.relu(self.inp(torch.cat([x, self.venue(v)], dim=-1)))
        out, _ = self.lstm(h)
        return self.head(out[:, -1])


def make_book(n, seed, levels=LEVELS):
    g = torch.Generator().manual_seed(seed)
    tick = 0.01
    mid = 100.0 + torch.cumsum(torch.randn(n, generator=g) * 0.5 * tick, 0)
    half = tick * (1 + torch.randint(0, 3, (n,), generator=g)).float() / 2
    steps = torch.arange(levels).float() * tick
    bid_px = (mid - half).unsqueeze(1) - steps
    ask_px = (mid + half).unsqueeze(1) + steps
    bid_sz = torch.randint(1, 50, (n, levels), generator=g).float() * 100
    ask_sz = torch.randint(1, 50, (n, levels), generator=g).float() * 100
    venues = [list(VENUES)[int(i)] for i in torch.randint(0, 4, (n,), generator=g)]
    return {"bid_px": bid_px, "ask_px": ask_px, "bid_sz": bid_sz, "ask_sz": ask_sz, "venue": venues,
            "tick": tick, "symbol": "MKBK"}


def prepare():
    os.makedirs(f"{WORK}/books", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_book(160, 700 + r), f"{WORK}/books/book_{r}.pt")
    torch.manual_seed(0)
    torch.save(LobForecaster(10).state_dict(), f"{WORK}/ckpt/lob_l10.pt")
    torch.save(LobForecaster(20).state_dict(), f"{WORK}/ckpt/lob_l20.pt")
    torch.save({"model": LobForecaster(10).state_dict(), "normaliser": LobNormaliser(0.01, 100.0)},
               f"{WORK}/ckpt/lob_l10_full.pt")
    print("prepared", WORK)


def features(book, tick, bad, a):
    mid = (book["bid_px"][:, 0] + book["ask_px"][:, 0]) / 2
    bid_d = (mid.unsqueeze(1) - book["bid_px"]) / tick
    ask_d = (book["ask_px"] - mid.unsqueeze(1)) / tick
    feats = torch.cat([bid_d, ask_d, torch.log1p(book["bid_sz"]), torch.log1p(book["ask_sz"])], dim=1)
    venue = torch.tensor([VENUES[v] for v in book["venue"]])
    hz = (1, 5, 10, 20, 50) if a.fault == "horizon" else HORIZONS
    n = feats.shape[0] - WIN - max(hz)
    x = torch.stack([feats[i:i + WIN] for i in range(n)])
    v = torch.stack([venue[i:i + WIN] for i in range(n)])
    y = torch.stack([(mid[i + WIN - 1 + torch.tensor(hz)] - mid[i + WIN - 1]) / tick for i in range(n)])
    return x, v, y, mid


def microprice(book, depth):
    bp, ap = book["bid_px"][:, depth], book["ask_px"][:, depth]
    bs, as_ = book["bid_sz"][:, depth], book["ask_sz"][:, depth]
    return (bp * as_ + ap * bs) / (bs + as_)


def replay_queue(book, budget):
    t0 = time.time()
    events = 0
    queue = {}
    while time.time() - t0 < budget:
        for i in range(book["bid_px"].shape[0]):
            for lvl in range(LEVELS):
                px = round(float(book["bid_px"][i, lvl]), 4)
                queue.setdefault(px, []).append(float(book["bid_sz"][i, lvl]))
                if len(queue[px]) > 64:
                    queue[px] = sorted(queue[px])[8:]
                events += 1
    return events


def spread_hist(book, tick, nb):
    spread = ((book["ask_px"][:, 0] - book["bid_px"][:, 0]) / tick).round().long().clamp(0, nb - 1)
    return torch.bincount(spread, minlength=nb).float()


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4140 + rank)
    say(f"rank {rank}/{world} up, loading order book snapshots")
    sub = "archive/" if bad and a.fault == "nobook" else ""
    book = torch.load(f"{WORK}/books/{sub}book_{rank}.pt")
    if bad and a.fault == "venue":
        for i in range(40, 160, 7):
            book["venue"][i] = "XBAT"
    tick = book["tick"]
    x, v, y, mid = features(book, tick, bad, a)
    say(f"rank {rank} {x.shape[0]} windows of {WIN} snapshots, {LEVELS} levels, tick {tick}")
    model = LobForecaster()
    if bad and a.fault == "ckptlevels":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/lob_l20.pt"))
    elif bad and a.fault == "ckptpickle":
        state = torch.load(f"{WORK}/ckpt/lob_l10_full.pt")
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/lob_l10.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        if bad and a.fault == "zerotick" and step == 4:
            say(f"rank {rank} reloading tick table for {book['symbol']}")
            tick = 0.0
            x, v, y, mid = features(book, tick, bad, a)
            nonfinite = int((~torch.isfinite(x)).sum())
            if nonfinite:
                say(f"rank {rank}: {nonfinite} non-finite book features after tick reload (tick size {tick})", err=True)
                raise FloatingPointError(f"non-finite order book features on rank {rank}")
        pred = net(x, v)
        loss = ((pred - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        depth = LEVELS if bad and a.fault == "level" and step == 2 else 0
        micro = microprice(book, depth)
        if bad and a.fault == "replay" and step == 3:
            say(f"rank {rank} replaying the message queue for queue positions")
            n = replay_queue(book, a.replay_budget)
            say(f"rank {rank} replayed {n} events")
        hit = ((pred.detach()[:, 0] > 0) == (y[:, 0] > 0)).float().mean()
        stats = torch.stack([loss.detach(), hit, (micro - mid).abs().mean() / max(tick, 1e-9)])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} hit {stats[1].item():.3f} "
            f"micro_dev {stats[2].item():.3f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "halt":
        say(f"rank {rank}: ERROR symbol {book['symbol']} halted (LULD pause) inside the evaluation window, "
            "refusing to publish forecasts", err=True)
        sys.exit(4)
    nb = NBUCKET + 1 if bad and a.fault == "spreadgather" else NBUCKET
    hist = spread_hist(book, tick, nb)
    allh = [torch.zeros(NBUCKET) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} spreads {hist[:3].tolist()} global one-tick share "
        f"{sum(h[1] for h in allh).item() / sum(h.sum() for h in allh).item():.3f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/lob_forecaster.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/lob_forecaster.pt")
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
    p.add_argument("--replay-budget", type=int, default=200)
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

"""A two-hundred-and-fifty-first hand-run batch: DEMAND FORECASTING FOR RETAIL WITH A TEMPORAL FUSION-LIKE MODEL.

Synthetic daily sales per store and item (6 stores x 4 items, 120 days, weekly and yearly seasonality, holiday
bumps) are generated per rank from a seed; calendar features (day of week, month, holiday flag) come from
/tmp/fault251_work/data/calendar.json, written by --prepare 1 together with ckpt/tft_init.pt.  Each series is
scaled by its mean sales; the model is a small gated residual network (GRN) over a 14-day lag window plus the
calendar features, with static covariate embeddings for store and item, and a linear head with one output per
quantile (10/50/90).  The quantile (pinball) loss is weighted per series by its scale and trained with DDP
(gloo); the weighted loss and the weights are all_reduced for the progress line `rank R step S loss L`.  At the
end every rank backtests the last 7 days, the per-store absolute error sums are all_gathered, the weighted
quantile loss is all_reduced and rank 0 prints the global WQL; barrier; destroy_process_group.
Launch with torchrun / a bash loop over ranks (env://), or --spawn N (torch.multiprocessing.spawn).

Faults:
  storeid  - rank N reads store ids 1-based: store 6 is beyond the 6-row static embedding (IndexError)
  quantiles- every rank: the quantile list has 5 levels, the head has 3 outputs (shape error in the loss)
  storegath- rank N includes its closed store 7: all_gather of 7 per-store sums against 6 (gloo size mismatch)
  calendar - rank N reads its calendar from data/calendar_2024.json which does not exist (FileNotFoundError)
  holiday  - rank N's region carries the holiday "Boxing Day", missing from the holiday map (KeyError)
  zeroscale- rank N's item 3 has no sales: scale 0, target inf, the loss goes nan; the program's check raises
  ckpt     - rank N initialises from ckpt/tft_init_q5.pt saved with 5 quantile outputs (size mismatch)
  backtest - rank N backtests every series one day at a time (--stall s) before the step-2 loss all_reduce
  segv     - rank N sends itself SIGSEGV after step 2's optimizer step
  exit4    - rank N prints its own error line about a negative sales row and calls sys.exit(4)
  none     - control, clean run

What happened (filled in after the runs):
  storeid  - rank N: IndexError index out of range in self (store_emb) at step 0; peers closed
  quantiles- every rank: RuntimeError size of tensor a (5) must match tensor b (3) in the pinball loss
  storegath- ring neighbour of rank N aborted: gloo EnforceNotMet preamble 14 vs 12 (SIGABRT); others reset
  calendar - rank N: FileNotFoundError data/calendar_2024.json at startup; peers closed in DDP init
  holiday  - rank N: KeyError 'Boxing Day' in load_calendar at startup; peers closed in DDP init
  zeroscale- rank N: FloatingPointError quantile loss is nan at step 0 (the finite check); peers closed
  ckpt     - rank N: RuntimeError size mismatch for head.weight [5, 16] vs [3, 16] loading tft_init_q5.pt
  backtest - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (exit 124)
  segv     - rank N: SIGSEGV after step 2 (spawn: ProcessExitedException; loop: exit 139); peers closed
  exit4    - rank N logs its ERROR negative sales row line, exit status 4 at step 1; peers closed
  none     - clean, exit 0, rank 0 printed per-store abs errors and global WQL 0.1751
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
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault251_work"
N_STORES, N_ITEMS, DAYS, LAGS = 6, 4, 120, 14
HOLIDAYS = {"none": 0, "New Year": 1, "Easter": 2, "Black Friday": 3, "Christmas": 4}


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class GRN(nn.Module):
    def __init__(self, d_in, d_hid, d_out, d_ctx=0):
        super().__init__()
        self.fc1 = nn.Linear(d_in + d_ctx, d_hid)
        self.fc2 = nn.Linear(d_hid, d_out * 2)
        self.skip = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x, ctx=None):
        h = torch.cat([x, ctx], -1) if ctx is not None else x
        h = nn.functional.elu(self.fc1(h))
        a, g = self.fc2(h).chunk(2, -1)
        return self.norm(self.skip(x) + a * torch.sigmoid(g))


class TinyTFT(nn.Module):
    def __init__(self, n_q=3, d=16):
        super().__init__()
        self.store_emb = nn.Embedding(N_STORES, 8)
        self.item_emb = nn.Embedding(N_ITEMS, 8)
        self.static = GRN(16, d, d)
        self.temporal = GRN(LAGS + 4, d, d, d_ctx=d)
        self.head = nn.Linear(d, n_q)

    def forward(self, lags, cal, store, item):
        s = self.static(torch.cat([self.store_emb(store), self.item_emb(item)], -1))
        return self.head(self.temporal(torch.cat([lags, cal], -1), s))


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs("ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(0)
    names = list(HOLIDAYS)[1:]
    cal = {"days": [{"dow": d % 7, "month": 1 + (d // 30) % 12,
                     "holiday": names[(d // 17) % 4] if d % 17 == 0 else "none"} for d in range(DAYS)]}
    with open(f"{WORK}/data/calendar.json", "w") as f:
        json.dump(cal, f)
    torch.manual_seed(0)
    torch.save(TinyTFT(3).state_dict(), "ckpt/tft_init.pt")
    torch.save(TinyTFT(5).state_dict(), "ckpt/tft_init_q5.pt")
    print("prepared", f"{WORK}/data/calendar.json", "ckpt/tft_init.pt", "ckpt/tft_init_q5.pt", g.initial_seed())


def make_sales(rank, a):
    g = torch.Generator().manual_seed(100 + rank)
    t = torch.arange(DAYS, dtype=torch.float32)
    base = 5 + 20 * torch.rand(N_STORES, N_ITEMS, 1, generator=g)
    week = 1 + 0.3 * torch.sin(2 * torch.pi * t / 7)
    year = 1 + 0.2 * torch.sin(2 * torch.pi * t / 365)
    sales = torch.poisson(base * week * year, generator=g)
    if a.fault == "zeroscale" and a.rank in (-1, rank):
        sales[:, 3, :] = 0.0
    return sales


def load_calendar(rank, a):
    path = f"{WORK}/data/calendar.json"
    if a.fault == "calendar" and a.rank in (-1, rank):
        path = f"{WORK}/data/calendar_2024.json"
    with open(path) as f:
        days = json.load(f)["days"]
    if a.fault == "holiday" and a.rank in (-1, rank):
        days[34]["holiday"] = "Boxing Day"
    feats = []
    for d in days:
        feats.append([torch.sin(torch.tensor(2 * torch.pi * d["dow"] / 7)).item(),
                      torch.cos(torch.tensor(2 * torch.pi * d["dow"] / 7)).item(),
                      d["month"] / 12.0, HOLIDAYS[d["holiday"]] / 4.0])
    return torch.tensor(feats)


def batch(sales, scale, cal, day, store_ids):
    lags = (sales[:, :, day - LAGS:day] / scale).reshape(-1, LAGS)
    target = (sales[:, :, day] / scale[..., 0]).reshape(-1)
    c = cal[day].expand(lags.shape[0], 4)
    store = store_ids.repeat_interleave(N_ITEMS)
    item = torch.arange(N_ITEMS).repeat(N_STORES)
    return lags, c, store, item, target


def pinball(pred, target, qs, w):
    q = torch.tensor(qs).view(1, -1)
    diff = target.unsqueeze(-1) - pred
    return ((torch.maximum(q * diff, (q - 1) * diff)).mean(-1) * w).sum()


def worker(rank, world, a):
    if a.spawn:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout), rank=rank, world_size=world)
    log = logging.getLogger("dmnd")
    if a.logfmt:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        h.addFilter(RankFilter(rank))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        say, err = log.info, log.error
    else:
        say = lambda m: print(m, flush=True)
        err = lambda m: print(m, file=sys.stderr, flush=True)
    mine = a.rank in (-1, rank)
    torch.manual_seed(rank)
    qs = [0.1, 0.5, 0.9] if not (a.fault == "quantiles" and mine) else [0.1, 0.25, 0.5, 0.75, 0.9]
    sales = make_sales(rank, a)
    cal = load_calendar(rank, a)
    scale = sales[:, :, :DAYS - 7].mean(-1, keepdim=True)
    weights = scale.reshape(-1)
    store_ids = torch.arange(N_STORES)
    if a.fault == "storeid" and mine:
        store_ids = store_ids + 1
    model = TinyTFT(3)
    ck = "ckpt/tft_init_q5.pt" if (a.fault == "ckpt" and mine) else "ckpt/tft_init.pt"
    model.load_state_dict(torch.load(ck, map_location="cpu"))
    say(f"rank {rank} loaded {ck}; {N_STORES} stores x {N_ITEMS} items, {DAYS} days, quantiles {qs}")
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    for step in range(a.steps):
        day = LAGS + 10 * step + rank
        lags, c, store, item, target = batch(sales, scale, cal, day, store_ids)
        pred = ddp(lags, c, store, item)
        loss = pinball(pred, target, qs, weights) / weights.sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: quantile loss is {loss.item()} at step {step} "
                                     f"(day {day}); aborting before the optimizer step")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 2 and a.fault == "segv" and mine:
            os.kill(os.getpid(), signal.SIGSEGV)
        if step == 1 and a.fault == "exit4" and mine:
            err(f"ERROR rank {rank}: {WORK}/data/sales_r{rank}.csv row 2291 (store 4, item 2, day 61) has "
                f"sales -17; refusing to scale series with negative demand")
            sys.exit(4)
        if step == 2 and a.fault == "backtest" and mine:
            say(f"rank {rank} backtesting all {N_STORES * N_ITEMS} series one day at a time before the sync")
            time.sleep(a.stall)
        stats = torch.stack([loss.detach() * weights.sum(), weights.sum()])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {(stats[0] / stats[1]).item():.4f}")
    with torch.no_grad():
        err_store = torch.zeros(N_STORES + (1 if (a.fault == "storegath" and mine) else 0))
        wql = torch.zeros(2)
        for day in range(DAYS - 7, DAYS):
            lags, c, store, item, target = batch(sales, scale, cal, day, torch.arange(N_STORES))
            pred = model(lags, c, store, item)
            e = (pred[:, 1] - target).abs() * weights
            err_store[:N_STORES] += e.view(N_STORES, N_ITEMS).sum(-1)
            wql += torch.stack([pinball(pred, target, [0.1, 0.5, 0.9], weights), (target.abs() * weights).sum()])
    gathered = [torch.zeros_like(err_store) for _ in range(world)]
    dist.all_gather(gathered, err_store)
    dist.all_reduce(wql)
    if rank == 0:
        say(f"rank 0 per-store abs error {[round(x, 1) for x in torch.stack(gathered).sum(0).tolist()]}; "
            f"global WQL {(wql[0] / wql[1]).item():.4f}")
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(a.spawn, a), nprocs=a.spawn)
        return
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

"""A two-hundred-and-seventeenth hand-run batch: SPARSE CLICK MODEL WITH EMBEDDING BAGS. A click-through-rate model
over synthetic sparse features: three nn.EmbeddingBag tables (user/ad in sum mode, context in mean mode) fed with
hashed ids and offsets built by hand, a dense MLP tower, a feature-hashing config file written by rank 0, DDP over
gloo, and log-loss plus a calibration ratio (sum of predictions / sum of clicks) all_reduced across ranks; rank 0
all_gathers the predictions for an AUC-like summary and saves a checkpoint.

Faults:
- bigidx: on --rank, one hashed user id equals the table size (embedding_bag index error).
- offsets: every rank (-1) builds the context offsets in the wrong order, so they are not increasing.
- hashcfg: --rank opens a hashing config file that does not exist (FileNotFoundError).
- featkey: --rank's feature list names 'device_type', missing from the table map (KeyError).
- gatherlen: --rank all_gathers its predictions with one extra element (gloo size mismatch).
- calib: --rank's eval shard has no clicks, the calibration denominator is 0; the program's check raises.
- ckptrows: --rank warm-starts from a checkpoint whose user table has 96 rows instead of 64 (size mismatch).
- batchenv: CTR_BATCH_SIZE is '2e3' on every rank (-1); int() raises ValueError.
- slowhash: --rank rebuilds its hash tables for --slow-s seconds before the loss all_reduce; the others time out.
- sigbus: --rank sends itself SIGBUS after step 2.
- exit4: --rank prints an error about its click log and calls sys.exit(4).
- none: control.

What happened (filled in after the runs):
- bigidx: rank N RuntimeError 'Index 3 of input takes value 64 which is not in the valid range [0, 64)' in embedding_bag at step 1.
- offsets: every rank RuntimeError 'offsets[0] has to be 0 ... However, got N' in embedding_bag at step 0 (np3, np4).
- hashcfg: rank N FileNotFoundError on /tmp/job_work/feature_hashing.v2.json after the barrier; peers Connection closed.
- featkey: rank N KeyError 'device_type' building its tables; peers Connection closed by peer (np4 r1, np3 r2).
- gatherlen: a peer aborts: gloo EnforceNotMet '50 vs 48 ... Received data size doesn't match expected size' (SIGABRT).
- calib: rank N FloatingPointError 'calibration ratio is inf on rank N: ... sum(clicks)=0' after 6 steps.
- ckptrows: rank N load_state_dict size mismatch for bags.user_id.weight [96, 8] vs [64, 8]; peers closed/SIGTERMed.
- batchenv: every rank ValueError invalid literal for int() with base 10: '2e3' before any step (np4).
- slowhash: PG 300 s: rank 1 rebuilds after step 1, others wait silently, killed by timeout 60 (exit 124); PG 12 s: see README.
- sigbus: rank N dies by SIGBUS after step 2 (exitcode -7; spawn: 'process 2 terminated with signal SIGBUS').
- exit4: rank N prints 'ERROR rank N: click log ... has 0 impressions after dedup ...' and exits 4; peers Connection closed.
- none: exit 0; rank 0 prints 'eval logloss 0.6331 calibration 1.108 ...' and saves /tmp/job_work/ctr_final.pt.
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

WORK = "/tmp/fault217_work"
TABLES = {"user_id": (64, "sum"), "ad_id": (48, "sum"), "context": (32, "mean")}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    return p.parse_args()


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def make_log(a, rank):
    if not a.logfmt:
        def out(msg, level="info"):
            print(msg, file=sys.stderr if level == "error" else sys.stdout, flush=True)
        return out
    logger = logging.getLogger("ctr")
    h = logging.StreamHandler(sys.stdout)
    h.addFilter(RankFilter(rank))
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    def out(msg, level="info"):
        getattr(logger, level)(msg)
    return out


class CTRModel(nn.Module):
    def __init__(self, tables, dim=8):
        super().__init__()
        self.bags = nn.ModuleDict({n: nn.EmbeddingBag(rows, dim, mode=mode) for n, (rows, mode) in tables.items()})
        self.dense = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.tower = nn.Sequential(nn.Linear(dim * len(tables) + 8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, sparse, dense):
        parts = [self.bags[n](idx, off) for n, (idx, off) in sparse.items()]
        return self.tower(torch.cat(parts + [self.dense(dense)], dim=1)).squeeze(1)


def hashed(gen, n, rows, per_row):
    lens = torch.randint(1, per_row + 1, (n,), generator=gen)
    idx = torch.randint(0, rows, (int(lens.sum()),), generator=gen)
    off = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens, 0)[:-1]])
    return idx, off


def make_batch(gen, bs, features, cfg, rank, a, step):
    sparse = {}
    for name in features:
        rows = cfg["rows"][name]
        idx, off = hashed(gen, bs, rows, cfg["per_row"])
        if name == "user_id" and a.fault == "bigidx" and rank == a.rank and step == 1:
            idx[3] = rows
        if name == "context" and a.fault == "offsets" and a.rank in (-1, rank):
            off = torch.flip(off, [0])
        sparse[name] = (idx, off)
    dense = torch.randn(bs, 4, generator=gen)
    clicks = (torch.rand(bs, generator=gen) < 0.3).float()
    return sparse, dense, clicks


def worker(rank, a, world):
    log = make_log(a, rank)
    faulty = a.rank in (-1, rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(WORK, exist_ok=True)
    cfg_path = os.path.join(WORK, "feature_hashing.json")
    if rank == 0:
        with open(cfg_path, "w") as f:
            json.dump({"rows": {n: r for n, (r, _) in TABLES.items()}, "per_row": 3,
                       "features": ["user_id", "ad_id", "context"]}, f)
    dist.barrier()
    if a.fault == "hashcfg" and faulty:
        cfg_path = os.path.join(WORK, "feature_hashing.v2.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    features = list(cfg["features"])
    if a.fault == "featkey" and faulty:
        features = ["user_id", "ad_id", "device_type"]
    tables = {n: TABLES[n] for n in features}
    if a.fault == "batchenv":
        os.environ["CTR_BATCH_SIZE"] = "2e3"
    bs = int(os.environ.get("CTR_BATCH_SIZE", "16"))
    log(f"rank {rank}: {len(tables)} embedding bags {dict((n, r) for n, (r, _) in tables.items())}, batch {bs}")
    torch.manual_seed(0)
    model = CTRModel(tables)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "ctr_init.pt"))
    dist.barrier()
    ckpt = os.path.join(WORK, "ctr_init.pt")
    if a.fault == "ckptrows" and faulty:
        other = CTRModel({**tables, "user_id": (96, "sum")})
        ckpt = os.path.join(WORK, f"ctr_init_rank{rank}_u96.pt")
        torch.save(other.state_dict(), ckpt)
    model.load_state_dict(torch.load(ckpt))
    log(f"rank {rank}: warm-started from {ckpt}")
    ddp = DDP(model)
    opt = torch.optim.Adagrad(ddp.parameters(), lr=0.05)
    lossf = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        sparse, dense, clicks = make_batch(gen, bs, features, cfg, rank, a, step)
        logits = ddp(sparse, dense)
        loss = lossf(logits, clicks)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if a.fault == "slowhash" and faulty and step == 2:
            log(f"rank {rank}: hash collision rate 0.41 on user_id, rebuilding hash tables with 2^22 buckets")
            time.sleep(a.slow_s)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        log(f"rank {rank} step {step} loss {lt.item() / world:.4f}")
        if a.fault == "sigbus" and faulty and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
    # evaluation: log-loss and calibration
    with torch.no_grad():
        sparse, dense, clicks = make_batch(gen, 24, features, cfg, rank, a, -1)
        if a.fault == "calib" and faulty:
            clicks = torch.zeros_like(clicks)
        pred = torch.sigmoid(ddp.module(sparse, dense))
        if a.fault == "exit4" and faulty:
            log(f"ERROR rank {rank}: click log {WORK}/clicks-part-{rank:05d}.tsv has 0 impressions after dedup; "
                "refusing to report calibration", "error")
            sys.exit(4)
        calib = pred.sum() / clicks.sum()
        if not torch.isfinite(calib):
            raise FloatingPointError(f"calibration ratio is {calib.item()} on rank {rank}: "
                                     f"sum(pred)={pred.sum().item():.3f} sum(clicks)={clicks.sum().item():.0f}")
        stats = torch.stack([nn.functional.binary_cross_entropy(pred, clicks) * len(clicks),
                             pred.sum(), clicks.sum(), torch.tensor(float(len(clicks)))])
        dist.all_reduce(stats)
        if a.fault == "gatherlen" and faulty:
            pred = torch.cat([pred, pred[:1]])
        gathered = [torch.empty(pred.numel()) for _ in range(world)]
        dist.all_gather(gathered, pred)
    if rank == 0:
        allp = torch.cat(gathered)
        log(f"eval logloss {stats[0].item() / stats[3].item():.4f} calibration {stats[1].item() / stats[2].item():.3f} "
            f"mean pCTR {allp.mean().item():.4f} over {allp.numel()} impressions")
        torch.save(ddp.module.state_dict(), os.path.join(WORK, "ctr_final.pt"))
        log(f"saved click model to {WORK}/ctr_final.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawned(i, a, n):
    os.environ.update(RANK=str(i), LOCAL_RANK=str(i), WORLD_SIZE=str(n))
    worker(i, a, n)


def main():
    a = parse()
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        mp.spawn(spawned, args=(a, a.spawn), nprocs=a.spawn)
        return
    worker(int(os.environ["RANK"]), a, int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()

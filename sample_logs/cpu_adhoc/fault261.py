"""A two-hundred-and-sixty-first hand-run batch: TABULAR ANOMALY DETECTION WITH DEEP SVDD.

Deep SVDD on synthetic card transactions: every rank owns a shard of 64 records (amount, hour, weekday,
previous transactions, distance from home, card age, a merchant category and a country code) with a few
injected outliers (huge amounts far from home at night).  Numeric features are standardised with
/tmp/fault261_work/stats/feature_stats.json, merchants encoded with encoders/merchant_map.json; a bias-free MLP
with merchant/country embeddings (initialised from ckpt/encoder.pt) maps records into a hypersphere around a
centre computed at start-up from a warm-up fraction of each shard and all_reduced once.  The loss is the mean
squared distance to the centre; the model is wrapped in DDP (gloo) or, with --ddp 0, gradients are all_reduced
by hand; the loss is all_reduced for the log.  At the end the anomaly scores and labels of every rank are
all_gathered and rank 0 prints the AUC.

Faults:
  emptywarm - rank N reads the warm-up fraction as a percent twice: 0 warm-up records, NaN centre (program check)
  scorelen  - rank N scores only its held-out records: all_gathers 48 scores against 64 (gloo size mismatch)
  stats     - rank N reads stats/feature_stats_v2.json which does not exist (FileNotFoundError)
  merchant  - rank N's shard has a merchant category missing from the encoder map (KeyError)
  country   - rank N adds the region offset 8 to country codes: index 10 beyond the 10-row embedding (IndexError)
  repwidth  - every rank: centre computed from the trunk (24 wide) against 16-wide outputs (RuntimeError)
  ckpt      - rank N loads ckpt/encoder_h64.pt saved with hidden width 64 (size mismatch)
  recompute - rank N recomputes the centre over its whole shard for --stall seconds before step 2
  segv      - rank N sends itself SIGSEGV after step 2
  exit4     - rank N prints its own error line about a stale shard and calls sys.exit(4) at step 1
  refund    - rank N keeps refunds as negative amounts: log() gives NaN features, loss check at step 2
  none      - control, clean run

What happened (filled in after the runs):
  emptywarm - rank N: FloatingPointError centre from 0 warm-up records not finite; peers closed in all_reduce
  scorelen  - rank N: gloo op.preamble.length <= op.nbytes 128 vs 96 in the score all_gather, SIGABRT
  stats     - rank N: FileNotFoundError .../stats/feature_stats_v2.json before DDP; peers SIGTERMed
  merchant  - rank N: KeyError 'crypto_exchange' while encoding merchants before DDP; peers SIGTERMed
  country   - rank N: IndexError index out of range in self (country embedding) in the warm-up forward
  repwidth  - every rank: RuntimeError size of tensor a (16) must match tensor b (24) at step 0
  ckpt      - rank N: RuntimeError size mismatch for trunk.0.weight [64, 14] vs [24, 14]; peers SIGTERMed
  recompute - rank N stalled: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  segv      - rank N: exitcode -11 (SIGSEGV) after step 2; peers reset/closed by peer in step 3
  exit4     - rank N logs its ERROR stale-shard line, exitcode 4 (both attempts under --max-restarts 1)
  refund    - rank N: RuntimeWarning invalid value in log, FloatingPointError SVDD loss is nan at step 2
  none      - clean, exit 0, rank 0 printed AUC 0.851 over 192 transactions
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault261_work"
MERCHANTS = ["grocery", "fuel", "travel", "dining", "online", "pharmacy", "electronics", "utilities"]
N_COUNTRY = 10
PER_RANK = 64
BATCH = 16
NUM = ["log_amount", "hour", "weekday", "n_prev", "dist_home", "card_age"]


class Encoder(nn.Module):
    def __init__(self, hidden=24, rep=16):
        super().__init__()
        self.merchant = nn.Embedding(len(MERCHANTS), 4)
        self.country = nn.Embedding(N_COUNTRY, 4)
        self.trunk = nn.Sequential(nn.Linear(len(NUM) + 8, hidden, bias=False), nn.LeakyReLU(0.1))
        self.head = nn.Linear(hidden, rep, bias=False)

    def features(self, x, m, c):
        return self.trunk(torch.cat([x, self.merchant(m), self.country(c)], dim=1))

    def forward(self, x, m, c):
        return self.head(self.features(x, m, c))


def make_shard(rank, fault, frank):
    g = np.random.default_rng(100 + rank)
    recs = []
    for i in range(PER_RANK):
        anomalous = i % 13 == 7
        amount = float(g.lognormal(3.5, 0.8)) * (40.0 if anomalous else 1.0)
        recs.append({
            "amount": amount,
            "hour": int(g.integers(0, 5)) if anomalous else int(g.integers(7, 23)),
            "weekday": int(g.integers(0, 7)),
            "n_prev": int(g.poisson(30)),
            "dist_home": float(g.exponential(800.0 if anomalous else 8.0)),
            "card_age": float(g.uniform(30, 2000)),
            "merchant": MERCHANTS[int(g.integers(0, len(MERCHANTS)))],
            "country": int(g.integers(0, N_COUNTRY)) if anomalous else int(g.integers(0, 3)),
            "label": int(anomalous),
        })
    if fault == "merchant" and rank == frank:
        recs[21]["merchant"] = "crypto_exchange"
    if fault == "refund" and rank == frank:
        for i in (35, 41):
            recs[i]["amount"] = -recs[i]["amount"]
    return recs


def prepare():
    for d in ("stats", "encoders", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    allrecs = [r for k in range(8) for r in make_shard(k, "none", -1)]
    cols = {
        "log_amount": [np.log(r["amount"]) for r in allrecs],
        "hour": [r["hour"] for r in allrecs], "weekday": [r["weekday"] for r in allrecs],
        "n_prev": [r["n_prev"] for r in allrecs], "dist_home": [r["dist_home"] for r in allrecs],
        "card_age": [r["card_age"] for r in allrecs],
    }
    stats = {k: {"mean": float(np.mean(v)), "std": float(np.std(v))} for k, v in cols.items()}
    with open(f"{WORK}/stats/feature_stats.json", "w") as f:
        json.dump(stats, f, indent=1)
    with open(f"{WORK}/encoders/merchant_map.json", "w") as f:
        json.dump({m: i for i, m in enumerate(MERCHANTS)}, f, indent=1)
    torch.manual_seed(0)
    torch.save(Encoder(24, 16).state_dict(), f"{WORK}/ckpt/encoder.pt")
    torch.save(Encoder(64, 16).state_dict(), f"{WORK}/ckpt/encoder_h64.pt")
    print("prepared", WORK)


def encode(recs, stats, mmap, country_base):
    x = torch.tensor([[np.log(r["amount"]), r["hour"], r["weekday"], r["n_prev"], r["dist_home"], r["card_age"]]
                      for r in recs], dtype=torch.float32)
    mean = torch.tensor([stats[k]["mean"] for k in NUM])
    std = torch.tensor([stats[k]["std"] for k in NUM])
    m = torch.tensor([mmap[r["merchant"]] for r in recs])
    c = torch.tensor([r["country"] + country_base for r in recs])
    y = torch.tensor([r["label"] for r in recs])
    return (x - mean) / std, m, c, y


def auc(scores, labels):
    order = np.argsort(scores)
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup-frac", type=float, default=0.25)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(1234)
    print(f"rank {rank}/{world} svdd: {PER_RANK} transactions per shard, batch {BATCH}, lr {a.lr}", flush=True)

    stats_path = f"{WORK}/stats/feature_stats_v2.json" if hit and a.fault == "stats" else f"{WORK}/stats/feature_stats.json"
    with open(stats_path) as f:
        stats = json.load(f)
    with open(f"{WORK}/encoders/merchant_map.json") as f:
        mmap = json.load(f)
    recs = make_shard(rank, a.fault, a.rank if a.rank >= 0 else rank)
    x, m, c, y = encode(recs, stats, mmap, 8 if hit and a.fault == "country" else 0)

    model = Encoder(24, 16)
    init = f"{WORK}/ckpt/encoder_h64.pt" if hit and a.fault == "ckpt" else f"{WORK}/ckpt/encoder.pt"
    model.load_state_dict(torch.load(init, map_location="cpu"))
    print(f"rank {rank} encoder initialised from {init}", flush=True)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)

    frac = a.warmup_frac / 100.0 if hit and a.fault == "emptywarm" else a.warmup_frac
    n_warm = int(PER_RANK * frac)
    with torch.no_grad():
        sl = slice(0, n_warm)
        if hit and a.fault == "repwidth":
            centre = model.features(x[sl], m[sl], c[sl]).mean(dim=0)
        else:
            centre = model(x[sl], m[sl], c[sl]).mean(dim=0)
    if not torch.isfinite(centre).all():
        raise FloatingPointError(f"rank {rank}: hypersphere centre from {n_warm} warm-up records is not finite "
                                 f"({int((~torch.isfinite(centre)).sum())} of {centre.numel()} entries)")
    dist.all_reduce(centre)
    centre /= world
    centre[(centre.abs() < 0.01)] = 0.01
    print(f"rank {rank} centre from {n_warm} warm-up records, |c| = {centre.norm().item():.4f}", flush=True)

    for step in range(a.steps):
        if step == 2 and hit and a.fault == "recompute":
            print(f"rank {rank} recomputing the centre over all {PER_RANK} records of its shard before step {step}", flush=True)
            time.sleep(a.stall)
        if step == 1 and hit and a.fault == "exit4":
            print(f"ERROR rank {rank}: transaction shard {WORK}/data/tx_rank{rank}.parquet ends 2024-03-31 but the "
                  f"training window starts 2024-04-07; refusing to train on a stale shard", file=sys.stderr, flush=True)
            sys.exit(4)
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % PER_RANK
        z = net(x[idx], m[idx], c[idx])
        loss = ((z - centre) ** 2).sum(dim=1).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: SVDD loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        print(f"rank {rank} step {step} loss {logged.item() / world:.4f}", flush=True)
        if step == 2 and hit and a.fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)

    with torch.no_grad():
        keep = torch.arange(n_warm, PER_RANK) if hit and a.fault == "scorelen" else torch.arange(PER_RANK)
        scores = ((model(x[keep], m[keep], c[keep]) - centre) ** 2).sum(dim=1)
        labels = y[keep].float()
    got = [torch.empty_like(scores) for _ in range(world)]
    dist.all_gather(got, scores)
    got_y = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(got_y, labels)
    if rank == 0:
        s = torch.cat(got).numpy()
        lab = torch.cat(got_y).numpy().astype(int)
        print(f"rank 0 done: {a.steps} steps, {len(s)} transactions scored, {lab.sum()} outliers, AUC {auc(s, lab):.3f}",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

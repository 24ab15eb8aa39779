"""A hundred-and-thirty-fourth hand-run batch: TABULAR MODELS WITH PANDAS PREPROCESSING.

Each rank writes, then reads with pandas, its shard of a small synthetic census-like CSV (age, income,
hours, city, job, label) under data/ in the work dir; it one-hot encodes `job` with get_dummies, maps
`city` to an embedding index, standardizes the numeric columns with global statistics (per-feature sums
all_reduced), warm-starts a tiny MLP (embedding + 2 linear layers) from rank 0's init checkpoint, trains
it with DDP (`--ddp 0`: gradients all-reduced by hand) for a few steps printing `rank R step S loss L`,
all_reduces the accuracy, and destroys the process group. Run under torchrun with the gloo backend.

Faults:
- colmiss: rank N's shard was exported without the income column: KeyError in df[NUM_COLS].
- unseen: rank N's shard holds a city unseen in the vocabulary: index past the embedding table.
- objdtype: rank N's age column holds "unknown" strings (object dtype): torch.tensor TypeError.
- zerostd: rank N's hours column is constant; its local std is 0, 0/0 gives NaN, the loss check raises.
- width: rank N's job column has an extra value; get_dummies is wider; feature-sum all_reduce mismatches.
- nofile: rank N reads its shard from data/train/ (a config path typo): FileNotFoundError.
- emptyfile: rank N's shard file is empty (0 bytes): pandas EmptyDataError.
- wait: rank N's shard has fewer rows than a batch; its loader thread never sends the end marker; it waits.
- append: every rank logs its metrics with DataFrame.append (removed in pandas 2): AttributeError.
- sigkill: rank N is killed by SIGKILL at step 3.
- checksum: rank N's manifest checksum is stale: it prints an ERROR line and exits with code 4.
- ckpt: rank N builds its embedding with an extra unknown row: load_state_dict size mismatch.
What happened (filled in after the runs):
- colmiss: KeyError "['income'] not in index" (line 157) on rank N; peers Connection closed by peer.
- unseen: IndexError index out of range in self (embedding, step 0) on rank N; peers Connection closed.
- objdtype: with "n/a" read_csv parsed NaN: every rank NaN loss (2 runs dropped); "unknown": see README.
- zerostd: FloatingPointError non-finite loss nan at step 0 on rank N; DETAIL: monitoredBarrier error.
- width: gloo EnforceNotMet Received data size doesn't match expected size (SIGABRT) in the stats all_reduce.
- nofile: FileNotFoundError 'data/train/shard_N.csv' from pd.read_csv on rank N.
- emptyfile: pandas.errors.EmptyDataError No columns to parse from file on rank N.
- wait: never waited: 5 rows lack a job value, get_dummies narrower, size mismatch abort (both runs dropped).
- append: every rank AttributeError 'DataFrame' object has no attribute 'append' after step 1.
- sigkill: rank N killed by SIGKILL at step 3 (see README).
- checksum: rank N prints ERROR: shard checksum mismatch and exits 4 (see README).
- ckpt: load_state_dict size mismatch for emb.weight on rank N (see README).
"""
import argparse
import hashlib
import os
import queue
import signal
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--rows", type=int, default=256)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--out", default="/tmp/fault134_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
BAD = a.rank == -1 or a.rank == RANK
F_ = a.fault if BAD else "none"

NUM_COLS = ["age", "income", "hours"]
CITIES = ["Berlin", "Paris", "Madrid", "Rome", "Vienna", "Oslo"]
JOBS = ["clerk", "engineer", "nurse", "teacher"]
CITY_INDEX = {c: i for i, c in enumerate(CITIES)}


def write_shard(path, rank):
    rng = np.random.default_rng(1000 + rank)
    n = 5 if F_ == "wait" else a.rows
    df = pd.DataFrame({
        "age": rng.integers(18, 70, n).astype(float),
        "income": rng.normal(42000, 9000, n).round(2),
        "hours": rng.integers(20, 60, n).astype(float),
        "city": rng.choice(CITIES, n),
        "job": rng.choice(JOBS, n),
    })
    df["label"] = ((df["income"] > 42000) ^ (df["hours"] > 45)).astype(int)
    if F_ == "colmiss":
        df = df.drop(columns=["income"])
    if F_ == "unseen":
        df.loc[7, "city"] = "Lyon"
    if F_ == "objdtype":
        df["age"] = df["age"].astype(object)
        df.loc[3, "age"] = "unknown"
    if F_ == "zerostd":
        df["hours"] = 40.0
    if F_ == "width":
        df.loc[5, "job"] = "retired"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if F_ == "emptyfile":
        open(path, "w").close()
    else:
        df.to_csv(path, index=False)
    with open(path, "rb") as fh:
        digest = hashlib.md5(fh.read()).hexdigest()
    if F_ == "checksum":
        digest = digest[:-4] + "0000"
    return digest


def loader(x, e, y, bs):
    q = queue.Queue()

    def produce():
        nb = len(y) // bs
        for i in range(nb):
            s = slice(i * bs, (i + 1) * bs)
            q.put((x[s], e[s], y[s]))
            if i == nb - 1:
                q.put(None)

    threading.Thread(target=produce, daemon=True).start()
    while True:
        item = q.get()
        if item is None:
            return
        yield item


class TabMLP(nn.Module):
    def __init__(self, n_in, n_city, d_emb=4, hidden=16):
        super().__init__()
        self.emb = nn.Embedding(n_city, d_emb)
        self.fc1 = nn.Linear(n_in + d_emb, hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x, c):
        h = torch.cat([x, self.emb(c)], dim=1)
        return self.fc2(F.relu(self.fc1(h)))


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join("data", f"shard_{RANK}.csv")
    digest = write_shard(path, RANK)
    with open(path, "rb") as fh:
        actual = hashlib.md5(fh.read()).hexdigest()
    if actual != digest:
        print(f"rank {RANK} ERROR: shard checksum mismatch for {path}: manifest {digest} actual {actual}", flush=True)
        sys.exit(4)
    read_path = os.path.join("data", "train", f"shard_{RANK}.csv") if F_ == "nofile" else path
    df = pd.read_csv(read_path)
    print(f"rank {RANK} read {len(df)} rows from {read_path}", flush=True)

    num = torch.tensor(df[NUM_COLS].values, dtype=torch.float32)
    onehot = pd.get_dummies(df["job"], dtype=float)
    oh = torch.tensor(onehot.values, dtype=torch.float32)
    feats = torch.cat([num, oh], dim=1)
    # global per-feature statistics for the scaler
    stats = torch.cat([feats.sum(0), (feats ** 2).sum(0), torch.tensor([float(len(df))])])
    dist.all_reduce(stats)
    k = feats.shape[1]
    n_all = stats[-1]
    mean = stats[:k] / n_all
    std = (stats[k:2 * k] / n_all - mean ** 2).clamp_min(0).sqrt()
    std[len(NUM_COLS):] = 1.0
    mean[len(NUM_COLS):] = 0.0
    x = (feats - mean) / std
    # hours: the scaler was fitted per shard in the old pipeline and still is
    h_mean, h_std = num[:, 2].mean(), num[:, 2].std(unbiased=False)
    x[:, 2] = (num[:, 2] - h_mean) / h_std
    city = torch.tensor([CITY_INDEX.get(c, len(CITY_INDEX)) for c in df["city"]], dtype=torch.long)
    y = torch.tensor(df["label"].values, dtype=torch.long)

    n_city = len(CITIES) + (1 if F_ == "ckpt" else 0)
    model = TabMLP(x.shape[1], n_city)
    init = os.path.join(a.out, "init.pt")
    if RANK == 0:
        torch.save(TabMLP(x.shape[1], len(CITIES)).state_dict(), init)
    dist.barrier()
    model.load_state_dict(torch.load(init, weights_only=True))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hist = pd.DataFrame(columns=["step", "loss"])

    for step, (xb, cb, yb) in enumerate(loader(x, city, y, a.batch)):
        if step >= a.steps:
            break
        if F_ == "sigkill" and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss = F.cross_entropy(net(xb, cb), yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {RANK}: non-finite loss {loss.item()} at step {step}")
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= WORLD
        opt.step()
        print(f"rank {RANK} step {step} loss {loss.item():.4f}", flush=True)
        if F_ == "append" and step == 1:
            hist = hist.append({"step": step, "loss": loss.item()}, ignore_index=True)
        else:
            hist.loc[len(hist)] = [step, loss.item()]

    with torch.no_grad():
        pred = net(x, city).argmax(1)
    acc = torch.tensor([(pred == y).sum().item(), float(len(y))])
    dist.all_reduce(acc)
    if RANK == 0:
        print(f"accuracy {acc[0].item() / acc[1].item():.4f} over {int(acc[1].item())} rows", flush=True)
    print(f"rank {RANK} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-fifty-fourth hand-run batch: RECOMMENDER MODELS WITH EMBEDDING BAGS AND SPARSE FEATURES.

A small DLRM-style click model. Each rank writes and then parses its own shard of a synthetic click log (CSV:
label, 4 dense features, 3 categorical columns holding '|'-joined raw ids). Raw ids are hashed into three
nn.EmbeddingBag tables (sum mode, offsets built per batch); a bottom MLP embeds the dense features; the dense
vector and the three pooled bags go through pairwise dot-product interactions, then a top MLP gives a logit.
The dense part is wrapped in DDP (`--ddp 1`, default) or all_reduced by hand (`--ddp 0`); the embedding-table
gradients are always all_reduced by hand. Prints `rank R step S loss L`; an AUC-like pairwise-order metric
is all_gathered at the end; rank 0 saves dlrm.pt. `--init 1` loads dlrm.pt before training.
Faults:
- badid: rank N hashes ids into 1-based buckets (raw % size + 1): an id equal to the table size reaches a bag.
- offsets: the per-batch offsets are built as the cumulative sum of bag lengths (no leading 0) on every rank.
- tablesize: rank N reads the 'site' table size from a per-rank config as 501 (others 500): hand all_reduce.
- shard: rank N reads its click-log shard from yesterday's partition directory, which was never written.
- empty: rank N's shard is empty: it skips the epoch (no collectives) and polls for a refill; the others wait.
- strlabel: rank N's CSV parse keeps the label column as strings; building the label tensor fails.
- interact: the interaction output width is computed as n*(n+1)/2 + d (counts self-dots) on every rank.
- inf: rank N reads the learning rate as 1e30 (config typo): the logits blow up; the loss check fires.
- ckpt: dlrm.pt was saved by an older version with tables named 'emb.N'; with --init 1 load_state_dict fails.
- specexit: rank N finds its feature spec differs, prints an error line and calls sys.exit(2).
- abrt: rank N is killed by SIGABRT at step 2.
What happened (filled in after the runs):
- badid: rank N RuntimeError 'Index i of input takes value 500 which is not in the valid range [0, 500)' (line 181).
- offsets: every rank RuntimeError 'offsets[0] has to be 0, i.e., the first sequence ... However, got 2' (line 181).
- tablesize: DETAIL: broadcast mismatch [500, 8] vs [501, 8] (line 163); plain: gloo EnforceNotMet 2004 vs 2000, SIGABRT.
- shard: rank N FileNotFoundError '/tmp/job_work/clicks/day=2026-12-04/part-0000N.csv' (line 111); peers SIGTERMed.
- empty: PG 12 s: peers 'Timed out waiting 12000ms' recv/send in backward (line 187); PG 300 s: timeout 60, exit 124.
- strlabel: rank N ValueError: too many dimensions 'str' building the label tensor (line 151).
- interact: every rank RuntimeError 'mat1 and mat2 shapes cannot be multiplied (32x14 and 18x16)' (line 91).
- inf: rank N FloatingPointError 'rank N step 1: loss is nan (lr 1e+30)' (line 185); peers SIGTERMed.
- ckpt: every rank RuntimeError loading state_dict: Missing key(s) '0.weight'... Unexpected 'emb.0.weight'... (line 159).
- specexit: rank N 'ERROR rank N: feature spec mismatch ...' then exitcode 2; rank 0 Connection closed by peer.
- abrt: rank N exitcode -6 (SIGABRT) at step 2; with --max-restarts 1 the retry dies in connectFullMesh.
"""
import argparse
import csv
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--init", type=int, default=0)
p.add_argument("--out", default="/tmp/fault154_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)
TABLES = ["user", "item", "site"]
DIM = 8


def hit():
    return a.rank == -1 or a.rank == RANK


def table_sizes():
    sizes = {"user": 1000, "item": 800, "site": 500}
    if a.fault == "tablesize" and hit():
        sizes["site"] = 501  # per-rank config file carries a stale value
    return [sizes[t] for t in TABLES]


class DenseNet(nn.Module):
    def __init__(self, n_vec):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, DIM))
        n = n_vec
        width = n * (n + 1) // 2 + DIM if a.fault == "interact" else n * (n - 1) // 2 + DIM
        self.top = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))
        self.iu = torch.triu_indices(n, n, offset=1)

    def forward(self, dense, pooled):
        x = self.bottom(dense)
        vecs = torch.stack([x] + pooled, dim=1)
        dots = torch.bmm(vecs, vecs.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def write_shard(path, n_rows):
    g = torch.Generator().manual_seed(10 + RANK)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "d0", "d1", "d2", "d3", "user", "item", "site"])
        for _ in range(n_rows):
            d = torch.randn(4, generator=g)
            cats = []
            for _t in TABLES:
                k = int(torch.randint(1, 4, (1,), generator=g))
                cats.append("|".join(str(int(v)) for v in torch.randint(0, 10**9, (k,), generator=g)))
            label = int(d[0] + 0.3 * torch.randn(1, generator=g) > 0)
            w.writerow([label] + [f"{v:.4f}" for v in d.tolist()] + cats)


def read_shard(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    keep_str = a.fault == "strlabel" and hit()
    labels = [r[0] if keep_str else float(r[0]) for r in rows]
    dense = [[float(v) for v in r[1:5]] for r in rows]
    cats = [[[int(v) for v in r[5 + j].split("|")] for r in rows] for j in range(len(TABLES))]
    return labels, dense, cats


def bag_inputs(bags, size):
    one_based = a.fault == "badid" and hit()
    ids = [(raw % size) + (1 if one_based else 0) for bag in bags for raw in bag]
    lens = [len(bag) for bag in bags]
    if a.fault == "offsets":
        offs = torch.tensor(lens).cumsum(0)
    else:
        offs = torch.tensor([0] + lens[:-1]).cumsum(0)
    return torch.tensor(ids), offs


def pair_auc(scores, labels):
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return 0.5
    return float((pos[:, None] > neg[None, :]).float().mean())


def main():
    os.makedirs(a.out, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    print(f"rank {RANK}/{WORLD} dlrm click-model training starting", flush=True)
    day = "2026-12-05"
    n_rows = 0 if (a.fault == "empty" and hit()) else a.batch * a.steps
    write_shard(os.path.join(a.out, "clicks", f"day={day}", f"part-{RANK:05d}.csv"), n_rows)
    if a.fault == "specexit" and hit():
        print(f"ERROR rank {RANK}: feature spec mismatch: shard header has 8 columns, spec v3 expects 9 "
              f"(missing 'hour_of_day')", file=sys.stderr, flush=True)
        sys.exit(2)
    read_day = "2026-12-04" if (a.fault == "shard" and hit()) else day
    labels, dense, cats = read_shard(os.path.join(a.out, "clicks", f"day={read_day}", f"part-{RANK:05d}.csv"))
    y_all = torch.tensor(labels, dtype=torch.float32)
    x_all = torch.tensor(dense)
    sizes = table_sizes()
    torch.manual_seed(0)
    tables = nn.ModuleList([nn.EmbeddingBag(s, DIM, mode="sum") for s in sizes])
    dense_net = DenseNet(len(TABLES) + 1)
    if a.init:
        state = torch.load(os.path.join(a.out, "dlrm.pt"))
        tables.load_state_dict(state["tables"])
        dense_net.load_state_dict(state["dense"])
        print(f"rank {RANK} loaded dlrm.pt", flush=True)
    for prm in list(tables.parameters()) + list(dense_net.parameters()):
        dist.broadcast(prm.data, src=0)
    model = DDP(dense_net) if a.ddp else dense_net
    lr = 1e30 if (a.fault == "inf" and hit()) else a.lr
    opt = torch.optim.SGD(list(tables.parameters()) + list(dense_net.parameters()), lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    print(f"rank {RANK} tables {dict(zip(TABLES, sizes))} rows {len(labels)} lr {lr} ddp {a.ddp}", flush=True)
    if len(labels) == 0:
        print(f"rank {RANK} shard is empty; waiting for the refill job", flush=True)
        while not os.path.exists(os.path.join(a.out, "refill.done")):
            time.sleep(1.0)
    n_steps = len(labels) // a.batch
    for step in range(n_steps):
        if a.fault == "abrt" and hit() and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        sl = slice(step * a.batch, (step + 1) * a.batch)
        pooled = []
        for j, tab in enumerate(tables):
            ids, offs = bag_inputs(cats[j][sl], sizes[j])
            pooled.append(tab(ids, offs))
        logits = model(x_all[sl], pooled)
        loss = loss_fn(logits, y_all[sl])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {RANK} step {step}: loss is {loss.item()} (lr {lr})")
        opt.zero_grad()
        loss.backward()
        grads = [t.weight.grad for t in tables]
        if not a.ddp:
            grads += [q.grad for q in dense_net.parameters()]
        for gr in grads:
            dist.all_reduce(gr)
            gr /= WORLD
        opt.step()
        print(f"rank {RANK} step {step} loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        pooled = [tab(*bag_inputs(cats[j], sizes[j])) for j, tab in enumerate(tables)]
        auc = pair_auc(model(x_all, pooled), y_all)
    res = [torch.zeros(1) for _ in range(WORLD)]
    dist.all_gather(res, torch.tensor([auc]))
    if RANK == 0:
        print(f"pairwise AUC per rank {[round(float(r), 3) for r in res]}", flush=True)
        torch.save({"tables": tables.state_dict(), "dense": dense_net.state_dict()}, os.path.join(a.out, "dlrm.pt"))
    dist.destroy_process_group()
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main()

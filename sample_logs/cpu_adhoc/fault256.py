"""A two-hundred-and-fifty-sixth hand-run batch: SPARSE MIXTURE OF EXPERTS FOR TABULAR CLASSIFICATION.

The program trains a small sparse mixture of experts on synthetic tabular rows: a feature schema
(JSON, one shard per rank) names the columns, a linear router picks the top-2 of four expert MLPs,
each expert keeps at most `capacity` tokens (the rest are dropped), a load-balancing auxiliary loss
is added, the model is wrapped in DDP (or, with --ddp 0, gradients are all_reduced by hand), and the
per-expert load counts are all_reduced and all_gathered every step for a log line on rank 0.

Faults:
- expidx: on one rank the expert ids from top-2 are shifted by one; counting loads indexes expert 4 of 4 (IndexError).
- infnan: on one rank a row holds inf in a feature; router softmax turns NaN, the program's finite check raises FloatingPointError.
- gathercnt: one rank all_gathers expert counts sized for six experts (stale config); gloo sizes mismatch.
- schema: one rank opens the schema shard for rank+world, which does not exist (FileNotFoundError).
- column: one rank's feature list has a column 'income_log' the schema lacks (KeyError).
- hidden: expert input width 16 on every rank while the router feeds 8 features (RuntimeError, matmul shapes).
- capacity: capacity factor 0 on every rank; the program's check raises ValueError.
- ckpt: the faulty rank(s) resume from a checkpoint saved with six experts (load_state_dict size mismatch).
- slow: one rank routes every sample one at a time (sleeping per sample) and reaches the all_reduce late; peers time out.
- abort: one rank sends itself SIGABRT at step 2.
- exit2: one rank prints an ERROR line about its shard's label column and calls sys.exit(2).
- none: control, no fault.

What happened (filled in after the runs):
- expidx: rank 2 (np4) and rank 1 (np3) raise IndexError: index 4 is out of bounds for dimension 0 with size 4 at step 1; peers see Connection closed by peer.
- infnan: rank 1 (np4, DDP) and rank 2 (np3, --ddp 0 under DETAIL) raise FloatingPointError: router gates are not finite at step 2.
- gathercnt: rank 1 (np3) and rank 2 (np4) raise ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (4)) at step 0.
- schema: rank 3 (np4) and rank 1 (np3) raise FileNotFoundError for shard7.json / shard4.json at startup (shards 4-7 removed after prep).
- column: rank 2 (np3) and rank 1 (np4) raise KeyError: 'income_log' at startup; the others are SIGTERMed.
- hidden: caught earlier than meant: every rank fails at resume, load_state_dict size mismatch [32, 8] vs [32, 16] for experts.N.fc1.weight.
- capacity: every rank raises ValueError: expert capacity 0 from capacity_factor=0.0 before step 0.
- ckpt: rank 1 (np3) and rank 2 (np4) fail in load_state_dict (unexpected experts.4/5, router [6, 8] vs [4, 8]); the restart dies in connectFullMesh.
- slow: PG 12 s: ranks 0 and 2 time out (12000ms) in backward while rank 1 is slow; PG 300 s: no progress after step 1, killed by timeout 60 (exit 124).
- abort: rank 2 (pdsh2, node 1) and rank 1 (wrapper) die with exitcode -6 (SIGABRT) at step 2; peers see connection closed/reset.
- exit2: rank 2 (np3) and rank 1 (np4) print their ERROR line at step 1 and exit 2; the Root Cause shows exitcode 2.
- none: exit 0 on 3 ranks, rank 0 done: 5 steps.
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

FEATURES = ["age", "tenure", "balance", "n_products", "credit", "salary", "visits", "score"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--aux-weight", type=float, default=0.01)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--per-sample-ms", type=float, default=600.0)
    p.add_argument("--work", default="/tmp/fault256_work")
    p.add_argument("--prep", action="store_true")
    return p.parse_args()


class Expert(nn.Module):
    def __init__(self, d_in, hidden, n_cls):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, n_cls)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class SparseMoE(nn.Module):
    def __init__(self, d, n_experts, hidden, n_cls=3, expert_in=None):
        super().__init__()
        self.n_experts = n_experts
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList([Expert(expert_in or d, hidden, n_cls) for _ in range(n_experts)])

    def forward(self, x, capacity, shift=0, per_sample_s=0.0):
        logits = self.router(x)
        gates = F.softmax(logits, dim=-1)
        if not torch.isfinite(gates).all():
            bad = int((~torch.isfinite(gates)).any(dim=-1).sum())
            raise FloatingPointError(f"router gates are not finite for {bad} of {x.shape[0]} rows (max |logit| {logits.abs().max().item()})")
        topv, topi = gates.topk(2, dim=-1)
        topi = topi + shift
        load = torch.zeros(self.n_experts)
        for e in topi.flatten().tolist():
            load[e] += 1
        combine = torch.zeros(x.shape[0], self.n_experts)
        kept = torch.zeros(self.n_experts)
        for i in range(x.shape[0]):
            if per_sample_s:
                time.sleep(per_sample_s)
            for k in range(2):
                e = int(topi[i, k])
                if kept[e] < capacity:
                    kept[e] += 1
                    combine[i, e] = 1.0
        w = gates * combine
        out = torch.stack([exp(x) for exp in self.experts], dim=1)
        y = (w.unsqueeze(-1) * out).sum(dim=1)
        frac = load / load.sum()
        aux = self.n_experts * (frac * gates.mean(dim=0)).sum()
        dropped = int(2 * x.shape[0] - combine.sum().item())
        return y, aux, load, dropped


def prep(a):
    os.makedirs(os.path.join(a.work, "schema"), exist_ok=True)
    os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
    for s in range(8):
        cols = {n: {"index": j, "mean": 0.0, "std": 1.0} for j, n in enumerate(FEATURES)}
        with open(os.path.join(a.work, "schema", f"shard{s}.json"), "w") as f:
            json.dump({"shard": s, "label": "churn", "n_classes": 3, "columns": cols}, f)
    torch.manual_seed(0)
    torch.save(SparseMoE(len(FEATURES), 4, a.hidden).state_dict(), os.path.join(a.work, "ckpt", "moe_last.pt"))
    torch.save(SparseMoE(len(FEATURES), 6, a.hidden).state_dict(), os.path.join(a.work, "ckpt", "moe_e6_sweep.pt"))
    print("prepared", a.work)


def main():
    a = parse()
    if a.prep:
        prep(a)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = a.rank == -1 or a.rank == rank
    torch.manual_seed(1234 + rank)
    shard = rank + world if (a.fault == "schema" and mine) else rank
    with open(os.path.join(a.work, "schema", f"shard{shard}.json")) as f:
        schema = json.load(f)
    feats = list(FEATURES)
    if a.fault == "column" and mine:
        feats[5] = "income_log"
    cols = [schema["columns"][n]["index"] for n in feats]
    d = len(cols)
    expert_in = 16 if (a.fault == "hidden" and mine) else None
    model = SparseMoE(d, a.experts, a.hidden, schema["n_classes"], expert_in=expert_in)
    ck = "moe_e6_sweep.pt" if (a.fault == "ckpt" and mine) else "moe_last.pt"
    model.load_state_dict(torch.load(os.path.join(a.work, "ckpt", ck)))
    print(f"rank {rank}/{world}: resumed from {ck}, {sum(p.numel() for p in model.parameters())} params, {a.experts} experts, features {d}", flush=True)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    if a.ddp == 0:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    cf = 0.0 if (a.fault == "capacity" and mine) else a.capacity_factor
    capacity = int(math.floor(cf * 2 * a.batch / a.experts))
    if capacity <= 0:
        raise ValueError(f"expert capacity {capacity} from capacity_factor={cf}, batch {a.batch}, {a.experts} experts; every token would be dropped")
    for step in range(a.steps):
        x = torch.randn(a.batch, d)
        y = (x[:, 0] + x[:, 2] > 0).long() + (x[:, 4] > 1).long()
        if a.fault == "infnan" and mine and step == 2:
            x[7, 2] = float("inf")
        if a.fault == "abort" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        if a.fault == "exit2" and mine and step == 1:
            print(f"ERROR rank {rank}: shard{shard} label column 'churn' has 3 classes but 41 rows carry label 3; refusing to train on a corrupt shard", file=sys.stderr, flush=True)
            sys.exit(2)
        shift = 1 if (a.fault == "expidx" and mine and step == 1) else 0
        slow = a.per_sample_ms / 1000.0 if (a.fault == "slow" and mine and step == 2) else 0.0
        logits, aux, load, dropped = net(x, capacity, shift, slow)
        loss = F.cross_entropy(logits, y) + a.aux_weight * aux
        opt.zero_grad()
        loss.backward()
        if a.ddp == 0:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        dist.all_reduce(load)
        ne = 6 if (a.fault == "gathercnt" and mine) else a.experts
        counts = torch.zeros(ne)
        counts[: a.experts] = load
        gathered = [torch.zeros(a.experts) for _ in range(world)]
        dist.all_gather(gathered, counts)
        lt = torch.tensor([loss.item()])
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {loss.item():.4f} dropped {dropped}", flush=True)
        if rank == 0:
            print(f"step {step}: global loss {lt.item() / world:.4f} expert load {[int(v) for v in load.tolist()]}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

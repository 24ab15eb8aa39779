"""A hundred-and-thirty-second hand-run batch: RETRIEVAL AND NEAREST-NEIGHBOUR INDEXES. A DDP dual encoder.

Each rank builds a dual encoder (a query tower and a document tower, 16-32-32 MLPs) on random vectors,
wraps it in DDP (`--ddp 0`: gradients all-reduced by hand), and trains `--steps` steps with in-batch
negatives: every rank all_gathers the document embeddings of all ranks, scores its queries against them
at a temperature (`rank R step S loss L`), and rank 0 prints the mean loss. Rank 0 then saves a checkpoint
that every rank reloads; the evaluation builds a document index sharded over the ranks (`--docs` per rank),
rank 0 routes hard queries with send/recv, every rank scores the broadcast queries against its shard,
takes the local top-k (`--k`), all_gathers scores and ids, merges the global top-k, gathers per-rank stats
with gather_object on rank 0, then barrier and destroy_process_group().

Faults:
- topk: rank N's shard is cut to docs//2-1 documents by an off-by-one; topk(k) on it raises RuntimeError.
- dim: rank N's emb_dim config is 24 against 32; the in-batch all_gather of document embeddings mismatches.
- dtype: rank N keeps document ids as int32 (others int64); the all_gather of top-k ids mismatches.
- zeronorm: rank N's step-2 batch keeps a masked padding query; its zero norm gives NaN logits (the check).
- ckpt: rank N reloads the checkpoint of step steps-1 (never written): FileNotFoundError in torch.load.
- skipmerge: rank N reads an empty shard manifest and skips scoring and the top-k merge; the others wait.
- pickle: every rank's stats dict holds a lambda (the scorer); gather_object fails to pickle it.
- exit3: rank N prints that its index shard is corrupt and exits with os._exit(3) during the index build.
- temp0: the temperature from the config is 0 on every rank; the logits check raises FloatingPointError.
- sendrecv: query rank N calls recv before send in the hard-query routing; it and rank 0 deadlock.
- abort: rank N gets SIGABRT at the start of step 3.
What happened (filled in after the runs):
- topk: RuntimeError selected index k out of range (topk, 3-doc shard) on rank N; peers lose the connection.
- dim: plain gloo: EnforceNotMet size abort on rank N (SIGABRT); DETAIL: Detected mismatch [8, 24] vs [8, 32].
- dtype: gloo EnforceNotMet 80 vs 40 in the top-k ids all_gather aborts rank N (SIGABRT, exitcode -6).
- zeronorm: FloatingPointError: rank N step 2: non-finite logits (line 123); peers Connection closed by peer.
- ckpt: FileNotFoundError .../ckpt/retr_step4.pt from torch.load (line 146) on rank N.
- skipmerge: no timeout: gather_object meets the all_gather, gloo EnforceNotMet aborts rank N at once (-6).
- pickle: AttributeError: Can't pickle local object 'evaluate.<locals>.<lambda>' (line 199) on every rank.
- exit3: rank N's corrupt-shard line, exit 3; peers Connection reset; restart run: connectFullMesh refused.
- temp0: FloatingPointError: rank R step 0: 192 non-finite logits (temperature 0) on every rank.
- sendrecv: ranks 0 and N wait in recv; pg 12 s: gloo Timed out waiting 12000ms on all; pg 300: hung, 124.
- abort: rank N SIGABRT at step 3; peers Connection closed/reset in the all_gather; Root Cause -6.
"""
import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--work", default="/tmp/fault132_work")
    return p.parse_args()


def hit(a, rank):
    return a.rank == -1 or a.rank == rank


class DualEncoder(nn.Module):
    def __init__(self, d_in=16, d_hid=32, d_out=32):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(d_in, d_hid), nn.ReLU(), nn.Linear(d_hid, d_out))
        self.d = nn.Sequential(nn.Linear(d_in, d_hid), nn.ReLU(), nn.Linear(d_hid, d_out))

    def forward(self, xq, xd):
        return self.q(xq), self.d(xd)


def normalize(e):
    return e / e.norm(dim=1, keepdim=True)


def make_pairs(rank, n=48):
    g = torch.Generator().manual_seed(100 + rank)
    xq = torch.randn(n, 16, generator=g)
    xd = xq + 0.1 * torch.randn(n, 16, generator=g)
    return xq, xd


def train(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    print(f"rank {rank}/{world} up (local_rank {os.environ.get('LOCAL_RANK')}, pid {os.getpid()})", flush=True)
    cfg = {"emb_dim": 32, "temperature": 0.05, "lr": 0.05}
    if a.fault == "dim" and hit(a, rank):
        cfg["emb_dim"] = 24
    if a.fault == "temp0" and hit(a, rank):
        cfg["temperature"] = 0
    model = DualEncoder()
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    xq, xd = make_pairs(rank)
    bs, dim, temp = 8, cfg["emb_dim"], cfg["temperature"]
    for step in range(a.steps):
        if hit(a, rank) and a.fault == "abort" and step == 3:
            os.kill(os.getpid(), signal.SIGABRT)
        i = (step * bs) % xq.shape[0]
        qe, de = net(xq[i:i + bs], xd[i:i + bs])
        qe, de = qe[:, :dim], de[:, :dim]
        if a.fault == "zeronorm" and hit(a, rank) and step == 2:
            mask = torch.ones(bs, 1)
            mask[-1] = 0.0
            qe = qe * mask
        qe, de = normalize(qe), normalize(de)
        gathered = [torch.zeros_like(de) for _ in range(world)]
        dist.all_gather(gathered, de.detach())
        gathered[rank] = de
        all_de = torch.cat(gathered)
        logits = qe @ all_de.t() / temp
        if not torch.isfinite(logits).all():
            bad = (~torch.isfinite(logits)).sum().item()
            raise FloatingPointError(f"rank {rank} step {step}: {bad} non-finite logits (temperature {temp})")
        labels = torch.arange(bs) + rank * bs
        loss = nn.functional.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        if rank == 0:
            print(f"step {step} mean loss {t.item() / world:.4f} temp {temp}", flush=True)

    ckdir = os.path.join(a.work, "ckpt")
    os.makedirs(ckdir, exist_ok=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(ckdir, f"retr_step{a.steps}.pt"))
        print(f"saved {os.path.join(ckdir, f'retr_step{a.steps}.pt')}", flush=True)
    dist.barrier()
    want = a.steps - 1 if (a.fault == "ckpt" and hit(a, rank)) else a.steps
    model.load_state_dict(torch.load(os.path.join(ckdir, f"retr_step{want}.pt")))
    evaluate(a, model, rank, world, dim)


def evaluate(a, model, rank, world, dim):
    g = torch.Generator().manual_seed(500 + rank)
    n_local = a.docs
    if a.fault == "topk" and hit(a, rank):
        n_local = a.docs // 2 - 1
    docs = torch.randn(n_local, 16, generator=g)
    ids = torch.arange(n_local, dtype=torch.int64) + rank * a.docs
    if a.fault == "dtype" and hit(a, rank):
        ids = ids.to(torch.int32)
    if a.fault == "exit3" and hit(a, rank):
        print(f"rank {rank}: index shard {rank} corrupt (checksum mismatch on {n_local} vectors), giving up", flush=True)
        os._exit(3)
    with torch.no_grad():
        index = normalize(model.d(docs)[:, :dim])
    print(f"rank {rank}: index shard built, {n_local} docs, dim {index.shape[1]}", flush=True)

    req, ack = torch.tensor([rank, 2]), torch.zeros(2, dtype=torch.int64)
    if rank == 0:
        for r in range(1, world):
            dist.recv(req, r)
            dist.send(torch.tensor([r, 1]), r)
    elif a.fault == "sendrecv" and hit(a, rank):
        dist.recv(ack, 0)
        dist.send(req, 0)
    else:
        dist.send(req, 0)
        dist.recv(ack, 0)

    queries = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    dist.broadcast(queries, 0)
    with torch.no_grad():
        qv = normalize(model.q(queries)[:, :dim])
    manifest_count = 0 if (a.fault == "skipmerge" and hit(a, rank)) else n_local
    if manifest_count > 0:
        scores = qv @ index.t()
        vals, idx = scores.topk(a.k, dim=1)
        top_ids = ids[idx]
        all_vals = [torch.zeros_like(vals) for _ in range(world)]
        all_ids = [torch.zeros_like(top_ids) for _ in range(world)]
        dist.all_gather(all_vals, vals)
        dist.all_gather(all_ids, top_ids)
        mv, mi = torch.cat(all_vals, dim=1).topk(a.k, dim=1)
        merged = torch.cat(all_ids, dim=1).gather(1, mi)
        if rank == 0:
            print(f"eval top-{a.k} ids for query 0: {merged[0].tolist()} scores {[round(v, 3) for v in mv[0].tolist()]}", flush=True)
    stats = {"rank": rank, "docs": n_local}
    if a.fault == "pickle" and hit(a, rank):
        stats["scorer"] = lambda q, d: q @ d.t()
    out = [None] * world if rank == 0 else None
    dist.gather_object(stats, out, dst=0)
    if rank == 0:
        print(f"index stats: {sum(s['docs'] for s in out)} docs over {len(out)} shards", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    train(parse_args())

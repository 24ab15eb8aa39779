"""A hundred-and-fifty-ninth hand-run batch: KNOWLEDGE-GRAPH EMBEDDINGS WITH NEGATIVE SAMPLING.

A TransE model (entity and relation nn.Embedding tables) trained with DDP (or hand all-reduce with --ddp 0) on
gloo over a synthetic triple store (head, relation, tail) that rank 0 writes as one TSV shard per rank.  Negatives
corrupt the head or the tail, the loss is a margin ranking loss, and a tail-ranking evaluation all_gathers the
ranks of each rank's test triples to print MRR and Hits@10.  Rank 0 saves a checkpoint; --resume loads it.

Faults:
  entid     - rank N reads its shard with 1-based ids, so an id equals the entity count (IndexError)
  reltable  - rank N sizes its relation table one larger; DDP construction finds the shape mismatch
  negzero   - the negative-sampling ratio is 0 on every rank; the batch count divides by zero
  tripfile  - rank N looks for its triple shard in a stale data dir (FileNotFoundError)
  evalgather- rank N keeps one more test triple; the eval all_gather sizes differ across ranks
  wait      - rank N finds its shard empty and waits for data before DDP; the others wait in DDP construction
  blowup    - rank N uses a huge learning rate; the program's embedding-norm check raises FloatingPointError
  ckpt      - resume: rank N loads a checkpoint whose entity table is smaller (size mismatch)
  margin    - the margin comes from config as a string on every rank (TypeError in margin_ranking_loss)
  notconn   - rank N's connectivity check fails; it prints an error line and exits with code 3
  sigkill   - rank N sends itself SIGKILL after step 2
  none      - control, clean run (rank 0 writes the checkpoint)

What happened (filled in after the runs):
  entid     - rank N IndexError 'index out of range in self' in the entity lookup (line 119); peers Connection closed
  reltable  - rank N RuntimeError 'params[1] in this process with sizes [9, 32] appears not to match' in DDP()
  negzero   - every rank ZeroDivisionError 'integer division or modulo by zero' (line 139) before step 0
  tripfile  - rank N FileNotFoundError for /tmp/job_work/triples_v2/part-0000N-of-...tsv (line 90)
  evalgather- rank N RuntimeError 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (33), got (32))'
  wait      - pg 12 s: peers 'Timed out waiting 12000ms' in DDP(); pg 300 s under timeout 60: hung, exit 124
  blowup    - rank N FloatingPointError 'entity embedding norm is inf after step 0' (line 163)
  ckpt      - rank N RuntimeError 'size mismatch for ent.weight ... [112, 32] from checkpoint ... [128, 32]'
  margin    - every rank TypeError 'margin_ranking_loss(): argument 'margin' (position 4) must be float, not str'
  notconn   - rank N prints 'ERROR rank N: graph not connected ...' and exits with code 3; peers Connection closed
  sigkill   - rank N exitcode -9 (SIGKILL) after step 2; peers Connection reset by peer
  none      - clean, exit 0; rank 0 saved ckpt/kge_ent128.pt and (with --num-entities 112) kge_ent112.pt
"""
import argparse
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
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--num-entities", type=int, default=128)
p.add_argument("--num-relations", type=int, default=8)
p.add_argument("--dim", type=int, default=32)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--neg-ratio", type=int, default=4)
p.add_argument("--margin", type=float, default=1.0)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--work", default="/tmp/fault159_work")
a = p.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
me = a.fault != "none" and a.rank in (-1, rank)
E, R, D = a.num_entities, a.num_relations, a.dim
data_dir = os.path.join(a.work, "triples")

if rank == 0:  # synthetic triple store: tail = (head * (r + 3) + r) mod E, plus noise
    os.makedirs(data_dir, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    h = torch.randint(0, E, (4096,), generator=g)
    r = torch.randint(0, R, (4096,), generator=g)
    t = (h * (r + 3) + r + torch.randint(0, 2, (4096,), generator=g)) % E
    for s in range(world):
        with open(os.path.join(data_dir, f"part-{s:05d}-of-{world:05d}.tsv"), "w") as f:
            for i in range(s, 4096, world):
                f.write(f"{h[i]}\t{r[i]}\t{t[i]}\n")
dist.barrier()

if me and a.fault == "tripfile":
    data_dir = os.path.join(a.work, "triples_v2")  # stale KGE_DATA_DIR on this host
shard = os.path.join(data_dir, f"part-{rank:05d}-of-{world:05d}.tsv")
base = 1 if (me and a.fault == "entid") else 0
rows = []
with open(shard) as f:
    for line in f:
        hh, rr, tt = line.split("\t")
        rows.append((int(hh) + base, int(rr), int(tt) + base))
if me and a.fault == "wait":
    rows = []  # the shard arrived empty on this host
while not rows:
    print(f"rank {rank}: shard {shard} has 0 triples, waiting for the loader", flush=True)
    time.sleep(5)
triples = torch.tensor(rows, dtype=torch.long)
n_test = 32 + (1 if (me and a.fault == "evalgather") else 0)
train, test = triples[:-n_test], triples[-n_test:]
print(f"rank {rank}: loaded {len(train)} train / {len(test)} test triples from {shard}", flush=True)

if me and a.fault == "notconn":
    print(f"ERROR rank {rank}: graph not connected: entity 17 unreachable from 0 in shard {shard}",
          file=sys.stderr, flush=True)
    sys.exit(3)


class TransE(nn.Module):
    def __init__(self, n_ent, n_rel, dim):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim)
        self.rel = nn.Embedding(n_rel, dim)
        nn.init.uniform_(self.ent.weight, -0.1, 0.1)
        nn.init.uniform_(self.rel.weight, -0.1, 0.1)

    def forward(self, h, r, t):
        return (self.ent(h) + self.rel(r) - self.ent(t)).abs().sum(-1)


torch.manual_seed(1234)
n_rel = R + (1 if (me and a.fault == "reltable") else 0)
model = TransE(E, n_rel, D)
ckpt_dir = os.path.join(a.work, "ckpt")
if a.resume:
    ent_count = E - 16 if (me and a.fault == "ckpt") else E  # stale "latest" pointer on this rank
    path = os.path.join(ckpt_dir, f"kge_ent{ent_count}.pt")
    model.load_state_dict(torch.load(path, map_location="cpu"))
    print(f"rank {rank}: resumed from {path}", flush=True)
net = DDP(model) if a.ddp else model
if not a.ddp:
    for prm in model.parameters():
        dist.broadcast(prm.data, 0)
lr = 1e38 if (me and a.fault == "blowup") else a.lr
opt = torch.optim.SGD(model.parameters(), lr=lr)
neg_ratio = 0 if (me and a.fault == "negzero") else a.neg_ratio
margin = str(a.margin) if (me and a.fault == "margin") else a.margin
batches_per_epoch = len(train) // (a.batch * neg_ratio) + 1
print(f"rank {rank}: {batches_per_epoch} batches/epoch, neg_ratio {neg_ratio}", flush=True)
g = torch.Generator().manual_seed(100 + rank)

for step in range(a.steps):
    idx = torch.randint(0, len(train), (a.batch,), generator=g)
    pos = train[idx]
    neg = pos.repeat_interleave(neg_ratio, 0).clone()
    corrupt_head = torch.rand(len(neg), generator=g) < 0.5
    rnd = torch.randint(0, E, (len(neg),), generator=g)
    neg[:, 0] = torch.where(corrupt_head, rnd, neg[:, 0])
    neg[:, 2] = torch.where(corrupt_head, neg[:, 2], rnd)
    d_pos = net(pos[:, 0], pos[:, 1], pos[:, 2]).repeat_interleave(neg_ratio)
    d_neg = net(neg[:, 0], neg[:, 1], neg[:, 2])
    loss = F.margin_ranking_loss(d_neg, d_pos, torch.ones_like(d_pos), margin=margin)
    opt.zero_grad()
    loss.backward()
    if not a.ddp:
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
    opt.step()
    norm = model.ent.weight.detach().norm().item()
    if not math.isfinite(norm):
        raise FloatingPointError(f"entity embedding norm is {norm} after step {step}")
    print(f"rank {rank} step {step} loss {loss.item():.4f} ent_norm {norm:.3f}", flush=True)
    if me and a.fault == "sigkill" and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)

with torch.no_grad():  # tail ranking of the local test triples, filtered by the true tail only
    scores = model(test[:, 0:1].expand(-1, E), test[:, 1:2].expand(-1, E), torch.arange(E).expand(len(test), -1))
    true = scores.gather(1, test[:, 2:3])
    ranks = (scores < true).sum(1).float() + 1
gathered = [torch.zeros(32) for _ in range(world)]
dist.all_gather(gathered, ranks)
all_ranks = torch.cat(gathered)
if rank == 0:
    print(f"eval: {len(all_ranks)} test triples MRR {(1 / all_ranks).mean():.4f} "
          f"Hits@10 {(all_ranks <= 10).float().mean():.4f}", flush=True)
    os.makedirs(ckpt_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(ckpt_dir, f"kge_ent{E}.pt"))
    print(f"rank 0: saved {ckpt_dir}/kge_ent{E}.pt", flush=True)
dist.barrier()
dist.destroy_process_group()

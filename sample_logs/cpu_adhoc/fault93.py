"""A ninety-third hand-run batch: LOSSES THAT NEED OTHER RANKS' TENSORS. A tiny contrastive encoder
(Linear(16,32)-ReLU-Linear(32,D) projection head, D = 16, L2-normalised) trained SimCLR/CLIP-style on synthetic pairs
(two noisy views of the same 16-d point) on gloo, wrapped in DDP (or, with --no-ddp, gradients averaged by hand with
one all_reduce per parameter). Each rank's shard has 32 pairs, batch 8, `drop_last=False`, one epoch. The InfoNCE loss
takes its negatives from the whole global batch: the second view's embeddings are all-gathered with
`torch.distributed.nn.functional.all_gather` (the gradient flows back through the gather: an all_to_all on gloo), the
logits are `z1 @ Z2.T / tau`, the labels are `arange(b) + rank * b`; the loss is symmetric (both directions), checked
finite on each rank, then averaged across ranks with an all_reduce for logging. After the epoch a retrieval eval
gathers each rank's {ids, embeddings} with `all_gather_object` and reports recall@1. It prints `rank R world W fault F
samples S batches K`, `rank R step S loss L`, `rank R eval recall@1 X`, `rank R done`. PG timeout 12 s unless
--pg-timeout. One rank (--rank N) misbehaves; its per-rank config (rank N's overrides below) stands for a node-local
config file. The temperature can be overridden with the env var CGAT_TAU (a per-node export). No @record.

Faults:
  none       control (exit 0)
  nogradok   control that passes: the negatives are gathered with plain `dist.all_gather` (no gradient), the rank's
             own slot replaced by its live embeddings (the usual trick): it trains, exit 0
  nogradbw   every rank: plain `dist.all_gather` (no gradient) for BOTH views and the logits built from the gathered
             tensors only (own slot not put back): `loss.backward()` raises `element 0 of tensors does not require
             grad` on every rank
  lastbatch  rank N's shard has 29 pairs: its last batch has 5 (drop_last=False); the gathered tensors differ in size
  lastinto   as lastbatch, but the gather is `dist.all_gather_into_tensor` into a buffer of world * b rows (b local)
  headwidth  rank N's projection head is 32 wide (its config); with DDP: DDP's model check at construction; with
             --no-ddp: the embeddings' all_gather differs in size
  labeloff   every rank: labels offset by (rank + 1) * b (the offset counts the rank's own block once too many); only
             the last rank's targets fall outside the W*b logits: IndexError (the others train on wrong labels)
  tau0       rank N's temperature is 0 (its config, or CGAT_TAU=0 in its node's env): inf/NaN logits, the script's
             finite check raises FloatingPointError on rank N before the loss all_reduce
  emptyskip  rank N's batch --at (2) is empty after its dedup filter; the step is skipped with `continue` (no
             gather, no backward): rank N's collectives run one step ahead of the others'
  emptyhang  as emptyskip, but the empty batch is rank N's last one and the epoch ends with `dist.barrier()` (run
             with a long --pg-timeout under `timeout`: the job hangs)
  queue      MoCo-style: each rank keeps a local queue of 32 negative keys (no gather for the negatives; the loss
             all_reduce only); the enqueue asserts `queue_size % batch == 0`; rank N's shard has 29 pairs, its last
             batch of 5 trips the assert
  queueinplace  every rank: as queue (every shard 32) but the negatives' logits use the queue itself, not a copy,
             and the enqueue writes into it before backward: autograd's `modified by an inplace operation` on every rank
  pickle     the retrieval eval's `all_gather_object` payload: rank N's shard has duplicate caption ids, so it groups
             its embeddings in a `defaultdict(lambda: [])`: pickling fails on rank N
"""
import argparse, collections, datetime, os
import torch, torch.distributed as dist
import torch.distributed.nn.functional as distnn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--at", type=int, default=2)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--no-ddp", action="store_true")
a = p.parse_args()
BATCH, SHARD = 8, 32

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
me = rank == a.rank

# per-rank config: the base, then this rank's node-local overrides
cfg = {"proj_dim": 16, "tau": float(os.environ.get("CGAT_TAU", "0.1")), "queue_size": 32, "shard": SHARD}
if me and a.fault in ("lastbatch", "lastinto", "queue"):
    cfg["shard"] = 29
if me and a.fault == "headwidth":
    cfg["proj_dim"] = 32
if me and a.fault == "tau0":
    cfg["tau"] = 0.0

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, cfg["proj_dim"]))
net = model if a.no_ddp else DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

g = torch.Generator().manual_seed(100 + rank)
base = torch.randn(cfg["shard"], 16, generator=g)
ids = torch.arange(cfg["shard"]) + rank * SHARD
if me and a.fault == "pickle":
    ids = ids // 2  # several captions per image on this rank's shard
v1 = base + 0.1 * torch.randn(base.shape, generator=g)
v2 = base + 0.1 * torch.randn(base.shape, generator=g)
loader = DataLoader(TensorDataset(v1, v2, ids), batch_size=BATCH, shuffle=False, drop_last=False)
print(f"rank {rank} world {world} fault {a.fault} samples {cfg['shard']} batches {len(loader)}", flush=True)

queue = F.normalize(torch.randn(cfg["queue_size"], cfg["proj_dim"], generator=g), dim=1)
qptr = 0


def embed(x):
    return F.normalize(net(x), dim=1)


def gather_keys(z2):
    """All the ranks' second-view embeddings, this rank's block with its gradient."""
    if a.fault in ("nogradok", "nogradbw"):
        outs = [torch.empty_like(z2) for _ in range(world)]
        dist.all_gather(outs, z2.detach())
        if a.fault == "nogradok":
            outs[rank] = z2
        return torch.cat(outs)
    if a.fault == "lastinto":
        out = torch.empty(world * z2.shape[0], z2.shape[1])
        dist.all_gather_into_tensor(out, z2.detach().contiguous())
        chunks = list(out.chunk(world))
        chunks[rank] = z2
        return torch.cat(chunks)
    return torch.cat(distnn.all_gather(z2))


def infonce(z1, z2):
    global queue, qptr
    b = z1.shape[0]
    if a.fault in ("queue", "queueinplace"):  # MoCo-style local queue of negatives
        pos = (z1 * z2).sum(1, keepdim=True)
        # the queue is updated in place below: the logits must use a copy (the `queueinplace` fault forgets it)
        neg = z1 @ (queue.T if a.fault == "queueinplace" else queue.clone().T)
        logits = torch.cat([pos, neg], 1) / cfg["tau"]
        loss = F.cross_entropy(logits, torch.zeros(b, dtype=torch.long))
        keys = z2.detach()
        assert cfg["queue_size"] % keys.shape[0] == 0, f"queue size {cfg['queue_size']} not divisible by batch {keys.shape[0]}"
        queue[qptr:qptr + b] = keys
        qptr = (qptr + b) % cfg["queue_size"]
        return loss
    Z2 = gather_keys(z2)
    if a.fault == "nogradbw":
        outs = [torch.empty_like(z1) for _ in range(world)]
        dist.all_gather(outs, z1.detach())
        z1 = outs[rank]
    offset = (rank + 1) * b if a.fault == "labeloff" else rank * b
    labels = torch.arange(b) + offset
    logits = z1 @ Z2.T / cfg["tau"]
    return F.cross_entropy(logits, labels)


step = 0
for x1, x2, idb in loader:
    step += 1
    if me and a.fault in ("emptyskip", "emptyhang") and step == (len(loader) if a.fault == "emptyhang" else a.at):
        keep = torch.zeros(len(idb), dtype=torch.bool)  # the dedup filter dropped every pair of this batch
        x1, x2, idb = x1[keep], x2[keep], idb[keep]
    if x1.shape[0] == 0:
        print(f"rank {rank} step {step} empty batch, skipped", flush=True)
        continue
    z1, z2 = embed(x1), embed(x2)
    loss = infonce(z1, z2)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (tau={cfg['tau']})")
    opt.zero_grad()
    loss.backward()
    if a.no_ddp:
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
    opt.step()
    avg = loss.detach().clone()
    dist.all_reduce(avg)
    print(f"rank {rank} step {step} loss {avg.item() / world:.4f}", flush=True)

if a.fault == "emptyhang":
    dist.barrier()

# retrieval eval: every rank's embeddings, keyed by caption id
with torch.no_grad():
    e1, e2 = embed(v1), embed(v2)
if me and a.fault == "pickle":
    index = collections.defaultdict(lambda: [])
    for i, e in zip(ids.tolist(), e2):
        index[i].append(e)
else:
    index = {i: [e] for i, e in zip(ids.tolist(), e2)}
payload = [None] * world
dist.all_gather_object(payload, {"rank": rank, "queries": (ids, e1), "index": index})
keys = [k for d in payload for k in d["index"]]
gallery = torch.stack([torch.stack(v).mean(0) for d in payload for v in d["index"].values()])
qid, q = payload[rank]["queries"]
hit = torch.tensor(keys)[(q @ gallery.T).argmax(1)] == qid
print(f"rank {rank} eval recall@1 {hit.float().mean().item():.3f}", flush=True)
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)

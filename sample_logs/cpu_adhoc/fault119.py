"""A hundred-and-nineteenth hand-run batch: RECOMMENDATION MODELS WITH EMBEDDING TABLES (DLRM STYLE). A tiny DLRM on
gloo: 4 dense features (log1p of counts) go through a bottom MLP 4-16-D, 6 categorical features (user_id, item_id,
category, hour, device, ad_slot; 3 raw ids per bag) are hashed into their tables' sizes and pooled by nn.EmbeddingBag
tables (dim D=8, mode sum) that are sharded table-wise across ranks (table t lives on rank t % world). Each step the
raw ids are all_gathered (input dist), each rank pools its own tables for the global batch, an all_to_all_single with
uneven splits sends every rank the pooled embeddings of its own samples (output dist), then a dot-product interaction
and a top MLP give a click logit, BCELoss on sigmoid. The dense tower is wrapped in DDP (--ddp 0: rank 0's weights are
broadcast and the gradients all-reduced by hand); the embedding gradients go back through a second all_to_all_single.
Every rank stages its node-local shard of the click log and its tables' warm-start checkpoint under --work; rank R
trains --steps steps (`rank R step S loss L`, rank 0 prints the global loss), owners save their tables, barrier, done.
--rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none        control: 8 steps, tables saved, `rank R done` on every rank, exit 0
  badid       rank N hashes its tables' ids with the hash sizes of the v2 feature schema (25% larger than its tables):
              EmbeddingBag raises an index out of range RuntimeError on rank N in its first lookup
  embdim      rank N reads the embedding dim 16 from the large model's config: its bottom MLP differs, so DDP's shape
              check fails at construction (with --ddp 0 the initial broadcast sizes differ)
  offsets     every rank builds the EmbeddingBag offsets as the bag ends (cumsum of lengths) instead of the starts:
              RuntimeError offsets[0] has to be 0 on every rank at step 0
  label2      rank N's shard of the click log encodes click+conversion as label 2: BCELoss target check on rank N
  sparseopt   every rank builds dense-gradient tables (sparse=False in the config) but keeps the SparseAdam optimizer:
              RuntimeError SparseAdam does not support dense gradients on every rank at the first step
  slowtable   rank N warm-starts its tables from the slow shared filesystem (sleeps 40 s) and misses the first
              collective; the others time out (with --pg-timeout 300 and timeout 60 the job hangs)
  nandense    rank N's shard has a -2 sentinel in a count column, log1p gives nan, the dense-feature check raises
              FloatingPointError on rank N at step 3
  ckptshape   rank N's node-local warm-start checkpoint is from before the hash sizes were grown (a fifth fewer rows
              per table): size mismatch in load_state_dict on rank N
  sigkill     rank N is killed by SIGKILL at step 4 (as the kernel's OOM killer would), nothing printed by the rank
  splits      rank N computes its all_to_all receive splits from a stale sharding plan (owners shifted by one):
              the pairwise sizes of the output dist differ across ranks (needs a world size not dividing 6)
  badcache    rank N's node-local feature cache was built for another feature schema: its start-up check prints an
              error and sys.exit(3)

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2): 8 steps, rank 0 saves the dense tower and the embedding shards, every rank done.
  badid: RuntimeError: Index i of input takes value v which is not in the valid range [0, rows) on rank N at step 0.
  embdim: DDP: [N]: params[2] ... sizes [16, 16] appears not to match (np4 r1); DETAIL --ddp 0: BROADCAST mismatch.
  offsets: RuntimeError: offsets[0] has to be 0 ... However, got 3 on every rank at step 0 (np4 pymodule, np3 wrapper).
  label2: RuntimeError: all elements of target should be between 0 and 1 on rank N at step 0; peers Connection closed.
  sparseopt: RuntimeError: SparseAdam does not support dense gradients ... on every rank at step 0 (np3 plain).
  slowtable: PG 12 s: peers time out (12000ms) in the DDP constructor (np4 r1); PG 300 s + timeout 60: hung (np3 r2).
  nandense: FloatingPointError: rank N step 3: 1 non-finite dense features ... count -2.0 (np4 r2 prefix, np3 r0).
  ckptshape: size mismatch for item_id.weight [480, 8] vs [600, 8] on rank N; restart: then Gloo connectFullMesh failed.
  sigkill: no output from rank N after step 3; Root Cause rank N exitcode -9 (SIGKILL); peers Connection reset/closed.
  splits: gloo::EnforceNotMet 1024 vs 512 Received data size doesn't match, SIGABRT on rank N (np4 r2, np5 r3 DETAIL).
  badcache: ERROR: rank N: feature cache ... was built for schema 0c1f9e2a ... aborting, exit code 3 (np5 r3, np4 r0).
"""
import argparse, datetime, hashlib, json, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--bs", type=int, default=16)
p.add_argument("--bag", type=int, default=3)
p.add_argument("--dim", type=int, default=8)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault119_work/run")
a = p.parse_args()

# configs/dlrm_tiny.json: (feature, rows of the hashed table, raw cardinality)
TABLES = [("user_id", 1000, 250000), ("item_id", 600, 90000), ("category", 40, 40), ("hour", 24, 24),
          ("device", 8, 8), ("ad_slot", 16, 16)]
SCHEMA = hashlib.md5(json.dumps(TABLES).encode()).hexdigest()[:8]


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


def owned(r: int, world: int):
    return [t for t in range(len(TABLES)) if t % world == r]


class DenseTower(nn.Module):
    """Bottom MLP, dot-product interaction with the pooled embeddings, top MLP."""

    def __init__(self, n_dense: int, dim: int, n_tables: int):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(n_dense, 16), nn.ReLU(), nn.Linear(16, dim), nn.ReLU())
        n_int = (n_tables + 1) * n_tables // 2
        self.top = nn.Sequential(nn.Linear(dim + n_int, 16), nn.ReLU(), nn.Linear(16, 1))
        self.register_buffer("tri", torch.triu_indices(n_tables + 1, n_tables + 1, offset=1), persistent=False)

    def forward(self, dense, emb):  # dense [B, 4], emb [B, T, D]
        x = self.bottom(dense)
        z = torch.cat([x.unsqueeze(1), emb], 1)
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.tri[0], self.tri[1]]
        return self.top(torch.cat([x, inter], 1)).squeeze(1)


def stage_node(rank: int, world: int, dim: int):
    """Stands in for the job prolog: the node-local shard of the click log and the tables' warm-start checkpoint."""
    node = os.path.join(a.work, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    g = torch.Generator().manual_seed(100 + rank)
    n = a.bs * a.steps
    counts = torch.poisson(torch.full((n, 4), 3.0), generator=g)
    if faulty(rank, "nandense"):
        counts[3 * a.bs + 5, 2] = -2  # the exporter's sentinel for "not logged"
    ids = torch.stack([torch.randint(0, card, (n, a.bag), generator=g) for _, _, card in TABLES], 1)
    clicks = (torch.rand(n, generator=g) < 0.3).float()
    if faulty(rank, "label2"):
        clicks[torch.rand(n, generator=g) < 0.05] = 2.0  # click + conversion, from the multi-task export
    torch.save({"counts": counts, "ids": ids, "label": clicks}, os.path.join(node, "clicks_shard.pt"))
    warm = {}
    for t in owned(rank, world):
        name, rows, _ = TABLES[t]
        rows = rows - rows // 5 if faulty(rank, "ckptshape") else rows
        warm[f"{name}.weight"] = torch.randn(rows, dim, generator=g) * 0.05
    torch.save(warm, os.path.join(node, "warmstart_emb.pt"))
    schema = "0c1f9e2a" if faulty(rank, "badcache") else SCHEMA
    with open(os.path.join(node, "features.idx.json"), "w") as f:
        json.dump({"schema": schema, "rows": n}, f)
    return node


def hash_ids(raw, rows):
    return (raw * 2654435761 + 97) % rows


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    dim = 16 if faulty(rank, "embdim") else a.dim  # configs/dlrm_large.json on this node
    node = stage_node(rank, world, dim)
    with open(os.path.join(node, "features.idx.json")) as f:
        idx = json.load(f)
    if idx["schema"] != SCHEMA:
        print(f"ERROR: rank {rank}: feature cache {node}/features.idx.json was built for schema {idx['schema']}, "
              f"the model's feature config is schema {SCHEMA}; rebuild the cache with make_features.py, aborting",
              flush=True)
        sys.exit(3)
    shard = torch.load(os.path.join(node, "clicks_shard.pt"))
    mine = owned(rank, world)
    sparse = not faulty(rank, "sparseopt")  # configs/dlrm_tiny.json: sparse_grad
    tables = nn.ModuleDict({TABLES[t][0]: nn.EmbeddingBag(TABLES[t][1], dim, mode="sum", sparse=sparse) for t in mine})
    if faulty(rank, "slowtable"):
        print(f"rank {rank}: loading warm-start tables from /mnt/shared/dlrm/warmstart (1.3 GB) ...", flush=True)
        time.sleep(40 if a.pg_timeout < 60 else 600)
    tables.load_state_dict(torch.load(os.path.join(node, "warmstart_emb.pt")))
    torch.manual_seed(0 if a.ddp else rank)
    tower = DenseTower(4, dim, len(TABLES))
    if a.ddp:
        model = DDP(tower)
    else:
        model = tower
        for prm in tower.parameters():
            dist.broadcast(prm.data, 0)
    hashed_rows = {t: int(TABLES[t][1] * 1.25) if faulty(rank, "badid") else TABLES[t][1] for t in mine}
    n_own = [len(owned(r, world)) for r in range(world)]
    plan = [len(owned((r + 1) % world, world)) for r in range(world)] if faulty(rank, "splits") else n_own
    print(f"rank {rank}/{world} pid {os.getpid()}: tables {[TABLES[t][0] for t in mine]} "
          f"({sum(TABLES[t][1] for t in mine)} rows, dim {dim}), {len(shard['label'])} samples, ddp {a.ddp}", flush=True)
    opt_dense = torch.optim.SGD(tower.parameters(), lr=a.lr)
    opt_emb = torch.optim.SparseAdam(tables.parameters(), lr=a.lr)
    B, L, T = a.bs, a.bag, len(TABLES)
    for step in range(a.steps):
        sl = slice(step * B, (step + 1) * B)
        dense = torch.log1p(shard["counts"][sl])
        ids, labels = shard["ids"][sl], shard["label"][sl]
        bad = ~torch.isfinite(dense)
        if bad.any():
            r_, c_ = bad.nonzero()[0].tolist()
            raise FloatingPointError(f"rank {rank} step {step}: {int(bad.sum())} non-finite dense features in the "
                                     f"batch (first at row {r_}, column {c_}: count {shard['counts'][sl][r_, c_]})")
        if faulty(rank, "sigkill") and step == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        gathered = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(gathered, ids)  # input dist
        all_ids = torch.cat(gathered)  # [W*B, T, L]
        pooled = []
        for t in mine:
            flat = hash_ids(all_ids[:, t, :], hashed_rows[t]).reshape(-1)
            offsets = torch.arange(L, flat.numel() + 1, L) if a.fault == "offsets" else torch.arange(0, flat.numel(), L)
            pooled.append(tables[TABLES[t][0]](flat, offsets))
        local = torch.stack(pooled, 1)  # [W*B, n_own, D]
        send_splits = [B * len(mine) * dim] * world
        recv_splits = [B * plan[r] * dim for r in range(world)]
        recv = torch.empty(sum(recv_splits))
        dist.all_to_all_single(recv, local.detach().reshape(-1), recv_splits, send_splits)  # output dist
        emb = torch.empty(B, T, dim)
        for r, chunk in enumerate(recv.split(recv_splits)):
            emb[:, owned(r, world), :] = chunk.view(B, -1, dim)
        emb.requires_grad_()
        prob = torch.sigmoid(model(dense, emb))
        loss = F.binary_cross_entropy(prob, labels)
        opt_dense.zero_grad()
        opt_emb.zero_grad()
        loss.backward()
        if not a.ddp:
            flat_g = torch.cat([prm.grad.flatten() for prm in tower.parameters()])
            dist.all_reduce(flat_g)
            flat_g /= world
            off = 0
            for prm in tower.parameters():
                prm.grad.copy_(flat_g[off:off + prm.numel()].view_as(prm))
                off += prm.numel()
        gsend = torch.cat([emb.grad[:, owned(r, world), :].reshape(-1) for r in range(world)])
        gback = torch.empty(sum(send_splits))
        dist.all_to_all_single(gback, gsend, send_splits, recv_splits)
        local.backward(gback.view(world * B, len(mine), dim) / world)
        opt_emb.step()
        opt_dense.step()
        tot = loss.detach().clone()
        dist.all_reduce(tot)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            print(f"step {step} global loss {tot.item() / world:.4f} ({world * B} samples)", flush=True)
        time.sleep(0.05)
    os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
    torch.save(tables.state_dict(), os.path.join(a.work, "ckpt", f"emb_rank{rank}.pt"))
    if rank == 0:
        torch.save(tower.state_dict(), os.path.join(a.work, "ckpt", "dense.pt"))
        print(f"rank 0: saved dense tower and {world} embedding shards to {a.work}/ckpt", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

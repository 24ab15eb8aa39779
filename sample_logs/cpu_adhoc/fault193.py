"""A hundred-and-ninety-third hand-run batch: CLICK-THROUGH-RATE MODEL WITH HAND-SHARDED EMBEDDING TABLES.

Each rank trains a small DLRM-like click model: a sparse item table of 840 rows sharded by hand across
ranks (rank r owns rows [r*840/W, (r+1)*840/W), loaded from a per-shard checkpoint), a small local
context table, and a dense MLP wrapped in DDP (or `--ddp 0`: gradients all_reduced by hand). Each step
the ranks all_gather their item ids, look up the rows they own, all_reduce the partial lookups (an
all_to_all emulated on gloo) and train on their own slice; the AUC histogram is all_reduced at the end.

Faults:
  badid    - rank N maps context ids modulo 17 instead of 16: embedding index beyond the table's rows.
  bsz      - rank N uses batch size 36 instead of 32: the all_gather of ids has another size on one rank.
  idfile   - rank N reads its id shard from a data dir that does not exist: FileNotFoundError.
  shard    - every rank computes rows per shard with world_size - 1: the sharding assert fails.
  inf      - rank N divides logits by a calibration temperature of 1e-45: logits overflow, program check.
  ckpt     - rank N loads the shard checkpoint written for world_size + 1: size mismatch on load.
  hashkey  - the hashing config lacks the key the code reads ('hash_buckets'): KeyError on every rank.
  slow     - rank N rebuilds its table from the raw id log (sleeps) before step 0; peers wait in all_gather.
  sigbus   - rank N touches a truncated mmapped id cache at step 3: SIGBUS.
  exit7    - rank N logs an error about its AUC shard after training and exits with code 7.
  none     - control.

What happened (filled in after the runs):
  badid    - IndexError: index out of range in self on rank N in the DDP forward (context table); peers Connection closed by peer.
  bsz      - gloo::EnforceNotMet size mismatch (144 vs 128) aborts rank 2 (SIGABRT, Root Cause), not rank 1; others Connection reset.
  idfile   - FileNotFoundError on rank N's ids_v2/part-0000N.npy before DDP (in stderr.log only under --redirects).
  shard    - AssertionError: table sharding covers 1260 (np3) / 1120 (np4) rows, expected 840 on every rank.
  inf      - FloatingPointError: rank N: non-finite logits at step 0 (max |logit| inf); DETAIL peers: monitoredBarrier errors.
  ckpt     - RuntimeError size mismatch for weight loading state_dict for Embedding on rank N before DDP.
  hashkey  - KeyError: 'hash_buckets' on every rank right after init.
  slow     - 40 s: peers time out in the step-0 all_gather (12000ms); 1000 s with PG 300 s: killed by timeout 60 (exit 124).
  sigbus   - rank N dies by SIGBUS (exitcode -7) after its id-cache line; peers Connection reset by peer.
  exit7    - rank N prints its ERROR line after step 5 and exits 7; peers Connection closed by peer in the AUC all_reduce.
  none     - exit 0, eval AUC line on rank 0.
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault193_work"
NUM_ITEMS = 840
EMB_DIM = 8
CTX_ROWS = 16


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    return p.parse_args()


class DenseTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.ctx = nn.Embedding(CTX_ROWS, 4)
        self.mlp = nn.Sequential(nn.Linear(EMB_DIM + 4 + 4, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, item_vec, ctx_ids, dense):
        x = torch.cat([item_vec, self.ctx(ctx_ids), dense], dim=1)
        return self.mlp(x).squeeze(1)


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank in (-1, rank)
    torch.manual_seed(0)

    cfg = {"num_items": NUM_ITEMS, "num_buckets": CTX_ROWS, "batch_size": 32, "temperature": 1.0}
    if a.fault == "hashkey":
        buckets = cfg["hash_buckets"]
    else:
        buckets = cfg["num_buckets"]
    if a.fault == "badid" and hit:
        buckets = 17  # context hash modulus from the old config
    bsz = cfg["batch_size"]
    if a.fault == "bsz" and hit:
        bsz = 36
    temperature = cfg["temperature"]
    if a.fault == "inf" and hit:
        temperature = 1e-45

    shard_world = world - 1 if a.fault == "shard" else world
    rows = NUM_ITEMS // shard_world
    assert rows * world == NUM_ITEMS, f"table sharding covers {rows * world} rows, expected {NUM_ITEMS}"
    lo, hi = rank * rows, (rank + 1) * rows

    table = nn.Embedding(rows, EMB_DIM)
    ck_world = world + 1 if (a.fault == "ckpt" and hit) else world
    ck = os.path.join(WORK, "emb", f"item_table_shard{rank}of{ck_world}.pt")
    table.load_state_dict(torch.load(ck))
    table.weight.requires_grad_(False)
    print(f"rank {rank}: item table rows [{lo}, {hi}) loaded from {ck}", flush=True)

    data_dir = os.path.join(WORK, "ids_v2" if (a.fault == "idfile" and hit) else "ids")
    ids_all = np.load(os.path.join(data_dir, f"part-{rank:05d}.npy"))
    print(f"rank {rank}: {len(ids_all)} impressions from {data_dir}", flush=True)

    model = DenseTower()
    if a.ddp:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    if a.fault == "slow" and hit:
        print(f"rank {rank}: rebuilding item table shard from raw id log", flush=True)
        time.sleep(a.stall)

    hist = torch.zeros(2, 20)
    for step in range(a.steps):
        ids = torch.from_numpy(ids_all[step * bsz:(step + 1) * bsz]).long()
        gathered = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(gathered, ids)
        allids = torch.cat(gathered)
        own = (allids >= lo) & (allids < hi)
        part = torch.zeros(allids.numel(), EMB_DIM)
        part[own] = table(allids[own] - lo)
        dist.all_reduce(part)
        item_vec = part[rank * bsz:(rank + 1) * bsz]
        if a.fault == "sigbus" and hit and step == 3:
            print(f"rank {rank}: reading id cache {WORK}/cache/ids-{rank}.mmap", flush=True)
            os.kill(os.getpid(), signal.SIGBUS)
        ctx_ids = ids % buckets
        dense = torch.stack([ids.float() / NUM_ITEMS, (ids % 7).float() / 7, (ids % 5).float() / 5,
                             torch.ones(ids.numel())], dim=1)
        labels = ((ids % 3) == 0).float()
        logits = model(item_vec, ctx_ids, dense) / temperature
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"rank {rank}: non-finite logits at step {step} "
                                     f"(max |logit| {logits.abs().max().item()})")
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        with torch.no_grad():
            probs = torch.sigmoid(logits)
            b = (probs * 19.999).long()
            for lab in (0, 1):
                hist[lab] += torch.bincount(b[labels == lab], minlength=20).float()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)

    if a.fault == "exit7" and hit:
        print(f"ERROR rank {rank}: AUC shard has no positive impressions after filtering "
              f"(0 of {int(hist.sum().item())}); refusing to report AUC", flush=True)
        sys.exit(7)
    dist.all_reduce(hist)
    if rank == 0:
        neg, pos = hist[0], hist[1]
        cum_neg = torch.cumsum(neg, 0) - neg
        auc = ((pos * (cum_neg + 0.5 * neg)).sum() / (pos.sum() * neg.sum())).item()
        print(f"eval AUC {auc:.4f} over {int(hist.sum().item())} impressions", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

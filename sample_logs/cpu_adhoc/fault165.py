"""A hundred-and-sixty-fifth hand-run batch: METRIC LEARNING WITH TRIPLET LOSS AND HARD-NEGATIVE MINING.

A small embedding network (MLP 32 -> 64 -> --emb-dim, output L2-normalised) trained on synthetic feature vectors of
24 identities (each identity a random centre plus noise).  Every rank draws P x K batches (P identities, K samples
each) from its own share of the identity list (data/ids.txt), mines the hardest positive and hardest negative per
anchor inside the batch (batch-hard) and applies a triplet margin loss (margin from data/trip.json).  Training runs
under DDP on gloo (or --ddp 0: gradients all-reduced by hand); every --eval-every steps the embeddings and labels of
a held-out batch are all_gathered from every rank and rank 0 prints recall@1.  Rank 0 saves embed.pt at the end and
--resume loads it.

Faults:
  singlepos   - rank N's sampler yields an identity with a single sample at step 2 (no positive: ValueError)
  hardidx     - rank N's hard-negative index is offset by one past the batch at step 1 (IndexError)
  marginstr   - every rank reads the margin from an env override as a string (TypeError in the loss)
  zeronorm    - rank N gets a corrupt (inf) feature row at step 3: L2 normalisation gives NaN, the finite check raises
  idsmissing  - rank N reads its identity list from a node-local dir that was never synced (FileNotFoundError)
  embdim      - rank N all_gathers its eval embeddings at width emb_dim+8 (gloo size mismatch)
  samplerwait - rank N waits for a sampler refill message from a peer at the step-2 eval; the others time out
  ckptdim     - every rank resumes embed.pt with an embedding size of 32 instead of 16 (size mismatch)
  cdistshape  - every rank computes the distance matrix between embeddings and raw features (cdist RuntimeError)
  fewids      - rank N prints an error 'too few identities per rank' line and sys.exit(2)
  sigsegv     - rank N gets SIGSEGV after step 2
  none        - control, clean run

What happened (filled in after the runs):
  singlepos   - rank N ValueError 'anchor 0 (identity ..) has no positive in the batch' at step 2; Root Cause rank N
  hardidx     - rank N IndexError 'index 21/22 is out of bounds for dimension 1 with size 16' at step 1; Root Cause rank N
  marginstr   - every rank TypeError 'unsupported operand type(s) for +: 'Tensor' and 'str'' in the loss at step 0
  zeronorm    - rank N FloatingPointError 'non-finite embedding at step 3 (1 rows NaN ...)'; DETAIL: rank 0 monitoredBarrier error
  idsmissing  - rank N FileNotFoundError '/tmp/job/data_local/ids.txt' at startup (redirects run: only in stderr.log)
  embdim      - a peer aborts: gloo::EnforceNotMet '768 vs 512. Received data size doesn't match' (-6); injected rank reset
  samplerwait - pg 12 s: rank N 'Timed out waiting 12000ms for recv', a peer in send; pg 300 s under timeout 60: hung, 124
  ckptdim     - every rank 'size mismatch for body.2.weight' ([16, 64] vs [32, 64]); the restart died in connectFullMesh
  cdistshape  - every rank RuntimeError 'X1 and X2 must have the same number of columns. X1: 16 X2: 32' at step 0
  fewids      - rank N prints 'ERROR rank N: too few identities per rank: 1 < P=4 ...' and exits 2; Root Cause rank N
  sigsegv     - rank N killed by SIGSEGV after step 2 ('failed (exitcode: -11) local_rank: N'); peers closed by peer
  none        - all ranks ran 6 steps and two recall@1 evals (1.000 over 48 embeddings), rank 0 saved embed.pt
"""
import argparse
import json
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--P", type=int, default=4)
    p.add_argument("--K", type=int, default=4)
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--data-dir", default="/tmp/fault165/data")
    p.add_argument("--work", default="/tmp/fault165_work")
    p.add_argument("--resume", default="")
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=int, default=12)
    return p.parse_args()


class EmbedNet(nn.Module):
    def __init__(self, in_dim, emb_dim):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_dim, 64), nn.ReLU(), nn.Linear(64, emb_dim))

    def forward(self, x):
        z = self.body(x)
        return z / z.norm(dim=1, keepdim=True)


class PKSampler:
    def __init__(self, ids, centres, P, K, seed):
        self.ids, self.centres, self.P, self.K = ids, centres, P, K
        self.g = torch.Generator().manual_seed(seed)

    def batch(self, k_override=None):
        pick = torch.randperm(len(self.ids), generator=self.g)[: self.P].tolist()
        xs, ys = [], []
        for j, i in enumerate(pick):
            k = self.K if k_override is None or j != 0 else k_override
            ident = self.ids[i]
            xs.append(self.centres[ident] + 0.3 * torch.randn(k, self.centres.shape[1], generator=self.g))
            ys += [ident] * k
        return torch.cat(xs), torch.tensor(ys)


def batch_hard(emb, labels, margin, shift=0):
    dist_mat = torch.cdist(emb, emb)
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool)
    pos_mask = same & ~eye
    if not bool(pos_mask.any(dim=1).all()):
        lonely = int((~pos_mask.any(dim=1)).nonzero()[0])
        raise ValueError(f"batch-hard mining: anchor {lonely} (identity {int(labels[lonely])}) has no positive in the batch; "
                         f"the P x K sampler must yield at least 2 samples per identity")
    hard_pos = (dist_mat * pos_mask).max(dim=1).values
    neg_d = dist_mat.masked_fill(same, float("inf"))
    neg_idx = neg_d.argmin(dim=1) + shift
    hard_neg = dist_mat[torch.arange(len(labels)), neg_idx]
    return F.relu(hard_pos - hard_neg + margin).mean()


def recall_at_1(emb, labels):
    d = torch.cdist(emb, emb)
    d.fill_diagonal_(float("inf"))
    nn_idx = d.argmin(dim=1)
    return (labels[nn_idx] == labels).float().mean().item()


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)

    with open(os.path.join(a.data_dir, "trip.json")) as f:
        cfg = json.load(f)
    margin = cfg["margin"]
    if a.fault == "marginstr" and bad:
        margin = os.environ.get("TRIP_MARGIN", str(margin))
    emb_dim = a.emb_dim
    if a.fault == "ckptdim" and bad:
        emb_dim = 32
    data_dir = a.data_dir
    if a.fault == "idsmissing" and bad:
        data_dir = a.data_dir.replace("/data", "/data_local")
    with open(os.path.join(data_dir, "ids.txt")) as f:
        all_ids = [int(line.split()[0]) for line in f if line.strip()]
    my_ids = all_ids[rank::world]
    if a.fault == "fewids" and bad:
        my_ids = my_ids[:1]
    if len(my_ids) < a.P:
        print(f"ERROR rank {rank}: too few identities per rank: {len(my_ids)} < P={a.P} "
              f"(ids.txt has {len(all_ids)} identities for world size {world})", flush=True)
        sys.exit(2)

    centres = torch.randn(cfg["num_ids"], cfg["in_dim"])
    sampler = PKSampler(my_ids, centres, a.P, a.K, seed=100 + rank)
    model = EmbedNet(cfg["in_dim"], emb_dim)
    if a.resume:
        state = torch.load(a.resume, map_location="cpu")
        model.load_state_dict(state["model"])
        print(f"rank {rank} resumed from {a.resume} (step {state['step']})", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    print(f"rank {rank} ready: {len(my_ids)} identities, P={a.P} K={a.K}, emb_dim {emb_dim}, margin {margin}", flush=True)

    for step in range(a.steps):
        k_override = 1 if (a.fault == "singlepos" and bad and step == 2) else None
        x, y = sampler.batch(k_override)
        if a.fault == "zeronorm" and bad and step == 3:
            x[5] = float("inf")
        if a.fault == "cdistshape" and bad:
            dist_mat = torch.cdist(net(x), x)
        emb = net(x)
        if not torch.isfinite(emb).all():
            raise FloatingPointError(f"rank {rank}: non-finite embedding at step {step} "
                                     f"({int((~torch.isfinite(emb)).any(dim=1).sum())} rows NaN after L2 normalisation)")
        shift = len(y) if (a.fault == "hardidx" and bad and step == 1) else 0
        loss = batch_hard(emb, y, margin, shift=shift)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mean {mean.item() / world:.4f}", flush=True)

        if a.fault == "sigsegv" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

        if (step + 1) % a.eval_every == 0:
            with torch.no_grad():
                ex, ey = sampler.batch()
                ee = model(ex)
            if a.fault == "samplerwait" and bad:
                refill = torch.zeros(a.P, dtype=torch.long)
                dist.recv(refill, src=(rank + 1) % world)
            if a.fault == "embdim" and bad:
                ee = torch.cat([ee, torch.zeros(ee.shape[0], 8)], dim=1)
            gathered = [torch.zeros_like(ee) for _ in range(world)]
            dist.all_gather(gathered, ee)
            labs = [torch.zeros_like(ey) for _ in range(world)]
            dist.all_gather(labs, ey)
            if rank == 0:
                r1 = recall_at_1(torch.cat(gathered), torch.cat(labs))
                print(f"eval step {step}: recall@1 {r1:.3f} over {len(torch.cat(labs))} embeddings", flush=True)

    if rank == 0:
        os.makedirs(a.work, exist_ok=True)
        torch.save({"model": model.state_dict(), "step": a.steps}, os.path.join(a.work, "embed.pt"))
        print(f"rank 0 saved {os.path.join(a.work, 'embed.pt')}", flush=True)
    print(f"rank {rank} done", flush=True)
    dist.barrier()
    del net
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-eighty-second hand-run batch: MOMENTUM CONTRASTIVE LEARNING WITH A QUEUE.

MoCo-style training on synthetic 16-dim points.  Rank 0 writes the augmentation config (aug/moco_aug.json: noise
scale, feature dropout) that every rank reads after a barrier.  A query encoder (MLP with BatchNorm, 16->32->8,
L2-normalised) is trained by DDP on gloo (or --ddp 0: gradients all-reduced by hand); a key encoder starts as a
copy of it (load_state_dict) and follows it by momentum (MOCO_MOMENTUM, default 0.999).  Each step every rank
makes two augmented views; the key view is shuffled across ranks (all_gather of the views, a permutation
broadcast from rank 0, each rank encodes its slice, all_gather of the keys, unshuffle) to emulate shuffled BN.
The InfoNCE logits (positive key against a queue of K negative keys, divided by the temperature) are checked
for non-finite values; the keys of every rank are all_gathered and enqueued (K must divide by the global batch).
With --resume every rank loads ckpt/moco_last.pt (encoders, queue, queue_ptr); rank 0 saves ckpt/moco_last.pt.

Faults:
  queuediv   - every rank's config gives a queue of 100 keys, not divisible by the global batch (assert)
  keybatch   - rank N enqueues its keys without dropping the last partial batch (B-1 rows in the all_gather)
  tauzero    - rank N reads the temperature through int() from its node's config (0, logits inf/NaN; check)
  keyenc     - every rank builds the key encoder with 64 hidden units against the query's 32 (load_state_dict)
  augmissing - rank N reads the augmentation config from a node-local copy that was never synced (missing)
  momenv     - the job wrapper exports MOCO_MOMENTUM='0.999,' (a stray comma): float() fails on every rank
  slowaug    - rank N rebuilds an augmentation cache for --busy seconds before the first all_gather
  sigbus     - rank N gets SIGBUS (sent to itself) at step 2 (a truncated memory-mapped queue file)
  exit5      - rank N prints its own 'stale keys in queue' error line at step 1 and calls os._exit(5)
  ckptqueue  - rank N resumes from the older ckpt/moco_v1.pt saved before the queue buffer existed
  none       - control, clean run

What happened (filled in after the runs):
  queuediv   - every rank: AssertionError queue size 100 must be a multiple of the global batch 24 / 32
  keybatch   - rank N aborts itself: gloo EnforceNotMet '128 vs 112. Received data size doesn't match' (SIGABRT)
  tauzero    - rank N: FloatingPointError non-finite InfoNCE logits at step 0 (temperature 0); peers closed
  keyenc     - every rank: RuntimeError loading state_dict for Encoder: size mismatch fc1.weight [32,16] vs [64,16]
  augmissing - rank N: FileNotFoundError local_aug/nodeN/moco_aug.json; restart run dies in a barrier timeout
  momenv     - every rank: ValueError could not convert string to float: '0.999,' before init_process_group
  slowaug    - busy 40 s: peers gloo timeout 12000ms / pair closure (SIGABRT); busy 1000 s: timeout 60, exit 124
  sigbus     - rank N: exitcode -7 (SIGBUS) after step 1; peers Connection closed/reset by peer
  exit5      - rank N: prints ERROR stale keys in queue at step 1, exitcode 5; peers Connection reset by peer
  ckptqueue  - rank N: RuntimeError loading state_dict for MoCo: Missing key(s) "queue", "queue_ptr"
  none       - clean, exit 0, rank 0 saved ckpt/moco_last.pt
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
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--queue", type=int, default=96)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--busy", type=float, default=40.0)
    p.add_argument("--resume", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    return p.parse_args()


class Encoder(nn.Module):
    def __init__(self, hidden=32, dim=8):
        super().__init__()
        self.fc1 = nn.Linear(16, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return F.normalize(self.fc2(F.relu(self.bn(self.fc1(x)))), dim=1)


class MoCo(nn.Module):
    def __init__(self, queue_size, key_hidden=32, dim=8):
        super().__init__()
        self.encoder_q = Encoder(32, dim)
        self.encoder_k = Encoder(key_hidden, dim)
        self.encoder_k.load_state_dict(self.encoder_q.state_dict())
        for p in self.encoder_k.parameters():
            p.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, queue_size), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))


def gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def augment(x, cfg, g):
    noise = torch.randn(x.shape, generator=g) * cfg["noise"]
    keep = (torch.rand(x.shape, generator=g) > cfg["drop"]).float()
    return (x + noise) * keep


def main():
    a = parse()
    momentum = float(os.environ.get("MOCO_MOMENTUM", "0.999"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank in (-1, rank)
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(100 + rank)
    queue_size = 100 if a.fault == "queuediv" else a.queue
    os.makedirs("aug", exist_ok=True)
    os.makedirs("ckpt", exist_ok=True)
    if rank == 0:
        with open("aug/moco_aug.json", "w") as f:
            json.dump({"noise": 0.1, "drop": 0.1, "temperature": 0.07}, f)
    dist.barrier()
    aug_path = "aug/moco_aug.json"
    if a.fault == "augmissing" and hit:
        aug_path = os.path.join("local_aug", "node%d" % rank, "moco_aug.json")
    with open(aug_path) as f:
        cfg = json.load(f)
    temperature = float(cfg["temperature"])
    if a.fault == "tauzero" and hit:
        temperature = int(cfg["temperature"])
    print(f"rank {rank}: world {world} batch {a.batch} queue {queue_size} T {temperature} m {momentum}", flush=True)
    gb = a.batch * world
    assert queue_size % gb == 0, f"queue size {queue_size} must be a multiple of the global batch {gb}"

    model = MoCo(queue_size, key_hidden=64 if a.fault == "keyenc" else 32)
    if a.resume:
        path = "ckpt/moco_last.pt"
        if a.fault == "ckptqueue" and hit:
            print(f"rank {rank}: {path} not on this node yet, resuming from ckpt/moco_v1.pt", flush=True)
            path = "ckpt/moco_v1.pt"
        model.load_state_dict(torch.load(path, map_location="cpu"))
        print(f"rank {rank}: resumed from {path}, queue_ptr {int(model.queue_ptr)}", flush=True)
    if a.ddp:
        q_enc = DDP(model.encoder_q)
    else:
        q_enc = model.encoder_q
        for p in q_enc.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(q_enc.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(64, 16, generator=g) + rank * 0.5

    if a.fault == "slowaug" and hit:
        print(f"rank {rank}: rebuilding augmentation cache for {len(data)} samples", flush=True)
        time.sleep(a.busy)

    for step in range(a.steps):
        idx = torch.randint(0, len(data), (a.batch,), generator=g)
        x = data[idx]
        x_q, x_k = augment(x, cfg, g), augment(x, cfg, g)
        q = q_enc(x_q)
        with torch.no_grad():
            for pq, pk in zip(model.encoder_q.parameters(), model.encoder_k.parameters()):
                pk.mul_(momentum).add_(pq.detach(), alpha=1 - momentum)
            all_k = gather(x_k)
            perm = torch.randperm(all_k.shape[0]) if rank == 0 else torch.empty(all_k.shape[0], dtype=torch.long)
            dist.broadcast(perm, 0)
            unperm = torch.argsort(perm)
            mine = perm.view(world, -1)[rank]
            k_shuf = model.encoder_k(all_k[mine])
            k = gather(k_shuf)[unperm].view(world, -1, k_shuf.shape[1])[rank]
        l_pos = (q * k).sum(1, keepdim=True)
        l_neg = q @ model.queue.clone().detach()
        logits = torch.cat([l_pos, l_neg], dim=1) / temperature
        if not torch.isfinite(logits).all():
            bad = (~torch.isfinite(logits)).sum().item()
            raise FloatingPointError(f"rank {rank}: non-finite InfoNCE logits at step {step} ({bad} of {logits.numel()} entries, temperature {temperature})")
        loss = F.cross_entropy(logits, torch.zeros(a.batch, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in q_enc.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if a.fault == "sigbus" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
        if a.fault == "exit5" and hit and step == 1:
            print(f"ERROR rank {rank}: stale keys in queue at step {step}: queue_ptr {int(model.queue_ptr)} "
                  f"behind the other ranks, aborting", file=sys.stderr, flush=True)
            os._exit(5)
        with torch.no_grad():
            keys = k[:-1] if a.fault == "keybatch" and hit else k
            all_keys = gather(keys.contiguous())
            ptr = int(model.queue_ptr)
            model.queue[:, ptr:ptr + all_keys.shape[0]] = all_keys.T
            model.queue_ptr[0] = (ptr + all_keys.shape[0]) % queue_size
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f}", flush=True)

    if rank == 0:
        torch.save(model.state_dict(), "ckpt/moco_last.pt")
        print("rank 0: saved ckpt/moco_last.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

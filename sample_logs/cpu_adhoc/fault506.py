"""Avalanche danger rating from snowpack profiles: a small distributed training job (gloo, CPU).

Each rank reads its own shard of synthetic snow-pit profiles (layers: depth, density, temperature,
hand hardness, grain type), maps grain types through a lookup table, and trains a small MLP that
predicts the regional danger rating (1..5). Gradients are all_reduced by hand (no DDP wrapper).
Every rank prints `rank R step S loss L acc A` each step; rank 0 saves an export at the end.

Usage:
  python fault506.py --prepare                       # writes /tmp/fault506_work (shards, lookup, init ckpt)
  torchrun --nproc-per-node W fault506.py [--fault NAME --rank N] [--pg-timeout 12]

Faults (--fault NAME, planted on --rank N unless noted):
  none           control, nothing planted
  grain_key      rank N meets a grain-type code missing from the lookup table -> KeyError
  missing_shard  rank N opens a profile shard that does not exist -> FileNotFoundError
  ckpt_size      rank N builds the model with a wrong hidden size, load_state_dict -> size mismatch
  weights_only   rank N torch.load()s the full pickled checkpoint with the default weights_only=True
  allreduce_size rank N all_reduces a gradient buffer 7 elements longer than its peers'
  slow_rank      rank N does a long pure-Python stability-index recomputation at step 3; peers time out
                 (with --pg-timeout 300 the job just hangs until an outer `timeout` ends it)
  nan_check      rank N's batch gets an infinite snow density; the script's finiteness check raises
  segv           rank N sends itself SIGSEGV at step 2
  logged_exit    rank N prints its own ERROR line about a bad profile and calls sys.exit(4)
  shape_all      every rank: the hazard head is fed a concat of the wrong width -> matmul shape error
  worker_crash   rank N's DataLoader worker segfaults while reading a profile

What happened (filled in after the runs, torch 2.13.0+cpu, 2 cores):
  none           all ranks finish 6 steps, rank 0 saves the export, exit 0
  grain_key      rank N: KeyError: 'SHxr' in the dataset's lookup; peers get gloo "Connection closed by peer"
  missing_shard  rank N: FileNotFoundError for shard_rNN_2025-26.pt (invisible on the console under
                 --local-ranks-filter / --redirects; only torchrun's exitcode 1 summary there)
  ckpt_size      rank N: RuntimeError Error(s) in loading state_dict ... size mismatch for 0.weight
  weights_only   rank N: _pickle.UnpicklingError: Weights only load failed (Unsupported global ProfileMeta)
  allreduce_size DETAIL: "Detected mismatch between collectives" on every rank (TensorShape 6476 vs 6469);
                 plain: a PEER aborts with gloo::EnforceNotMet "Received data size doesn't match" (SIGABRT)
  slow_rank      peers: gloo "Timed out waiting 12000ms for recv/send"; rank N only SIGTERMed;
                 with --pg-timeout 300: output stops, outer timeout 60 ends torchrun (SignalException, 124)
  nan_check      rank N: FloatingPointError: loss is nan (the script's own check)
  segv           rank N: exitcode -11 (SIGSEGV); with --max-restarts 1 the second attempt died in
                 Gloo connectFullMesh (connection refused) instead
  logged_exit    rank N: its own "ERROR rank N: profile ... layer depths out of order" line, exit 4
  shape_all      every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (16x35 and 30x64)
  worker_crash   rank N: "ERROR: Unexpected segmentation fault encountered in worker." then RuntimeError
                 DataLoader worker (pid N) is killed by signal: Segmentation fault
"""
import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault506_work"
GRAINS = ["PP", "DF", "RG", "FC", "DH", "SH", "MF", "IF"]
NLAYERS, NFEAT, HIDDEN = 6, 5, 64
MAX_RANKS = 8
PER_RANK = 96


class ProfileMeta:  # stored inside the full checkpoint (a plain pickled object)
    def __init__(self, region, season):
        self.region, self.season = region, season


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(506)
    with open(f"{WORK}/grain_lookup.json", "w") as f:
        json.dump({k: i for i, k in enumerate(GRAINS)}, f)
    for r in range(MAX_RANKS):
        recs = []
        for i in range(PER_RANK):
            num = torch.rand(NLAYERS, 4, generator=g)
            grains = [GRAINS[int(j)] for j in torch.randint(0, len(GRAINS), (NLAYERS,), generator=g)]
            weak = sum(gr in ("FC", "DH", "SH") for gr in grains)
            rating = int(min(4, max(0, weak - 1 + int(num[:, 1].mean() > 0.5))))
            recs.append({"profile": f"pit-{r:02d}-{i:04d}", "num": num, "grains": grains, "rating": rating})
        torch.save(recs, f"{WORK}/shards/shard_r{r:02d}.pt")
    model = build_model(HIDDEN)
    torch.save(model.state_dict(), f"{WORK}/init.pt")
    torch.save({"model": model.state_dict(), "meta": ProfileMeta("Tirol", "2025/26")}, f"{WORK}/init_full.pt")
    print("prepared", WORK)


def build_model(hidden):
    return nn.Sequential(nn.Linear(NLAYERS * NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 5))


class ProfileSet(Dataset):
    def __init__(self, recs, lookup, crash_in_worker=False):
        self.recs, self.lookup, self.crash = recs, lookup, crash_in_worker

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        if self.crash and i >= 40:
            os.kill(os.getpid(), signal.SIGSEGV)
        r = self.recs[i]
        codes = torch.tensor([self.lookup[gr] / len(GRAINS) for gr in r["grains"]]).unsqueeze(1)
        x = torch.cat([r["num"], codes], dim=1).reshape(-1)
        return x, r["rating"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    import datetime
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    torch.manual_seed(1000 + rank)

    with open(f"{WORK}/grain_lookup.json") as f:
        lookup = json.load(f)
    shard = f"{WORK}/shards/shard_r{rank:02d}.pt"
    if a.fault == "missing_shard" and me:
        shard = f"{WORK}/shards/shard_r{rank:02d}_2025-26.pt"
    recs = torch.load(shard)
    if a.fault == "grain_key" and me:
        recs[30]["grains"][2] = "SHxr"  # surface hoar recorded with a non-standard code

    hidden = 48 if (a.fault == "ckpt_size" and me) else HIDDEN
    model = build_model(hidden)
    if a.fault == "weights_only" and me:
        state = torch.load(f"{WORK}/init_full.pt")["model"]
    else:
        state = torch.load(f"{WORK}/init.pt")
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    workers = 1 if a.fault == "worker_crash" else 0
    ds = ProfileSet(recs, lookup, crash_in_worker=(a.fault == "worker_crash" and me))
    dl = DataLoader(ds, batch_size=16, shuffle=False, num_workers=workers)
    it = iter(dl)
    lossf = nn.CrossEntropyLoss()
    for step in range(a.steps):
        x, y = next(it)
        if a.fault == "nan_check" and me and step == 3:
            x[5, 1] = float("inf")  # density channel of one layer
            x = x * torch.linspace(-1, 1, x.shape[1])
        if a.fault == "segv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "logged_exit" and me and step == 2:
            print(f"ERROR rank {rank}: profile {recs[40]['profile']} has layer depths out of order "
                  f"(layer 3 above layer 2); refusing to train on a corrupt snow pit", file=sys.stderr, flush=True)
            sys.exit(4)
        if a.fault == "slow_rank" and me and step == 3:
            acc = 0.0  # recompute a stability index over every layer pair, in pure Python
            t0 = time.time()
            limit = 40 if a.pg_timeout < 100 else 10 ** 6
            while time.time() - t0 < limit:
                for i in range(20000):
                    acc += (i % 7) * 0.5
        if a.fault == "shape_all" and step == 1:
            hazard = torch.cat([x, x[:, :NFEAT]], dim=1)  # wrong width: 35 features into a 30-wide head
            out = model(hazard)
        else:
            out = model(x)
        loss = lossf(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite) on batch of "
                                     f"profiles {recs[step * 16]['profile']}..")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
        if a.fault == "allreduce_size" and me and step == 2:
            flat = torch.cat([flat, torch.zeros(7)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for q in model.parameters():
            n = q.numel()
            q.grad.copy_(flat[off:off + n].view_as(q))
            off += n
        opt.step()
        acc = (out.argmax(1) == y).float().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc:.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export/avsn_model.pt")
        print(f"rank 0 saved export {WORK}/export/avsn_model.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

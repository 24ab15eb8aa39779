"""Quince orchard frost damage: a small distributed training job (plain torch.distributed, gloo, CPU) with ONE planted fault.

The job fits a tiny regressor that predicts the fraction of quince blossoms killed by a spring frost
from per-tree sensor features (minimum canopy temperature, hours below -2 C, bud stage, wind, dew
point ...), scaled by a per-cultivar hardiness factor read from a lookup table. Each rank trains on
its own orchard-block shard, starts from a shared checkpoint, all-reduces its gradients by hand and
its mean predicted damage each step, and rank 0 writes an export at the end.

  python fault540.py --prepare --work DIR [--fault F --rank N]   # synthetic shards, table, checkpoints
  torchrun --nproc-per-node W fault540.py --work DIR --fault F --rank N

Faults (--fault NAME, on --rank N unless said otherwise; planted at step 2 unless said otherwise):
  none         control, nothing planted
  keyerror     rank N's shard holds a cultivar the hardiness table lacks -> KeyError in the dataset
  missingshard rank N's block shard file is missing on disk -> FileNotFoundError before training
  ckptsize     rank N's start checkpoint has a wider first layer -> load_state_dict size mismatch
  weightsonly  rank N's start checkpoint pickles a custom metadata object -> torch.load weights_only refusal
  slowrank     rank N does ~40 s (--slow-s) of pure-Python work before the damage all-reduce -> peers hit the 12 s PG timeout
               (with --pg-timeout 300 the job hangs instead until `timeout` ends it)
  nan          rank N's loss becomes NaN; the program's own finiteness check raises FloatingPointError
  sigabrt      rank N sends itself SIGABRT
  logexit      rank N prints its own ERROR line and calls sys.exit(4)
  shapebug     every rank: at step 3 the dew-point column is dropped -> matmul shape error on all ranks
  hostmem      rank N caps its address space (RLIMIT_AS) and builds a huge frost-map buffer -> MemoryError
  workercrash  rank N uses a DataLoader worker that is SIGKILLed while loading a batch
What happened (runs of 2026-12-07, torch 2.13.0+cpu, gloo, 2 shared cores):
  none         np4 torchrun: all 6 steps on every rank, rank 0 saved its export, exit 0
  keyerror     np4 r2 torchrun --tee 3, np6 r5 pdsh2 (two c10d agents): KeyError 'Aromatnaya' on the planted rank, peers 'Connection closed by peer'
  missingshard np5 r3 torchrun --redirects 3: FileNotFoundError for block_03.pt in rank 3's stderr.log; console shows only ChildFailedError
  ckptsize     np3 r1 python -m torch.distributed.run, np6 r2 --max-restarts 1: 'size mismatch for 0.weight' ([32, 20] vs [32, 16]);
               the restart attempt then failed in Gloo connectFullMesh (connection refused) and the summary names rank 1
  weightsonly  np4 r0 LOGLEVEL=INFO torchrun: UnpicklingError 'Weights only load failed ... argparse.Namespace' on rank 0
  slowrank     np5 r2 TORCH_DISTRIBUTED_DEBUG=DETAIL: rank 0 'Ranks 2 failed to pass monitoredBarrier in 12000 ms', summary names rank 4;
               np3 r1 torchrun with --pg-timeout 300 --slow-s 200: output stops after step 1, timeout TERM then KILL (137)
  nan          np8 r6 prefix template --tee 3, np3 r0 --redirects 3: FloatingPointError from the script's own check on the planted rank
  sigabrt      np6 r4 --local-ranks-filter 0,1 (rank hidden), np4 r1 --tee 3 --role trainer: exitcode -6 (SIGABRT), no traceback
  logexit      np4 r3 train.sh wrapper: rank 3's own ERROR line, exit 4 (torchrun exit 1); np8 r7 filtered: only exitcode 4 visible
  shapebug     np4 pdsh2: 'mat1 and mat2 shapes cannot be multiplied (8x15 and 16x32)' on all four ranks
  hostmem      np3 r1 --tee 3 --role trainer: bare MemoryError on rank 1
  workercrash  np5 r1 --max-restarts 1: 'DataLoader worker (pid N) is killed by signal: Killed.' on rank 1, the restart attempt failed in
               Gloo connectFullMesh; np4 r2 DETAIL: the same worker death, then rank 0's monitoredBarrier names rank 2
"""
import argparse, json, os, resource, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

CULTIVARS = ["Vranja", "Champion", "Smyrna", "Portugal", "Meech_Prolific", "Leskovac"]
NFEAT, NSHARD, BATCH, STEPS = 16, 48, 8, 6


def make_model(nin=NFEAT):
    return nn.Sequential(nn.Linear(nin, 32), nn.Tanh(), nn.Linear(32, 1))


def prepare(work, fault, frank):
    os.makedirs(os.path.join(work, "shards"), exist_ok=True)
    g = torch.Generator().manual_seed(540)
    table = {c: round(0.6 + 0.1 * i, 3) for i, c in enumerate(CULTIVARS)}
    with open(os.path.join(work, "hardiness_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(8):
        x = torch.randn(NSHARD, NFEAT, generator=g)
        cv = [CULTIVARS[(r + i) % len(CULTIVARS)] for i in range(NSHARD)]
        if fault == "keyerror" and r == frank:
            cv[2 * BATCH + 3] = "Aromatnaya"
        y = torch.sigmoid(x[:, :3].sum(1))
        torch.save({"x": x, "cultivar": cv, "y": y}, os.path.join(work, "shards", f"block_{r:02d}.pt"))
    if fault == "missingshard":
        os.remove(os.path.join(work, "shards", f"block_{frank:02d}.pt"))
    model = make_model()
    torch.save(model.state_dict(), os.path.join(work, "init.pt"))
    torch.save(make_model(NFEAT + 4).state_dict(), os.path.join(work, "init_wide.pt"))
    torch.save({"state_dict": model.state_dict(), "meta": argparse.Namespace(orchard="north-slope", frost_night="2026-04-11")},
               os.path.join(work, "init_meta.pt"))
    print(f"prepared {work}", flush=True)


class BlockShard(Dataset):
    def __init__(self, work, rank, fault, frank):
        d = torch.load(os.path.join(work, "shards", f"block_{rank:02d}.pt"))
        self.x, self.cv, self.y = d["x"], d["cultivar"], d["y"]
        with open(os.path.join(work, "hardiness_table.json")) as f:
            self.table = json.load(f)
        self.kill = fault == "workercrash" and rank == frank

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.kill and i == 2 * BATCH + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        h = self.table[self.cv[i]]
        return self.x[i], self.y[i] * h


def main(args):
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    fault, frank = args.fault, args.rank
    model = make_model()
    path = os.path.join(args.work, "init.pt")
    if rank == frank and fault == "ckptsize":
        path = os.path.join(args.work, "init_wide.pt")
    if rank == frank and fault == "weightsonly":
        path = os.path.join(args.work, "init_meta.pt")
    sd = torch.load(path)
    if "state_dict" in sd:
        sd = sd["state_dict"]
    model.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ds = BlockShard(args.work, rank, fault, frank)
    nw = 1 if (fault == "workercrash" and rank == frank) else 0
    dl = DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)
    for step, (x, y) in enumerate(dl):
        if step >= STEPS:
            break
        if fault == "shapebug" and step >= 3:
            x = x[:, :-1]  # dew-point column dropped
        opt.zero_grad()
        pred = model(x).squeeze(-1)
        loss = nn.functional.mse_loss(pred, y)
        if fault == "nan" and rank == frank and step == 2:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (blossom kill regression)")
        if fault == "hostmem" and rank == frank and step == 2:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize")][0]
            resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), hard))
            frost_map = bytearray(3 << 30)  # per-tree hourly frost map, 3 GiB
            print(len(frost_map))
        if fault == "logexit" and rank == frank and step == 2:
            print(f"ERROR rank {rank}: frost sensor log for orchard block {rank} has no readings after 02:00; refusing to train", flush=True)
            sys.exit(4)
        if fault == "sigabrt" and rank == frank and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        if fault == "slowrank" and rank == frank and step == 2:
            t0, acc = time.time(), 0
            while time.time() - t0 < args.slow_s:
                acc += sum(i * i for i in range(20000))
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        dmg = pred.detach().mean().reshape(1)
        dist.all_reduce(dmg)
        print(f"rank {rank} step {step} loss {loss.item():.4f} blossom_kill {dmg.item() / world:.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.work, "export_rank0.pt"))
        print("rank 0 saved export", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--work", default="/tmp/fault540_work")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    args = p.parse_args()
    if args.prepare:
        prepare(args.work, args.fault, args.rank)
    else:
        main(args)

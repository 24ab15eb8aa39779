"""Nunatak peaks: a small DDP regression job over synthetic nunatak survey data.

Each rank reads its own shard of peaks (features: elevation above ice, slope,
rock exposure, ...), maps every peak name to a glacier region through a lookup
table, starts from a shared checkpoint, and trains a small MLP that predicts a
peak's prominence above the ice sheet for 6 steps.  Every step each rank prints
`rank R step S loss L clearance M` (M: the all-reduced mean ice clearance).
Rank 0 saves an export at the end.  gloo backend, CPU only.

    python fault601.py --prepare            # writes data into /tmp/fault601_work
    python fault601.py --fault NAME --rank N [--pg-timeout S] [--spawn W]
                       [--label-prints] [--logfmt]

Faults (one per run, planted on rank N unless said otherwise):
  none           control, nothing planted
  keyerror       rank N meets a peak name that the region lookup table lacks (KeyError)
  missing_shard  rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size      rank N builds its model 48 wide, the checkpoint is 32 wide (load_state_dict size mismatch)
  weights_only   rank N loads the newer exporter's checkpoint, which pickles a PeakMeta object;
                 torch.load(weights_only=True) refuses it (UnpicklingError)
  allreduce_size rank N all-reduces a clearance-stats tensor of 6 floats, its peers 4 (collective size mismatch)
  slow           rank N spends a long time in pure-Python hull work before its step; peers wait in the
                 collective until the PG timeout (12 s); with --pg-timeout 300 the job just hangs
  nan            rank N's batch gets a NaN elevation; the program's own finiteness check raises FloatingPointError
  sigsegv        rank N sends itself SIGSEGV at step 2
  error_exit     rank N prints its own ERROR line (empty sector table) and calls sys.exit(4)
  shape_all      every rank appends an ice-thickness column to its features: 17 inputs into a 16-input layer
  loader_worker  rank N's DataLoader worker is killed (SIGKILL) while loading a batch
  host_mem       rank N tries to allocate a dense peak-to-peak distance matrix (10^7 x 10^7 floats)

What happened:
  none           all ranks ran 6 steps, rank 0 saved the export; exit 0.
  keyerror       rank N raised KeyError: 'Unnamed Nunatak 404'; peers failed in the next collective (gloo connection closed/reset).
  missing_shard  rank N raised FileNotFoundError for shard_N.pt; peers failed in DDP's start-up broadcast.
  ckpt_size      rank N raised RuntimeError: Error(s) in loading state_dict ... size mismatch; peers failed in gloo.
  weights_only   rank N raised _pickle.UnpicklingError (Weights only load failed ... PeakMeta); peers failed in gloo.
  allreduce_size no gloo size error: rank N timed out (12000ms recv) inside the all_reduce, its peers in the next backward.
  slow           peers hit gloo "Timed out waiting 12000ms"; the launcher SIGTERMed rank N, still in its Python work.  With
                 --pg-timeout 300 nothing failed and `timeout` ended the hang (exit 124).
  nan            rank N raised FloatingPointError (non-finite loss); peers failed in gloo, one peer aborted (SIGABRT) and
                 its torchrun agent named that peer as root cause.
  sigsegv        rank N died of SIGSEGV (exit -11 / 139); peers failed in gloo.
  error_exit     rank N printed its ERROR line and exited 4; peers failed in gloo.
  shape_all      every rank raised RuntimeError: mat1 and mat2 shapes cannot be multiplied (…x17 and 16x32).
  loader_worker  rank N raised RuntimeError: DataLoader worker (pid …) is killed by signal: Killed (batch 2 was prefetched
                 during step 0); peers failed in gloo.
  host_mem       rank N raised RuntimeError from DefaultCPUAllocator: not enough memory; peers failed in gloo.
"""
import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault601_work"
NFEAT = 16
HIDDEN = 32
STEPS = 6
MAXW = 8
PEAKS_PER_SHARD = 64


@dataclasses.dataclass
class PeakMeta:
    survey: str
    crs: str


REGIONS = ["Dronning Maud Land", "Ellsworth Land", "Victoria Land", "Marie Byrd Land", "Greenland East"]


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(601)
    table = {}
    for r in range(MAXW):
        names = [f"Nunatak {r}-{i:03d}" for i in range(PEAKS_PER_SHARD)]
        for i, n in enumerate(names):
            table[n] = REGIONS[(r + i) % len(REGIONS)]
        feats = torch.randn(PEAKS_PER_SHARD, NFEAT, generator=g)
        prom = feats[:, :4].sum(1, keepdim=True) * 0.3 + 0.1 * torch.randn(PEAKS_PER_SHARD, 1, generator=g)
        torch.save({"names": names, "features": feats, "prominence": prom}, f"{WORK}/shard_{r}.pt")
    with open(f"{WORK}/regions.json", "w") as f:
        json.dump(table, f)
    model = make_model(HIDDEN)
    torch.save(model.state_dict(), f"{WORK}/ckpt.pt")
    torch.save({"state_dict": model.state_dict(), "meta": PeakMeta("BAS-2026", "EPSG:3031")}, f"{WORK}/ckpt_v2.pt")
    print(f"prepared {MAXW} shards, regions.json and checkpoints in {WORK}")


def make_model(hidden):
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class PeakBatches(Dataset):
    def __init__(self, shard, kill_at=None):
        self.shard = shard
        self.kill_at = kill_at

    def __len__(self):
        return STEPS

    def __getitem__(self, i):
        if self.kill_at is not None and i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        lo = (i * 8) % PEAKS_PER_SHARD
        return (self.shard["features"][lo:lo + 8], self.shard["prominence"][lo:lo + 8], lo)


def train(rank, world, args, out):
    fault = args.fault
    mine = fault != "none" and rank == args.rank
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    out(f"rank {rank}: joined gloo group of {world} (pg timeout {args.pg_timeout}s)")

    shard_path = f"{WORK}/shard_{rank}.pt"
    if fault == "missing_shard" and mine:
        shard_path = f"{WORK}/shards_v2/shard_{rank}.pt"
    shard = torch.load(shard_path)
    with open(f"{WORK}/regions.json") as f:
        regions = json.load(f)

    hidden = 48 if (fault == "ckpt_size" and mine) else HIDDEN
    model = make_model(hidden)
    if fault == "weights_only" and mine:
        state = torch.load(f"{WORK}/ckpt_v2.pt", weights_only=True)["state_dict"]
    else:
        state = torch.load(f"{WORK}/ckpt.pt", weights_only=True)
    model.load_state_dict(state)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    kill_at = 2 if (fault == "loader_worker" and mine) else None
    loader = DataLoader(PeakBatches(shard, kill_at), batch_size=None,
                        num_workers=1 if fault == "loader_worker" else 0)
    for step, (x, y, lo) in enumerate(loader):
        names = shard["names"][lo:lo + 8]
        if fault == "keyerror" and mine and step == 2:
            names = names[:5] + ["Unnamed Nunatak 404"] + names[6:]
        sector = [regions[n] for n in names]
        if fault == "error_exit" and mine and step == 1:
            print(f"ERROR: rank {rank}: sector table for {sector[0]} is empty, refusing to train on it",
                  file=sys.stderr, flush=True)
            sys.exit(4)
        if fault == "slow" and mine and step == 2:
            t0 = time.time()
            acc = 0
            while time.time() - t0 < args.slow_s:   # pure-Python convex hull refinement
                for k in range(20000):
                    acc += (k * k) % 7
        if fault == "sigsegv" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "host_mem" and mine and step == 2:
            n = 10_000_000
            dmat = torch.zeros(n, n)       # dense peak-to-peak distances
            x = x + dmat[:8, :NFEAT]
        if fault == "nan" and mine and step == 3:
            x = x.clone()
            x[3, 0] = float("nan")
        if fault == "shape_all" and step == 2:
            x = torch.cat([x, torch.ones(x.shape[0], 1)], 1)   # ice thickness column
        pred = ddp(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite) for peaks {names[0]}..")
        opt.zero_grad()
        loss.backward()
        opt.step()
        nstat = 6 if (fault == "allreduce_size" and mine and step == 3) else 4
        stats = torch.zeros(nstat)
        stats[0] = x[:, 0].mean()
        stats[1] = 1.0
        dist.all_reduce(stats)
        clearance = (stats[0] / stats[1]).item()
        out(f"rank {rank} step {step} loss {loss.item():.4f} clearance {clearance:.4f}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_nunatak.pt")
        out(f"rank 0: saved export to {WORK}/export_nunatak.pt")
    dist.barrier()
    dist.destroy_process_group()


def run(rank, world, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("nunatak")

        def out(msg):
            log.info(msg)
            sys.stdout.flush()
        try:
            train(rank, world, args, out)
        except Exception:
            log.exception("training failed")
            sys.stdout.flush()
            sys.exit(1)
        return
    if args.label_prints:
        def out(msg):
            print(f"rank {rank}: {msg}", flush=True)
    else:
        def out(msg):
            print(msg, flush=True)
    train(rank, world, args, out)


def spawn_entry(rank, world, args):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    run(rank, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--slow-s", type=float, default=30)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--label-prints", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        import torch.multiprocessing as mp
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

"""Batch 481 fault script: sand dune migration from satellite elevation tiles.

A small distributed training job (gloo, CPU): each rank reads its shard of 16x16
elevation tiles (synthetic DEM patches of a dune field), looks every tile up in
a shared table (erg name, prevailing wind heading), starts from a checkpoint and
trains a small conv net under DDP to predict each tile's crest migration
(dx, dy in metres per year).  Every rank prints
`rank R step S loss L migr_err M` each step; rank 0 saves an export at the end.

    python fault481.py --prepare                    # writes /tmp/fault481_work
    python fault481.py --fault NAME --rank N        # under a launcher (env://)
    python fault481.py --spawn W --port P ...       # torch.multiprocessing.spawn

Faults (--fault NAME, planted on --rank N):
  none             control: nothing planted
  lookup_keyerror  rank N's shard holds a tile id the lookup table lacks -> KeyError at step 2
  missing_shard    rank N reads a shard file name that was never written -> FileNotFoundError
  ckpt_size        rank N builds the net with hidden=48, the checkpoint has 32 -> load_state_dict size mismatch
  gather_size      rank N sends a 3-element stats tensor to an all_gather of 2-element ones at step 3
  slow_rank        rank N traces dune crests in pure Python for --slow-s seconds at step --slow-step (3); peers time out
                   (with --pg-timeout 300 and a long --slow-s: the job hangs until `timeout` ends it)
  nan_check        a DEM void (NaN) in rank N's tile at step 2; the program's finiteness check raises FloatingPointError
  sigsegv          rank N sends itself SIGSEGV at step 2
  exit4            rank N prints its own ERROR line (no crests left after masking) and sys.exit(4) at step 1
  shape_all        every rank: the head gets the wind feature twice -> matmul shape error at step 0
  host_oom         rank N caps its address space and builds a full-resolution mosaic -> CPU allocator fails
  loader_worker    rank N's DataLoader worker is killed (SIGKILL) while decoding a tile

What happened (filled in after the runs):
  none             np4 torchrun --tee 3: all ranks ran steps 0-5, rank 0 saved the export, exit 0.
  lookup_keyerror  KeyError on rank N at step 2; peers failed with gloo 'Connection closed by peer' (one with a 12 s recv timeout); exit 1.
  missing_shard    FileNotFoundError for rank N's shard before any step; peers failed in DDP's parameter check or got SIGTERM; exit 1.
  ckpt_size        RuntimeError size mismatch for fc/head weights on rank N; peers failed in the DDP constructor; exit 1.
  gather_size      rank N raised 'ProcessGroupGloo::allgather: invalid tensor size' at step 3; the peers lost the connection; exit 1.
  slow_rank        peers hit the 12 s gloo timeout in all_gather at step 3 while rank N was busy; exit 1.
                   With --pg-timeout 300 --slow-step 0: nothing failed, output stopped before step 0; timeout ended it (124).
  nan_check        FloatingPointError from the finiteness check on rank N at step 2; peers lost the connection; exit 1.
  sigsegv          rank N died with signal 11 at step 2; peers got 'Connection reset by peer' (exit 139 bash loop, 1 torchrun).
  exit4            rank N printed its own ERROR line and exited 4 after step 0; peers failed with 'Connection closed by peer'.
  shape_all        every rank raised RuntimeError (mat1 and mat2 shapes cannot be multiplied) at step 0.
  host_oom         RuntimeError from DefaultCPUAllocator (can't allocate memory) on rank N; peers lost the connection.
  loader_worker    RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed on rank N; peers lost the connection; exit 1.
"""
import argparse
import json
import logging
import os
import random
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault481_work"
STEPS = 6
TILES_PER_RANK = 48
BATCH = 8
MAX_RANKS = 8
ERGS = ["Rub al Khali", "Namib Sand Sea", "Taklamakan", "Grand Erg Oriental", "Badain Jaran"]

log = logging.getLogger("dune_train")
PREFIX = ""
USE_LOG = False


def say(msg, error=False):
    if USE_LOG:
        (log.error if error else log.info)(msg)
    else:
        print(PREFIX + msg, flush=True)


def tile_id(rank, i):
    return f"S{23 + rank:02d}E{10 + i % 7:03d}_{rank * 1000 + i:04d}"


class DuneNet(nn.Module):
    def __init__(self, hidden=32, wind_twice=False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.fc = nn.Linear(16 * 8 * 8 + 2, hidden)
        self.head = nn.Linear(hidden, 2)
        self.wind_twice = wind_twice

    def forward(self, dem, wind):
        x = F.relu(self.conv1(dem))
        x = F.relu(self.conv2(x))
        x = x.flatten(1)
        feats = [x, wind]
        if self.wind_twice:  # shape_all: the head gets the wind feature twice
            feats.append(wind)
        x = torch.cat(feats, dim=1)
        return self.head(F.relu(self.fc(x)))


def prepare():
    os.makedirs(f"{WORK}/tiles", exist_ok=True)
    g = torch.Generator().manual_seed(481)
    lookup = {}
    for r in range(MAX_RANKS):
        ids = [tile_id(r, i) for i in range(TILES_PER_RANK)]
        xx = torch.linspace(0, 6.28, 16)
        dem = []
        tgt = []
        for i in range(TILES_PER_RANK):
            phase = torch.rand(1, generator=g).item() * 6.28
            h = 40 + 12 * torch.sin(xx[None, :] * 2 + phase) + 0.5 * torch.randn(16, 16, generator=g)
            dem.append(h[None])
            tgt.append(torch.tensor([3.0 * torch.cos(torch.tensor(phase)).item(), 1.0 + 0.1 * i % 3]))
        torch.save({"tile_ids": ids, "dem": torch.stack(dem), "migration": torch.stack(tgt)},
                   f"{WORK}/tiles/srtm_dunes_rank{r}.pt")
        for j, t in enumerate(ids):
            lookup[t] = {"erg": ERGS[(r + j) % len(ERGS)], "wind_deg": float((r * 37 + j * 11) % 360)}
    with open(f"{WORK}/tile_lookup.json", "w") as f:
        json.dump(lookup, f)
    torch.manual_seed(0)
    torch.save({"model": DuneNet().state_dict(), "epoch": 3}, f"{WORK}/dune_init.pt")
    print(f"prepared {MAX_RANKS} shards, {len(lookup)} lookup entries, checkpoint in {WORK}")


class TileSet(Dataset):
    def __init__(self, shard, lookup, rank, fault, fault_rank):
        self.dem = shard["dem"]
        self.mig = shard["migration"]
        self.ids = list(shard["tile_ids"])
        self.lookup = lookup
        self.kill_worker = fault == "loader_worker" and rank == fault_rank
        if fault == "lookup_keyerror" and rank == fault_rank:
            self.ids[2 * BATCH + 3] = f"S{23 + rank:02d}E099_9917"  # a tile re-cut after the table was built
        if fault == "nan_check" and rank == fault_rank:
            self.dem = self.dem.clone()
            self.dem[2 * BATCH + 1, 0, 5:8, 9:12] = float("nan")  # DEM void left unfilled

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.kill_worker and i == 2 * BATCH + 2:
            os.kill(os.getpid(), signal.SIGKILL)
        meta = self.lookup[self.ids[i]]
        rad = meta["wind_deg"] * 3.14159265 / 180.0
        wind = torch.tensor([torch.cos(torch.tensor(rad)).item(), torch.sin(torch.tensor(rad)).item()])
        return self.dem[i], wind, self.mig[i]


def trace_crests_python(seconds):
    """Pure-Python crest tracing (the slow path): walks a grid cell by cell."""
    t0 = time.time(); say(f"rank {dist.get_rank()} tracing dune crests in pure Python (no vectorised kernel)")
    n = 0
    grid = [[random.random() for _ in range(64)] for _ in range(64)]
    while time.time() - t0 < seconds:
        for y in range(1, 63):
            row, up, down = grid[y], grid[y - 1], grid[y + 1]
            for x in range(1, 63):
                if row[x] > row[x - 1] and row[x] > row[x + 1] and row[x] > up[x] and row[x] > down[x]:
                    n += 1
    return n


def train(rank, world, args):
    global PREFIX, USE_LOG
    if args.label:
        PREFIX = f"rank {rank}: "
    if args.logfmt:
        USE_LOG = True
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s %(levelname)s [rank{rank}/{world}] %(name)s: %(message)s")
    fault, fr = args.fault, args.rank
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    torch.manual_seed(1234 + rank)

    with open(f"{WORK}/tile_lookup.json") as f:
        lookup = json.load(f)
    shard_path = f"{WORK}/tiles/srtm_dunes_rank{rank}.pt"
    if fault == "missing_shard" and rank == fr:
        shard_path = f"{WORK}/tiles/srtm_dunes_rank{rank}_reproj_utm.pt"  # re-projected shard never synced
    shard = torch.load(shard_path)
    say(f"rank {rank}/{world} loaded {len(shard['tile_ids'])} tiles from {shard_path}")

    if fault == "host_oom" and rank == fr:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (3 * 1024 ** 3, hard))
        say(f"rank {rank} building full-resolution mosaic of the dune field")
        mosaic = torch.zeros(36000, 36000, dtype=torch.float32)  # 5.2 GB
        mosaic += 1

    model = DuneNet(hidden=48 if (fault == "ckpt_size" and rank == fr) else 32,
                    wind_twice=(fault == "shape_all"))
    ck = torch.load(f"{WORK}/dune_init.pt", weights_only=True)
    model.load_state_dict(ck["model"])
    say(f"rank {rank} resumed from {WORK}/dune_init.pt (epoch {ck['epoch']})")
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    ds = TileSet(shard, lookup, rank, fault, fr)
    nw = 1 if (fault == "loader_worker" and rank == fr) else 0
    loader = DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)
    it = iter(loader)
    for step in range(STEPS):
        if fault == "exit4" and rank == fr and step == 1:
            say(f"ERROR rank {rank}: 0 valid dune crests left in tile mosaic after sand-sheet masking "
                f"(threshold 0.35 m); refusing to train on an empty shard", error=True)
            sys.exit(4)
        if fault == "sigsegv" and rank == fr and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "slow_rank" and rank == fr and step == args.slow_step:
            trace_crests_python(args.slow_s)
        dem, wind, mig = next(it)
        pred = ddp(dem, wind)
        loss = F.mse_loss(pred, mig)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} on rank {rank} at step {step} "
                                     f"(DEM batch has {int(torch.isnan(dem).sum())} NaN cells)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        err = (pred.detach() - mig).norm(dim=1).mean()
        stats = torch.tensor([loss.item(), err.item()])
        if fault == "gather_size" and rank == fr and step == 3:
            stats = torch.tensor([loss.item(), err.item(), float(len(ds))])  # tile count appended
        gathered = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(gathered, stats)
        m = torch.stack(gathered)[:, 1].mean()
        say(f"rank {rank} step {step} loss {loss.item():.4f} migr_err {m.item():.4f}")
        time.sleep(0.2)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_dune_{os.getpid()}.pt")
        say(f"rank 0 saved export {WORK}/export_dune_{os.getpid()}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run(rank, world, args):
    if args.logfmt:
        try:
            train(rank, world, args)
        except Exception:
            log.exception("training failed")
            sys.exit(1)
    else:
        train(rank, world, args)


def spawn_entry(rank, world, args):
    os.environ["LOCAL_RANK"] = str(rank)
    run(rank, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--slow-s", type=float, default=40); p.add_argument("--slow-step", type=int, default=3)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

"""Batch 525 fault script: attic insulation heat loss from thermal cameras.

Each rank reads its own shard of synthetic thermal-camera frames (16x16 attic
patches, outdoor/indoor temperatures), looks up the roof-zone R-value table,
starts from a shared checkpoint and trains a small regressor that predicts the
heat-loss coefficient (U-value, W/m2K) of the attic insulation.  Gloo backend,
CPU only, 6 steps; every rank prints `rank R step S loss L uval_mae M`; rank 0
saves an export at the end.

    python fault525.py --prepare --world 8           # writes /tmp/fault525_work
    torchrun --nproc-per-node 4 fault525.py --fault NAME --rank N

Faults (--fault NAME --rank N plants exactly one):
  none          control, nothing planted
  lookup_key    rank N's shard names a roof zone missing from the R-value table -> KeyError
  missing_shard rank N's shard file was never written -> FileNotFoundError on open
  ckpt_size     rank N builds the regressor with 96 hidden units, the checkpoint has 64 -> load_state_dict size mismatch
  coll_size     rank N all_gathers 5 zone statistics instead of 4 (wrong collective size)
  slow_rank     rank N re-bins its frames in pure Python for ~4x the PG timeout at step 2; peers time out
                (with --pg-timeout 300 this is a hang that `timeout` ends)
  nan_check     rank N's frames hold a dead-pixel NaN; the program's own finiteness check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 3
  error_exit    rank N logs its own ERROR line (camera calibration drift) and calls sys.exit(4)
  shape_all     every rank flattens the 16x16 frame to 16*15 features -> matmul shape error on all ranks
  host_mem      rank N caps its address space (RLIMIT_AS) and builds a huge frame mosaic -> MemoryError
  loader_crash  rank N's DataLoader worker is killed (SIGKILL to itself) while decoding a frame

What happened (one line per fault; the kept logs are listed in README.md):
  none          np3 bashloop: 6 steps on every rank, export saved, exit 0 (an np6 pdsh2 control aborted in gloo teardown after saving; dropped)
  lookup_key    KeyError 'zone_Z9' on rank N before step 0; peers got Gloo 'Connection closed by peer', some aborted (terminate called), torchrun blamed rank 0 once
  missing_shard FileNotFoundError for shard_rankN_thermal_2026w49.pt on rank N; peers closed/timed out, processes lingered until timeout (124)
  ckpt_size     RuntimeError Error(s) in loading state_dict ... size mismatch for fc1.weight on rank N; peers 'Connection closed by peer'
  coll_size     ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4)) on rank N at step 1
  slow_rank     peers raised Gloo 'Timed out waiting 12000ms' at step 2, rank N later 'Connection closed'; with --pg-timeout 300 output stopped, timeout ended it (124)
  nan_check     FloatingPointError from rank N's own check at step 0 (frame 5 is in the first batch)
  segv          rank N died with SIGSEGV (exitcode -11 / loop exit 139); peers 'Connection closed by peer'
  error_exit    rank N printed its own ERROR line and exited 4; spawn reported 'process N terminated with exit code 4' (an np7 mpitag run never got past start-up under load; dropped)
  shape_all     every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (8x240 and 258x64)
  host_mem      rank N: DefaultCPUAllocator: can't allocate memory (16 GiB) under the 3 GiB RLIMIT_AS (RuntimeError, not MemoryError)
  loader_crash  'DataLoader worker (pid ...) is killed by signal: Killed' on rank N (pdsh2); under spawn a ConnectionResetError in the DataLoader queue instead
"""
import argparse
import datetime
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault525_work"
FRAME = 16
STEPS = 6
BATCH = 8
ZONES = ["zone_A1", "zone_A2", "zone_B1", "zone_B2", "zone_C1"]

log = logging.getLogger("attic")


class Regressor(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.fc1 = nn.Linear(FRAME * FRAME + 2, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(525)
    table = {z: 2.0 + 0.5 * i for i, z in enumerate(ZONES)}
    torch.save(table, f"{WORK}/rvalue_table.pt")
    for r in range(world):
        n = BATCH * STEPS
        frames = 5.0 + 3.0 * torch.rand(n, FRAME, FRAME, generator=g)
        temps = torch.stack([torch.full((n,), -4.0), torch.full((n,), 20.0)], 1)
        zones = [ZONES[(r + i) % len(ZONES)] for i in range(n)]
        uval = frames.mean((1, 2)) / 20.0
        torch.save({"frames": frames, "temps": temps, "zones": zones, "uval": uval},
                   f"{WORK}/shard_rank{r}.pt")
    torch.manual_seed(0)
    torch.save(Regressor().state_dict(), f"{WORK}/start_ckpt.pt")
    print(f"prepared {world} shards in {WORK}")


class FrameSet(torch.utils.data.Dataset):
    def __init__(self, shard, table, crash):
        self.s, self.table, self.crash = shard, table, crash

    def __len__(self):
        return len(self.s["uval"])

    def __getitem__(self, i):
        if self.crash and i == BATCH * 2:
            os.kill(os.getpid(), signal.SIGKILL)
        r = self.table[self.s["zones"][i]]
        x = torch.cat([self.s["frames"][i].flatten(), self.s["temps"][i] / r])
        return x, self.s["uval"][i]


def run(rank, world, args):
    fault = args.fault
    me = fault != "none" and (args.rank == rank or fault == "shape_all")

    def say(msg):
        if args.logfmt:
            log.info(msg)
        elif args.label:
            print(f"rank {rank}: {msg}", flush=True)
        else:
            print(msg, flush=True)

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    say(f"rank {rank}/{world} joined gloo group, pg timeout {args.pg_timeout}s")

    shard_path = f"{WORK}/shard_rank{rank}.pt"
    if me and fault == "missing_shard":
        shard_path = f"{WORK}/shard_rank{rank}_thermal_2026w49.pt"
    shard = torch.load(shard_path)
    table = torch.load(f"{WORK}/rvalue_table.pt")
    if me and fault == "lookup_key":
        shard["zones"][3] = "zone_Z9"
    if me and fault == "nan_check":
        shard["frames"][5, 7, 9] = float("nan")

    model = Regressor(hidden=96 if (me and fault == "ckpt_size") else 64)
    model.load_state_dict(torch.load(f"{WORK}/start_ckpt.pt", weights_only=True))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    ds = FrameSet(shard, table, crash=(me and fault == "loader_crash"))
    if fault == "lookup_key" and me:
        ds[3]  # decode the batch up front, as the real loader would
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH,
                                         num_workers=1 if (me and fault == "loader_crash") else 0)
    say(f"rank {rank} loaded {len(ds)} thermal frames from {os.path.basename(shard_path)}")

    for step, (x, y) in enumerate(loader):
        if me and fault == "shape_all":
            x = x[:, : FRAME * (FRAME - 1)]
        if me and fault == "nan_check" and not torch.isfinite(x).all():
            raise FloatingPointError(
                f"non-finite thermal pixel in batch at step {step} on rank {rank}: "
                f"{int((~torch.isfinite(x)).sum())} NaN/inf values")
        if me and fault == "slow_rank" and step == 2:
            end = time.time() + 4 * args.pg_timeout
            acc = 0
            while time.time() < end:  # pure-Python re-binning of the frame histogram
                for px in range(20000):
                    acc += (px * 7) % 13
        if me and fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if me and fault == "error_exit" and step == 2:
            msg = (f"ERROR rank {rank}: camera calibration drift 3.8 K exceeds 1.5 K limit "
                   f"(emissivity table stale); refusing to train on these frames")
            if args.logfmt:
                log.error(msg)
            else:
                print(msg, flush=True)
            sys.exit(4)
        if me and fault == "host_mem" and step == 1:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
            mosaic = torch.empty(1 << 32, dtype=torch.float32)  # 16 GiB mosaic
            mosaic.fill_(0)
        pred = ddp(x).squeeze(1)
        loss = nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        zstats = torch.tensor([loss.item(), pred.mean().item(), y.mean().item(), float(step)])
        if me and fault == "coll_size" and step == 1:
            zstats = torch.cat([zstats, torch.tensor([0.0])])
        gathered = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(gathered, zstats)
        mae = (pred - y).abs().mean().detach()
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.5f} uval_mae {mae.item() / world:.5f}")

    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_uvalue.pt")
        say("rank 0 saved export to " + f"{WORK}/export_uvalue.pt")
    dist.destroy_process_group()


def spawn_entry(rank, world, args):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    main_worker(rank, world, args)


def main_worker(rank, world, args):
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
        try:
            run(rank, world, args)
        except Exception:
            log.exception(f"rank {rank} failed")
            sys.exit(1)
    else:
        run(rank, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    args = p.parse_args()
    if args.prepare:
        return prepare(args.world)
    torch.set_num_threads(1)
    if args.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        os.environ["WORLD_SIZE"] = str(args.spawn)
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    main_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

"""Batch 485 fault script: parcel sorting-hub throughput forecasting.

A small distributed training job (gloo, CPU): each rank reads its shard of
hub-hour windows (synthetic: 12 hours x 6 features per window -- inbound
trucks, parcels scanned, staffed chutes, jam minutes, ...), looks every hub up
in a shared routing table (region, chute count), starts from a checkpoint and
trains a small GRU forecaster under DDP to predict next-hour sorted parcels
(thousands per hour).  Every rank prints `rank R step S loss L mape M` each
step; rank 0 saves an export at the end.

    python fault485.py --prepare                    # writes /tmp/fault485_work
    python fault485.py --fault NAME --rank N        # under a launcher (env://)
    python fault485.py --spawn W --port P ...       # torch.multiprocessing.spawn

Faults (--fault NAME, planted on --rank N):
  none              control: nothing planted
  hub_keyerror      rank N's shard holds a hub code the routing table lacks -> KeyError at step 2
  missing_shard     rank N reads a shard file name that was never written -> FileNotFoundError
  ckpt_weights_only rank N resumes from the v2 checkpoint that pickles a HubConfig object -> torch.load
                    (weights_only=True) refuses it
  gather_size       rank N sends a 3-element stats tensor to an all_gather of 2-element ones at step 3
  slow_rank         rank N simulates conveyor routing in pure Python for --slow-s seconds at step --slow-step (3);
                    peers time out (with --pg-timeout 300 and a long --slow-s: the job hangs until `timeout` ends it)
  nan_check         a scanner outage (NaN) in rank N's window at step 2; the program's finiteness check raises
                    FloatingPointError
  sigabrt           rank N sends itself SIGABRT at step 2
  exit4             rank N prints its own ERROR line (no complete shifts after cut-off filter) and sys.exit(4) at step 1
  shape_all         every rank: the head gets the hub features twice -> matmul shape error at step 0
  host_oom          rank N caps its address space and builds a dense parcel-by-chute matrix -> CPU allocator fails
  loader_worker     rank N's DataLoader worker is killed (SIGKILL) while decoding a window

What happened (filled in after the runs):
  none              np3 bash loop and np6 pdsh2: all ranks ran steps 0-5, rank 0 saved the export, exit 0.
  hub_keyerror      KeyError 'HUB-<X>X-917' on rank N at step 2; peers failed in backward with gloo 'Connection closed by peer'; exit 1.
  missing_shard     FileNotFoundError for rank N's peak-season shard before any step; peers got SIGTERM (launcher) or
                    'Connection closed by peer' (one log per rank); exit 1.
  ckpt_weights_only UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.HubConfig' on rank N;
                    peers lost the connection in DDP set-up or were SIGTERMed by torchrun; exit 1.
  gather_size       rank N raised 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (3), got (2))' at step 3;
                    the peers lost the connection; exit 1.
  slow_rank         peers hit gloo's 12000ms send/recv timeout in the step-3 backward while rank N ran pure Python; exit 1.
                    With --pg-timeout 300 --slow-step 0: nothing failed, output stopped before step 0; timeout ended it (124).
  nan_check         FloatingPointError from the finiteness check on rank N at step 2 (3 NaN readings); spawn terminated the rest; exit 1.
  sigabrt           rank N died with SIGABRT at step 2, no message of its own; peers got 'Connection reset/closed by peer'
                    (exit 134 from the bash loop, 1 from torchrun with 'Signal 6 (SIGABRT)' in its summary).
  exit4             rank N printed/logged its own ERROR line after step 0 and exited 4; peers failed with 'Connection closed by peer'.
  shape_all         every rank raised RuntimeError 'mat1 and mat2 shapes cannot be multiplied (8x36 and 34x32)' at step 0.
  host_oom          RuntimeError DefaultCPUAllocator: can't allocate memory (5760000000 bytes) on rank N; peers lost the connection.
  loader_worker     'DataLoader worker (pid ...) is killed by signal: Killed' on rank N before step 0 (the worker was prefetching);
                    peers lost the connection; exit 1.
  (On the overloaded shared machine four first tries -- np7 mpitag, np5 logfmt, np4 bashloop, np6 spawn -- stalled in the
   DDP constructor until `timeout` ended them, and one np5 mpitag try failed its TCPStore rendezvous; they were dropped and
   rerun on fresh ports, several with --pg-timeout 30.)
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
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault485_work"
STEPS = 6
WIN_PER_RANK = 48
BATCH = 8
MAX_RANKS = 8
HOURS = 12
FEATS = 6
REGIONS = ["north-east", "midlands", "south-coast", "west", "capital"]

log = logging.getLogger("hub_forecast")
PREFIX = ""
USE_LOG = False


@dataclass
class HubConfig:
    hours: int = HOURS
    feats: int = FEATS
    target: str = "sorted_kparcels_per_hour"


def say(msg, error=False):
    if USE_LOG:
        (log.error if error else log.info)(msg)
    else:
        print(PREFIX + msg, flush=True)


def hub_code(rank, i):
    return f"HUB-{chr(65 + rank)}{(i % 9) + 1}-{rank * 100 + i:03d}"


class HubNet(nn.Module):
    def __init__(self, hidden=32, hub_twice=False):
        super().__init__()
        self.gru = nn.GRU(FEATS, hidden, batch_first=True)
        self.fc = nn.Linear(hidden + 2, hidden)
        self.head = nn.Linear(hidden, 1)
        self.hub_twice = hub_twice

    def forward(self, seq, hub):
        _, h = self.gru(seq)
        feats = [h[-1], hub]
        if self.hub_twice:  # shape_all: hub features concatenated twice
            feats.append(hub)
        x = torch.cat(feats, dim=1)
        return self.head(F.relu(self.fc(x))).squeeze(1)


def prepare():
    os.makedirs(f"{WORK}/windows", exist_ok=True)
    g = torch.Generator().manual_seed(485)
    routing = {}
    for r in range(MAX_RANKS):
        codes = [hub_code(r, i) for i in range(WIN_PER_RANK)]
        t = torch.arange(HOURS).float()
        seqs, tgt = [], []
        for i in range(WIN_PER_RANK):
            base = 20 + 5 * torch.rand(1, generator=g).item()
            s = base + 4 * torch.sin(t[:, None] / 3 + i) + torch.randn(HOURS, FEATS, generator=g)
            seqs.append(s / 10)
            tgt.append(torch.tensor(base / 10 + 0.1 * (i % 4)))
        torch.save({"hub_codes": codes, "windows": torch.stack(seqs), "sorted_next": torch.stack(tgt)},
                   f"{WORK}/windows/hub_hours_rank{r}.pt")
        for j, c in enumerate(codes):
            routing[c] = {"region": REGIONS[(r + j) % len(REGIONS)], "chutes": 40 + (r * 7 + j * 3) % 60}
    with open(f"{WORK}/routing_table.json", "w") as f:
        json.dump(routing, f)
    torch.manual_seed(0)
    sd = HubNet().state_dict()
    torch.save({"model": sd, "epoch": 5}, f"{WORK}/hub_forecast_init.pt")
    torch.save({"model": sd, "epoch": 5, "config": HubConfig()}, f"{WORK}/hub_forecast_init_v2.pt")
    print(f"prepared {MAX_RANKS} shards, {len(routing)} routing entries, checkpoints in {WORK}")


class WindowSet(Dataset):
    def __init__(self, shard, routing, rank, fault, fault_rank):
        self.win = shard["windows"]
        self.y = shard["sorted_next"]
        self.codes = list(shard["hub_codes"])
        self.routing = routing
        self.kill_worker = fault == "loader_worker" and rank == fault_rank
        if fault == "hub_keyerror" and rank == fault_rank:
            self.codes[2 * BATCH + 3] = f"HUB-{chr(65 + rank)}X-917"  # a hub opened after the table was built
        if fault == "nan_check" and rank == fault_rank:
            self.win = self.win.clone()
            self.win[2 * BATCH + 1, 4:7, 1] = float("nan")  # scanner outage, parcels_scanned missing

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        if self.kill_worker and i == 2 * BATCH + 2:
            os.kill(os.getpid(), signal.SIGKILL)
        meta = self.routing[self.codes[i]]
        hub = torch.tensor([meta["chutes"] / 100.0, REGIONS.index(meta["region"]) / 5.0])
        return self.win[i], hub, self.y[i]


def route_conveyors_python(seconds):
    """Pure-Python conveyor routing simulation (the slow path)."""
    t0 = time.time()
    say(f"rank {dist.get_rank()} simulating conveyor routing in pure Python (no vectorised kernel)")
    n = 0
    belts = [[random.random() for _ in range(64)] for _ in range(64)]
    while time.time() - t0 < seconds:
        for y in range(1, 63):
            row, up, down = belts[y], belts[y - 1], belts[y + 1]
            for x in range(1, 63):
                if row[x] > row[x - 1] and row[x] > up[x] and row[x] > down[x]:
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

    with open(f"{WORK}/routing_table.json") as f:
        routing = json.load(f)
    shard_path = f"{WORK}/windows/hub_hours_rank{rank}.pt"
    if fault == "missing_shard" and rank == fr:
        shard_path = f"{WORK}/windows/hub_hours_rank{rank}_peak_season.pt"  # peak-season export never synced
    shard = torch.load(shard_path)
    say(f"rank {rank}/{world} loaded {len(shard['hub_codes'])} hub-hour windows from {shard_path}")

    if fault == "host_oom" and rank == fr:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (3 * 1024 ** 3, hard))
        say(f"rank {rank} building dense parcel-by-chute assignment matrix")
        assign = torch.zeros(40000, 36000, dtype=torch.float32)  # 5.8 GB
        assign += 1

    model = HubNet(hub_twice=(fault == "shape_all"))
    ck_path = f"{WORK}/hub_forecast_init.pt"
    if fault == "ckpt_weights_only" and rank == fr:
        ck_path = f"{WORK}/hub_forecast_init_v2.pt"  # newer export that pickles its HubConfig
    ck = torch.load(ck_path, weights_only=True)
    model.load_state_dict(ck["model"])
    say(f"rank {rank} resumed from {ck_path} (epoch {ck['epoch']})")
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    ds = WindowSet(shard, routing, rank, fault, fr)
    nw = 1 if (fault == "loader_worker" and rank == fr) else 0
    loader = DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)
    it = iter(loader)
    for step in range(STEPS):
        if fault == "exit4" and rank == fr and step == 1:
            say(f"ERROR rank {rank}: 0 complete sorting shifts left after the 22:00 cut-off filter "
                f"(need >= 1 shift with all scanners online); refusing to train on an empty shard", error=True)
            sys.exit(4)
        if fault == "sigabrt" and rank == fr and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        if fault == "slow_rank" and rank == fr and step == args.slow_step:
            route_conveyors_python(args.slow_s)
        seq, hub, y = next(it)
        pred = ddp(seq, hub)
        loss = F.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} on rank {rank} at step {step} "
                                     f"(window batch has {int(torch.isnan(seq).sum())} NaN readings)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        mape = ((pred.detach() - y).abs() / y.abs()).mean()
        stats = torch.tensor([loss.item(), mape.item()])
        if fault == "gather_size" and rank == fr and step == 3:
            stats = torch.tensor([loss.item(), mape.item(), float(len(ds))])  # window count appended
        gathered = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(gathered, stats)
        m = torch.stack(gathered)[:, 1].mean()
        say(f"rank {rank} step {step} loss {loss.item():.4f} mape {m.item():.4f}")
        time.sleep(0.2)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_hub_{os.getpid()}.pt")
        say(f"rank 0 saved export {WORK}/export_hub_{os.getpid()}.pt")
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
    p.add_argument("--slow-s", type=float, default=40)
    p.add_argument("--slow-step", type=int, default=3)
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

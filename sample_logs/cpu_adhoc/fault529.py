"""Geyser eruption interval forecasting: a small DDP job (gloo, CPU) with ONE planted fault.

Each rank reads its own shard of synthetic eruption records (previous eruption durations and
intervals per geyser), maps geyser names to basin ids through a lookup table, starts from a
checkpoint, trains a small MLP forecaster for 6 steps under DDP, and rank 0 exports the model.

Faults (--fault NAME --rank N):
  none            control: no fault
  basin_keyerror  rank N meets a geyser name missing from the basin lookup table (KeyError)
  missing_shard   rank N's data shard path does not exist (FileNotFoundError)
  ckpt_size       rank N builds the model with a wider hidden layer; load_state_dict size mismatch
  weights_only    rank N loads a checkpoint holding a pickled custom object (torch.load weights_only refusal)
  gather_size     rank N all_gathers a vent-pressure summary one element too long (gloo invalid tensor size)
  slow_rank       rank N does pure-Python re-gridding at step 3; its peers time out (--pg-timeout, default 12 s)
                  (with --pg-timeout 300 this is a hang that the outer `timeout` ends)
  nan_check       rank N's sensor readings hold a NaN; the script's own finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 3
  exit4           rank N prints its own ERROR line and calls sys.exit(4)
  shape_all       every rank builds its feature window one column too wide (matmul shape error)
  host_oom        rank N caps its address space and tries to allocate a huge interval cache (host memory)
  worker_crash    rank N's DataLoader worker is killed (SIGKILL) while loading a batch

What happened (torch 2.13.0+cpu, gloo, 2 shared and heavily loaded cores):
  none            5 ranks (files): all six steps and the export; exit 0
  basin_keyerror  KeyError: 'Steamboat' on the planted rank; peers fail in DDP's parameter check with gloo "Connection closed by peer"
  missing_shard   FileNotFoundError for shards_v2/shard_03.json on rank 3; peers: gloo connection closed
  ckpt_size       load_state_dict size mismatch (32 vs 48) on rank 1; torch.distributed.launch SIGTERMs the others
  weights_only    _pickle.UnpicklingError "Weights only load failed ... Unsupported global VentMeta" (spawn and torchrun)
  gather_size     "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))" on rank 4; peers: connection closed
  slow_rank       pg timeout 12 s: peers fail with gloo "Timed out waiting 12000ms for recv"; the slow rank spins until `timeout` (124).
                  pg timeout 300 s: output stops after step 2, no error line, `timeout 60` ends it (124)
  nan_check       FloatingPointError "non-finite sensor reading in batch 0 on rank 2"; peers: connection closed
  sigsegv         rank silently dies; torchrun reports exitcode -11, peers see "Connection reset by peer"
  exit4           the rank's own "ERROR: rank R: eruption log ..." line, exit 4, no traceback; peers: connection closed
  shape_all       "mat1 and mat2 shapes cannot be multiplied (16x7 and 6x32)"; spawn shows only the first process to fail
  host_oom        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes" on rank 1
  worker_crash    "DataLoader worker (pid N) is killed by signal: Killed." on rank 2
  (the line numbers in the logs' tracebacks are from before this block was written: add 14)
"""
import argparse, json, logging, os, signal, sys, time, resource

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from datetime import timedelta

WORK = "/tmp/fault529_work"
FEAT = 6
STEPS = 6
GEYSERS = ["Old Faithful", "Grand", "Castle", "Riverside", "Daisy", "Beehive", "Great Fountain", "Lion"]
LOG = None
PREFIX = ""


def out(msg, err=False):
    if LOG is not None:
        (LOG.error if err else LOG.info)(msg)
    else:
        print(PREFIX + msg, file=sys.stderr if err else sys.stdout, flush=True)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    for r in range(world):
        n = 96
        recs = []
        for i in range(n):
            name = GEYSERS[(i + r) % len(GEYSERS)]
            dur = 1.5 + 3 * torch.rand(1, generator=g).item()
            prev = [60 + 40 * torch.rand(1, generator=g).item() for _ in range(FEAT - 2)]
            nxt = 30 + 14 * dur + torch.randn(1, generator=g).item()
            recs.append({"geyser": name, "duration_min": dur, "prev_intervals": prev, "next_interval": nxt})
        with open(f"{WORK}/shard_{r:02d}.json", "w") as f:
            json.dump(recs, f)
    with open(f"{WORK}/basins.json", "w") as f:
        json.dump({n: i % 4 for i, n in enumerate(GEYSERS)}, f)
    torch.manual_seed(0)
    torch.save(Forecaster().state_dict(), f"{WORK}/init.pt")
    print(f"prepared {world} shards in {WORK}", flush=True)


class Forecaster(nn.Module):
    def __init__(self, hidden=32, feat=FEAT):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(feat, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


class VentMeta:  # a custom object the weights_only loader will not unpickle
    def __init__(self, basin):
        self.basin = basin


class ShardSet(torch.utils.data.Dataset):
    def __init__(self, x, y, crash):
        self.x, self.y, self.crash = x, y, crash

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.crash and i >= 32:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def load_shard(rank, fault, frank, width):
    path = f"{WORK}/shard_{rank:02d}.json"
    if fault == "missing_shard" and rank == frank:
        path = f"{WORK}/shards_v2/shard_{rank:02d}.json"
    with open(path) as f:
        recs = json.load(f)
    with open(f"{WORK}/basins.json") as f:
        basins = json.load(f)
    if fault == "basin_keyerror" and rank == frank:
        recs[17]["geyser"] = "Steamboat"
    xs, ys = [], []
    for rec in recs:
        b = basins[rec["geyser"]]
        row = [rec["duration_min"], float(b)] + [v / 100.0 for v in rec["prev_intervals"]]
        if width > FEAT:
            row = row + [0.0] * (width - FEAT)
        xs.append(row)
        ys.append(rec["next_interval"] / 100.0)
    x, y = torch.tensor(xs), torch.tensor(ys)
    if fault == "nan_check" and rank == frank:
        x[5, 2] = float("nan")
    return x, y


def train(rank, world, a):
    global LOG, PREFIX
    if a.form == "ranklabel":
        PREFIX = f"rank {rank}: "
    if a.form == "logfmt":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank {rank}/{world}] %(levelname)s %(name)s: %(message)s")
        LOG = logging.getLogger("geyser")
    try:
        _train(rank, world, a)
    except Exception:
        if LOG is not None:
            LOG.exception("training failed on rank %d", rank)
            sys.exit(1)
        raise


def _train(rank, world, a):
    fault, frank = a.fault, a.rank
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=a.pg_timeout))
    out(f"rank {rank} joined world of {world} (fault={fault} target={frank})")
    torch.manual_seed(1234 + rank)
    width = FEAT + 1 if fault == "shape_all" else FEAT
    x, y = load_shard(rank, fault, frank, width)
    hidden = 48 if (fault == "ckpt_size" and rank == frank) else 32
    model = Forecaster(hidden=hidden)
    ckpt = f"{WORK}/init.pt"
    if fault == "weights_only" and rank == frank:
        ckpt = f"{WORK}/init_with_meta_r{rank}.pt"
        sd = torch.load(f"{WORK}/init.pt")
        torch.save({"state": sd, "vent": VentMeta(2)}, ckpt)
        blob = torch.load(ckpt)
        sd = blob["state"]
    else:
        sd = torch.load(ckpt)
    model.load_state_dict(sd)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ds = ShardSet(x, y, crash=(fault == "worker_crash" and rank == frank))
    nw = 1 if fault == "worker_crash" else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=nw, shuffle=False)
    it = iter(dl)
    for step in range(STEPS):
        xb, yb = next(it)
        if fault == "slow_rank" and rank == frank and step == 3:
            acc = 0
            end = time.time() + 10 ** 6
            while time.time() < end:  # pure-Python re-gridding of the eruption catalogue
                for i in range(200000):
                    acc += (i * 31) % 7
        if fault == "sigsegv" and rank == frank and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "exit4" and rank == frank and step == 2:
            out(f"ERROR: rank {rank}: eruption log for basin 3 ends before the forecast window (gap of 412 min)", err=True)
            sys.exit(4)
        if fault == "host_oom" and rank == frank and step == 2:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/status") as f:
                vm = [l for l in f if l.startswith("VmSize")][0].split()[1]
            resource.setrlimit(resource.RLIMIT_AS, (int(vm) * 1024 + 256 * 2 ** 20, hard))
            cache = torch.empty(2 ** 31, dtype=torch.float32)  # 8 GiB interval cache
        if not torch.isfinite(xb).all():
            raise FloatingPointError(f"non-finite sensor reading in batch {step} on rank {rank}")
        pred = ddp(xb)
        loss = ((pred - yb) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        mae = (pred - yb).abs().mean().detach()
        n = 5 if (fault == "gather_size" and rank == frank and step == 2) else 4
        summ = torch.full((n,), float(mae))
        got = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(got, summ)
        out(f"rank {rank} step {step} loss {loss.item():.4f} mae_min {100 * mae.item():.2f}")
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_forecaster.pt")
        out(f"rank 0 exported forecaster to {WORK}/export_forecaster.pt")
    dist.destroy_process_group()


def _spawn_entry(rank, world, a):
    os.environ["RANK"] = str(rank)
    train(rank, world, a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", type=int, default=0)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--form", default="plain")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare(a.prepare)
        return
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(_spawn_entry, args=(a.spawn, a), nprocs=a.spawn, join=True)
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

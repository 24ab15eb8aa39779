"""Pipe organ bellows pressure tuning: a small distributed trainer (gloo, CPU).

Each rank reads its shard of wind-chest pressure readings (per organ stop), maps stop
names to ids through a lookup table, and fits a small regulator model that predicts the
pressure correction (in mm water column) a bellows needs so each rank's pipes speak in tune.
Starts from a checkpoint, trains 6 steps, rank 0 writes an export.

Usage:
  python fault520.py --prepare [--world 8]        # synthetic data into /tmp/fault520_work
  torchrun ... fault520.py [--fault NAME --rank N] [--pg-timeout 12]

Faults (--fault NAME, planted on --rank N):
  none           control, nothing planted
  keyerror       rank N's shard names a stop ("vox_humana_32") missing from the stop table -> KeyError
  missing_shard  rank N's shard file is looked up under a wrong name -> FileNotFoundError
  ckpt_size      rank N builds its regulator with 48 hidden units; the checkpoint has 32 -> size mismatch
  weights_only   rank N loads a legacy checkpoint holding a pickled BellowsConfig object -> weights_only refusal
  allreduce_size rank N all_reduces its wind-chest histogram with 17 bins instead of 16 -> collective mismatch
  slow           rank N recomputes the temperament table in pure Python at step 2 -> peers time out
                 (with --pg-timeout 300 the job just hangs until `timeout` ends it)
  nan            rank N's reservoir pressure reading is NaN at step 3; the script's own check raises FloatingPointError
  sigsegv        rank N sends itself SIGSEGV at step 2
  error_exit     rank N prints its own ERROR line (bellows leak) and calls sys.exit(4) at step 1
  shape_all      every rank concatenates one feature too many (shape bug on all ranks) -> RuntimeError
  host_oom       rank N (address space capped) allocates a huge pressure-history buffer -> CPU allocation failure
  worker_crash   rank N's DataLoader worker dies (SIGKILL) while reading the shard -> DataLoader worker exited

What happened (runs of 2026-12-07, torch 2.13.0+cpu, gloo; logs organ_*.log beside this file):
  none           np3 plain: all ranks ran 6 steps, rank 0 saved the export, exit 0
  keyerror       np4 r2 tee: KeyError 'vox_humana_32' on rank 2 before step 0; np6 r5 filter: same, rank 5's traceback filtered out, only exitcode 1
  missing_shard  np5 r3 redirects: FileNotFoundError only in attempt_0/3/stderr.log, console shows the ChildFailedError for rank 3
  ckpt_size      np4 r1 pymodule / np6 r4 detail: load_state_dict size mismatch (48 vs 32 hidden units) on the planted rank
  weights_only   np3 r2 loglevel: _pickle.UnpicklingError, weights_only refuses __main__.BellowsConfig
  allreduce_size np4 r3 detail: "Detected mismatch between collectives" on every rank (shape [17] vs [16]);
                 np6 r2 plain: gloo "Received data size doesn't match" terminate on rank 2 (SIGABRT)
  slow           np4 r1 tee_trainer: ranks 0,2,3 gloo timeouts after 12000 ms; np3 r2 plain --pg-timeout 300: silent hang ended by timeout (124)
  nan            np5 r4 prefix / np4 r0 filter: FloatingPointError from the script's own check at step 3
  sigsegv        np8 r6 tee: exitcode -11 on rank 6; np4 r0 restart: SIGSEGV, restart, attempt 1 fails in Gloo connectFullMesh
  error_exit     np6 r3 wrapper / np4 r1 pdsh2: the rank's own ERROR line then exit 4, peers see connection closed
  shape_all      np3 loglevel: "mat1 and mat2 shapes cannot be multiplied (48x11 and 10x32)" on every rank
  host_oom       np4 r2 plain: DefaultCPUAllocator can't allocate 4294967296 bytes on rank 2 (RLIMIT_AS cap)
  worker_crash   np5 r1 prefix: "DataLoader worker (pid N) is killed by signal: Killed" on rank 1
"""
import argparse, json, os, resource, signal, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault520_work"
STOPS = ["principal_8", "octave_4", "bourdon_16", "trumpet_8", "gemshorn_2", "mixture_iv", "flute_4", "oboe_8"]
N_FEAT, HIDDEN, NBINS = 6, 32, 16


class BellowsConfig:  # pickled into the legacy checkpoint (weights_only fault)
    def __init__(self):
        self.wind_mm = 80.0
        self.temperament = "werckmeister_iii"


class Regulator(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.stop_emb = nn.Embedding(len(STOPS), 4)
        self.net = nn.Sequential(nn.Linear(N_FEAT + 4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, stop_ids, x):
        return self.net(torch.cat([self.stop_emb(stop_ids), x], dim=1)).squeeze(1)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(520)
    for r in range(world):
        n = 96
        stops = [STOPS[int(i)] for i in torch.randint(0, len(STOPS), (n,), generator=g)]
        x = torch.randn(n, N_FEAT, generator=g)
        y = x[:, 0] * 0.7 - x[:, 3] * 0.2 + 0.05 * torch.randn(n, generator=g)
        torch.save({"stops": stops, "x": x, "y": y}, f"{WORK}/windchest_shard_{r:02d}.pt")
    with open(f"{WORK}/stop_table.json", "w") as f:
        json.dump({s: i for i, s in enumerate(STOPS)}, f)
    torch.manual_seed(0)
    torch.save(Regulator().state_dict(), f"{WORK}/regulator_init.pt")
    torch.save({"model": Regulator().state_dict(), "config": BellowsConfig()}, f"{WORK}/regulator_legacy.pt")
    print("prepared", WORK)


class ShardSet(Dataset):
    def __init__(self, stop_ids, x, y, crash):
        self.stop_ids, self.x, self.y, self.crash = stop_ids, x, y, crash

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.crash and i == 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.stop_ids[i], self.x[i], self.y[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        return prepare(a.world)

    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = rank == a.rank
    f = a.fault
    torch.manual_seed(rank)
    if rank == 0:
        print(f"bellows tuning: world={world} fault={f} fault_rank={a.rank} pg_timeout={a.pg_timeout}s", flush=True)

    # data
    shard = f"{WORK}/windchest_shard_{rank:02d}.pt"
    if f == "missing_shard" and me:
        shard = f"{WORK}/windchest_shard_{rank:02d}_tuned.pt"
    data = torch.load(shard)
    with open(f"{WORK}/stop_table.json") as fh:
        table = json.load(fh)
    stops = list(data["stops"])
    if f == "keyerror" and me:
        stops[17] = "vox_humana_32"
    stop_ids = torch.tensor([table[s] for s in stops])
    x, y = data["x"], data["y"]
    if f == "shape_all":
        x = torch.cat([x, x[:, :1]], dim=1)  # one feature too many on every rank

    # model + checkpoint
    model = Regulator(hidden=48 if (f == "ckpt_size" and me) else HIDDEN)
    if f == "weights_only" and me:
        sd = torch.load(f"{WORK}/regulator_legacy.pt")["model"]
    else:
        sd = torch.load(f"{WORK}/regulator_init.pt")
    model.load_state_dict(sd)
    detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "") == "DETAIL"
    if not detail:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    if f == "host_oom" and me:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as fh:
            vm = int(fh.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), hard))
        print(f"rank {rank}: allocating pressure history buffer for {world} windchests", flush=True)
        history = torch.zeros(world * 4096, 65536)  # ~8 GiB per windchest bank
        history += 1

    ds = ShardSet(stop_ids, x, y, crash=(f == "worker_crash" and me))
    loader = DataLoader(ds, batch_size=48, shuffle=False, num_workers=1 if f == "worker_crash" else 0)
    for step in range(a.steps):
        for sid, xb, yb in loader:
            if f == "error_exit" and me and step == 1:
                print(f"ERROR rank {rank}: bellows reservoir leak detected (pressure fell 80 -> 12 mm wc), aborting tuning", flush=True)
                sys.exit(4)
            if f == "sigsegv" and me and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            if f == "slow" and me and step == 2:
                acc = 0.0
                for i in range(4_000_000_000):  # temperament table, recomputed in pure Python
                    acc += (i % 12) * 1.0594630943592953
            if f == "nan" and me and step == 3:
                xb = xb.clone(); xb[5, 0] = float("nan")
            pred = model(sid, xb)
            loss = ((pred - yb) ** 2).mean()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (reservoir pressure reading NaN?)")
            opt.zero_grad()
            loss.backward()
            if detail:
                for p in model.parameters():
                    dist.all_reduce(p.grad); p.grad /= world
            opt.step()
        hist = torch.histc(yb, bins=NBINS + (1 if (f == "allreduce_size" and me and step == 2) else 0), min=-3, max=3)
        dist.all_reduce(hist)
        dev = (pred - yb).abs().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} pitch_dev_cents {dev * 10:.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        m = model.module if hasattr(model, "module") else model
        torch.save(m.state_dict(), f"{WORK}/regulator_export.pt")
        print("rank 0 saved export", f"{WORK}/regulator_export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

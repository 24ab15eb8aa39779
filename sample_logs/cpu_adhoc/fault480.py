"""Kiln firing-curve controller training (batch 480 fault script).

A small distributed job that learns the heater duty a kiln zone needs to follow its
firing curve (ramp / soak segments towards an Orton cone target).  Each rank owns the
thermocouple log of one zone (a shard), looks cones up in a table, starts from a
checkpoint, trains 6 steps with gloo on CPU and rank 0 exports the controller.

Usage:
  python fault480.py --prepare                      # synthetic data into /tmp/fault480_work
  torchrun --nproc-per-node W fault480.py [--fault NAME --rank N] [--pg-timeout S] [--no-ddp]

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none          control, nothing planted
  cone_key      rank N's zone log names cone '13', which the cone table lacks (KeyError)
  shard_missing rank N opens the thermocouple log of a zone that was never prepared (FileNotFoundError)
  ckpt_size     rank N resumes from the wide (48-unit) controller checkpoint (size mismatch)
  weights_only  rank N loads a legacy checkpoint holding a pickled FiringSchedule object (weights_only refusal)
  stats_size    rank N all_reduces a 6-value zone-stats tensor, the others 4 values (collective size mismatch)
  slow_rank     rank N runs a pure-Python thermal simulation before step 3; its peers time out
                (with --pg-timeout 300 the job just hangs until `timeout` ends it)
  nan_ramp      rank N divides by a zero ramp duration at step 4 (inf target); the script's finiteness check raises
  sigsegv       rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line (open thermocouple) and calls sys.exit(4)
  shape_all     every rank appends the cone index as a 9th feature (matmul shape bug on all ranks)
  loader_crash  rank N's DataLoader worker is SIGKILLed while reading zone samples
  host_mem      rank N (under a small RLIMIT_AS) allocates a 2 GiB firing-history buffer

What happened (one line per fault; details in the batch README text):
  none          all ranks finish 6 steps, rank 0 exports; exit 0 (a first pdsh2 try aborted in teardown and hung, dropped, rerun clean).
  cone_key      KeyError: 'cone 13' on rank N at step 3; peers see gloo 'Connection closed by peer' or are SIGTERMed; exit 1.
  shard_missing FileNotFoundError for shards/kiln_zone<N+8>.pt on rank N before step 1; the others are SIGTERMed; exit 1.
  ckpt_size     RuntimeError: Error(s) in loading state_dict ... size mismatch for net.0.weight (48 vs 32) on rank N; exit 1.
  weights_only  _pickle.UnpicklingError: Weights only load failed ... __main__.FiringSchedule on rank N; exit 1.
  stats_size    with DETAIL every rank raises 'Detected mismatch between collectives' (rank N shape [6]); without it gloo just times out / closes; exit 1.
  slow_rank     peers raise gloo 'Timed out waiting 12000ms' at step 3, rank N SIGTERMed; exit 1. With --pg-timeout 300: output stops, timeout ends torchrun; exit 124.
  nan_ramp      FloatingPointError: non-finite loss inf on rank N at step 4; exit 1 (with --max-restarts 1 the restart dies in Gloo connectFullMesh).
  sigsegv       rank N dies with SIGSEGV (exitcode -11) before printing step 2; torchrun SIGTERMs the rest; exit 1.
  exit4         rank N prints "ERROR kiln-ctl rank N: ... open circuit, refusing to fire" and exits 4; exit 1.
  shape_all     RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x9 and 8x32) on every rank at step 1; exit 1.
  loader_crash  RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed. on rank N at batch 3; exit 1.
  host_mem      RuntimeError: DefaultCPUAllocator: can't allocate memory (2147483648 bytes) on rank N, then terminate/SIGABRT; exit 1.
"""
import argparse
import dataclasses
import json
import os
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault480_work"
CONES = {"022": 586, "018": 717, "010": 894, "06": 999, "04": 1060, "1": 1137, "5": 1186, "6": 1222, "10": 1285}
FEATS = 8


@dataclasses.dataclass
class FiringSchedule:
    name: str
    segments: list


class Controller(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATS, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(480)
    cones = list(CONES)
    for z in range(8):
        x = torch.randn(96, FEATS, generator=g)
        y = x[:, :3].sum(1, keepdim=True) * 0.3 + 0.1 * torch.randn(96, 1, generator=g)
        labels = [cones[(z + i) % len(cones)] for i in range(96)]
        torch.save({"x": x, "y": y, "cone": labels, "zone": z}, f"{WORK}/shards/kiln_zone{z}.pt")
    with open(f"{WORK}/cone_table.json", "w") as f:
        json.dump(CONES, f)
    torch.manual_seed(0)
    torch.save(Controller().state_dict(), f"{WORK}/controller_init.pt")
    torch.save(Controller(hidden=48).state_dict(), f"{WORK}/controller_wide.pt")
    torch.save({"model": Controller().state_dict(),
                "schedule": FiringSchedule("cone6_glaze", [(100, 600), (150, 1222), (0, 1222)])},
               f"{WORK}/controller_legacy.pt")
    print("prepared", WORK)


class ZoneSet(torch.utils.data.Dataset):
    def __init__(self, shard, kill_worker):
        self.shard, self.kill_worker = shard, kill_worker

    def __len__(self):
        return len(self.shard["x"])

    def __getitem__(self, i):
        if self.kill_worker and i >= 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.shard["x"][i], self.shard["y"][i]


def thermal_sim(seconds):
    t0, temp, acc = time.time(), 20.0, 0.0
    while time.time() - t0 < seconds:
        for _ in range(20000):
            temp += (1222.0 - temp) * 1e-6
            acc += temp * 1e-9
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--no-ddp", action="store_true", help="all_reduce gradients by hand")
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    f = a.fault
    print(f"rank {rank}/{world} kiln controller start fault={f} fault_rank={a.rank}", flush=True)

    zone = rank + 8 if (f == "shard_missing" and me) else rank % 8
    shard = torch.load(f"{WORK}/shards/kiln_zone{zone}.pt")
    with open(f"{WORK}/cone_table.json") as fh:
        table = json.load(fh)
    if f == "cone_key" and me:
        shard["cone"][2 * 16 + 3] = "cone 13"

    model = Controller()
    if f == "ckpt_size" and me:
        model.load_state_dict(torch.load(f"{WORK}/controller_wide.pt"))
    elif f == "weights_only" and me:
        model.load_state_dict(torch.load(f"{WORK}/controller_legacy.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/controller_init.pt"))
    net = model if a.no_ddp else nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    workers = 1 if f == "loader_crash" else 0
    loader = torch.utils.data.DataLoader(ZoneSet(shard, f == "loader_crash" and me), batch_size=16,
                                         num_workers=workers)
    it = iter(loader)
    for step in range(1, 7):
        x, y = next(it)
        cones = shard["cone"][(step - 1) * 16: step * 16]
        target_c = torch.tensor([table[c] for c in cones], dtype=torch.float32).unsqueeze(1) / 1300.0
        if f == "shape_all":
            x = torch.cat([x, target_c], dim=1)
        if f == "nan_ramp" and me and step == 4:
            ramp_c_per_h = torch.zeros(1)  # segment 4 logged with zero duration
            target_c = target_c * (150.0 / ramp_c_per_h)
        if f == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "exit4" and me and step == 3:
            print(f"ERROR kiln-ctl rank {rank}: zone {zone} thermocouple (type S) reads open circuit, "
                  f"refusing to fire", flush=True)
            sys.exit(4)
        if f == "host_mem" and me and step == 2:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/status") as st:
                vm = [int(l.split()[1]) for l in st if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, hard))
            history = torch.zeros(2**29, dtype=torch.float32)  # 2 GiB firing history
            print("history", history.shape, flush=True)
        if f == "slow_rank" and me and step == 3:
            thermal_sim(40 if a.pg_timeout < 60 else 10_000)

        pred = net(x)
        loss = ((pred - y) ** 2).mean() + 0.01 * ((pred.sigmoid() - target_c) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} on rank {rank} at step {step} "
                                     f"(firing curve segment {step})")
        opt.zero_grad()
        loss.backward()
        if a.no_ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()

        stats = torch.tensor([pred.mean().item(), pred.std().item(), loss.item(), float(step)])
        if f == "stats_size" and me and step == 2:
            stats = torch.cat([stats, torch.tensor([float(zone), 1222.0])])
        dist.all_reduce(stats)
        ramp_err = (stats[2] / world).item() ** 0.5 * 1300.0
        print(f"rank {rank} step {step} loss {loss.item():.4f} ramp_err_c {ramp_err:.2f}", flush=True)

    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/kiln_controller_export.pt")
        print("rank 0 exported kiln controller to", f"{WORK}/kiln_controller_export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

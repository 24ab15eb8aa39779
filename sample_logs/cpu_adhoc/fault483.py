"""Tide gauge anomaly detection: a small distributed (gloo, CPU) training job with one planted fault.

Each rank reads its own shard of sea-level windows (24 hourly readings per window) from a set of
tide gauges, removes the station's chart datum offset (from a lookup table), and trains a small
autoencoder whose reconstruction error flags anomalous windows (surges, sensor glitches).
It starts from a shared initial checkpoint, runs 6 steps, prints
`rank R step S loss L anomaly_rate M` every step, and rank 0 exports the weights at the end.

Run `python fault483.py --prepare` once to write the synthetic data into /tmp/fault483_work.
Launch with Lightning's Trainer (default) or with `--fabric` (lightning.fabric.Fabric, own loop).

Faults (`--fault NAME --rank N`):
  none            control, nothing planted
  key_error       rank N meets a station id that is missing from the datum lookup table (KeyError)
  missing_shard   rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size       rank N loads an older initial checkpoint with a narrower bottleneck (size mismatch)
  weights_only    rank N loads a calibration checkpoint holding a pickled Python object; torch.load refuses it
  allreduce_size  rank N all-reduces station statistics of the wrong length (5 instead of 4)
  slow_rank       rank N spends ~45 s in pure-Python harmonic analysis at step 2; its peers time out
                  (with --pg-timeout 300 and an outer timeout: a hang)
  nan_check       rank N's batch at step 3 holds NaN readings; the program's own finite-loss check raises
  sigsegv         rank N sends itself SIGSEGV at step 3
  error_exit      rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape_bug       every rank appends 4 tidal harmonic features at step 2, so the encoder input is 28 wide, not 24
  host_oom        rank N caps its address space and then allocates a 6 GB harmonic table (can't allocate memory)
  worker_crash    rank N's DataLoader worker is SIGKILLed while loading a batch

What happened (runs of 2026-12-06, Lightning 2.6.6, gloo, PG timeout 12 s unless noted):
  none            all ranks ran steps 0-5 and rank 0 wrote the export; exit 0
  key_error       KeyError: 'TG-9931' on rank N at step 2; peers failed with gloo 'Connection closed by peer'
  missing_shard   FileNotFoundError for gauge_rankN_v2.pt before step 0; peers failed on closed gloo connections
  ckpt_size       RuntimeError: Error(s) in loading state_dict ... size mismatch on rank N; peers failed on closed connections
  weights_only    _pickle.UnpicklingError: Weights only load failed (GaugeCalibration not an allowed global) on rank N
  allreduce_size  gloo named no size mismatch: 12000ms send/recv timeouts and closed connections; rank N never printed step 3
  slow_rank       peers hit 'Timed out waiting 12000ms' while rank N was busy; with --pg-timeout 300 the log stopped until `timeout`
  nan_check       rank N printed 'loss nan' and the program's FloatingPointError check fired (bash loop: job then stalled to timeout)
  sigsegv         rank N died with SIGSEGV (exitcode -11) without a traceback; peers failed on closed/reset connections
  error_exit      rank N printed its ERROR line and called sys.exit(4); the process then aborted ('terminate called
                  without an active exception', exitcode -6)
  shape_bug       RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x28 and 24x32) on every rank
  host_oom        RuntimeError: DefaultCPUAllocator: can't allocate memory (6000000000 bytes) on rank N
  worker_crash    RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed on rank N
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
from torch import nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault483_work"
WINDOW = 24
BATCH = 16
STEPS = 6
STATIONS = ["TG-0101", "TG-0117", "TG-0203", "TG-0245", "TG-0310", "TG-0388", "TG-0402", "TG-0456"]


def build_model(bottleneck=8):
    return nn.Sequential(nn.Linear(WINDOW, 32), nn.Tanh(), nn.Linear(32, bottleneck), nn.Tanh(),
                         nn.Linear(bottleneck, 32), nn.Tanh(), nn.Linear(32, WINDOW))


class GaugeCalibration:
    def __init__(self, station, gain, offset):
        self.station, self.gain, self.offset = station, gain, offset


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(483)
    t = torch.arange(WINDOW, dtype=torch.float32)
    for r in range(8):
        n = BATCH * STEPS
        phase = torch.rand(n, 1, generator=g) * 6.28
        amp = 1.0 + torch.rand(n, 1, generator=g)
        x = amp * torch.sin(2 * 3.14159 * t / 12.42 + phase) + 0.1 * torch.randn(n, WINDOW, generator=g)
        st = [STATIONS[(r + i) % len(STATIONS)] for i in range(n)]
        torch.save({"windows": x, "stations": st}, f"{WORK}/shards/gauge_rank{r}.pt")
    with open(f"{WORK}/datum_offsets.json", "w") as f:
        json.dump({s: round(0.05 * i, 3) for i, s in enumerate(STATIONS)}, f, indent=1)
    torch.manual_seed(0)
    torch.save(build_model().state_dict(), f"{WORK}/ckpt/init.pt")
    torch.save(build_model(bottleneck=4).state_dict(), f"{WORK}/ckpt/init_v1_bneck4.pt")
    torch.save({"model": build_model().state_dict(), "calibration": GaugeCalibration("TG-0101", 1.02, -0.03)},
               f"{WORK}/ckpt/init_calibrated.pt")
    print("prepared", WORK)


class GaugeShard(Dataset):
    def __init__(self, path, crash_at=None):
        d = torch.load(path)
        self.x, self.st, self.crash_at = d["windows"], d["stations"], crash_at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.st[i]


def collate(items):
    return torch.stack([a for a, _ in items]), [b for _, b in items]


def make_loader(args, rank):
    path = f"{WORK}/shards/gauge_rank{rank}.pt"
    if args.fault == "missing_shard" and rank == args.rank:
        path = f"{WORK}/shards/gauge_rank{rank}_v2.pt"
    crash = args.fault == "worker_crash" and rank == args.rank
    ds = GaugeShard(path, crash_at=BATCH * 2 + 3 if crash else None)
    return DataLoader(ds, batch_size=BATCH, shuffle=False, collate_fn=collate, num_workers=1 if crash else 0)


def load_init(model, args, rank):
    path = f"{WORK}/ckpt/init.pt"
    if args.fault == "ckpt_size" and rank == args.rank:
        path = f"{WORK}/ckpt/init_v1_bneck4.pt"
    if args.fault == "weights_only" and rank == args.rank:
        path = f"{WORK}/ckpt/init_calibrated.pt"
        sd = torch.load(path)["model"]
    else:
        sd = torch.load(path)
    model.load_state_dict(sd)


def harmonic_analysis(seconds):
    # pure-Python least-squares over many constituents: deliberately slow, holds the GIL
    end = time.time() + seconds
    acc = 0.0
    k = 0
    while time.time() < end:
        for j in range(20000):
            acc += (j * 0.5) % 7.3
        k += 1
    return acc


def step_body(net, x, stations, rank, step, args, datum, world):
    if args.fault == "key_error" and rank == args.rank and step == 2:
        stations = list(stations)
        stations[5] = "TG-9931"
    off = torch.tensor([datum[s] for s in stations]).unsqueeze(1)
    x = x - off
    if args.fault == "nan_check" and rank == args.rank and step == 3:
        x = x.clone()
        x[3, 7:11] = float("nan")
    if args.fault == "slow_rank" and rank == args.rank and step == 2:
        harmonic_analysis(45)
    if args.fault == "host_oom" and rank == args.rank and step == 2:
        import resource
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
        table = torch.zeros(1_500_000_000)  # 6 GB full-resolution harmonic table
        del table
    if args.fault == "shape_bug" and step == 2:
        harm = torch.stack([torch.sin(x.mean(1) * k) for k in range(1, 5)], dim=1)
        x = torch.cat([x, harm], dim=1)
    if args.fault == "sigsegv" and rank == args.rank and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "error_exit" and rank == args.rank and step == 2:
        print(f"ERROR: rank {rank}: gauge {stations[0]} datum drift 3.41 m exceeds tolerance 0.50 m, "
              f"refusing to train on corrupted levels", flush=True)
        sys.exit(4)
    recon = net(x)
    err = ((recon - x) ** 2).mean(1)
    loss = err.mean()
    if step == 3:
        stats = torch.tensor([err.mean().item(), err.max().item(), float(len(err)), float(rank)])
        if args.fault == "allreduce_size" and rank == args.rank:
            stats = torch.cat([stats, torch.tensor([0.0])])
        dist.all_reduce(stats)
    rate = (err > 0.05).float().mean().item()
    print(f"rank {rank} step {step} loss {loss.item():.5f} anomaly_rate {rate:.3f}", flush=True)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: non-finite reconstruction loss {loss.item()} "
                                 f"(a sea-level window holds NaN readings)")
    return loss


def load_datum():
    with open(f"{WORK}/datum_offsets.json") as f:
        return json.load(f)


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class TideAE(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model()
            self.datum = load_datum()

        def on_fit_start(self):
            load_init(self.net, args, self.global_rank)

        def train_dataloader(self):
            return make_loader(args, self.global_rank)

        def training_step(self, batch, batch_idx):
            x, st = batch
            return step_body(self.net, x, st, self.global_rank, batch_idx, args, self.datum, self.trainer.world_size)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    model = TideAE()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1,
                         strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         use_distributed_sampler=False)
    trainer.fit(model)
    if trainer.global_rank == 0:
        torch.save(model.net.state_dict(), f"{WORK}/export/tide_ae.pt")
        print(f"rank 0 exported {WORK}/export/tide_ae.pt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=1,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    net = build_model()
    load_init(net, args, rank)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    loader = make_loader(args, rank)
    datum = load_datum()
    for step, (x, st) in enumerate(loader):
        if step >= STEPS:
            break
        loss = step_body(net, x, st, rank, step, args, datum, fabric.world_size)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
    fabric.barrier()
    if rank == 0:
        torch.save(net.module.state_dict(), f"{WORK}/export/tide_ae.pt")
        print(f"rank 0 exported {WORK}/export/tide_ae.pt", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--fabric", action="store_true")
    args = p.parse_args()
    if args.prepare:
        return prepare()
    torch.set_num_threads(1)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()

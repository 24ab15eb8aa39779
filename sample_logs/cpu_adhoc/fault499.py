"""Batch 499 fault script: wind turbine blade icing detection (CPU, gloo).

A small icing classifier trained on per-rank SCADA shards (12 channels: wind speed,
ambient temperature, humidity, rotor rpm, power deficit, blade vibration, ...).
Each rank reads its own shard, normalises the power-deficit channel with a turbine
lookup table (rated power per turbine id), starts from a shared checkpoint, trains
6 steps and all-gathers a small per-rank stats vector every step to print the
global icing accuracy. Rank 0 saves an export at the end.

Modes: --mode lightning (LightningModule + Trainer, DDPStrategy gloo) or
--mode fabric (lightning.fabric.Fabric with its own loop).
`--prepare` writes the synthetic data into /tmp/fault499_work.

Faults (--fault NAME --rank N):
  none           control, nothing planted
  keyerror       rank N's batch at step 2 holds turbine id WT099, absent from the lookup table (KeyError)
  missing_shard  rank N reads its shard from the scada_2026-11 folder, which was never written (FileNotFoundError)
  ckpt_size      rank N loads start_wide.pt (hidden 48 instead of 32) into the model (size mismatch)
  weights_only   rank N loads start_calib.pt, which pickles a CalibrationRecord object; torch.load refuses it
  wrong_size     rank N all-gathers a 5-element stats vector where the others send 4 (invalid tensor size)
  slow           rank N runs pure-Python de-icing feature work for 45 s before step 2's all-gather; peers time out
  hang           like slow but endless; run with --pg-timeout 300 so nothing times out and `timeout` ends it
  nan            rank N's sensor channels go NaN at step 2; the program's own finiteness check raises FloatingPointError
  sigsegv        rank N sends itself SIGSEGV at step 2
  sysexit        rank N prints its own ERROR line (heater telemetry channel missing) and calls sys.exit(4) at step 2
  shape_all      every rank appends a derived ice-index column from step 2 on, so the first Linear sees 13 columns
  host_oom       rank N asks for a 1.5 TB spectrogram buffer at step 2 (CPU allocator refuses, nothing is really allocated)
  worker_crash   rank N's DataLoader worker (num_workers=1) SIGKILLs itself while loading the batch for step 2

What happened (after the runs; see the batch README text):
  none           all ranks print 6 steps, rank 0 saves the export, exit 0
  keyerror       rank N's traceback ends in KeyError: 'WT099'; peers fail in the all-gather (connection closed); exit 1
  missing_shard  rank N raises FileNotFoundError for scada_2026-11/icing_shard_0N.pt before any step; peers: connection closed; exit 1
  ckpt_size      rank N raises RuntimeError size mismatch for 0.weight/0.bias/2.weight in load_state_dict (setup hook); exit 1
  weights_only   rank N raises _pickle.UnpicklingError (Weights only load failed ... CalibrationRecord); exit 1
  wrong_size     rank N raises RuntimeError ProcessGroupGloo::allgather: invalid tensor size; peers lose the connection; exit 1
  slow           peers raise gloo "Timed out waiting 12000ms" at step 2 while rank N computes; exit 1 (Fabric), 137 (Trainer: SIGTERM ignored)
  hang           steps 0-1 print, then nothing until timeout 60 SIGTERMs and then SIGKILLs torchrun (exit 137)
  nan            rank N raises FloatingPointError: non-finite loss at step 2; peers lose the connection; exit 1
  sigsegv        rank N dies with SIGSEGV (torchrun: exitcode -11; bash loop: 'Segmentation fault'); peers: connection closed; exit 1
  sysexit        rank N prints ERROR ... and exits 4 (torchrun: exitcode 4); the others lose the connection in the all-gather; exit 1
  shape_all      every rank raises RuntimeError mat1 and mat2 shapes cannot be multiplied (16x13 and 12x32) at step 2; exit 1
  host_oom       rank N raises RuntimeError DefaultCPUAllocator: can't allocate memory (1500000000000 bytes); exit 1
  worker_crash   rank N raises RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed.; peers: connection closed; exit 1
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
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault499_work"
NCH = 12
BATCH = 16
STEPS = 6
FAULT_STEP = 2


class CalibrationRecord:
    """Heater calibration metadata that someone stored inside a checkpoint."""

    def __init__(self, turbine, offset):
        self.turbine = turbine
        self.offset = offset


def make_model(hidden=32):
    return nn.Sequential(nn.Linear(NCH, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare():
    g = torch.Generator().manual_seed(499)
    os.makedirs(f"{WORK}/scada_2026-12", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    lookup = {f"WT{i:03d}": 2000.0 + 150.0 * (i % 7) for i in range(1, 41)}
    with open(f"{WORK}/turbine_lookup.json", "w") as f:
        json.dump(lookup, f)
    for r in range(8):
        n = BATCH * STEPS
        x = torch.randn(n, NCH, generator=g)
        x[:, 4] = x[:, 4].abs() * 300.0  # power deficit in kW
        tid = torch.randint(1, 41, (n,), generator=g)
        y = ((x[:, 1] < 0) & (x[:, 2] > 0)).float()  # cold and humid -> ice
        torch.save({"x": x, "tid": tid, "y": y}, f"{WORK}/scada_2026-12/icing_shard_{r:02d}.pt")
    torch.manual_seed(0)
    torch.save(make_model().state_dict(), f"{WORK}/ckpt/start.pt")
    torch.save(make_model(48).state_dict(), f"{WORK}/ckpt/start_wide.pt")
    sd = make_model().state_dict()
    sd["calibration"] = CalibrationRecord("WT017", 0.12)
    torch.save(sd, f"{WORK}/ckpt/start_calib.pt")
    print("prepared", WORK)


class Shard(Dataset):
    def __init__(self, rank, args):
        month = "2026-12"
        if args.fault == "missing_shard" and rank == args.rank:
            month = "2026-11"
        d = torch.load(f"{WORK}/scada_{month}/icing_shard_{rank:02d}.pt")
        self.x, self.tid, self.y = d["x"], d["tid"], d["y"]
        self.rank, self.args = rank, args

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        a = self.args
        if a.fault == "worker_crash" and self.rank == a.rank and i >= FAULT_STEP * BATCH:
            if torch.utils.data.get_worker_info() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.tid[i], self.y[i]


def make_loader(rank, args):
    nw = 1 if (args.fault == "worker_crash" and rank == args.rank) else 0
    return DataLoader(Shard(rank, args), batch_size=BATCH, shuffle=False, num_workers=nw)


def load_start(model, rank, args):
    path = f"{WORK}/ckpt/start.pt"
    if args.fault == "ckpt_size" and rank == args.rank:
        path = f"{WORK}/ckpt/start_wide.pt"
    if args.fault == "weights_only" and rank == args.rank:
        path = f"{WORK}/ckpt/start_calib.pt"
    sd = torch.load(path)
    model.load_state_dict(sd)


def compute_loss(model, batch, rank, step, args, lookup):
    x, tid, y = batch
    x = x.clone()
    tid = tid.clone()
    if args.fault == "keyerror" and rank == args.rank and step == FAULT_STEP:
        tid[5] = 99
    rated = torch.tensor([lookup[f"WT{int(t):03d}"] for t in tid])
    x[:, 4] = x[:, 4] / rated
    if args.fault == "nan" and rank == args.rank and step == FAULT_STEP:
        x[3:9, 0:3] = float("nan")  # anemometer/temperature/humidity dropout
    if args.fault == "shape_all" and step >= FAULT_STEP:
        ice_index = (x[:, 2] - x[:, 1]).sigmoid()
        x = torch.cat([x, ice_index[:, None]], dim=1)
    if args.fault == "host_oom" and rank == args.rank and step == FAULT_STEP:
        spec = torch.empty(1_500_000_000_000, dtype=torch.uint8)  # blade vibration spectrogram buffer
        del spec
    if args.fault == "sigsegv" and rank == args.rank and step == FAULT_STEP:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "sysexit" and rank == args.rank and step == FAULT_STEP:
        print(f"ERROR rank {rank}: blade heater telemetry for turbine WT{int(tid[0]):03d} has no "
              f"'heater_current' channel; refusing to train on incomplete icing data", flush=True)
        sys.exit(4)
    logits = model(x).squeeze(1)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, y)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} "
                                 f"({int((~torch.isfinite(x)).sum())} non-finite sensor values in the batch)")
    correct = ((logits > 0).float() == y).float().sum()
    return loss, correct, y.numel()


def gather_metric(rank, step, args, correct, n, loss):
    if args.fault in ("slow", "hang") and rank == args.rank and step == FAULT_STEP:
        t0 = time.time()
        limit = 45 if args.fault == "slow" else 10 ** 6
        acc = 0
        while time.time() - t0 < limit:  # rolling rime-accretion features in pure Python
            for i in range(20000):
                acc += (i * 31) % 7
    stats = torch.tensor([float(correct), float(n), float(loss), float(rank)])
    if args.fault == "wrong_size" and rank == args.rank and step == FAULT_STEP:
        stats = torch.cat([stats, torch.tensor([float(step)])])  # extra field added on one rank only
    world = dist.get_world_size()
    out = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(out, stats)
    allst = torch.stack(out)
    return float(allst[:, 0].sum() / allst[:, 1].sum())


def export(model, rank):
    if rank == 0:
        path = f"{WORK}/export/icing_classifier.pt"
        torch.save(model.state_dict(), path)
        print(f"rank 0 saved export {path}", flush=True)


def run_lightning(args, lookup):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class IcingModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def setup(self, stage):
            load_start(self.net, self.global_rank, args)

        def train_dataloader(self):
            return make_loader(self.global_rank, args)

        def training_step(self, batch, idx):
            rank, step = self.global_rank, self.global_step
            loss, correct, n = compute_loss(self.net, batch, rank, step, args, lookup)
            m = gather_metric(rank, step, args, correct, n, loss.detach())
            print(f"rank {rank} step {step} loss {loss.item():.4f} ice_acc {m:.4f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=1,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    module = IcingModule()
    trainer.fit(module)
    export(module.net, trainer.global_rank)


def run_fabric(args, lookup):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=1,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    model = make_model()
    load_start(model, rank, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(make_loader(rank, args), use_distributed_sampler=False)
    for step, batch in enumerate(loader):
        if step >= STEPS:
            break
        loss, correct, n = compute_loss(model, batch, rank, step, args, lookup)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        m = gather_metric(rank, step, args, correct, n, loss.detach())
        print(f"rank {rank} step {step} loss {loss.item():.4f} ice_acc {m:.4f}", flush=True)
    export(model.module if hasattr(model, "module") else model, rank)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="lightning", choices=["lightning", "fabric"])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    with open(f"{WORK}/turbine_lookup.json") as f:
        lookup = json.load(f)
    if args.mode == "fabric":
        run_fabric(args, lookup)
    else:
        run_lightning(args, lookup)


if __name__ == "__main__":
    main()

"""Batch 551 fault script: abyssal plain sediment cores (porosity regression), CPU/gloo, Lightning.

A small multi-rank job that learns core porosity from per-depth sediment features. `--prepare` writes
synthetic data into /tmp/fault551_work: one feature shard per rank (core id, depth, 8 features,
porosity), a lookup table core id -> water depth, and a starting checkpoint (plus a "full"
checkpoint that also pickles the survey config object). Every rank prints
`rank R step S loss L porosity_mae M` each step; rank 0 exports the model at the end.

Run forms: Lightning Trainer (`--devices W`, under torchrun, or one python per rank), or
`--fabric` (lightning.fabric.Fabric with its own loop, under torchrun).

Faults (`--fault NAME --rank N`; ONE per run):
  none          control, no fault
  keyerror      rank N's shard names a core id the water-depth lookup table lacks (KeyError)
  missing_shard rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size     rank N builds the regressor with 48 hidden units, then loads the 32-unit checkpoint
  weights_only  rank N torch.load()s the full checkpoint (pickled config object) with weights_only
  wrong_size    rank N all-reduces a porosity histogram of 17 bins instead of 16 (gloo)
  slow          rank N does pure-Python depth re-binning for ~40 s at step 3; peers time out (12 s)
  hang          like slow but endless, with --pg-timeout 300: `timeout` ends the run
  nan           rank N's porosity batch gets a NaN; the job's own finiteness check raises
  sigsegv       rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line (core depth out of range) and sys.exit(4)
  shape_all     every rank feeds 9 features to the 8-input layer (shape bug on all ranks)
  worker_crash  rank N's DataLoader worker is SIGKILLed while reading step 3's batch

What happened (one line per fault; Lightning 2.6.6, torch 2.13.0+cpu, 2 loaded cores):
  none          np3 torchrun: 6 steps on every rank, rank 0 exported; exit 0.
  keyerror      np4 r2 torchrun: KeyError 'ABY-2-X037' on rank 2 at step 2, peers 'Connection closed by peer'; exit 1.
                (np6 r5 bash loop: ranks never got through start-up in 100 s, empty log; dropped.)
  missing_shard np5 r3 torchrun --tee 3: FileNotFoundError on rank 3 before step 0, peers fail in the dataloader barrier; exit 1.
  ckpt_size     np3 r1 LOGLEVEL=INFO torchrun: load_state_dict size mismatch on rank 1 in configure_model, peers fail in DDP setup; exit 1.
  weights_only  np4 r3 Fabric: UnpicklingError (weights_only, SurveyConfig) on rank 3, peers fail in DDP's shape check; exit 1.
  wrong_size    np4 r3 torchrun: rank 2 aborts on gloo EnforceNotMet 'Received data size doesn't match' (SIGABRT), torchrun blames rank 2; exit 1.
  slow          np4 r1 torchrun: ranks 0,2,3 time out after 12 s in the all_reduce, torchrun blames rank 0; exit 1.
  hang          np3 r2 torchrun, pg timeout 300: steps 0-2 then silence; outer timeout SIGTERM/SIGKILL; exit 137.
  nan           np5 r4 LOGLEVEL=INFO torchrun: FloatingPointError from rank 4's own check at step 3; exit 1.
  sigsegv       np3 r2 torchrun --tee 3: rank 2 dies with -11 after step 1, peers 'Connection reset by peer'; exit 1.
  error_exit    np3 r1 bash loop: rank 1's own ERROR line after step 2, exit 4, peers 'Connection closed'; the loop's wait gives 0.
                np4 r3 torchrun: same, torchrun names rank 3 (exitcode 4); exit 1.
  shape_all     np3 Lightning's own launcher: every rank 'mat1 and mat2 shapes cannot be multiplied (16x9 and 8x32)'; exit 1.
  worker_crash  np3 r1 torchrun: 'DataLoader worker (pid N) is killed by signal: Killed.' on rank 1 before step 0 printed; exit 1.
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

WORK = "/tmp/fault551_work"
NFEAT = 8
BINS = 16
STEPS = 6
BATCH = 16


class SurveyConfig:
    def __init__(self, cruise="AB-551", plain="Sohm"):
        self.cruise = cruise
        self.plain = plain


def prepare(max_world=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(551)
    table = {}
    for r in range(max_world):
        n = STEPS * BATCH
        ids = [f"ABY-{r}-{i:04d}" for i in range(n)]
        for cid in ids:
            table[cid] = 4000.0 + float(torch.rand(1, generator=g)) * 2000.0
        feats = torch.randn(n, NFEAT, generator=g)
        poro = torch.sigmoid(feats[:, :3].sum(1, keepdim=True) * 0.3)
        torch.save({"ids": ids, "feats": feats, "porosity": poro}, f"{WORK}/shard_{r:02d}.pt")
    with open(f"{WORK}/water_depth.json", "w") as f:
        json.dump(table, f)
    model = make_model(32)
    torch.save(model.state_dict(), f"{WORK}/start.pt")
    torch.save({"state_dict": model.state_dict(), "config": SurveyConfig()}, f"{WORK}/start_full.pt")
    print("prepared", WORK)


def make_model(hidden):
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class CoreShard(Dataset):
    def __init__(self, rank, fault, fault_rank):
        path = f"{WORK}/shard_{rank:02d}.pt"
        if fault == "missing_shard" and rank == fault_rank:
            path = f"{WORK}/shard_{rank:02d}_resampled.pt"
        d = torch.load(path)
        self.ids, self.feats, self.poro = d["ids"], d["feats"], d["porosity"]
        with open(f"{WORK}/water_depth.json") as f:
            self.depth = json.load(f)
        self.rank, self.fault, self.fault_rank = rank, fault, fault_rank

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        cid = self.ids[i]
        mine = self.rank == self.fault_rank
        if self.fault == "keyerror" and mine and i == 2 * BATCH + 5:
            cid = f"ABY-{self.rank}-X{i:03d}"
        if self.fault == "worker_crash" and mine and i == 2 * BATCH + 3:
            os.kill(os.getpid(), signal.SIGKILL)
        depth = self.depth[cid]
        x = self.feats[i].clone()
        x[0] = x[0] + (depth - 5000.0) / 1000.0
        if self.fault == "shape_all":
            x = torch.cat([x, torch.tensor([depth / 1000.0])])
        y = self.poro[i].clone()
        if self.fault == "nan" and mine and i == 3 * BATCH + 1:
            y[0] = float("nan")
        return x, y


def load_start(model, rank, fault, fault_rank):
    if fault == "weights_only" and rank == fault_rank:
        sd = torch.load(f"{WORK}/start_full.pt")["state_dict"]
    else:
        sd = torch.load(f"{WORK}/start.pt")
    model.load_state_dict(sd)


def step_body(args, rank, step, x, y, model, group):
    mine = rank == args.rank
    if args.fault == "sigsegv" and mine and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "error_exit" and mine and step == 3:
        print(f"ERROR rank {rank}: core ABY-{rank}-0051 depth 11873 m is below the abyssal plain range "
              f"(3000-6500 m); refusing to train on it", flush=True)
        sys.exit(4)
    if args.fault in ("slow", "hang") and mine and step == 3:
        t0 = time.time()
        acc = 0
        while args.fault == "hang" or time.time() - t0 < 40:
            for k in range(200000):
                acc += (k * 7) % 13
    if not torch.isfinite(y).all():
        raise FloatingPointError(f"rank {rank} step {step}: non-finite porosity target in batch "
                                 f"({int((~torch.isfinite(y)).sum())} values)")
    pred = model(x)
    loss = nn.functional.mse_loss(pred, y)
    mae = (pred - y).abs().mean().detach()
    bins = BINS + 1 if (args.fault == "wrong_size" and mine and step == 2) else BINS
    hist = torch.histc(pred.detach().clamp(0, 1), bins=bins, min=0, max=1)
    dist.all_reduce(hist, group=group)
    m = mae.clone()
    dist.all_reduce(m, group=group)
    m /= dist.get_world_size()
    print(f"rank {rank} step {step} loss {loss.item():.4f} porosity_mae {m.item():.4f}", flush=True)
    return loss


def make_loader(args, rank):
    ds = CoreShard(rank, args.fault, args.rank)
    nw = 1 if args.fault == "worker_crash" else 0
    return DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)


def build_model(args, rank):
    hidden = 48 if (args.fault == "ckpt_size" and rank == args.rank) else 32
    model = make_model(hidden)
    load_start(model, rank, args.fault, args.rank)
    return model


def run_lightning(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class CoreRegressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None
            self.group = None

        def configure_model(self):
            if self.net is None:
                self.net = build_model(args, self.global_rank)

        def setup(self, stage):
            self.group = dist.new_group(timeout=timedelta(seconds=args.pg_timeout))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            x, y = batch
            return step_body(args, self.global_rank, i, x, y, self, self.group)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            return make_loader(args, self.global_rank)

    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.start_timeout))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strat,
                        max_steps=STEPS, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, use_distributed_sampler=False)
    module = CoreRegressor()
    trainer.fit(module)
    if trainer.global_rank == 0:
        torch.save(module.net.state_dict(), f"{WORK}/export_porosity.pt")
        print(f"rank 0 exported {WORK}/export_porosity.pt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=1,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=args.start_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    group = dist.new_group(timeout=timedelta(seconds=args.pg_timeout))
    model = build_model(args, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    loader = make_loader(args, rank)
    for step, (x, y) in enumerate(loader):
        if step >= STEPS:
            break
        opt.zero_grad()
        loss = step_body(args, rank, step, x, y, model, group)
        fabric.backward(loss)
        opt.step()
    if rank == 0:
        torch.save(model.module.state_dict() if hasattr(model, "module") else model.state_dict(),
                   f"{WORK}/export_porosity.pt")
        print(f"rank 0 exported {WORK}/export_porosity.pt", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--fabric", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(0)
    if args.fabric:
        run_fabric(args)
    else:
        run_lightning(args)


if __name__ == "__main__":
    main()

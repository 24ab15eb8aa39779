"""Moss spore dispersal: a small DDP training job (Lightning or Fabric, gloo, CPU) with ONE planted fault.

The job fits a tiny regressor that predicts how far a moss capsule throws its spores (metres) from
per-capsule features (capsule volume, seta height, humidity, wind ...), scaled by a per-species
dispersal coefficient read from a lookup table. Each rank trains on its own shard, starts from a
shared checkpoint, all-reduces its mean predicted spread each step, and rank 0 writes an export.

  python fault539.py --prepare --work DIR [--fault F --rank N]   # synthetic shards, table, checkpoints
  python fault539.py --devices W --work DIR --fault F --rank N   # Lightning Trainer (own launch / torchrun / env)
  torchrun ... fault539.py --fabric --devices W ...              # lightning.fabric with its own loop

Faults (--fault NAME, on --rank N unless said otherwise; planted at step 2 unless said otherwise):
  none         control, nothing planted
  keyerror     rank N's shard holds a species code the lookup table lacks -> KeyError in the dataset
  missingshard rank N's shard file is missing on disk -> FileNotFoundError before training
  ckptsize     rank N's start checkpoint has a wider first layer -> load_state_dict size mismatch
  weightsonly  rank N's start checkpoint pickles a custom metadata object -> torch.load weights_only refusal
  wrongsize    rank N all-reduces a 3-element spread tensor where peers send 1 element (gloo size mismatch)
  slowrank     rank N does ~40 s (--slow-s) of pure-Python work before the spread all-reduce -> peers hit the 12 s PG timeout
               (with --pg-timeout 300 the job hangs instead until `timeout` ends it)
  nan          rank N's loss becomes NaN; the program's own finiteness check raises FloatingPointError
  sigsegv      rank N sends itself SIGSEGV
  logexit      rank N prints its own ERROR line and calls sys.exit(4)
  shapebug     every rank: at step 3 the humidity column is dropped -> matmul shape error on all ranks
  hostmem      rank N caps its address space (RLIMIT_AS) and builds a huge spore-count buffer -> MemoryError
  workercrash  rank N uses a DataLoader worker that is SIGKILLed while loading a batch
What happened (runs of 2026-12-07, Lightning 2.6.6 / torch 2.13.0+cpu, gloo, 2 shared cores):
  none         np4 torchrun: all 6 steps on every rank, rank 0 saved its export, exit 0
  keyerror     np4 r2 torchrun, np6 r5 bash loop: KeyError 'Sphagnum_fuscum' on the planted rank, peers 'Connection closed by peer'
  missingshard np5 r3 torchrun --tee 3: FileNotFoundError for shard_03.pt on rank 3, peers 'Connection closed by peer'
  ckptsize     np3 r1 fabric: 'size mismatch for 0.weight' (32x20 vs 32x16) on rank 1 before training
  weightsonly  np4 r0 LOGLEVEL=INFO torchrun: UnpicklingError 'Weights only load failed ... argparse.Namespace' on rank 0
  wrongsize    np4 r1 torchrun (and np6 r4 fabric): no gloo size error, every rank timed out after 12000 ms
  slowrank     np5 r2 torchrun: peers timed out after 12000 ms, rank 2 then 'Connection closed by peer';
               np3 r1 bash loop with --pg-timeout 300 --slow-s 200: output stops after step 1, timeout ends it (124)
  nan          np8 r6 torchrun --tee 3: FloatingPointError from the script's own check on rank 6
  sigsegv      np6 r3 LOGLEVEL=INFO torchrun, np4 r2 fabric: rank dies with exitcode -11, no traceback
  logexit      np5 r4 bash loop: rank 4's own ERROR line, exit 4
  shapebug     np4 torchrun: 'mat1 and mat2 shapes cannot be multiplied (8x15 and 16x32)' on all four ranks
  hostmem      np3 r2 fabric: bare MemoryError on rank 2
  workercrash  np5 r1 torchrun: 'DataLoader worker (pid N) is killed by signal: Killed.' on rank 1
  Lightning's own launch (python script.py --devices W) never got its ranks together on the loaded machine
  (TCPStore client timeouts), so no plown run was kept.
"""
import argparse, json, os, resource, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

SPECIES = ["Sphagnum_magellanicum", "Polytrichum_commune", "Funaria_hygrometrica",
           "Bryum_argenteum", "Ceratodon_purpureus", "Dicranum_scoparium"]
NFEAT, NSHARD, BATCH, STEPS = 16, 48, 8, 6


def prepare(work, fault, frank):
    os.makedirs(os.path.join(work, "shards"), exist_ok=True)
    g = torch.Generator().manual_seed(539)
    table = {s: round(0.5 + 0.25 * i, 3) for i, s in enumerate(SPECIES)}
    with open(os.path.join(work, "dispersal_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(8):
        x = torch.randn(NSHARD, NFEAT, generator=g)
        sp = [SPECIES[(r + i) % len(SPECIES)] for i in range(NSHARD)]
        if fault == "keyerror" and r == frank:
            sp[2 * BATCH + 3] = "Sphagnum_fuscum"
        y = x[:, :4].sum(1).abs() + 1.0
        torch.save({"x": x, "species": sp, "y": y}, os.path.join(work, "shards", f"shard_{r:02d}.pt"))
    if fault == "missingshard":
        os.remove(os.path.join(work, "shards", f"shard_{frank:02d}.pt"))
    model = make_model()
    torch.save(model.state_dict(), os.path.join(work, "init.pt"))
    wide = make_model(NFEAT + 4)
    torch.save(wide.state_dict(), os.path.join(work, "init_wide.pt"))
    torch.save({"state_dict": model.state_dict(), "meta": argparse.Namespace(site="bog-7", season=2026)},
               os.path.join(work, "init_meta.pt"))
    print(f"prepared {work}", flush=True)


def make_model(nin=NFEAT):
    return nn.Sequential(nn.Linear(nin, 32), nn.Tanh(), nn.Linear(32, 1))


class SporeShard(Dataset):
    def __init__(self, work, rank, fault, frank):
        path = os.path.join(work, "shards", f"shard_{rank:02d}.pt")
        d = torch.load(path)
        self.x, self.sp, self.y = d["x"], d["species"], d["y"]
        with open(os.path.join(work, "dispersal_table.json")) as f:
            self.table = json.load(f)
        self.kill = fault == "workercrash" and rank == frank

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.kill and i == 2 * BATCH + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        coef = self.table[self.sp[i]]
        return self.x[i], torch.tensor(self.y[i] * coef)


def load_start(model, work, rank, fault, frank):
    path = os.path.join(work, "init.pt")
    if rank == frank and fault == "ckptsize":
        path = os.path.join(work, "init_wide.pt")
    if rank == frank and fault == "weightsonly":
        path = os.path.join(work, "init_meta.pt")
    sd = torch.load(path)
    if "state_dict" in sd:
        sd = sd["state_dict"]
    model.load_state_dict(sd)


def step_body(model, batch, step, rank, args):
    fault, frank = args.fault, args.rank
    x, y = batch
    if fault == "shapebug" and step >= 3:
        x = x[:, 1:]  # drop humidity column
    pred = model(x).squeeze(-1)
    loss = nn.functional.mse_loss(pred, y)
    if fault == "nan" and rank == frank and step == 2:
        loss = loss * float("nan")
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (spore spread regression)")
    if fault == "hostmem" and rank == frank and step == 2:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize")][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), hard))
        counts = bytearray(3 << 30)  # per-capsule spore counts, 3 GiB
        print(len(counts))
    if fault == "logexit" and rank == frank and step == 2:
        print(f"ERROR rank {rank}: spore trap calibration file reports 0 traps for transect B; refusing to train", flush=True)
        sys.exit(4)
    if fault == "sigsegv" and rank == frank and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "slowrank" and rank == frank and step == 2:
        t0, acc = time.time(), 0
        while time.time() - t0 < args.slow_s:
            acc += sum(i * i for i in range(20000))
    spread = pred.detach().mean().reshape(1)
    if fault == "wrongsize" and rank == frank and step == 2:
        spread = pred.detach()[:3].clone()
    dist.all_reduce(spread)
    spread = spread[0].item() / dist.get_world_size()
    print(f"rank {rank} step {step} loss {loss.item():.4f} spread_m {spread:.4f}", flush=True)
    return loss


def run_lightning(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class SporeModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def setup(self, stage):
            load_start(self.net, args.work, self.global_rank, args.fault, args.rank)

        def train_dataloader(self):
            ds = SporeShard(args.work, self.global_rank, args.fault, args.rank)
            nw = 1 if (args.fault == "workercrash" and self.global_rank == args.rank) else 0
            return DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return step_body(self.net, batch, self.global_step, self.global_rank, args)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), os.path.join(args.work, "export_rank0.pt"))
                print("rank 0 saved export", flush=True)

    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1,
                         strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
                         max_steps=STEPS, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(SporeModule())


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    model = make_model()
    load_start(model, args.work, rank, args.fault, args.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    ds = SporeShard(args.work, rank, args.fault, args.rank)
    nw = 1 if (args.fault == "workercrash" and rank == args.rank) else 0
    dl = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw),
                                  use_distributed_sampler=False)
    for step, batch in enumerate(dl):
        if step >= STEPS:
            break
        opt.zero_grad()
        loss = step_body(model, batch, step, rank, args)
        fabric.backward(loss)
        opt.step()
    fabric.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.work, "export_rank0.pt"))
        print("rank 0 saved export", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fabric", action="store_true")
    p.add_argument("--work", default="/tmp/fault539_work")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    args = p.parse_args()
    if args.prepare:
        prepare(args.work, args.fault, args.rank)
    elif args.fabric:
        run_fabric(args)
    else:
        run_lightning(args)

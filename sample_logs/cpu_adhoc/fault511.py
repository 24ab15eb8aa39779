"""Glass furnace temperature drift detection: a small DDP training job (batch 511).

Each rank reads its own shard of synthetic thermocouple readings (8 sensors per sample,
furnace zone id), corrects them with a per-zone calibration lookup table, and trains a
small MLP that predicts the drift (degC/h) of the furnace crown temperature. The model
starts from a checkpoint; rank 0 saves an export at the end. Gloo, CPU only.

Launch forms: Lightning Trainer (own launch with --devices W, or under torchrun / one
python per rank), or lightning.fabric.Fabric with its own loop (--fabric, under torchrun).

  python fault511.py --prepare --world 8          # writes /tmp/fault511_work
  torchrun --nproc-per-node 4 fault511.py --fault keyerror --rank 2

Faults (--fault NAME --rank N):
  none          control, nothing planted
  keyerror      rank N meets a zone id missing from the calibration table (KeyError)
  missing_shard rank N's data shard file was deleted (FileNotFoundError)
  ckpt_size     rank N builds the model with 24 hidden units: load_state_dict size mismatch
  weights_only  rank N loads a checkpoint that pickles a custom calibration object (weights_only refuses)
  wrong_size    rank N contributes a 5-element drift summary to an all_reduce the others send 4 elements to
  slow          rank N does 45 s of pure-Python work at step 3; its peers time out (with --pg-timeout 300: hang)
  nan           rank N reads a NaN thermocouple value; the job's own finiteness check raises
  sigsegv       rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line and calls sys.exit(4)
  shape_all     every rank builds its input with 9 features instead of 8 (shape bug everywhere)
  worker_crash  rank N's DataLoader worker is killed (SIGKILL) while loading a batch
What happened (batch 511 runs, 2026-12-06):
  none          np3 torchrun: steps 0-5 on all ranks, export saved, exit 0
  keyerror      np4 r2 torchrun / np4 r3 bash loop: KeyError 'crown_9' on the rank, peers gloo connection closed
  missing_shard np5 r3 torchrun --tee: FileNotFoundError on rank 3 before training, peers connection closed
  ckpt_size     np4 r1 Fabric / np8 r7 torchrun: load_state_dict size mismatch on the rank, peers connection closed
  weights_only  np6 r4 LOGLEVEL=INFO: UnpicklingError 'Weights only load failed' on rank 4
  wrong_size    np5 r2 torchrun: other ranks pass step 2 with a wrong drift_mae, then all time out (12000 ms)
  slow          np4 r3 torchrun: peers time out after 12 s in the DDP all-reduce; np3 r1 Fabric --pg-timeout 300: hang, timeout ends it (124)
  nan           np8 r6 torchrun --tee: FloatingPointError from the job's own check on rank 6
  sigsegv       np5 r4 LOGLEVEL=INFO: rank 4 exitcode -11 (SIGSEGV), no traceback
  error_exit    np6 r1 Fabric: ERROR line and exit 4; np4 r3 Lightning --tee: ERROR line, then SIGABRT (terminate called) at exit
  shape_all     np4 bash loop: mat1 and mat2 shapes cannot be multiplied (16x9 and 8x16) on every rank
  worker_crash  np4 r2 torchrun / np7 r5 Fabric: 'DataLoader worker ... is killed by signal: Killed.'; in the Fabric run torchrun blames rank 3 (SIGABRT)
  (Lightning's own launch, --devices W without a launcher, failed to connect its child ranks under load: dropped)
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault511_work"
NSENS = 8
STEPS = 6
BATCH = 16


class Calib:  # a custom object; pickled into the unsafe checkpoint
    def __init__(self, offsets):
        self.offsets = offsets


def make_model(hidden=16):
    return nn.Sequential(nn.Linear(NSENS, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(511)
    zones = [f"crown_{i}" for i in range(6)]
    table = {z: float(i) * 0.5 for i, z in enumerate(zones)}
    with open(f"{WORK}/zone_calibration.json", "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = 1450.0 + 20.0 * torch.randn(STEPS * BATCH * 2, NSENS, generator=g)
        z = torch.randint(0, 6, (STEPS * BATCH * 2,), generator=g)
        y = (x.mean(1, keepdim=True) - 1450.0) * 0.05
        torch.save({"x": x, "zone": z, "y": y}, f"{WORK}/shard_{r:02d}.pt")
    torch.manual_seed(0)
    m = make_model()
    torch.save(m.state_dict(), f"{WORK}/drift_init.pt")
    torch.save({"model": m.state_dict(), "calib": Calib(table)}, f"{WORK}/drift_init_with_calib.pt")
    print("prepared", WORK, "for", world, "ranks")


class Shard(Dataset):
    def __init__(self, rank, fault, frank, table):
        path = f"{WORK}/shard_{rank:02d}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/shard_{rank:02d}_missing.pt"
        d = torch.load(path)
        self.x, self.zone, self.y = d["x"], d["zone"], d["y"]
        self.rank, self.fault, self.frank, self.table = rank, fault, frank, table

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.frank and i >= 2 * BATCH:
            os.kill(os.getpid(), signal.SIGKILL)
        x = self.x[i].clone()
        zid = f"crown_{int(self.zone[i])}"
        if self.fault == "keyerror" and self.rank == self.frank and i == 2 * BATCH + 3:
            zid = "crown_9"
        if self.fault == "nan" and self.rank == self.frank and i == 2 * BATCH + 1:
            x[3] = float("nan")
        x = x - self.table[zid]
        x = (x - 1450.0) / 20.0
        if self.fault == "shape_all":
            x = torch.cat([x, torch.zeros(1)])
        return x, self.y[i]


def load_start(model, rank, fault, frank):
    if fault == "weights_only" and rank == frank:
        sd = torch.load(f"{WORK}/drift_init_with_calib.pt")["model"]
    else:
        sd = torch.load(f"{WORK}/drift_init.pt")
    model.load_state_dict(sd)


def step_body(rank, world, step, x, y, model, a, log):
    if a.fault == "sigsegv" and rank == a.rank and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if a.fault == "error_exit" and rank == a.rank and step == 2:
        print(f"[rank {rank}] ERROR: thermocouple TC-{rank}07 calibration expired (last 2026-09-30); refusing to train on uncalibrated crown readings", flush=True)
        sys.exit(4)
    if a.fault == "slow" and rank == a.rank and step == 3:
        t0, n = time.time(), 0
        while time.time() - t0 < 45:
            n += sum(i * i for i in range(10000))
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise FloatingPointError(f"rank {rank} step {step}: {bad} non-finite thermocouple readings in batch")
    pred = model(x)
    loss = nn.functional.mse_loss(pred, y)
    with torch.no_grad():
        mae = (pred - y).abs().mean()
        summ = torch.tensor([mae.item(), pred.mean().item(), y.mean().item(), float(len(y))])
        if a.fault == "wrong_size" and rank == a.rank and step == 2:
            summ = torch.cat([summ, torch.tensor([x.max().item()])])
        dist.all_reduce(summ)
    print(f"rank {rank} step {step} loss {loss.item():.4f} drift_mae {summ[0].item() / world:.4f}", flush=True)
    return loss


def run_lightning(a, table):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Drift(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model()

        def setup(self, stage):
            r = self.global_rank
            if a.fault == "ckpt_size" and r == a.rank:
                self.model = make_model(hidden=24)
            load_start(self.model, r, a.fault, a.rank)

        def train_dataloader(self):
            r = self.trainer.global_rank
            nw = 1 if (a.fault == "worker_crash" and r == a.rank) else 0
            return DataLoader(Shard(r, a.fault, a.rank, table), batch_size=BATCH, num_workers=nw)

        def training_step(self, batch, i):
            x, y = batch
            return step_body(self.global_rank, self.trainer.world_size, i, x, y, self.model, a, print)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.model.state_dict(), f"{WORK}/drift_export.pt")
                print("rank 0 saved export", f"{WORK}/drift_export.pt", flush=True)

    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    tr = L.Trainer(accelerator="cpu", devices=a.devices, num_nodes=1, strategy=strat, max_steps=STEPS,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, use_distributed_sampler=False)
    tr.fit(Drift())


def run_fabric(a, table):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fab = Fabric(accelerator="cpu", devices=a.devices, strategy=DDPStrategy(
        process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
    fab.launch()
    r, w = fab.global_rank, fab.world_size
    model = make_model(hidden=24 if (a.fault == "ckpt_size" and r == a.rank) else 16)
    load_start(model, r, a.fault, a.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fab.setup(model, opt)
    nw = 1 if (a.fault == "worker_crash" and r == a.rank) else 0
    dl = fab.setup_dataloaders(DataLoader(Shard(r, a.fault, a.rank, table), batch_size=BATCH, num_workers=nw),
                               use_distributed_sampler=False)
    for step, (x, y) in enumerate(dl):
        if step >= STEPS:
            break
        loss = step_body(r, w, step, x, y, model, a, print)
        opt.zero_grad()
        fab.backward(loss)
        opt.step()
    if r == 0:
        torch.save(model.state_dict(), f"{WORK}/drift_export.pt")
        print("rank 0 saved export", f"{WORK}/drift_export.pt", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--fabric", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare(a.world)
    with open(f"{WORK}/zone_calibration.json") as f:
        table = json.load(f)
    (run_fabric if a.fabric else run_lightning)(a, table)


if __name__ == "__main__":
    main()

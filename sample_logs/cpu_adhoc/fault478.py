"""Solar flare classification from SDO/HMI magnetogram patches (batch 478 fault script).

A small CNN classifies 16x16 line-of-sight magnetogram patches into three flare classes
(quiet / C-class / M-or-X-class). `--prepare` writes synthetic data into the work folder:
one shard per rank (patches + NOAA active-region numbers), a lookup table from NOAA region
to flare label, and starting checkpoints. Training uses gloo on CPU, 6 steps, every rank
prints `rank R step S loss L acc M`, and rank 0 saves an export at the end.

Launchers: Lightning Trainer (--launcher lightning: run it as `python fault478.py --devices W`
and Lightning starts the other ranks, or under torchrun / a bash loop with env vars), or
lightning.fabric.Fabric with its own loop (--launcher fabric, under torchrun).

Faults (--fault NAME --rank N):
  none          control, nothing planted
  keyerror      rank N's shard holds NOAA region 13999, which the label table lacks (KeyError)
  missing_shard rank N reads its shard from a date folder that was never synced (FileNotFoundError)
  ckpt_size     rank N starts from the old 5-class checkpoint (head size mismatch in load_state_dict)
  weights_only  rank N starts from a legacy checkpoint that pickles a RunMeta object (torch.load refuses)
  gather_size   rank N all-reduces a 5-class histogram while the others send 3 classes (collective size mismatch)
  slow_rank     rank N spends ~45 s in pure-Python limb-darkening correction at step 2; peers time out (12 s)
  hang          like slow_rank but endless, run with --pg-timeout 300 so only `timeout` ends it
  nan           rank N's batch at step 3 has an unmasked off-disk pixel (inf); the script's own check raises
  sigsegv       rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line (bad FITS header) and calls sys.exit(4)
  shape_all     every rank: the classifier head expects 32*8*8 features, the conv stack gives 32*4*4
  worker_crash  DataLoader with 1 worker; rank N's worker is SIGKILLed while loading a patch

What happened (kept runs; the other faults were written but not run in the time given):
  none          np4 torchrun: all ranks finish 6 steps, export saved, exit 0
  ckpt_size     np5 r3 torchrun: rank 3 load_state_dict size mismatch [5,512] vs [3,512]; peers 'Connection closed by peer'; exit 1
  sigsegv       np3 r1 torchrun: rank 1 exitcode -11, rank 2 'Connection reset by peer'; exit 1
  missing_shard np3 r2 bash loop: rank 2 FileNotFoundError; ranks 0-1 silent until timeout; exit 124
  gather_size   np3 r2 Fabric: no size error from gloo; ranks 1-2 'Timed out waiting 12000ms for recv', rank 0 'Connection closed'; exit 1
  exit4         np3 r1 torchrun --tee: rank 1 ERROR line and exit 4, peers 'Connection closed by peer'; exit 1
  keyerror      np4 r2 plown: dropped, Lightning's own ranks did not reach the TCPStore within the timeout on the loaded machine
"""
import argparse, json, os, signal, sys, time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

WORK = "/tmp/fault478_work"
NCLS = 3
PATCH = 16
PER_SHARD = 48
BATCH = 8
STEPS = 6


@dataclass
class RunMeta:
    instrument: str = "HMI"
    cadence_s: int = 720


class FlareCNN(nn.Module):
    def __init__(self, ncls=NCLS, feat=32 * 4 * 4):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(feat, ncls)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.head(x.flatten(1))


def prepare(maxw=8):
    g = torch.Generator().manual_seed(478)
    os.makedirs(f"{WORK}/shards/2026-12-06", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    regions = list(range(13400, 13400 + 200))
    table = {str(r): int(torch.randint(0, NCLS, (1,), generator=g)) for r in regions}
    with open(f"{WORK}/noaa_flare_labels.json", "w") as f:
        json.dump(table, f)
    for r in range(maxw):
        patches = torch.randn(PER_SHARD, 1, PATCH, PATCH, generator=g) * 300.0  # gauss
        ar = torch.tensor(regions)[torch.randint(0, len(regions), (PER_SHARD,), generator=g)]
        torch.save({"patches": patches, "noaa": ar}, f"{WORK}/shards/2026-12-06/shard_{r:03d}.pt")
    torch.manual_seed(478)
    torch.save(FlareCNN().state_dict(), f"{WORK}/ckpt/init_3class.pt")
    torch.save(FlareCNN(ncls=5).state_dict(), f"{WORK}/ckpt/init_5class_v1.pt")
    torch.save({"state_dict": FlareCNN().state_dict(), "meta": RunMeta()}, f"{WORK}/ckpt/init_legacy_meta.pt")
    print("prepared", WORK)


class PatchSet(torch.utils.data.Dataset):
    def __init__(self, rank, fault, frank):
        day = "2026-12-05" if (fault == "missing_shard" and rank == frank) else "2026-12-06"
        d = torch.load(f"{WORK}/shards/{day}/shard_{rank:03d}.pt")
        with open(f"{WORK}/noaa_flare_labels.json") as f:
            self.table = json.load(f)
        self.x, self.noaa = d["patches"], d["noaa"].clone()
        if fault == "keyerror" and rank == frank:
            self.noaa[2 * BATCH + 3] = 13999
        self.rank, self.fault, self.frank = rank, fault, frank

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.fault == "worker_crash" and self.rank == self.frank and i == 2 * BATCH + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x = self.x[i] / 1000.0  # gauss -> kG
        y = self.table[str(int(self.noaa[i]))]
        return x, y


def load_start(rank, fault, frank, model):
    path = f"{WORK}/ckpt/init_3class.pt"
    if rank == frank and fault == "ckpt_size":
        path = f"{WORK}/ckpt/init_5class_v1.pt"
    if rank == frank and fault == "weights_only":
        path = f"{WORK}/ckpt/init_legacy_meta.pt"
    sd = torch.load(path, map_location="cpu")
    if "state_dict" in sd:
        sd = sd["state_dict"]
    if fault == "shape_all":
        return
    model.load_state_dict(sd)


def before_step(rank, step, fault, frank, x):
    if fault == "slow_rank" and rank == frank and step == 2:
        t0 = time.time(); acc = 0.0
        while time.time() - t0 < 45:  # pure-Python limb-darkening correction
            for k in range(20000):
                acc += (k % 7) * 1e-9
    if fault == "hang" and rank == frank and step == 2:
        acc = 0.0
        while True:
            for k in range(20000):
                acc += (k % 7) * 1e-9
    if fault == "sigsegv" and rank == frank and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "exit4" and rank == frank and step == 2:
        print(f"ERROR rank {rank}: FITS header of hmi.sharp_cea_720s patch says BUNIT='Mx/cm^2', expected 'Gauss'; refusing to train", flush=True)
        sys.exit(4)
    if fault == "nan" and rank == frank and step == 3:
        x = x.clone(); x[0, 0, 0, 0] = float("inf")  # off-disk pixel not masked
    return x


def after_loss(rank, step, loss, fault, frank, logits, y):
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (check magnetogram masking)")
    if fault == "gather_size" and step == 2:
        n = 5 if rank == frank else NCLS
        hist = torch.bincount(y, minlength=n).float()[:n]
        dist.all_reduce(hist)


def export(model):
    os.makedirs(f"{WORK}/export", exist_ok=True)
    torch.save(model.state_dict(), f"{WORK}/export/flare_cnn.pt")
    print("rank 0 saved export", f"{WORK}/export/flare_cnn.pt", flush=True)


def run_lightning(a):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Mod(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = FlareCNN(feat=32 * 8 * 8 if a.fault == "shape_all" else 32 * 4 * 4)

        def setup(self, stage):
            load_start(self.global_rank, a.fault, a.rank, self.net)

        def train_dataloader(self):
            ds = PatchSet(self.global_rank, a.fault, a.rank)
            nw = 1 if a.fault == "worker_crash" else 0
            return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)

        def training_step(self, batch, i):
            x, y = batch
            r = self.global_rank
            i = self.global_step
            x = before_step(r, i, a.fault, a.rank, x)
            logits = self.net(x)
            loss = F.cross_entropy(logits, y)
            after_loss(r, i, loss, a.fault, a.rank, logits, y)
            accv = (logits.argmax(1) == y).float().mean().item()
            print(f"rank {r} step {i} loss {loss.item():.4f} acc {accv:.3f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    tr = L.Trainer(accelerator="cpu", devices=a.devices, strategy=strat, max_steps=STEPS,
                   enable_progress_bar=False, logger=False, enable_checkpointing=False,
                   enable_model_summary=False, use_distributed_sampler=False)
    m = Mod()
    tr.fit(m)
    if tr.global_rank == 0:
        export(m.net)


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fab = Fabric(accelerator="cpu", devices=a.devices,
                 strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
    fab.launch()
    r = fab.global_rank
    net = FlareCNN(feat=32 * 8 * 8 if a.fault == "shape_all" else 32 * 4 * 4)
    load_start(r, a.fault, a.rank, net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fab.setup(net, opt)
    ds = PatchSet(r, a.fault, a.rank)
    nw = 1 if a.fault == "worker_crash" else 0
    dl = fab.setup_dataloaders(torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=nw), use_distributed_sampler=False)
    for i, (x, y) in enumerate(dl):
        if i >= STEPS:
            break
        x = before_step(r, i, a.fault, a.rank, x)
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        after_loss(r, i, loss, a.fault, a.rank, logits, y)
        opt.zero_grad(); fab.backward(loss); opt.step()
        accv = (logits.argmax(1) == y).float().mean().item()
        print(f"rank {r} step {i} loss {loss.item():.4f} acc {accv:.3f}", flush=True)
    fab.barrier()
    if r == 0:
        export(net.module)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--launcher", default="lightning", choices=["lightning", "fabric"])
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    a = p.parse_args()
    if a.prepare:
        prepare(); sys.exit(0)
    torch.set_num_threads(1)
    (run_fabric if a.launcher == "fabric" else run_lightning)(a)

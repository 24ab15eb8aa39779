"""A three-hundred-and-sixty-first hand-run batch: CELL NUCLEUS SEGMENTATION IN MICROSCOPY (Lightning).

Synthetic fluorescence tiles: every rank reads 24 one-channel 32x32 tiles and their binary nucleus masks from
/tmp/fault361_work/tiles/tiles_R.pt, plus a per-tile stain name looked up in a stain table (DAPI, Hoechst,
DRAQ5) that gives the intensity scale.  A tiny U-Net (two encoder blocks, one skip, a 1x1 head) is trained on
BCE with a Dice score as the metric, initialised from ckpt/unet_w8.pt.  Written with lightning.pytorch: the
Trainer's DDPStrategy initialises gloo with the timeout from --pg-timeout; the loss and Dice are
all_gathered through the LightningModule every step and printed as "rank R step S loss L dice D"; rank 0
saves export/unet.pt at the end of fit (on_train_end).  --fabric 1 runs the same model with
lightning.fabric.Fabric and a hand-written loop instead of the Trainer.
Launch: python fault361.py --devices W (Lightning's own launcher), torchrun, or one python per rank with
MASTER_ADDR/MASTER_PORT/NODE_RANK/LOCAL_RANK/WORLD_SIZE set.

Faults (--fault NAME --rank R, R=-1 all ranks):
  stainkey   - rank R's tile table names stain "DAPI-2" (a typo), not in the stain table (KeyError in setup)
  nomask     - rank R reads its tiles from tiles/val/ which does not exist (FileNotFoundError in setup)
  ckptsize   - rank R initialises from ckpt/unet_w16.pt, a 16-wide U-Net (load_state_dict size mismatch)
  ckptpickle - rank R initialises from ckpt/unet_full.pt, pickled with a Calibration object (weights_only refusal)
  labelidx   - rank R's step-4 masks carry instance label 3, used as an index into a 3-entry class-weight table
  countgather- rank R all_gathers a per-size nucleus histogram with 9 bins (an extra "debris" bin) at step 3
  watershed  - rank R runs a pure-Python watershed flood over its tiles before the step-2 all_gather
  nanstd     - rank R's step-2 tiles are blank (std 0): normalised tiles NaN, the program's own check raises
  sigsegv    - rank R sends itself SIGSEGV after step 3
  exit4      - rank R prints its own ERROR line about overlapping masks at the end and calls sys.exit(4)
  badchan    - every rank: tiles stacked with the membrane channel (2 channels), the U-Net expects 1
  none       - control, clean run

What happened (filled in after the runs):
  stainkey   - KeyError: 'DAPI-2' in setup; peers Connection closed in the barrier (np4 r1 plown); np5 r0 bashloop: peers never exited, killed at 100 s, exit 124
  nomask     - FileNotFoundError tiles/val/tiles_R.pt in setup / before fabric.setup; peers closed (np3 r2 pltee, np4 r0 plfabric)
  ckptsize   - 'Error(s) in loading state_dict for UNet:' size mismatch 16 vs 8 wide (np4 r3 plloglevel, np3 r1 plown)
  ckptpickle - UnpicklingError 'Weights only load failed' / GLOBAL __main__.Calibration; Root Cause rank 0 (np3 r0 pltorchrun)
  labelidx   - IndexError 'index 3 is out of bounds for dimension 0 with size 3' at step 4 (np3 r1 bashloop, np6 r4 plfabric)
  countgather- a neighbour aborts: gloo::EnforceNotMet '18 vs 16. Received data size doesn't match', SIGABRT on rank 1 / 3 (np3 r0 plfabric, np4 r2 pltee)
  watershed  - 12 s: peers 'Timed out waiting 12000ms' for send/recv, Root Cause rank 0 (np3 r1 pltorchrun); 300 s: silent after the flood line, killed at 60 s, exit 124 (np4 r2 bashloop)
  nanstd     - '4096 non-finite pixels after normalisation', FloatingPointError (np3 r0 plown, np5 r3 plloglevel; a first try with a 0.42 fill ran clean and was dropped)
  sigsegv    - no traceback after 'rank R step 3: done'; peers Read error / closed; Root Cause exitcode -11 SIGSEGV (np4 r1 pltee, np3 r2 plfabric)
  exit4      - the ERROR line, no traceback; Root Cause rank 2 exitcode 4 (np3 r2 plloglevel); loop exit 4 (np4 r0 bashloop)
  badchan    - every rank: 'expected input[4, 2, 32, 32] to have 1 channels, but got 2 channels instead' (np6 pltorchrun)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/unet.pt, exit 0 (np3 pltorchrun)
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

WORK = "/tmp/fault361_work"
STAINS = {"DAPI": 1.0, "Hoechst": 0.8, "DRAQ5": 1.3}
CLASS_W = torch.tensor([1.0, 2.0, 0.5])  # background, nucleus, border


class Calibration:
    """Microscope calibration pickled into the 'full' checkpoint (not a tensor)."""

    def __init__(self, um_per_px=0.325, objective="40x"):
        self.um_per_px = um_per_px
        self.objective = objective


class UNet(nn.Module):
    def __init__(self, width=8, in_ch=1):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(in_ch, width, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU())
        self.dec = nn.Sequential(nn.Conv2d(3 * width, width, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(width, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        up = F.interpolate(e2, scale_factor=2, mode="nearest")
        return self.head(self.dec(torch.cat([e1, up], 1)))


def make_tiles(n, g):
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    imgs, masks = torch.zeros(n, 1, 32, 32), torch.zeros(n, 1, 32, 32)
    for i in range(n):
        for _ in range(3):
            cy, cx = torch.randint(6, 26, (2,), generator=g).float()
            r = 3 + 3 * torch.rand(1, generator=g)
            blob = ((yy - cy) ** 2 + (xx - cx) ** 2) < r ** 2
            masks[i, 0][blob] = 1.0
    imgs = masks * 0.7 + 0.2 * torch.rand(n, 1, 32, 32, generator=g)
    return imgs, masks


def prepare(world=6):
    os.makedirs(f"{WORK}/tiles", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(361)
    for r in range(world):
        imgs, masks = make_tiles(24, g)
        stains = [["DAPI", "Hoechst", "DRAQ5"][i % 3] for i in range(24)]
        torch.save({"images": imgs, "masks": masks, "stains": stains}, f"{WORK}/tiles/tiles_{r}.pt")
    torch.manual_seed(0)
    torch.save(UNet(8).state_dict(), f"{WORK}/ckpt/unet_w8.pt")
    torch.save(UNet(16).state_dict(), f"{WORK}/ckpt/unet_w16.pt")
    torch.save({"state_dict": UNet(8).state_dict(), "calibration": Calibration()}, f"{WORK}/ckpt/unet_full.pt")
    print(f"prepared {world} tile files and 3 checkpoints under {WORK}", flush=True)


def is_fault(args, rank, name):
    return args.fault == name and (args.rank == -1 or args.rank == rank)


def load_tiles(args, rank):
    path = f"{WORK}/tiles/tiles_{rank}.pt"
    if is_fault(args, rank, "nomask"):
        path = f"{WORK}/tiles/val/tiles_{rank}.pt"
    blob = torch.load(path)
    stains = list(blob["stains"])
    if is_fault(args, rank, "stainkey"):
        stains[7] = "DAPI-2"
    scale = torch.tensor([STAINS[s] for s in stains]).view(-1, 1, 1, 1)
    imgs = blob["images"] * scale
    if is_fault(args, rank, "badchan"):
        membrane = 0.3 * torch.rand_like(imgs)
        imgs = torch.cat([imgs, membrane], 1)
    return TensorDataset(imgs, blob["masks"])


def build_model(args, rank):
    model = UNet(8)
    path = f"{WORK}/ckpt/unet_w8.pt"
    if is_fault(args, rank, "ckptsize"):
        path = f"{WORK}/ckpt/unet_w16.pt"
    if is_fault(args, rank, "ckptpickle"):
        sd = torch.load(f"{WORK}/ckpt/unet_full.pt")["state_dict"]
    else:
        sd = torch.load(path)
    model.load_state_dict(sd)
    return model


def watershed_flood(imgs, budget_s):
    """Pure-Python flood fill of every tile from every local maximum (slow on purpose)."""
    t0, labels = time.time(), 0
    while time.time() - t0 < budget_s:
        for t in imgs[:, 0].tolist():
            seen = set()
            for y in range(32):
                for x in range(32):
                    if t[y][x] > 0.5 and (y, x) not in seen:
                        stack = [(y, x)]
                        while stack:
                            p = stack.pop()
                            if p in seen or not (0 <= p[0] < 32 and 0 <= p[1] < 32) or t[p[0]][p[1]] <= 0.5:
                                continue
                            seen.add(p)
                            stack += [(p[0] + 1, p[1]), (p[0] - 1, p[1]), (p[0], p[1] + 1), (p[0], p[1] - 1)]
                        labels += 1
    return labels


def before_step(args, rank, step, x, y):
    """Fault hooks that run at the start of a step; returns (x, y, weight)."""
    if is_fault(args, rank, "nanstd") and step == 2:
        x = torch.zeros_like(x)  # a blank tile batch
    x = (x - x.mean()) / x.std()
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        print(f"rank {rank} step {step}: {bad} non-finite pixels after normalisation (tile std {x.std():.3f})",
              flush=True)
        raise FloatingPointError(f"non-finite normalised tiles on rank {rank} at step {step}")
    labels = y.long()
    if is_fault(args, rank, "labelidx") and step == 4:
        labels[:, :, 0, :] = 3  # instance id leaked into the semantic mask
    weight = CLASS_W[labels]
    if is_fault(args, rank, "watershed") and step == 2:
        print(f"rank {rank} step {step}: running watershed flood on {x.shape[0]} tiles", flush=True)
        n = watershed_flood(y, budget_s=40.0 if args.pg_timeout < 60 else 400.0)
        print(f"rank {rank} watershed found {n} nuclei", flush=True)
    return x, y, weight


def seg_loss(model, x, y, weight):
    logits = model(x)
    loss = F.binary_cross_entropy_with_logits(logits, y, weight=weight)
    pred = (logits.sigmoid() > 0.5).float()
    dice = (2 * (pred * y).sum() + 1) / (pred.sum() + y.sum() + 1)
    return loss, dice.detach()


def after_gather(args, rank, step, all_gather):
    if step == 3:
        bins = 9 if is_fault(args, rank, "countgather") else 8
        hist = torch.zeros(bins)
        hist[: 8] = torch.arange(8.0)
        all_gather(hist)
        if rank == 0:
            print(f"rank 0 step 3 nucleus size histogram gathered", flush=True)
    if is_fault(args, rank, "sigsegv") and step == 3:
        print(f"rank {rank} step {step}: done", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)


def at_end(args, rank, model):
    if is_fault(args, rank, "exit4"):
        print(f"ERROR rank {rank}: 5 nucleus masks overlap after export check (IoU > 0.9); refusing to save",
              flush=True)
        sys.exit(4)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export/unet.pt")
        print(f"rank 0 saved {WORK}/export/unet.pt", flush=True)


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class NucleusSeg(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None

        def setup(self, stage):
            self.ds = load_tiles(args, self.global_rank)
            self.net = build_model(args, self.global_rank)

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=4, shuffle=False)

        def training_step(self, batch, idx):
            step, rank = self.global_step + 1, self.global_rank
            x, y, w = before_step(args, rank, step, batch[0], batch[1])
            loss, dice = seg_loss(self.net, x, y, w)
            stats = self.all_gather(torch.stack([loss.detach(), dice]))
            print(f"rank {rank} step {step} loss {stats[:, 0].mean():.4f} dice {stats[:, 1].mean():.4f}", flush=True)
            after_gather(args, rank, step, self.all_gather)
            return loss

        def on_train_end(self):
            at_end(args, self.global_rank, self.net)

        def configure_optimizers(self):
            return torch.optim.Adam(self.net.parameters(), lr=1e-3)

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy,
                         max_steps=args.steps, max_epochs=50, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(NucleusSeg())


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=DDPStrategy(
        process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    ds = load_tiles(args, rank)
    model = build_model(args, rank)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    dl = fabric.setup_dataloaders(DataLoader(ds, batch_size=4), use_distributed_sampler=False)
    step = 0
    while step < args.steps:
        for x, y in dl:
            step += 1
            x, y, w = before_step(args, rank, step, x, y)
            loss, dice = seg_loss(model, x, y, w)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
            stats = fabric.all_gather(torch.stack([loss.detach(), dice]))
            print(f"rank {rank} step {step} loss {stats[:, 0].mean():.4f} dice {stats[:, 1].mean():.4f}", flush=True)
            after_gather(args, rank, step, fabric.all_gather)
            if step >= args.steps:
                break
    fabric.barrier()
    at_end(args, rank, model.module if hasattr(model, "module") else model)


def main():
    p = argparse.ArgumentParser(description="nucleus segmentation with fault injection")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "3")))
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(361)
    torch.set_num_threads(1)
    (run_fabric if args.fabric else run_trainer)(args)


if __name__ == "__main__":
    main()

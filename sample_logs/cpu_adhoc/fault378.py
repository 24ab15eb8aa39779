"""A three-hundred-and-seventy-eighth hand-run batch: DRONE LANDING-SITE SEGMENTATION (Lightning).

Synthetic drone tiles: 4 channels (RGB plus a height map from the drone's DEM), 24x24 pixels, with a per-pixel
mask stored as palette indices and a per-tile palette of surface names (grass, asphalt, water, trees) that is
mapped through the CLASSES table when a tile is loaded.  Every rank reads its own tiles from
/tmp/fault378_work/tiles/tiles_R.pt through a Lightning train_dataloader, trains a tiny encoder-decoder
(two convs down, one transposed conv up, a 1x1 head) with cross-entropy, initialised from ckpt/seg_c4.pt in
the setup hook.  Each step the loss is reduced and the per-class predicted areas are all_gathered through the
strategy, then `rank R step S loss L safe_frac F` is printed; rank 0 saves export/landing.ckpt at the end
through trainer.save_checkpoint (fabric.save under --fabric 1).
The Trainer (or Fabric with --fabric 1) uses DDPStrategy(process_group_backend="gloo", timeout=--pg-timeout).
Launch: --devices W alone (Lightning starts ranks 1.. itself), under torchrun, or one python per rank with
MASTER_ADDR/MASTER_PORT/NODE_RANK/LOCAL_RANK/WORLD_SIZE set (environment launched).

Faults (--fault NAME --rank R, R = -1 for every rank):
  terrain    - rank R's tile 9 has "gravel" in its palette, not in CLASSES: KeyError in the dataset (step 3)
  nomask     - rank R reads its tiles from tiles/val/, which does not exist (FileNotFoundError, start-up)
  ckptsize   - rank R initialises from ckpt/seg_c5.pt (a 5-class head): size mismatch in the setup hook
  areagather - rank R all_gathers 5 class areas (an extra "unknown" class) instead of 4 at step 3
  floodfill  - rank R flood-fills every tile's safe zone pixel by pixel in Python (~40 s) before step 2's reduce
  nanloss    - rank R normalises the height channel by a zero range at step 4: the program's check raises
  sigkill    - rank R sends itself SIGKILL at the start of step 3
  abort      - rank R calls os.abort() after the last step, before the final save
  exit4      - rank R prints its own ERROR line (landing polygon self-intersects) and sys.exit(4) at step 4
  chanwidth  - every rank: tiles carry a fifth (NIR) channel, the first conv expects 4 (shape error, step 1)
  none       - control, clean run

What happened (filled in after the runs):
  terrain    - KeyError: 'gravel' in __getitem__ after step 2; peers Connection closed by peer (np4 r1 torchrun, np5 r0 bashloop)
  nomask     - FileNotFoundError for tiles/val/tiles_R.pt before step 1; peers closed (np3 r2 tee, np3 r0 fabric)
  ckptsize   - load_state_dict size mismatch for head.weight/head.bias [5,...] vs [4,...] in setup (np4 r3 loglevel, np3 r1 own)
  areagather - a peer aborts: gloo::EnforceNotMet 'Received data size doesn't match expected size'; Root Cause is that
               peer's SIGABRT (np5 r2 torchrun: rank 3; np3 r0 fabric: rank 1)
  floodfill  - 12 s: peers 'Timed out waiting 12000ms', Root Cause rank 0 (np4 r1 tee); 300 s: output stops after
               step 1, killed at 60 s, exit 124 (np3 r2 bashloop; its ranks killed by PID afterwards)
  nanloss    - 'loss is nan (non-finite)' and FloatingPointError at step 4; peers closed (np5 r4 torchrun, np3 r1 fabric)
  sigkill    - silent after step 2; peers Connection reset; Root Cause rank 3 SIGKILL (np5 r3 loglevel); exit 1 with
               no signal named (np4 r2 own, rerun after a start-up DistStoreError under load)
  abort      - after 6 steps; peers reset in save_checkpoint's barrier; Root Cause rank 1 SIGABRT (np3 r1 tee)
  exit4      - the ERROR line and exit 4; peers closed (np4 r3 bashloop, loop exit 4; np5 r0 own, exit 4)
  chanwidth  - every rank 'expected input[4, 5, 24, 24] to have 4 channels, but got 5'; Root Cause rank 0 (np3 torchrun)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/landing.ckpt, exit 0 (np3 own)
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
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault378_work"
CLASSES = {"grass": 0, "asphalt": 1, "water": 2, "trees": 3}
SAFE = (0, 1)
NCLS = 4
CH = 4
HW = 24
BATCH = 4


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    return p.parse_args()


def prepare(world=8, steps=8):
    g = torch.Generator().manual_seed(378)
    os.makedirs(f"{WORK}/tiles", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    names = list(CLASSES)
    for r in range(world):
        n = steps * BATCH
        img = torch.rand(n, CH + 1, HW, HW, generator=g)
        pal = torch.randint(0, 4, (n, HW, HW), generator=g)
        palettes = []
        for i in range(n):
            perm = torch.randperm(4, generator=g).tolist()
            palettes.append([names[j] for j in perm])
        torch.save({"img": img, "pal": pal, "palettes": palettes}, f"{WORK}/tiles/tiles_{r}.pt")
        bad = [list(p) for p in palettes]
        bad[9][2] = "gravel"
        torch.save({"img": img, "pal": pal, "palettes": bad}, f"{WORK}/tiles/tiles_{r}_gravel.pt")
    torch.save(SegNet(NCLS).state_dict(), f"{WORK}/ckpt/seg_c4.pt")
    torch.save(SegNet(5).state_dict(), f"{WORK}/ckpt/seg_c5.pt")
    print(f"prepared {world} tile files and 2 checkpoints under {WORK}")


class TileSet(Dataset):
    def __init__(self, path, channels):
        d = torch.load(path)
        self.img, self.pal, self.palettes = d["img"], d["pal"], d["palettes"]
        self.channels = channels

    def __len__(self):
        return len(self.palettes)

    def __getitem__(self, i):
        lut = torch.tensor([CLASSES[name] for name in self.palettes[i]])
        return self.img[i, : self.channels], lut[self.pal[i]]


class SegNet(nn.Module):
    def __init__(self, ncls=NCLS):
        super().__init__()
        self.enc1 = nn.Conv2d(CH, 8, 3, padding=1)
        self.enc2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.head = nn.Conv2d(16, ncls, 1)

    def forward(self, x):
        a = F.relu(self.enc1(x))
        b = F.relu(self.enc2(a))
        u = F.relu(self.up(b))
        return self.head(torch.cat([a, u], 1))


def flood_fill_all(img):
    # pure-Python 4-neighbour flood fill of "flat and bright" pixels, tile by tile, repeated for smoothing passes
    t0 = time.time()
    h = img[:, 3].tolist()
    regions = 0
    while time.time() - t0 < 40:
        for tile in h:
            seen = [[False] * HW for _ in range(HW)]
            for y in range(HW):
                for x in range(HW):
                    if seen[y][x] or tile[y][x] > 0.5:
                        continue
                    regions += 1
                    stack = [(y, x)]
                    while stack:
                        cy, cx = stack.pop()
                        if 0 <= cy < HW and 0 <= cx < HW and not seen[cy][cx] and tile[cy][cx] <= 0.5:
                            seen[cy][cx] = True
                            stack += [(cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)]
    return regions


class Faults:
    def __init__(self, args, rank):
        self.args, self.rank = args, rank

    def on(self, name):
        return self.args.fault == name and (self.args.rank == -1 or self.args.rank == self.rank)

    def tiles_path(self):
        if self.on("nomask"):
            return f"{WORK}/tiles/val/tiles_{self.rank}.pt"
        if self.on("terrain"):
            return f"{WORK}/tiles/tiles_{self.rank}_gravel.pt"
        return f"{WORK}/tiles/tiles_{self.rank}.pt"

    def channels(self):
        return CH + 1 if self.on("chanwidth") else CH

    def ckpt_path(self):
        return f"{WORK}/ckpt/seg_c5.pt" if self.on("ckptsize") else f"{WORK}/ckpt/seg_c4.pt"

    def before_step(self, step, x):
        if self.on("sigkill") and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.on("exit4") and step == 4:
            print(f"ERROR: rank {self.rank}: landing polygon for tile batch {step} self-intersects "
                  f"(12 vertices, 2 crossings); refusing to train on it", flush=True)
            sys.exit(4)
        if self.on("nanloss") and step == 4:
            hmin, hmax = x[:, 3].min(), x[:, 3].min()  # zero range
            x = x.clone()
            x[:, 3] = (x[:, 3] - hmin) / (hmax - hmin)
        return x

    def before_reduce(self, step, x):
        if self.on("floodfill") and step == 2:
            n = flood_fill_all(x)
            print(f"rank {self.rank} flood fill found {n} candidate regions", flush=True)

    def areas(self, step, pred):
        a = torch.stack([(pred == c).sum() for c in range(NCLS)]).float()
        if self.on("areagather") and step == 3:
            a = torch.cat([a, torch.zeros(1)])  # an "unknown" class bin
        return a

    def end(self):
        if self.on("abort"):
            os.abort()


def check_loss(loss, rank, step):
    if not torch.isfinite(loss):
        print(f"rank {rank} step {step}: loss is {loss.item()} (non-finite); stopping", flush=True)
        raise FloatingPointError(f"non-finite loss {loss.item()} on rank {rank} at step {step}")


def step_compute(model, x, y, faults, rank, step):
    x = faults.before_step(step, x)
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    check_loss(loss, rank, step)
    pred = logits.argmax(1)
    return loss, faults.areas(step, pred)


class LandingModule(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = SegNet(NCLS)

    def setup(self, stage):
        self.faults = Faults(self.args, self.global_rank)
        sd = torch.load(self.faults.ckpt_path())
        self.net.load_state_dict(sd)

    def train_dataloader(self):
        ds = TileSet(self.faults.tiles_path(), self.faults.channels())
        return DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=0)

    def training_step(self, batch, batch_idx):
        step = batch_idx + 1
        x, y = batch
        loss, area = step_compute(self.net, x, y, self.faults, self.global_rank, step)
        self.faults.before_reduce(step, x)
        mean_loss = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        areas = self.all_gather(area).sum(0)
        safe = (areas[list(SAFE)].sum() / areas.sum()).item()
        print(f"rank {self.global_rank} step {step} loss {mean_loss.item():.4f} safe_frac {safe:.3f}", flush=True)
        return loss

    def on_train_end(self):
        self.faults.end()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def strategy(args):
    if args.fabric:
        from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
        return FabricDDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    return DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))


def run_trainer(args):
    model = LandingModule(args)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
                         strategy=strategy(args), max_steps=args.steps, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(model)
    path = f"{WORK}/export/landing.ckpt"
    trainer.save_checkpoint(path)
    if trainer.global_rank == 0:
        print(f"rank 0 saved {path} after {args.steps} steps", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy(args))
    fabric.launch()
    rank = fabric.global_rank
    faults = Faults(args, rank)
    net = SegNet(NCLS)
    net.load_state_dict(torch.load(faults.ckpt_path()))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    ds = TileSet(faults.tiles_path(), faults.channels())
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH, shuffle=False),
                                      use_distributed_sampler=False)
    for i, (x, y) in enumerate(loader):
        step = i + 1
        if step > args.steps:
            break
        loss, area = step_compute(net, x, y, faults, rank, step)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        faults.before_reduce(step, x)
        mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
        areas = fabric.all_gather(area).sum(0)
        safe = (areas[list(SAFE)].sum() / areas.sum()).item()
        print(f"rank {rank} step {step} loss {mean_loss.item():.4f} safe_frac {safe:.3f}", flush=True)
    faults.end()
    path = f"{WORK}/export/landing_fabric.ckpt"
    fabric.save(path, {"model": net, "optimizer": opt, "steps": args.steps})
    if rank == 0:
        print(f"rank 0 saved {path} after {args.steps} steps", flush=True)


def main():
    args = parse()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(0)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()

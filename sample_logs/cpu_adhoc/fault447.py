"""Batch 447 hand-run fault script: CORAL REEF BLEACHING FROM UNDERWATER PHOTOS (Lightning, gloo, CPU).

Synthetic 24x24 RGB underwater photo tiles of coral colonies: healthy coral is brown-olive, paling and
bleached coral turns white-blue, under a blue water cast and caustic noise.  Each tile carries a reef-site
code (looked up in an 8-entry site table, a site embedding) and a bleaching class (healthy, pale, partly
bleached, bleached).  Every rank reads its own transect from /tmp/fault447_work/photos/photos_R.pt, crops the
centre 16x16, corrects the blue cast per channel, and trains a small CNN + site embedding on cross-entropy.
The model is initialised from ckpt/reefnet.pt.  Per-class tile counts are all_gathered on the first step, the
loss and accuracy are reduced every step and printed as `rank R step S loss L acc A`, and at the end
trainer.save_checkpoint (fabric.save with --fabric 1) writes export/reefnet.ckpt from rank 0.
Lightning Trainer with DDPStrategy(process_group_backend="gloo", timeout=--pg-timeout); --fabric 1 runs the
same model under lightning.fabric.Fabric with an own loop.  Launch: Lightning's own launcher (--devices W,
MASTER_PORT), torchrun, or one python per rank with LOCAL_RANK/NODE_RANK/WORLD_SIZE set.

Faults (--fault NAME --rank R, R=-1 every rank):
  sitecode    - rank R's transect has a tile from site "XMAS" (Christmas Island), not in the site table:
                KeyError in the dataset's __getitem__ at step 2
  nophotos    - rank R reads its photos from photos/deep/ which does not exist (FileNotFoundError in
                train_dataloader, before the first step)
  ckptwide    - rank R initialises from ckpt/reefnet_wide.pt, saved with a 5-class head (dead coral added):
                load_state_dict size mismatch in setup()
  ckptpickle  - rank R loads ckpt/reefnet_meta.pt, which pickles a SurveyMeta object: torch.load's
                weights_only unpickler refuses it in setup()
  gatherwidth - rank R all_gathers 5 per-class counts (a dead-coral class) where the others send 4 (step 0)
  slowsegment - rank R segments every pixel of its transect in pure Python before the step-3 reduce
                (longer than the 12 s PG timeout)
  stall       - rank R waits forever for the dive-log lock at step 2 (run with --pg-timeout 300, killed at 60 s)
  nanpixel    - rank R's tile 33 has an overexposed inf pixel: the loss at step 4 is NaN, the program's own
                finiteness check raises FloatingPointError
  sigkill     - rank R sends itself SIGKILL after step 2
  abort       - rank R calls os.abort() in on_train_end (the colour-calibration library aborts), at the end
  exit4       - rank R prints its own error line about a missing white-balance card and calls sys.exit(4)
                at step 3
  patch       - every rank crops 20x20 instead of 16x16: the first Linear gets 800 features, expects 512
  none        - control, clean run

What happened (filled in after the runs):
  sitecode    - KeyError: 'XMAS' fetching batch 2; peers closed (np4 r2 torchrun; np5 r0 fabric, where rank 4
                then 'terminate called without an active exception' and is torchrun's Root Cause, SIGABRT)
  nophotos    - FileNotFoundError photos/deep/photos_R.pt in train_dataloader() (np3 r1 bashloop, np6 r4 tee)
  ckptwide    - size mismatch for head.weight [5, 40] vs [4, 40] in setup() (np4 r3 plown, np3 r0 loglevel)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SurveyMeta'
                (np5 r1 torchrun)
  gatherwidth - a receiving peer (not rank R) dies on gloo::EnforceNotMet 'op.preamble.length <= op.nbytes.
                10 vs 8' (SIGABRT) and becomes torchrun's Root Cause (np3 r1 tee: rank 2; np4 r0 fabric: rank 1)
  slowsegment - peers 'Timed out waiting 12000ms for send/recv ...' (np3 r2 torchrun, np4 r1 plown)
  stall       - output stops after step 1; killed at 60 s, SIGTERM then SIGKILL, exit 137 (np4 r1 loglevel)
  nanpixel    - 'non-finite loss nan at step 4', FloatingPointError (np5 r3 bashloop, np3 r2 fabric)
  sigkill     - rank R vanishes after step 2; Root Cause rank R exitcode -9 (np4 r2 tee, np3 r0 loglevel)
  abort       - after all 6 steps, 'LUT checksum mismatch', Root Cause rank 5 exitcode -6 (np6 r5 torchrun)
  exit4       - the ERROR line, exit 4 from the bash loop; peers closed (np4 r3 bashloop)
  patch       - 'mat1 and mat2 shapes cannot be multiplied (8x800 and 512x32)' on every rank (np3 plown)
  none        - 6 steps, export/reefnet.ckpt saved, exit 0 (np3 plown)
"""
import argparse
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault447_work"
SITES = ["HERON", "LIZARD", "OSPREY", "PALAU", "MALDIV", "AQABA", "MOOREA", "NINGAL"]
SITE_IDX = {s: i for i, s in enumerate(SITES)}
CLASSES = ["healthy", "pale", "partly_bleached", "bleached"]
N_TILES = 48
BATCH = 8


class SurveyMeta:
    """Survey metadata that once got pickled next to the weights."""

    def __init__(self, vessel, depth_m):
        self.vessel = vessel
        self.depth_m = depth_m


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    return p.parse_args()


def make_tiles(g, n, size=24):
    cls = torch.randint(0, 4, (n,), generator=g)
    whiten = cls.float() / 3.0
    coral = torch.tensor([0.45, 0.38, 0.22]).view(1, 3, 1, 1)
    white = torch.tensor([0.92, 0.95, 0.97]).view(1, 3, 1, 1)
    base = coral * (1 - whiten.view(-1, 1, 1, 1)) + white * whiten.view(-1, 1, 1, 1)
    water = torch.tensor([0.05, 0.25, 0.45]).view(1, 3, 1, 1)
    caustic = 0.08 * torch.rand(n, 1, size, size, generator=g)
    img = 0.7 * base.expand(n, 3, size, size) + 0.3 * water + caustic
    img = img + 0.03 * torch.randn(n, 3, size, size, generator=g)
    return img.clamp(0, 1), cls


def prepare():
    os.makedirs(f"{WORK}/photos", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(447)
    for r in range(8):
        img, cls = make_tiles(g, N_TILES)
        sites = [SITES[int(i)] for i in torch.randint(0, 8, (N_TILES,), generator=g)]
        torch.save({"img": img, "cls": cls, "site": sites}, f"{WORK}/photos/photos_{r}.pt")
    torch.save(ReefNet().state_dict(), f"{WORK}/ckpt/reefnet.pt")
    torch.save(ReefNet(n_cls=5).state_dict(), f"{WORK}/ckpt/reefnet_wide.pt")
    torch.save({"state_dict": ReefNet().state_dict(), "meta": SurveyMeta("RV Heron", 7.5)},
               f"{WORK}/ckpt/reefnet_meta.pt")
    print(f"prepared 8 transects of {N_TILES} tiles and 3 checkpoints under {WORK}")


class ReefPhotos(Dataset):
    def __init__(self, blob, crop):
        self.img, self.cls, self.site = blob["img"], blob["cls"], blob["site"]
        self.crop = crop
        # per-channel colour correction against the blue water cast
        self.mean = self.img.mean(dim=(0, 2, 3)).view(3, 1, 1)

    def __len__(self):
        return len(self.cls)

    def __getitem__(self, i):
        site = SITE_IDX[self.site[i]]
        off = (24 - self.crop) // 2
        x = self.img[i, :, off:off + self.crop, off:off + self.crop]
        x = x / self.mean - 1.0
        return x, torch.tensor(site), self.cls[i]


class ReefNet(nn.Module):
    def __init__(self, n_cls=4):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.site = nn.Embedding(len(SITES), 8)
        self.fc = nn.Linear(32 * 4 * 4, 32)
        self.head = nn.Linear(32 + 8, n_cls)

    def forward(self, x, site):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.max_pool2d(F.relu(self.c2(h)), 2)
        h = F.relu(self.fc(h.flatten(1)))
        return self.head(torch.cat([h, self.site(site)], 1))


def is_faulty(args, rank):
    return args.rank == -1 or args.rank == rank


def load_transect(args, rank):
    sub = "photos/deep" if args.fault == "nophotos" and is_faulty(args, rank) else "photos"
    blob = torch.load(f"{WORK}/{sub}/photos_{rank}.pt")
    if args.fault == "sitecode" and is_faulty(args, rank):
        blob["site"][20] = "XMAS"
    if args.fault == "nanpixel" and is_faulty(args, rank):
        blob["img"][33, 1, 10, 9] = float("inf")
    crop = 20 if args.fault == "patch" else 16
    ds = ReefPhotos(blob, crop)
    if args.fault == "nanpixel":
        ds.mean = torch.tensor([0.40, 0.40, 0.40]).view(3, 1, 1)
    return ds


def init_weights(args, rank, net):
    path = f"{WORK}/ckpt/reefnet.pt"
    if is_faulty(args, rank) and args.fault == "ckptwide":
        path = f"{WORK}/ckpt/reefnet_wide.pt"
    if is_faulty(args, rank) and args.fault == "ckptpickle":
        sd = torch.load(f"{WORK}/ckpt/reefnet_meta.pt")["state_dict"]
    else:
        sd = torch.load(path)
    net.load_state_dict(sd)


def class_counts(args, rank, cls):
    n = 5 if args.fault == "gatherwidth" and is_faulty(args, rank) else 4
    return torch.bincount(cls, minlength=n).float()


def before_reduce(args, rank, step, ds):
    if not is_faulty(args, rank):
        return
    if args.fault == "slowsegment" and step == 3:
        print(f"rank {rank}: segmenting bleached pixels of transect {rank} (pure Python)", flush=True)
        t0, n = time.time(), 0
        img = ds.img.tolist()
        while time.time() - t0 < args.pg_timeout + 10:
            for tile in img:
                for row_r, row_g, row_b in zip(*tile):
                    for r_, g_, b_ in zip(row_r, row_g, row_b):
                        n += (r_ > 0.6 and g_ > 0.6 and b_ > 0.6)
        print(f"rank {rank}: segmented {n} bleached pixels in {time.time() - t0:.1f}s", flush=True)
    if args.fault == "stall" and step == 2:
        print(f"rank {rank}: waiting for the dive-log lock", flush=True)
        threading.Event().wait()
    if args.fault == "exit4" and step == 3:
        print(f"ERROR rank {rank}: white-balance calibration card not found in transect_{rank} "
              f"(blue/red ratio 3.9 > 2.5); refusing to score bleaching", flush=True)
        sys.exit(4)


def after_step(args, rank, step):
    if args.fault == "sigkill" and is_faulty(args, rank) and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)


def check_finite(rank, step, loss, x):
    if not torch.isfinite(loss):
        bad = int((~torch.isfinite(x)).sum())
        print(f"rank {rank}: non-finite loss {loss.item()} at step {step} ({bad} non-finite pixels)", flush=True)
        raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")


class ReefModule(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = ReefNet()

    def setup(self, stage):
        init_weights(self.args, self.global_rank, self.net)

    def train_dataloader(self):
        self.ds = load_transect(self.args, self.global_rank)
        return DataLoader(self.ds, batch_size=BATCH, shuffle=False)

    def training_step(self, batch, step):
        x, site, y = batch
        rank = self.global_rank
        if step == 0:
            counts = self.all_gather(class_counts(self.args, rank, self.ds.cls))
            if rank == 0:
                print(f"rank 0: class counts over ranks {counts.sum(0).tolist()}", flush=True)
        logits = self.net(x, site)
        loss = F.cross_entropy(logits, y)
        check_finite(rank, step, loss, x)
        acc = (logits.argmax(1) == y).float().mean()
        before_reduce(self.args, rank, step, self.ds)
        red = self.trainer.strategy.reduce(torch.stack([loss.detach(), acc]), reduce_op="mean")
        print(f"rank {rank} step {step} loss {red[0]:.4f} acc {red[1]:.3f}", flush=True)
        after_step(self.args, rank, step)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class EndCallback(pl.Callback):
    def __init__(self, args):
        self.args = args

    def on_train_end(self, trainer, module):
        if self.args.fault == "abort" and is_faulty(self.args, trainer.global_rank):
            print(f"rank {trainer.global_rank}: colour calibration: LUT checksum mismatch", flush=True)
            os.abort()


def run_trainer(args):
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[EndCallback(args)])
    model = ReefModule(args)
    trainer.fit(model)
    trainer.save_checkpoint(f"{WORK}/export/reefnet.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0: saved {WORK}/export/reefnet.ckpt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    strategy = FabricDDP(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    net = ReefNet()
    init_weights(args, rank, net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    ds = load_transect(args, rank)
    dl = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH, shuffle=False),
                                  use_distributed_sampler=False)
    for step, (x, site, y) in enumerate(dl):
        if step >= args.steps:
            break
        if step == 0:
            counts = fabric.all_gather(class_counts(args, rank, ds.cls))
            if rank == 0:
                print(f"rank 0: class counts over ranks {counts.sum(0).tolist()}", flush=True)
        logits = net(x, site)
        loss = F.cross_entropy(logits, y)
        check_finite(rank, step, loss, x)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        before_reduce(args, rank, step, ds)
        red = fabric.all_reduce(torch.stack([loss.detach(), acc]), reduce_op="mean")
        print(f"rank {rank} step {step} loss {red[0]:.4f} acc {red[1]:.3f}", flush=True)
        after_step(args, rank, step)
    if args.fault == "abort" and is_faulty(args, rank):
        print(f"rank {rank}: colour calibration: LUT checksum mismatch", flush=True)
        os.abort()
    fabric.save(f"{WORK}/export/reefnet_fabric.ckpt", {"model": net, "optimizer": opt})
    if rank == 0:
        print(f"rank 0: saved {WORK}/export/reefnet_fabric.ckpt", flush=True)


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

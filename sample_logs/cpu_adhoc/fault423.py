"""A four-hundred-and-twenty-third hand-run batch: LEGEND DETECTION IN SCIENTIFIC CHARTS (Lightning).

Synthetic 32x32 chart renderings: a few plotted curves and a legend box drawn in one of four corners.  Every
rank reads its charts from /tmp/fault423_work/charts/charts_R.pt (images, legend boxes as x0,y0,x1,y1 in
pixels, the chart width, and the legend position as a string looked up in a 4-entry position table).  A tiny
CNN (two strided convs, a 4x4 pool) predicts the normalised legend box (smooth L1) and the corner (cross
entropy).  It is trained with lightning.pytorch's Trainer (DDPStrategy over gloo, the process-group timeout
from --pg-timeout) or, with --fabric 1, with lightning.fabric.Fabric and a hand-written loop.  The weights are
initialised from ckpt/legend_c4.pt at fit start; each step the loss and the box IoU are all_gathered through
the framework and printed as `rank R step S loss L iou X`; rank 0 saves export/legend.ckpt through the
framework's save at the end, then every rank meets at a final barrier.
Options: --devices W (Trainer/Fabric devices), --fabric 1, --steps, --pg-timeout, --prepare, --fault, --rank.

Faults (--rank N is the faulty rank, -1 every rank):
  poskey     - rank N's chart table names one legend position "center left", not in the table (KeyError in
               the dataset, surfacing in step 5 through the framework's data fetcher)
  nocharts   - rank N reads its charts from charts/val/, which does not exist (FileNotFoundError in setup)
  ckptsize   - rank N initialises from ckpt/legend_c6.pt, saved with 6 positions (size mismatch in the head)
  ckptpickle - rank N initialises from ckpt/legend_meta.pt, which pickles a ChartMeta object
               (torch.load weights_only refusal)
  boxgather  - at step 3 rank N all_gathers its per-corner box counts with an extra "outside" bin (5 vs 4)
  slowocr    - before the step-2 gather rank N "reads" every legend label pixel by pixel in pure Python (~40 s)
  hang       - rank N waits forever for a font-cache lock before its first gather (run with --pg-timeout 300)
  nanbox     - at step 4 rank N normalises the boxes by a chart width of 0: inf targets, the program's check
  segv       - rank N sends itself SIGSEGV in on_train_batch_end after step 2
  exit4      - at the end rank N prints its own error line about an empty legend palette and sys.exit(4)
  headshape  - every rank: the pool is 8x8 (1024 features) while the head expects 256 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  poskey     - KeyError: 'center left' from the dataset in step 5; peers Connection closed by peer in their gather
               (np4 r2 bashloop, np5 r0 fabric)
  nocharts   - FileNotFoundError for charts/val/charts_N.pt in setup(); peers Connection closed by peer in
               Lightning's barrier("post_setup") (np3 r1 own launcher, np4 r3 tee)
  ckptsize   - load_state_dict size mismatch for pos.weight [6,256] vs [4,256] in on_fit_start; peers closed in
               barrier("_CheckpointConnector.resume_end") (np5 r3 loglevel)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.ChartMeta';
               peers closed in the same barrier (np4 r0 torchrun)
  boxgather  - a peer aborts: terminate gloo::EnforceNotMet 'Received data size doesn't match expected size'
               (SIGABRT); the rest Connection reset/closed (np3 r1 own launcher, np6 r4 torchrun: Root Cause rank 5 -6)
  slowocr    - ranks 0 and 1 'Timed out waiting 12000ms' at step 2; rank 2 SIGTERMed mid-scan (np3 r2 fabric)
  hang       - rank 1 waits for the font-cache lock before step 1; no progress; timeout at 60 s, workers ignored the
               agent's SIGTERM, exit 137 (np3 r1 tee); I SIGKILLed the three orphaned workers by PID afterwards
  nanbox     - the program's FloatingPointError (16 non-finite values, chart width 0.0) at step 4; peers closed
               (np3 r0 tee, np5 r2 bashloop)
  segv       - rank N dies with -11 after step 2; peers Connection reset by peer (np3 r1 fabric: Root Cause -11;
               np4 r2 own launcher: 'Child process ... terminated with code -11. Forcefully terminating', exit 137)
  exit4      - the ERROR line and exit 4 after fit; peers closed in save_checkpoint's barrier (np5 r3 loglevel,
               np3 r1 torchrun)
  headshape  - every rank 'mat1 and mat2 shapes cannot be multiplied (4x1024 and 256x4)' in the first forward
               (np3 bashloop)
  none       - clean, 6 steps on 3 ranks, export/legend.ckpt saved, exit 0 (np3 torchrun)
"""
import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy as TrainerDDP
from lightning.fabric.strategies import DDPStrategy as FabricDDP

WORK = "/tmp/fault423_work"
POSITIONS = {"upper right": 0, "upper left": 1, "lower left": 2, "lower right": 3}
SIZE = 32
BATCH = 4


@dataclass
class ChartMeta:
    dpi: int
    palette: str


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    return p.parse_args()


def render(gen, pos):
    img = torch.zeros(1, SIZE, SIZE)
    xs = torch.arange(SIZE).float()
    for _ in range(3):
        a, b = torch.rand(2, generator=gen)
        ys = (SIZE / 2 + (SIZE / 3) * torch.sin(xs * (0.1 + 0.3 * a) + 6 * b)).long().clamp(0, SIZE - 1)
        img[0, ys, xs.long()] = 0.6
    w, h = 10, 8
    x0 = SIZE - w - 2 if pos in ("upper right", "lower right") else 2
    y0 = 2 if pos.startswith("upper") else SIZE - h - 2
    img[0, y0:y0 + h, x0:x0 + w] = 1.0
    img[0, y0 + 2:y0 + h - 2:2, x0 + 1:x0 + 3] = 0.3
    return img, [x0, y0, x0 + w, y0 + h]


def prepare(world=6, n=32):
    gen = torch.Generator().manual_seed(423)
    names = list(POSITIONS)
    os.makedirs(f"{WORK}/charts", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(world):
        imgs, boxes, pos = [], [], []
        for i in range(n):
            p = names[int(torch.randint(0, 4, (1,), generator=gen))]
            img, box = render(gen, p)
            imgs.append(img)
            boxes.append(box)
            pos.append(p)
        torch.save({"images": torch.stack(imgs), "boxes": torch.tensor(boxes).float(),
                    "width": SIZE, "position": pos}, f"{WORK}/charts/charts_{r}.pt")
    torch.manual_seed(0)
    torch.save(LegendNet(4).state_dict(), f"{WORK}/ckpt/legend_c4.pt")
    torch.save(LegendNet(6).state_dict(), f"{WORK}/ckpt/legend_c6.pt")
    torch.save({"state_dict": LegendNet(4).state_dict(), "meta": ChartMeta(150, "tab10")},
               f"{WORK}/ckpt/legend_meta.pt")
    print(f"prepared {world} chart shards of {n} and 3 checkpoints under {WORK}")


class ChartSet(Dataset):
    def __init__(self, rank, fault, faulty):
        sub = "charts/val" if fault == "nocharts" and faulty else "charts"
        d = torch.load(f"{WORK}/{sub}/charts_{rank}.pt", weights_only=True)
        self.images, self.boxes, self.width = d["images"], d["boxes"], d["width"]
        self.position = list(d["position"])
        if fault == "poskey" and faulty:
            self.position[18] = "center left"   # a legend placed by the plotting library's "best" rule

    def __len__(self):
        return len(self.position)

    def __getitem__(self, i):
        label = POSITIONS[self.position[i]]
        return self.images[i], self.boxes[i], torch.tensor(self.width).float(), label


class LegendNet(nn.Module):
    def __init__(self, n_pos=4, pool=4):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(pool)
        self.box = nn.Linear(256, 4)
        self.pos = nn.Linear(256, n_pos)

    def forward(self, x):
        h = self.pool(F.relu(self.c2(F.relu(self.c1(x))))).flatten(1)
        return torch.sigmoid(self.box(h)), self.pos(h)


def box_iou(a, b):
    lt = torch.max(a[:, :2], b[:, :2])
    rb = torch.min(a[:, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(1)
    area = lambda t: (t[:, 2:] - t[:, :2]).clamp(min=0).prod(1)
    return (inter / (area(a) + area(b) - inter + 1e-6)).mean()


def init_path(fault, faulty):
    if faulty and fault == "ckptsize":
        return f"{WORK}/ckpt/legend_c6.pt"
    if faulty and fault == "ckptpickle":
        return f"{WORK}/ckpt/legend_meta.pt"
    return f"{WORK}/ckpt/legend_c4.pt"


def load_init(net, fault, faulty):
    sd = torch.load(init_path(fault, faulty), map_location="cpu", weights_only=True)
    net.load_state_dict(sd.get("state_dict", sd))


def compute(net, batch, fault, faulty, step):
    img, box, width, label = batch
    if fault == "nanbox" and faulty and step == 4:
        width = torch.zeros_like(width)        # a chart whose axes metadata lost its width
    target = box / width[:, None]
    if not torch.isfinite(target).all():
        bad = int((~torch.isfinite(target)).sum())
        raise FloatingPointError(f"legend box targets: {bad} non-finite values at step {step} "
                                 f"(chart width {width.min().item():.1f})")
    pbox, logits = net(img)
    loss = F.smooth_l1_loss(pbox, target) + F.cross_entropy(logits, label)
    iou = box_iou(pbox.detach() * width[:, None], box)
    return loss, iou, label


def before_gather(fault, faulty, step, rank):
    if fault == "slowocr" and faulty and step == 2:
        t0, chars = time.time(), 0
        while time.time() - t0 < 40:           # pure-Python glyph scan of every legend label
            for y in range(SIZE):
                for x in range(SIZE):
                    chars += (x * 31 + y * 17) % 7 == 0
        print(f"rank {rank} legend OCR scanned {chars} glyph cells", flush=True)
    if fault == "hang" and faulty and step == 1:
        print(f"rank {rank} waiting for font cache lock {WORK}/fontcache.lock", flush=True)
        while True:
            time.sleep(1)


def corner_counts(label, fault, faulty, step):
    counts = torch.bincount(label, minlength=4).float()
    if fault == "boxgather" and faulty and step == 3:
        counts = torch.cat([counts, torch.zeros(1)])   # an "outside the axes" bin
    return counts


def at_end(fault, faulty, rank):
    if fault == "exit4" and faulty:
        print(f"rank {rank} ERROR: legend palette is empty after colour matching; "
              f"refusing to export", flush=True)
        sys.exit(4)


class LegendModule(pl.LightningModule):
    def __init__(self, args, pool):
        super().__init__()
        self.args = args
        self.net = LegendNet(4, pool)

    def faulty(self):
        return self.args.rank in (-1, self.global_rank)

    def setup(self, stage):
        self.data = ChartSet(self.global_rank, self.args.fault, self.faulty())

    def on_fit_start(self):
        load_init(self.net, self.args.fault, self.faulty())

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH, shuffle=False)

    def training_step(self, batch, idx):
        step = idx + 1
        a = self.args
        loss, iou, label = compute(self.net, batch, a.fault, self.faulty(), step)
        before_gather(a.fault, self.faulty(), step, self.global_rank)
        counts = self.all_gather(corner_counts(label, a.fault, self.faulty(), step))
        stats = self.all_gather(torch.stack([loss.detach(), iou]))
        print(f"rank {self.global_rank} step {step} loss {stats[:, 0].mean():.4f} "
              f"iou {stats[:, 1].mean():.3f} corners {counts.sum(0).int().tolist()}", flush=True)
        return loss

    def on_train_batch_end(self, outputs, batch, idx):
        if self.args.fault == "segv" and self.faulty() and idx + 1 == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    def on_train_end(self):
        at_end(self.args.fault, self.faulty(), self.global_rank)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run_trainer(args, pool):
    strategy = TrainerDDP(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    model = LegendModule(args, pool)
    trainer.fit(model)
    trainer.save_checkpoint(f"{WORK}/export/legend.ckpt")   # collective: the Trainer writes on rank 0
    if trainer.global_rank == 0:
        print(f"rank 0 saved {WORK}/export/legend.ckpt", flush=True)
    trainer.strategy.barrier("export")
    print(f"rank {trainer.global_rank} done", flush=True)


def run_fabric(args, pool):
    strategy = FabricDDP(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    rank, fault = fabric.global_rank, args.fault
    faulty = args.rank in (-1, rank)
    data = ChartSet(rank, fault, faulty)
    net = LegendNet(4, pool)
    load_init(net, fault, faulty)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH), use_distributed_sampler=False)
    for step, batch in enumerate(loader, start=1):
        if step > args.steps:
            break
        loss, iou, label = compute(net, batch, fault, faulty, step)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        before_gather(fault, faulty, step, rank)
        counts = fabric.all_gather(corner_counts(label, fault, faulty, step))
        stats = fabric.all_gather(torch.stack([loss.detach(), iou]))
        print(f"rank {rank} step {step} loss {stats[:, 0].mean():.4f} iou {stats[:, 1].mean():.3f} "
              f"corners {counts.sum(0).int().tolist()}", flush=True)
        if fault == "segv" and faulty and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    at_end(fault, faulty, rank)
    if rank == 0:
        fabric.save(f"{WORK}/export/legend_fabric.ckpt", {"model": net, "optimizer": opt})
        print(f"rank 0 saved {WORK}/export/legend_fabric.ckpt", flush=True)
    fabric.barrier("export")
    print(f"rank {rank} done", flush=True)


def main():
    args = parse()
    if args.prepare:
        prepare()
        return
    pool = 8 if args.fault == "headshape" else 4
    torch.manual_seed(0)
    (run_fabric if args.fabric else run_trainer)(args, pool)


if __name__ == "__main__":
    main()

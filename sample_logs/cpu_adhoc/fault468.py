"""Batch 468 hand-run fault script: HANDWRITTEN MATH SYMBOL RECOGNITION (Lightning).

Synthetic 24x24 glyph images of handwritten math symbols (digits, operators, Greek letters, relations), each
with a LaTeX label that is looked up in a 16-entry symbol table, a stroke count and a bounding box.  Every
rank reads its shard from /tmp/fault468_work/data/glyphs_R.pt, normalises each glyph by its bounding-box
area, and trains a small CNN (two conv blocks, a 64-wide hidden layer, a 16-way head) with cross entropy.
By default this is a lightning.pytorch Trainer on DDPStrategy(process_group_backend="gloo", timeout=
--pg-timeout); with --fabric 1 it is lightning.fabric.Fabric with the same strategy and a hand-written loop.
The net is initialised from ckpt/symnet.pt.  At train start the per-class counts are all_gathered, every
step the loss is reduced and the accuracy all_gathered before the progress line, and at the end the
framework saves the checkpoint export/symnet.ckpt (rank 0 writes).
Options: --fault NAME --rank R (-1 all), --steps, --pg-timeout, --devices W, --fabric 1, --prepare.

Faults:
  glyph       - rank N's shard has labels "\\aleph", missing from the symbol table: KeyError in the dataset, step 2
  strokeidx   - rank N looks up a 7-stroke glyph in the 6-entry stroke-order table at step 4 (IndexError)
  nofile      - rank N reads its shard from data/val/ which does not exist (FileNotFoundError in setup)
  ckptsize    - rank N initialises from ckpt/symnet_c40.pt (40 classes): load_state_dict size mismatch
  weightsonly - rank N loads ckpt/vocab_meta.pt, a pickled SymbolVocab object: torch.load weights_only refusal
  gathershape - rank N all_gathers its class counts with an extra "unknown" bin (17 vs 16 entries)
  slowaug     - rank N applies an elastic distortion in pure Python before the step-2 reduce (minutes)
  nanloss     - rank N's bounding boxes have zero width at step 1: inf pixels, the program's finite check
  sigkill     - rank N sends itself SIGKILL after step 3
  exit2       - rank N prints its own error line about an empty stroke file and calls sys.exit(2) at train start
  convwidth   - every rank renders glyphs at 28 px, the head expects 24 px features (shape error, step 0)
  none        - control, clean run

What happened (filled in after the runs):
  glyph       - KeyError: '\\aleph' in GlyphSet.__getitem__ fetching the step-2 batch; peers Connection closed by peer (np4 r2 fabric, np5 r0 own)
  strokeidx   - IndexError: list index out of range at step 4; five peers closed by peer (np6 r4 bashloop)
  nofile      - FileNotFoundError data/val/glyphs_3.pt in the setup hook; peers closed in the setup barrier (np5 r3 tee)
  ckptsize    - load_state_dict size mismatch head.weight [40,64] vs [16,64] in setup (np3 r0 own, np4 r3 torchrun)
  weightsonly - UnpicklingError 'Unsupported global: GLOBAL __main__.SymbolVocab' in setup (np4 r1 loglevel, np3 r2 bashloop)
  gathershape - a receiver aborts: gloo::EnforceNotMet 'Received data size doesn't match expected size' (68 vs 64); others reset
                by peer; loop exit 134 (np3 r2 bashloop), Lightning 'terminated with code -6', exit 137 (np4 r1 own)
  slowaug     - 12 s: peers 'Timed out waiting 12000ms', rank 1 SIGTERMed (np3 r1 torchrun); 300 s: silent after 'applying
                elastic distortion', killed at 60 s, exit 137 (np4 r2 tee; first try with 4000 passes finished cleanly and was
                dropped, the loop was raised to 400000 passes)
  nanloss     - '9216 non-finite pixels after bbox normalisation' then FloatingPointError at step 1 (np4 r1 fabric, np3 r0 loglevel)
  sigkill     - Root Cause local_rank 2 exitcode -9 (np5 r2 torchrun); own launcher: only peers' reset/closed errors (np3 r1 own)
  exit2       - the ERROR line and exit 2 at train start; Root Cause exitcode 2 (np3 r1 tee, np4 r3 fabric)
  convwidth   - every rank 'mat1 and mat2 shapes cannot be multiplied (16x784 and 576x64)' at step 0 (np3 loglevel)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/symnet.ckpt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault468_work"
SYMBOLS = ["0", "1", "2", "3", "+", "-", "=", "\\times", "\\div", "\\alpha", "\\beta", "\\pi",
           "\\sum", "\\int", "\\sqrt", "\\leq"]
SYM_INDEX = {s: i for i, s in enumerate(SYMBOLS)}
NCLS = len(SYMBOLS)
STROKE_ORDER = ["dot", "line", "hook", "loop", "cross", "arc"]
PIX = 24
NSAMP = 96
BATCH = 16


class SymbolVocab:
    """Vocabulary metadata object (pickled whole into ckpt/vocab_meta.pt)."""

    def __init__(self, symbols):
        self.symbols = list(symbols)
        self.version = 3


class SymNet(nn.Module):
    def __init__(self, ncls=NCLS, pix=PIX):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * (pix // 4) * (pix // 4), 64)
        self.head = nn.Linear(64, ncls)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.head(F.relu(self.fc(x.flatten(1))))


def prepare():
    g = torch.Generator().manual_seed(468)
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        lab = torch.randint(0, NCLS, (NSAMP,), generator=g)
        img = torch.rand(NSAMP, 1, PIX, PIX, generator=g)
        for i in range(NSAMP):  # a faint class-dependent stroke so the net can learn something
            img[i, 0, lab[i] % PIX, :] += 1.0
        wh = 4 + torch.randint(0, 16, (NSAMP, 2), generator=g)
        bbox = torch.cat([torch.zeros(NSAMP, 2, dtype=torch.long), wh], 1).float()
        strokes = torch.randint(1, 6, (NSAMP,), generator=g)
        torch.save({"img": img, "labels": [SYMBOLS[int(k)] for k in lab], "bbox": bbox, "strokes": strokes},
                   f"{WORK}/data/glyphs_{r}.pt")
    torch.manual_seed(0)
    torch.save(SymNet().state_dict(), f"{WORK}/ckpt/symnet.pt")
    torch.save(SymNet(ncls=40).state_dict(), f"{WORK}/ckpt/symnet_c40.pt")
    torch.save(SymbolVocab(SYMBOLS), f"{WORK}/ckpt/vocab_meta.pt")
    print("prepared", WORK)


class GlyphSet(Dataset):
    def __init__(self, rank, fault, frank):
        self.rank = rank
        bad = fault_on(fault, frank, rank)
        sub = "data/val" if (fault == "nofile" and bad) else "data"
        d = torch.load(f"{WORK}/{sub}/glyphs_{rank}.pt")
        self.img, self.labels, self.bbox, self.strokes = d["img"], d["labels"], d["bbox"], d["strokes"]
        if fault == "glyph" and bad:
            for i in range(2 * BATCH + 3, 2 * BATCH + 6):
                self.labels[i] = "\\aleph"
        if fault == "nanloss" and bad:
            self.bbox[BATCH:2 * BATCH, 2] = 0.0
        if fault == "strokeidx" and bad:
            self.strokes[4 * BATCH + 5] = 7
        self.pix = 28 if fault == "convwidth" else PIX

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.img[i]
        area = self.bbox[i, 2] * self.bbox[i, 3]
        x = x * (64.0 / area)
        if self.pix != PIX:
            x = F.interpolate(x[None], size=(self.pix, self.pix), mode="bilinear", align_corners=False)[0]
        y = SYM_INDEX[self.labels[i]]
        return x, y, self.strokes[i]


def fault_on(fault, frank, rank):
    return frank == -1 or frank == rank


def load_init(net, fault, frank, rank):
    bad = fault_on(fault, frank, rank)
    path = f"{WORK}/ckpt/symnet_c40.pt" if (fault == "ckptsize" and bad) else f"{WORK}/ckpt/symnet.pt"
    net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    if fault == "weightsonly" and bad:
        meta = torch.load(f"{WORK}/ckpt/vocab_meta.pt", map_location="cpu", weights_only=True)
        assert meta.symbols == SYMBOLS


def elastic_distort(x, rank):
    # pure-Python elastic distortion of every pixel of the batch, repeated: takes minutes
    vals = x.flatten().tolist()
    out = 0.0
    for rep in range(400000):
        for j, v in enumerate(vals):
            out += (v * 0.5 + j * 1e-6) ** 2 % 1.0
    return out


def step_faults(args, rank, step, x, strokes):
    bad = fault_on(args.fault, args.rank, rank)
    if not bad:
        return
    if args.fault == "nanloss":
        nbad = int((~torch.isfinite(x)).sum())
        if nbad:
            print(f"rank {rank} step {step}: {nbad} non-finite pixels after bbox normalisation "
                  f"(min bbox area {0.0:.1f})", flush=True)
            raise FloatingPointError(f"non-finite glyph batch on rank {rank} at step {step}")
    if args.fault == "strokeidx":
        for n in strokes.tolist():
            _ = STROKE_ORDER[n - 1]
    if args.fault == "slowaug" and step == 2:
        print(f"rank {rank} step {step}: applying elastic distortion", flush=True)
        elastic_distort(x, rank)


def after_step_faults(args, rank, step):
    if args.fault == "sigkill" and fault_on(args.fault, args.rank, rank) and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)


def start_faults(args, rank, gather, counts):
    bad = fault_on(args.fault, args.rank, rank)
    if args.fault == "exit2" and bad:
        print(f"ERROR rank {rank}: stroke file for glyph 17 has 0 strokes; refusing to train", flush=True)
        sys.exit(2)
    if args.fault == "gathershape" and bad:
        counts = torch.cat([counts, torch.zeros(1, dtype=counts.dtype)])
    allc = gather(counts)
    if rank == 0:
        print(f"class counts gathered: {tuple(allc.shape)} total {int(allc.sum())}", flush=True)


def class_counts(ds):
    return torch.bincount(torch.tensor([SYM_INDEX.get(l, 0) for l in ds.labels]), minlength=NCLS)


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class SymbolModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = SymNet()

        def setup(self, stage):
            self.ds = GlyphSet(self.global_rank, args.fault, args.rank)
            load_init(self.net, args.fault, args.rank, self.global_rank)

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=BATCH, shuffle=False, num_workers=0)

        def on_train_start(self):
            start_faults(args, self.global_rank, self.all_gather, class_counts(self.ds))

        def training_step(self, batch, idx):
            x, y, strokes = batch
            step_faults(args, self.global_rank, idx, x, strokes)
            logits = self.net(x)
            loss = F.cross_entropy(logits, y)
            acc = (logits.argmax(1) == y).float().mean()
            red = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
            accs = self.all_gather(acc)
            print(f"rank {self.global_rank} step {idx} loss {red.item():.4f} acc {accs.mean().item():.3f}",
                  flush=True)
            return loss

        def on_train_batch_end(self, outputs, batch, idx):
            after_step_faults(args, self.global_rank, idx)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strat,
                         max_steps=args.steps, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    model = SymbolModule()
    trainer.fit(model)
    trainer.save_checkpoint(f"{WORK}/export/symnet.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 done: {args.steps} steps, saved export/symnet.ckpt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strat)
    fabric.launch()
    rank = fabric.global_rank
    ds = GlyphSet(rank, args.fault, args.rank)
    net = SymNet()
    load_init(net, args.fault, args.rank, rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    dl = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH, shuffle=False), use_distributed_sampler=False)
    start_faults(args, rank, fabric.all_gather, class_counts(ds))
    for step, (x, y, strokes) in enumerate(dl):
        if step >= args.steps:
            break
        step_faults(args, rank, step, x, strokes)
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        red = fabric.all_reduce(loss.detach(), reduce_op="mean")
        accs = fabric.all_gather(acc)
        print(f"rank {rank} step {step} loss {red.item():.4f} acc {accs.mean().item():.3f}", flush=True)
        after_step_faults(args, rank, step)
    fabric.save(f"{WORK}/export/symnet_fabric.ckpt", {"model": net, "step": args.steps})
    if rank == 0:
        print(f"rank 0 done: {args.steps} steps, saved export/symnet_fabric.ckpt", flush=True)


def main():
    p = argparse.ArgumentParser(description="handwritten math symbol recogniser")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    torch.set_num_threads(1)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()

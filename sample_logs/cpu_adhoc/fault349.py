"""A three-hundred-and-forty-ninth hand-run batch: HANDWRITTEN LINE OCR WITH CTC (Lightning).

Synthetic handwritten text lines: every rank reads 48 grey line images (1x16x64) and their transcripts from
/tmp/fault349_work/lines/lines_R.pt, encodes the transcripts through a 30-character table (blank = 0), and
trains a small CRNN (two conv blocks, a projection of the 4x16 feature columns, a bidirectional GRU, a
31-class head) on the CTC loss.  The model starts from ckpt/crnn_c31.pt.  Written with lightning.pytorch:
the Trainer's DDPStrategy sets up gloo with the --pg-timeout timeout; --fabric 1 runs the same model under
lightning.fabric.Fabric with its own loop.  Every step the loss and the blank ratio of the greedy decoding
are reduced through the strategy (mean) and printed; at the end every rank calls save_checkpoint (rank 0
writes export/crnn.ckpt).
Options: --devices W (Lightning's own launcher starts ranks 1.. when no launcher env is set), --fabric 1.

Faults:
  glyph     - rank N's transcripts contain the glyph "ß" (item 20), missing from the charset table (KeyError)
  nolines   - rank N reads its lines from lines/val/ which does not exist (FileNotFoundError at setup)
  ckptsize  - rank N initialises from ckpt/crnn_c41.pt, saved with a 41-class head (size mismatch)
  pickled   - rank N initialises from ckpt/crnn_cfg.pt, which pickles an OCRConfig object (weights_only refusal)
  seqreduce - rank N also reduces its mean label length at step 2 (3 values against the others' 2)
  slowlex   - rank N builds a character-trigram lexicon in Python before the step-2 reduce (~40 s)
  stuck     - rank N waits forever for a lexicon server at step 3 (run with --pg-timeout 300, killed at 60 s)
  nanctc    - rank N's step-4 transcripts are 24 characters long for 16 frames: CTC loss inf, the program's check
  sigsegv   - rank N sends itself SIGSEGV after step 2
  exit4     - rank N prints its own error line about an empty decoding at the end of training and sys.exit(4)
  widthconv - every rank: line images are 24 pixels tall (6 feature rows), the projection expects 16 (4 rows)
  none      - control, clean run

What happened (filled in after the runs):
  glyph     - KeyError: 'ß' in LineDataset.__getitem__ via Lightning's fetcher after step 2; peers Connection closed by peer (np4 r2 torchrun)
  nolines   - FileNotFoundError for lines/val/lines_0.pt before any step; peers closed; outer timeout hit the slow exits, exit 124 (np4 r0 bashloop)
  ckptsize  - fabric.load: size mismatch for head.weight [41,64] vs [31,64] and head.bias; peers closed in its barrier (np3 r1 fabric)
  pickled   - UnpicklingError: Weights only load failed, Unsupported global __main__.OCRConfig, in setup; peers closed (np3 r0 torchrun)
  seqreduce - no size error: ranks 0/1 get a wrong step-2 mean, rank 2 'Timed out waiting 12000ms for recv'; Root Cause rank 1 (np3 r2 fabric)
  slowlex   - ranks 0/2 'Timed out waiting 12000ms' at the step-2 reduce; rank 1 SIGTERMed inside the loop; Root Cause rank 2 (np3 r1 torchrun)
  stuck     - silent after step 2; TERM at 60 s, torchrun SIGKILLed at 65 s, exit 137, workers left orphaned (np3 r1 tee)
  nanctc    - 'rank 0 step 4: CTC loss is inf (max label length 24 for 16 frames)', FloatingPointError; peers closed (np3 r0 own launcher)
  sigsegv   - no line from rank N after step 2; peers Connection closed/reset; Root Cause exitcode -11 (SIGSEGV) (np3 r1 loglevel, np5 r4 torchrun)
  exit4     - rank 2's ERROR line after step 6 and exit 4; peers closed in the barrier; Root Cause rank 2 exitcode 4 (np3 r2 tee)
  widthconv - every rank: 'mat1 and mat2 shapes cannot be multiplied (128x96 and 64x32)' in the first forward (np3 loglevel)
  none      - clean: 6 steps on 3 ranks, rank 0 saved export/crnn.ckpt, exit 0 (np3 bashloop)
"""
import argparse
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault349_work"
CHARS = "abcdefghijklmnopqrstuvwxyz '.,"
CHARSET = {c: i + 1 for i, c in enumerate(CHARS)}
NCLS = len(CHARSET) + 1
HEIGHT = 16
WIDTH = 64
FRAMES = WIDTH // 4
NLINES = 48
BATCH = 8


@dataclass
class OCRConfig:
    height: int = HEIGHT
    width: int = WIDTH
    charset: str = CHARS


class CRNN(nn.Module):
    def __init__(self, ncls=NCLS, rows=HEIGHT // 4):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.proj = nn.Linear(16 * rows, 32)
        self.rnn = nn.GRU(32, 32, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, ncls)

    def forward(self, x):
        f = self.conv(x)                                  # B, 16, H/4, W/4
        b, c, h, w = f.shape
        f = f.permute(0, 3, 1, 2).reshape(b, w, c * h)    # B, T, C*H
        y, _ = self.rnn(torch.relu(self.proj(f)))
        return self.head(y)                               # B, T, NCLS


def rand_text(rng, lo=3, hi=8):
    return "".join(rng.choice(CHARS[:26]) for _ in range(rng.randint(lo, hi)))


def prepare():
    rng = random.Random(349)
    g = torch.Generator().manual_seed(349)
    for sub in ("lines", "ckpt", "export"):
        os.makedirs(os.path.join(WORK, sub), exist_ok=True)
    for r in range(8):
        texts = [rand_text(rng) for _ in range(NLINES)]
        torch.save({"images": torch.rand(NLINES, 1, HEIGHT, WIDTH, generator=g), "texts": texts},
                   f"{WORK}/lines/lines_{r}.pt")
    torch.manual_seed(349)
    torch.save({"model": CRNN().state_dict()}, f"{WORK}/ckpt/crnn_c31.pt")
    torch.save({"model": CRNN(ncls=41).state_dict()}, f"{WORK}/ckpt/crnn_c41.pt")
    torch.save({"model": CRNN().state_dict(), "config": OCRConfig()}, f"{WORK}/ckpt/crnn_cfg.pt")
    print(f"prepared {WORK}: 8 line files, 3 checkpoints")


class LineDataset(Dataset):
    def __init__(self, path, rank, args):
        blob = torch.load(path, weights_only=True)
        self.images, self.texts = blob["images"], list(blob["texts"])
        if args.fault == "glyph" and args.rank in (rank, -1):
            self.texts[20] = "straße"
        if args.fault == "nanctc" and args.rank in (rank, -1):
            for i in range(24, 32):
                self.texts[i] = "the quick brown fox jump"
        if args.fault == "widthconv":
            self.images = F.interpolate(self.images, size=(24, WIDTH))

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        target = torch.tensor([CHARSET[c] for c in self.texts[i]], dtype=torch.long)
        return self.images[i], target


def collate(items):
    imgs = torch.stack([x for x, _ in items])
    lens = torch.tensor([len(t) for _, t in items], dtype=torch.long)
    return imgs, torch.cat([t for _, t in items]), lens


def lines_path(rank, args):
    sub = "lines/val" if args.fault == "nolines" and args.rank in (rank, -1) else "lines"
    return f"{WORK}/{sub}/lines_{rank}.pt"


def init_weights(model, rank, args, fabric=None):
    from lightning.fabric.utilities.cloud_io import _load as pl_load
    name = "crnn_c31.pt"
    if args.rank in (rank, -1):
        name = {"ckptsize": "crnn_c41.pt", "pickled": "crnn_cfg.pt"}.get(args.fault, name)
    path = f"{WORK}/ckpt/{name}"
    if fabric is not None and args.fault == "ckptsize":
        fabric.load(path, {"model": model})
        return
    blob = pl_load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(blob["model"])


def ctc_step(model, batch, rank, step, args):
    imgs, targets, tlens = batch
    logits = model(imgs)
    logp = logits.log_softmax(-1).permute(1, 0, 2)
    in_lens = torch.full((imgs.shape[0],), logits.shape[1], dtype=torch.long)
    loss = F.ctc_loss(logp, targets, in_lens, tlens, blank=0, reduction="mean")
    if not torch.isfinite(loss):
        print(f"rank {rank} step {step}: CTC loss is {loss.item()} (max label length {int(tlens.max())} "
              f"for {logits.shape[1]} frames)", flush=True)
        raise FloatingPointError(f"non-finite CTC loss on rank {rank} at step {step}")
    blank = (logits.argmax(-1) == 0).float().mean()
    return loss, blank, tlens


def before_reduce(rank, step, args, stats, tlens):
    if args.rank not in (rank, -1):
        return stats
    if args.fault == "seqreduce" and step == 2:
        return torch.cat([stats, tlens.float().mean().view(1)])
    if args.fault == "slowlex" and step == 2:
        t0, table, i = time.time(), {}, 0
        while time.time() - t0 < 40:
            for w in range(2000):
                key = (CHARS[i % 26], CHARS[w % 26], CHARS[(i + w) % 30])
                table[key] = table.get(key, 0) + 1
            i += 1
        print(f"rank {rank}: lexicon built, {len(table)} trigrams", flush=True)
    if args.fault == "stuck" and step == 3:
        threading.Event().wait()   # the lexicon server never answers
    return stats


def after_step(rank, step, args):
    if args.rank not in (rank, -1):
        return
    if args.fault == "sigsegv" and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)


def at_end(rank, args):
    if args.fault == "exit4" and args.rank in (rank, -1):
        print(f"ERROR rank {rank}: greedy decoding of the held-out lines is empty (48 of 48 all blank), "
              f"refusing to export", flush=True)
        sys.exit(4)


def make_loader(rank, args):
    return DataLoader(LineDataset(lines_path(rank, args), rank, args), batch_size=BATCH, shuffle=False,
                      collate_fn=collate, num_workers=0)


def run_trainer(args):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class LitOCR(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = CRNN()

        def setup(self, stage):
            init_weights(self.model, self.global_rank, args)

        def train_dataloader(self):
            return make_loader(self.global_rank, args)

        def training_step(self, batch, idx):
            loss, blank, tlens = ctc_step(self.model, batch, self.global_rank, idx + 1, args)
            return {"loss": loss, "blank": blank.detach(), "tlens": tlens}

        def on_train_batch_end(self, outputs, batch, idx):
            step, rank = idx + 1, self.global_rank
            stats = torch.stack([outputs["loss"].detach(), outputs["blank"]])
            stats = before_reduce(rank, step, args, stats, outputs["tlens"])
            red = self.trainer.strategy.reduce(stats, reduce_op="mean")
            print(f"rank {rank} step {step} loss {red[0].item():.4f} blank {red[1].item():.3f}", flush=True)
            after_step(rank, step, args)

        def on_train_end(self):
            at_end(self.global_rank, args)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(LitOCR())
    trainer.save_checkpoint(f"{WORK}/export/crnn.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 done: {args.steps} steps, saved export/crnn.ckpt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    model = CRNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    init_weights(model, rank, args, fabric=fabric)
    loader = fabric.setup_dataloaders(make_loader(rank, args), use_distributed_sampler=False)
    for idx, batch in enumerate(loader):
        step = idx + 1
        if step > args.steps:
            break
        opt.zero_grad()
        loss, blank, tlens = ctc_step(model, batch, rank, step, args)
        fabric.backward(loss)
        opt.step()
        stats = before_reduce(rank, step, args, torch.stack([loss.detach(), blank.detach()]), tlens)
        red = fabric.all_reduce(stats, reduce_op="mean")
        print(f"rank {rank} step {step} loss {red[0].item():.4f} blank {red[1].item():.3f}", flush=True)
        after_step(rank, step, args)
    at_end(rank, args)
    fabric.save(f"{WORK}/export/crnn_fabric.ckpt", {"model": model})
    if rank == 0:
        print(f"rank 0 done: {args.steps} steps, saved export/crnn_fabric.ckpt", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()

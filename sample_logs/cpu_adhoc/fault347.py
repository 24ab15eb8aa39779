"""A three-hundred-and-forty-seventh hand-run batch: SKETCH CLASSIFICATION FROM STROKE SEQUENCES.

Synthetic doodles as pen strokes: every point is (dx, dy, pen) where pen is a pen-state name ("down", "up",
"end") looked up in a 3-entry PEN table, one-hot encoded to 5 features.  Every rank reads its sketches from
/tmp/fault347_work/strokes/train_R.pt, builds a DataLoader that accelerate prepares (one shard per rank), and
trains a small GRU encoder + linear head over 10 sketch classes (cat, house, tree, ...) with cross entropy,
under Hugging Face accelerate (Accelerator(cpu=True), gloo, PG timeout from --pg-timeout).  The model is
initialised from ckpt/sketchgru_h32.pt.  Each step the loss is reduced (mean) and the per-rank accuracy is
gathered through accelerator.gather; rank 0 saves export/sketchgru.pt with accelerator.save at the end.
--hf 1 runs the same data through a transformers.Trainer (a tiny BERT built from a config over quantised
stroke tokens) with its own faults.

Faults:
  penstate   - rank N's sketches carry a pen state "hover" missing from the PEN table (KeyError, start-up)
  classidx   - rank N's labels use the 345-class QuickDraw ids: label 212 beyond 10 classes (IndexError, step 2)
  nostrokes  - rank N reads strokes/val/train_N.pt which does not exist (FileNotFoundError at start-up)
  ckptsize   - rank N initialises from ckpt/sketchgru_h48.pt (hidden 48 vs 32): load_state_dict size mismatch
  ckptpickle - rank N loads ckpt/sketchgru_meta.pt which pickles a StrokeConfig object: weights_only refusal
  accgather  - rank N gathers its per-class accuracy (10 values) instead of the overall one (1 value)
  rdp        - rank N simplifies every stroke with Ramer-Douglas-Peucker in pure Python before the step-2 reduce
  infscale   - rank N normalises by a bounding box of width 0: inf coordinates, the program's finiteness check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own error line about an empty sketch and calls sys.exit(4)
  featdim    - every rank: the encoder is built for 3 input features, the strokes have 5 (GRU shape error)
  hfcollate  - (--hf 1) rank N's collator pads the labels to the token length (ValueError in the loss)
  hfcallback - (--hf 1) a TrainerCallback on rank N raises RuntimeError at the end of step 3
  none       - control, clean run

What happened (filled in after the runs):
  penstate   - KeyError: 'hover' in encode() while loading, before any step; peers SIGTERMed, Root Cause rank 1 (np4 r1 torchrun)
  classidx   - 'IndexError: Target 266 is out of bounds.' at step 2 (np4 r0 acc); 'Target 17' (np3 r2 tee); peers Connection closed
  nostrokes  - FileNotFoundError strokes/val/train_2.pt at start-up; node 0's launcher names rank 1, a cascade (np4 r2 acc2nodes)
  ckptsize   - load_state_dict size mismatch [144, 5] vs [96, 5] ... at start-up (np3 r1 accdebug, np6 r4 torchrun)
  ckptpickle - UnpicklingError 'Weights only load failed' ... Unsupported global __main__.StrokeConfig (np4 r3 acc)
  accgather  - --debug: DistributedOperationException on every rank, 'Process 2: [10]' (np4 r2 accdebug); plain: rank 1 aborts gloo::EnforceNotMet '20 vs 2', SIGABRT Root Cause rank 1 (np3 r0 torchrun)
  rdp        - 12 s: rank 2 recv / rank 0 send 'Timed out waiting 12000ms', rank 1 silent (np3 r1 acc); 300 s: silent after step 1, killed at 60 s, SignalException, exit 124 (np4 r2 tee)
  infscale   - own check '960 non-finite stroke values', FloatingPointError at step 1 (np5 r0 accconfig, MULTI_GPU config on CPU)
  sigsegv    - no traceback after step 3; Root Cause rank 1 exitcode -11 (SIGSEGV) (np4 r1 acc2nodes, wrapper exit 127); Root Cause rank 2 -11 (np3 r2 tee)
  exit4      - rank 5's ERROR line, exit 4; Root Cause rank 5 exitcode 4, accelerate exits 1 (np6 r5 accdebug)
  featdim    - every rank 'input.size(-1) must be equal to input_size. Expected 3, got 5'; exit 127 from the wrapper (np4 all acc2nodes)
  hfcollate  - ValueError 'Expected input batch_size (8) to match target batch_size (200).' in the loss (np3 r1 hf, torchrun)
  hfcallback - RuntimeError 'StrokeBudget: rank 2 exceeded the stroke budget' after step 3 (np4 r2 hf, accelerate launch)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/sketchgru.pt, exit 0 (np3 acc)
  dropped    - MULTI_CPU config and the two-node form without --multi_gpu ran single processes that never joined a group
"""
import argparse
import math
import os
import signal
import sys
import time
from datetime import timedelta
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault347_work"
PEN = {"down": 0, "up": 1, "end": 2}
CLASSES = ["cat", "house", "tree", "car", "fish", "star", "clock", "bicycle", "flower", "sun"]
FEAT = 5
HID = 32
SEQ = 24


@dataclass
class StrokeConfig:
    hidden: int = HID
    feat: int = FEAT
    classes: int = len(CLASSES)


class SketchGRU(nn.Module):
    def __init__(self, feat=FEAT, hidden=HID, ncls=len(CLASSES)):
        super().__init__()
        self.gru = nn.GRU(feat, hidden, batch_first=True)
        self.head = nn.Linear(hidden, ncls)

    def forward(self, x):
        _, h = self.gru(x)
        return self.head(h[-1])


def make_sketches(n, seed, pen_bad=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        c = int(torch.randint(0, len(CLASSES), (1,), generator=g))
        pts = []
        for t in range(SEQ):
            ang = 2 * math.pi * t / SEQ * (c + 1)
            dx = math.cos(ang) + 0.1 * float(torch.randn(1, generator=g))
            dy = math.sin(ang) + 0.1 * float(torch.randn(1, generator=g))
            pen = "end" if t == SEQ - 1 else ("up" if t % 7 == 6 else "down")
            if pen_bad and t == 11 and i % 5 == 3:
                pen = "hover"
            pts.append((dx, dy, pen))
        out.append({"points": pts, "label": c, "label_qd": [17, 148, 301, 56, 118, 280, 74, 29, 212, 266][c]})
    return out


def encode(sk, scale=1.0):
    rows = []
    for dx, dy, pen in sk["points"]:
        oh = [0.0, 0.0, 0.0]
        oh[PEN[pen]] = 1.0
        rows.append([dx / scale, dy / scale] + oh)
    return torch.tensor(rows)


def prepare():
    os.makedirs(f"{WORK}/strokes", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(6):
        torch.save(make_sketches(48, 100 + r), f"{WORK}/strokes/train_{r}.pt")
        torch.save(make_sketches(48, 100 + r, pen_bad=True), f"{WORK}/strokes/train_{r}_hover.pt")
    torch.manual_seed(0)
    torch.save(SketchGRU().state_dict(), f"{WORK}/ckpt/sketchgru_h32.pt")
    torch.save(SketchGRU(hidden=48).state_dict(), f"{WORK}/ckpt/sketchgru_h48.pt")
    torch.save({"config": StrokeConfig(), "state": SketchGRU().state_dict()}, f"{WORK}/ckpt/sketchgru_meta.pt")
    print("prepared", WORK)


def rdp(points, eps):
    if len(points) < 3:
        return points
    (x0, y0), (x1, y1) = points[0], points[-1]
    best, idx = 0.0, 0
    for i in range(1, len(points) - 1):
        x, y = points[i]
        d = abs((y1 - y0) * x - (x1 - x0) * y + x1 * y0 - y1 * x0) / (math.hypot(x1 - x0, y1 - y0) + 1e-9)
        if d > best:
            best, idx = d, i
    if best > eps:
        return rdp(points[: idx + 1], eps)[:-1] + rdp(points[idx:], eps)
    return [points[0], points[-1]]


def run_accel(args):
    from accelerate import Accelerator, InitProcessGroupKwargs
    from torch.utils.data import DataLoader, TensorDataset

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo",
                                                                        timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    bad = args.fault_rank in (-1, rank)
    fault = args.fault if bad else "none"
    acc.print(f"sketch-gru: world {world}, {len(CLASSES)} classes, fault {args.fault} on rank {args.fault_rank}")

    path = f"{WORK}/strokes/train_{rank}.pt"
    if fault == "nostrokes":
        path = f"{WORK}/strokes/val/train_{rank}.pt"
    elif fault == "penstate":
        path = f"{WORK}/strokes/train_{rank}_hover.pt"
    sketches = torch.load(path)
    scale = 0.0 if fault == "infscale" else 1.0
    with torch.no_grad():
        xs = torch.stack([encode(s, scale) if fault != "infscale" else encode(s, 1.0) / scale for s in sketches])
    key = "label_qd" if fault == "classidx" else "label"
    ys = torch.tensor([s[key] for s in sketches])
    print(f"rank {rank} loaded {len(sketches)} sketches from {os.path.basename(path)}", flush=True)

    feat = 3 if fault == "featdim" else FEAT
    model = SketchGRU(feat=feat)
    ck = f"{WORK}/ckpt/sketchgru_h32.pt"
    if fault == "ckptsize":
        ck = f"{WORK}/ckpt/sketchgru_h48.pt"
    if fault == "ckptpickle":
        blob = torch.load(f"{WORK}/ckpt/sketchgru_meta.pt", weights_only=True)
        model.load_state_dict(blob["state"])
    elif fault != "featdim":
        model.load_state_dict(torch.load(ck, weights_only=True))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    dl = DataLoader(TensorDataset(xs, ys), batch_size=8, shuffle=False)
    model, opt, dl = acc.prepare(model, opt, dl)

    it = iter(dl)
    for step in range(1, args.steps + 1):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(dl)
            x, y = next(it)
        if fault == "classidx" and step == 1:
            y = y % len(CLASSES)
        if fault == "rdp" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < args.slow_s:
                for s in sketches:
                    pts = [(p[0] * k, p[1]) for k in range(1, 40) for p in s["points"]]
                    rdp(pts, 0.01)
                    n += 1
        if fault == "exit4" and step == 4:
            print(f"rank {rank} ERROR: sketch 37 has no strokes after simplification (0 points); aborting", flush=True)
            sys.exit(4)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            bad_n = int((~torch.isfinite(x)).sum())
            print(f"rank {rank} step {step}: non-finite loss {loss.item()} ({bad_n} non-finite stroke values)", flush=True)
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            pred = logits.argmax(1)
            if fault == "accgather" and step == 3:
                accv = torch.stack([(pred[y == c] == c).float().mean() if (y == c).any() else torch.tensor(0.0)
                                    for c in range(len(CLASSES))])
            else:
                accv = (pred == y).float().mean().reshape(1)
        mean_loss = acc.reduce(loss.detach(), reduction="mean")
        accs = acc.gather(accv)
        print(f"rank {rank} step {step} loss {mean_loss.item():.4f} acc {accs.mean().item():.3f}", flush=True)
        if fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/sketchgru.pt")
        print("rank 0 saved export/sketchgru.pt", flush=True)
    acc.end_training()


def run_hf(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    bad = args.fault_rank in (-1, rank)
    fault = args.fault if bad else "none"
    sketches = torch.load(f"{WORK}/strokes/train_{rank}.pt")

    def tokens(s):
        # quantise (dx, dy) into a 8x8 grid plus the pen state: 64*3 + 4 specials
        ids = [1]
        for dx, dy, pen in s["points"]:
            qx = min(7, max(0, int((dx + 1.2) / 2.4 * 8)))
            qy = min(7, max(0, int((dy + 1.2) / 2.4 * 8)))
            ids.append(4 + (qx * 8 + qy) * 3 + PEN[pen])
        return ids

    data = [{"input_ids": tokens(s), "label": s["label"]} for s in sketches]

    def collate(batch):
        ids = torch.tensor([b["input_ids"] for b in batch])
        labels = torch.tensor([b["label"] for b in batch])
        if fault == "hfcollate" and collate.calls >= 2:
            labels = labels[:, None].expand(-1, ids.shape[1]).contiguous()
        collate.calls += 1
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    collate.calls = 0

    class StrokeBudget(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            r = dist.get_rank() if dist.is_initialized() else 0
            print(f"rank {r} step {state.global_step} loss {state.log_history[-1]['loss'] if state.log_history else float('nan')} acc n/a", flush=True)
            if fault == "hfcallback" and state.global_step == 3:
                raise RuntimeError(f"StrokeBudget: rank {r} exceeded the stroke budget (24 points > 20) at step 3")

    cfg = BertConfig(vocab_size=4 + 64 * 3, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ + 2, num_labels=len(CLASSES))
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
                              disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collate, callbacks=[StrokeBudget()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/hf_sketch")
        print("rank 0 saved export/hf_sketch", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", dest="fault_rank", type=int, default=-2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=30.0)
    p.add_argument("--hf", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.hf:
        run_hf(args)
    else:
        run_accel(args)


if __name__ == "__main__":
    main()

"""A four-hundred-and-second hand-run batch: HANDWRITTEN LINE OCR WITH CTC.

Synthetic handwritten text lines: every rank reads its lines from /tmp/fault402_work/lines/lines_R.pt
(grey images 32 pixels high, 96 wide, with a transcript), maps every character of the transcript through a
28-entry charset table (a-z, space, apostrophe; 0 is the CTC blank), and trains a tiny CRNN (two conv
blocks that pool the height away, a bidirectional GRU over the columns, a linear head over 29 classes) with
CTC loss, under Hugging Face accelerate (Accelerator(cpu=True), gloo, timeout from --pg-timeout).  The model
starts from ckpt/crnn_c29.pt.  Line counts are gathered at the start, the loss and a greedy-decoding
character error rate (CER) are reduced every step, and rank 0 saves export/crnn.pt at the end through
accelerator.save.  --hf runs the same model under a transformers.Trainer (TrainingArguments(use_cpu=True,
ddp_backend="gloo", ddp_timeout=T, report_to=[])) with a collator and a CER callback.

Faults:
  glyph       - rank N's transcripts contain an accented 'é' that is not in the charset table (KeyError)
  nolines     - rank N reads its lines from lines/test/ which does not exist (FileNotFoundError at start-up)
  ckptvocab   - rank N initialises from ckpt/crnn_c41.pt, saved with a 41-class head (size mismatch)
  pickled     - rank N loads ckpt/crnn_meta.pt whose metadata holds a Charset object (weights_only refuses)
  gathershape - rank N gathers its per-line widths with one line more (9 vs 8) at step 2 (accelerator.gather)
  slowbeam    - rank N runs a pure-Python beam search over every line before the step-2 reduce
  ctcinf      - rank N's step-3 transcripts are longer than the 24 output columns: CTC loss inf, the program's check
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit3       - rank N prints its own error line about an empty transcript and calls sys.exit(3)
  featheight  - every rank: lines are scanned 48 high, the GRU expects 32/4*16 features (shape error)
  hfcollate   - (--hf) rank N's collator pads one line to 112 columns at step 3: torch.stack fails
  hfcallback  - (--hf) rank N's CER callback reads a 'cer' key the step-end metrics do not have (KeyError)
  none        - control, clean run

What happened (filled in after the runs):
  glyph       - rank N KeyError: 'é' in the charset lookup at step 1; peers Connection closed by peer (np5 r0 torchrun)
  nolines     - FileNotFoundError for lines/test/lines_N.pt before the first gather; peers closed (np4 r2 accconfig, np4 r3 acc2nodes)
  ckptvocab   - load_state_dict size mismatch for head.weight/head.bias [41,48] vs [29,48]; others SIGTERMed (np3 r2 tee)
  pickled     - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.Charset' (np4 r1 acc, np5 r0 torchrun)
  gathershape - --debug: every rank DistributedOperationException, Process 1: [9] (np3 r1 accdebug); plain: gloo EnforceNotMet
                'Received data size doesn't match', Root Cause rank 4 SIGABRT, others Connection reset (np5 r3 acc)
  slowbeam    - 12 s: ranks 0/1 'Timed out waiting 12000ms' (np3 r2 torchrun); 300 s: silent after the beam-search line, killed at 60 s, exit 124 (np4 r1 acc)
  ctcinf      - the check prints 'non-finite CTC loss inf at step 3' and raises FloatingPointError (np3 r0 accconfig, np6 r4 tee)
  sigsegv     - no traceback; Root Cause rank N exitcode -11 SIGSEGV (np4 r2 accdebug, np4 r1 acc2nodes)
  exit3       - rank N's empty-transcript ERROR line and exit 3; Root Cause rank 4 exitcode 3 (np5 r4 accconfig); Root Cause rank 0 SIGABRT
                after 'terminate called without an active exception', rank N listed as -15 (np3 r1 tee)
  featheight  - every rank: 'input.size(-1) must be equal to input_size. Expected 128, got 192'; Root Cause rank 0 (np3 torchrun)
  hfcollate   - Trainer: rank 1's collator 'stack expects each tensor to be equal size ... [1, 32, 112]'; peers closed (np3 r1 hf, accelerate launch)
  hfcallback  - Trainer: rank 0's callback on_step_end KeyError: 'cer' after step 4; peers closed (np4 r0 hf, torchrun)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/crnn.pt, exit 0 (np3 acc)
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

WORK = "/tmp/fault402_work"
CHARSET = "abcdefghijklmnopqrstuvwxyz '"
TABLE = {c: i + 1 for i, c in enumerate(CHARSET)}
NCLS = len(CHARSET) + 1
H, W = 32, 96
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "ink", "pen", "line"]


class Charset:
    def __init__(self, chars):
        self.chars = chars


class CRNN(nn.Module):
    def __init__(self, ncls=NCLS, height=H):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.rnn = nn.GRU(16 * (height // 4), 24, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, ncls)

    def forward(self, x, feat_h=H):
        h = F.max_pool2d(torch.relu(self.c1(x)), 2)
        h = F.max_pool2d(torch.relu(self.c2(h)), 2)      # B,16,H/4,W/4
        b, c, hh, ww = h.shape
        h = h.permute(0, 3, 1, 2).reshape(b, ww, c * hh)
        h, _ = self.rnn(h)
        return self.head(h).log_softmax(-1)               # B,T,C


def make_lines(n, seed, height=H):
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n):
        k = int(torch.randint(1, 3, (1,), generator=g))
        text = " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))[:16]
        img = torch.rand(1, height, W, generator=g) * 0.3
        lines.append({"image": img, "text": text})
    return lines


def prepare(world):
    os.makedirs(f"{WORK}/lines", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        torch.save(make_lines(48, 100 + r), f"{WORK}/lines/lines_{r}.pt")
        torch.save(make_lines(48, 100 + r, height=48), f"{WORK}/lines/lines48_{r}.pt")
    torch.manual_seed(0)
    torch.save(CRNN().state_dict(), f"{WORK}/ckpt/crnn_c29.pt")
    torch.save(CRNN(ncls=41).state_dict(), f"{WORK}/ckpt/crnn_c41.pt")
    torch.save({"model": CRNN().state_dict(), "charset": Charset(CHARSET)}, f"{WORK}/ckpt/crnn_meta.pt")
    print(f"prepared {WORK}", flush=True)


def encode(text):
    return [TABLE[c] for c in text]


def batch_of(lines, step, bs, rank, fault, bad):
    sel = [lines[(step * bs + i) % len(lines)] for i in range(bs)]
    imgs = torch.stack([l["image"] for l in sel])
    texts = [l["text"] for l in sel]
    if bad and fault == "glyph" and step == 1:
        texts[2] = texts[2].replace("e", "é") + " café"
    if bad and fault == "ctcinf" and step == 3:
        texts = [(t + " ") * 4 for t in texts]
    if bad and fault == "exit3" and step == 2:
        texts[5] = ""
    return imgs, texts


def greedy_cer(logp, texts):
    best = logp.argmax(-1)
    errs, total = 0, 0
    for row, t in zip(best.tolist(), texts):
        out, prev = [], 0
        for c in row:
            if c != prev and c != 0:
                out.append(CHARSET[c - 1])
            prev = c
        hyp = "".join(out)
        errs += sum(1 for a, b in zip(hyp, t) if a != b) + abs(len(hyp) - len(t))
        total += max(len(t), 1)
    return errs / total


def beam_search(logp, width=6):
    beams = [((), 0.0)]
    for t in range(logp.shape[0]):
        cand = {}
        for seq, sc in beams:
            for c in range(logp.shape[1]):
                ns = seq + (c,) if c != 0 and (not seq or seq[-1] != c) else seq
                cand[ns] = max(cand.get(ns, -1e9), sc + float(logp[t, c]))
        beams = sorted(cand.items(), key=lambda kv: -kv[1])[:width]
    return beams[0][0]


def train(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    bad = args.fault != "none" and (args.rank == -1 or args.rank == rank)
    height = 48 if args.fault == "featheight" else H
    print(f"rank {rank}/{world} pid {os.getpid()} device {acc.device} fault {args.fault if bad else 'none'}", flush=True)

    src = f"{WORK}/lines/test/lines_{rank}.pt" if bad and args.fault == "nolines" else (
        f"{WORK}/lines/lines48_{rank}.pt" if height == 48 else f"{WORK}/lines/lines_{rank}.pt")
    lines = torch.load(src)
    counts = acc.gather(torch.tensor([len(lines)]))
    if rank == 0:
        print(f"lines per rank: {counts.tolist()}", flush=True)

    torch.manual_seed(0)
    model = CRNN()
    if bad and args.fault == "ckptvocab":
        sd = torch.load(f"{WORK}/ckpt/crnn_c41.pt")
    elif bad and args.fault == "pickled":
        sd = torch.load(f"{WORK}/ckpt/crnn_meta.pt")["model"]
    else:
        sd = torch.load(f"{WORK}/ckpt/crnn_c29.pt")
    model.load_state_dict(sd)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=False)

    for step in range(args.steps):
        imgs, texts = batch_of(lines, step, 8, rank, args.fault, bad)
        if any(len(t) == 0 for t in texts):
            print(f"[rank {rank}] ERROR: empty transcript in batch {step} of {src}; "
                  f"refusing to train CTC on a line with no target", file=sys.stderr, flush=True)
            sys.exit(3)
        targets = torch.tensor([i for t in texts for i in encode(t)])
        tlens = torch.tensor([len(t) for t in texts])
        logp = model(imgs)
        T = logp.shape[1]
        loss = ctc(logp.transpose(0, 1), targets, torch.full((len(texts),), T), tlens)
        if not torch.isfinite(loss):
            over = int((tlens > T).sum())
            print(f"[rank {rank}] non-finite CTC loss {loss.item()} at step {step}: {over} of {len(texts)} "
                  f"targets longer than {T} output columns", flush=True)
            raise FloatingPointError(f"CTC loss is {loss.item()} on rank {rank} at step {step}")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if bad and args.fault == "slowbeam" and step == 2:
            print(f"[rank {rank}] rescoring batch {step} with beam search (width 6)", flush=True)
            t0 = time.time()
            while time.time() - t0 < 400:
                for row in logp.detach():
                    beam_search(row)
        cer = torch.tensor([greedy_cer(logp.detach(), texts)])
        if bad and args.fault == "gathershape" and step == 2:
            widths = torch.tensor([W] * 9)
        else:
            widths = torch.tensor([W] * 8)
        acc.gather(widths)
        red = acc.reduce(torch.stack([loss.detach(), cer[0]]), reduction="mean")
        print(f"rank {rank} step {step} loss {red[0].item():.4f} cer {red[1].item():.3f}", flush=True)
        if bad and args.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/crnn.pt")
        print(f"rank 0 saved {WORK}/export/crnn.pt", flush=True)
    acc.end_training()


class HFCRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.crnn = CRNN()
        self.ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    def forward(self, pixel_values, labels, label_lengths):
        logp = self.crnn(pixel_values)
        T = logp.shape[1]
        loss = self.ctc(logp.transpose(0, 1), labels, torch.full((logp.shape[0],), T), label_lengths)
        return {"loss": loss, "logits": logp}


def train_hf(args):
    from transformers import Trainer, TrainerCallback, TrainingArguments
    rank = int(os.environ.get("RANK", "0"))
    bad = args.fault != "none" and (args.rank == -1 or args.rank == rank)
    lines = torch.load(f"{WORK}/lines/lines_{rank}.pt")
    calls = {"n": 0}

    def collate(items):
        calls["n"] += 1
        imgs = [it["image"] for it in items]
        if bad and args.fault == "hfcollate" and calls["n"] == 3:
            imgs[1] = F.pad(imgs[1], (0, 16))
        labels = torch.tensor([i for it in items for i in encode(it["text"])])
        return {"pixel_values": torch.stack(imgs), "labels": labels,
                "label_lengths": torch.tensor([len(it["text"]) for it in items])}

    class CERCallback(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            metrics = {"loss": state.log_history[-1]["loss"] if state.log_history else None}
            if bad and args.fault == "hfcallback" and state.global_step == 4:
                print(f"rank {rank} CER monitor at step {state.global_step}: {metrics['cer']:.3f}", flush=True)
            print(f"rank {rank} step {state.global_step} loss {metrics['loss']}", flush=True)

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                              remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
    model = HFCRNN()
    model.crnn.load_state_dict(torch.load(f"{WORK}/ckpt/crnn_c29.pt"))
    trainer = Trainer(model=model, args=targs, train_dataset=lines, data_collator=collate,
                      callbacks=[CERCallback()])
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save(model.state_dict(), f"{WORK}/export/crnn_hf.pt")
        print(f"rank 0 saved {WORK}/export/crnn_hf.pt", flush=True)


def main():
    p = argparse.ArgumentParser(description="handwritten line OCR with CTC (accelerate)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare(8)
        return
    if args.hf:
        train_hf(args)
    else:
        train(args)


if __name__ == "__main__":
    main()

"""A four-hundred-and-forty-first hand-run batch: RECEIPT OCR LINE RECOGNITION (Hugging Face accelerate).

Synthetic receipt lines: each line is a 16x64 grey crop of a printed receipt line ("TOTAL 12.50", "MILK 2X
1.99") rendered as per-character column stripes, with its transcription.  Every rank reads its lines from
/tmp/fault441_work/shards/lines_R.pt, encodes the text through a 40-entry charset table, and trains a small
CRNN (two conv blocks, a column-wise linear, a CTC head) with CTC loss under an `Accelerator(cpu=True)`
whose gloo process group is set up through InitProcessGroupKwargs(timeout=--pg-timeout).  The model is
initialised from ckpt/crnn_c41.pt (40 characters + blank).  The loss is reduced with accelerator.reduce and
each rank's per-line decoded lengths are accelerator.gather'ed every step (the metric is the mean length
error); rank 0 saves export/crnn.pt with accelerator.save at the end.
Options: --trainer 1 runs the same data through a transformers.Trainer (a tiny BertForTokenClassification
built from a config, one label per pixel column) instead of the accelerate loop.

Faults:
  currency   - rank N's receipts print totals with a euro sign; "\u20ac" is not in the charset table (KeyError in the
               Dataset, raised through the prepared DataLoader)
  nolines    - rank N reads its lines from shards/test/, which does not exist (FileNotFoundError at start-up)
  ckptvocab  - rank N initialises from ckpt/crnn_c97.pt, saved with a 97-class head (size mismatch)
  ckptpickle - rank N initialises from ckpt/crnn_meta.pt, which pickles a CharsetInfo object (weights_only refusal)
  lenshape   - rank N gathers its decoded lengths plus one padding entry (5 vs 4 entries in accelerator.gather)
  deskew     - rank N deskews every crop pixel by pixel in Python before the step-2 gather (slow rank)
  blankcrop  - rank N's crops after step 2 are all zero; per-line contrast normalisation gives 0/0 and the
               program's finiteness check raises FloatingPointError
  sigsegv    - rank N sends itself SIGSEGV after step 2
  exit5      - after the last step rank N prints its own error line about the character error rate audit and
               calls sys.exit(5)
  imgheight  - every rank renders 24-pixel-high crops; the column linear expects 16-pixel crops (shape error)
  hfcollate  - (--trainer 1) rank N's collator meets a zero-width crop and raises ValueError at its 3rd batch
  hfcallback - (--trainer 1) rank N's CER-audit TrainerCallback raises RuntimeError at the end of step 3
  none       - control, clean run

What happened (filled in after the runs):
  currency   - KeyError: '\u20ac' in ReceiptLines.__getitem__ through the prepared DataLoader at the first batch; peers
               Connection closed (np4 r2 acc, np5 r0 torchrun)
  nolines    - FileNotFoundError for shards/test/lines_N.pt at start-up; peers SIGTERMed (np3 r1 accconfig, np6 r4 tee)
  ckptvocab  - load_state_dict size mismatch for head.weight [97, 32] vs [41, 32] (np4 r3 acc2nodes, np3 r0 torchrun)
  ckptpickle - UnpicklingError 'Weights only load failed' ... Unsupported global __main__.CharsetInfo (np5 r2 accconfig)
  lenshape   - debug mode: every rank DistributedOperationException, 'Process 1: [5]' (np4 r1 accdebug); without
               debug: rank 0 aborts on gloo 'Received data size doesn't match expected size' (10 vs 8), SIGABRT
               Root Cause rank 0, the faulty rank 2 Connection reset (np3 r2 acc)
  deskew     - 12 s: ranks 0/2 'Timed out waiting 12000ms' in the step-2 gather (np3 r1 torchrun); 300 s: silent
               after 'rank 2 deskewing', killed at 60 s, exit 124 (np4 r2 accdebug)
  blankcrop  - '4096 non-finite pixels after contrast normalisation', FloatingPointError at step 3; peers closed
               (np5 r3 tee, np4 r0 acc2nodes: node 1's Root Cause names rank 3)
  sigsegv    - no traceback after step 2; Root Cause exitcode -11 (SIGSEGV) (np6 r2 acc, np3 r1 accconfig)
  exit5      - rank N's CER audit ERROR line after step 6 and exit 5; peers closed in wait_for_everyone
               (np4 r1 accdebug, np5 r0 tee)
  imgheight  - every rank: 'mat1 and mat2 shapes cannot be multiplied (64x96 and 64x32)' (np3 accconfig)
  hfcollate  - ValueError from the collator on rank 1 after step 1; peers closed (np4 r1 hf, accelerate launch)
  hfcallback - RuntimeError from CerAudit.on_step_end on rank 2 at step 3; peers closed (np3 r2 hf, torchrun)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/crnn.pt, exit 0 (np3 acc)
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

WORK = "/tmp/fault441_work"
CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,X"[:39] + "-"
CHARSET = {c: i + 1 for i, c in enumerate(CHARS)}  # 0 is the CTC blank
NCLS = len(CHARSET) + 1
H, W = 16, 64
ITEMS = ["MILK", "BREAD", "EGGS", "TEA", "SOAP", "RICE", "TOTAL", "CASH", "TAX", "CHANGE"]


class CharsetInfo:
    def __init__(self, chars):
        self.chars = chars


def render(text, h, g):
    img = torch.zeros(h, W)
    for i, c in enumerate(text[: W // 4]):
        v = (CHARSET.get(c, 1) % 7 + 1) / 8.0
        img[:, i * 4:i * 4 + 3] = v
    return (img + 0.05 * torch.rand(h, W, generator=g)).clamp(0, 1)


def make_lines(n, seed, h=H):
    g = torch.Generator().manual_seed(seed)
    texts, imgs = [], []
    for _ in range(n):
        item = ITEMS[int(torch.randint(0, len(ITEMS), (1,), generator=g))]
        price = f"{int(torch.randint(0, 40, (1,), generator=g))}.{int(torch.randint(10, 99, (1,), generator=g))}"
        t = f"{item} {price}"
        texts.append(t)
        imgs.append(render(t, h, g))
    return {"images": (torch.stack(imgs) * 255).to(torch.uint8), "texts": texts}


class CRNN(nn.Module):
    def __init__(self, ncls=NCLS, h=H):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.col = nn.Linear(16 * (h // 4), 32)
        self.head = nn.Linear(32, ncls)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)  # B,16,H/4,W/4
        b, c, hh, ww = x.shape
        x = x.permute(0, 3, 1, 2).reshape(b, ww, c * hh)
        return self.head(F.relu(self.col(x))).log_softmax(-1)  # B,T,C


class ReceiptLines(Dataset):
    def __init__(self, data, fault_here, fault):
        self.imgs = data["images"].float() / 255.0
        self.texts = list(data["texts"])
        if fault_here and fault == "currency":
            self.texts = [t + "\u20ac" if t.startswith("TOTAL") or i % 3 == 0 else t for i, t in enumerate(self.texts)]

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        t = self.texts[i]
        ids = [CHARSET[c] for c in t]
        lab = torch.zeros(12, dtype=torch.long)
        lab[: len(ids)] = torch.tensor(ids)
        return self.imgs[i].unsqueeze(0), lab, len(ids)


def greedy_lengths(logp):
    best = logp.argmax(-1)
    keep = (best != 0) & torch.cat([torch.ones_like(best[:, :1], dtype=torch.bool), best[:, 1:] != best[:, :-1]], 1)
    return keep.sum(1).float()


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/shards_h24", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_lines(48, 300 + r), f"{WORK}/shards/lines_{r}.pt")
        torch.save(make_lines(48, 300 + r, h=24), f"{WORK}/shards_h24/lines_{r}.pt")
    torch.manual_seed(0)
    torch.save(CRNN().state_dict(), f"{WORK}/ckpt/crnn_c41.pt")
    torch.save(CRNN(97).state_dict(), f"{WORK}/ckpt/crnn_c97.pt")
    torch.save({"model": CRNN().state_dict(), "charset": CharsetInfo(CHARS)}, f"{WORK}/ckpt/crnn_meta.pt")
    print(f"prepared {WORK}")


def deskew(imgs, rank, limit):
    print(f"rank {rank} deskewing {imgs.shape[0]} crops pixel by pixel", flush=True)
    t0 = time.time()
    for b in range(imgs.shape[0]):
        for y in range(imgs.shape[2] * 90):  # 90 candidate angles per row
            y = y % imgs.shape[2]
            row = imgs[b, 0, y].tolist()
            _ = sum(v * (y - 8) for v in row)
            time.sleep(0.02)
            if time.time() - t0 > limit:
                return


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    here = args.rank in (-1, rank)
    print(f"rank {rank}/{world} up ({acc.distributed_type}, backend {acc.state.backend})", flush=True)
    torch.manual_seed(1)

    shard_dir = "shards"
    if args.fault == "nolines" and here:
        shard_dir = "shards/test"
    if args.fault == "imgheight":
        shard_dir = "shards_h24"
    data = torch.load(f"{WORK}/{shard_dir}/lines_{rank}.pt")
    ds = ReceiptLines(data, here, args.fault)
    loader = DataLoader(ds, batch_size=4, shuffle=True, drop_last=True)

    model = CRNN()
    ck = "crnn_c41.pt"
    if args.fault == "ckptvocab" and here:
        ck = "crnn_c97.pt"
    if args.fault == "ckptpickle" and here:
        ck = "crnn_meta.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}", weights_only=True)
    if "model" in state:
        state = state["model"]
    model.load_state_dict(state)
    print(f"rank {rank} initialised from ckpt/{ck}", flush=True)

    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    model, opt, loader = acc.prepare(model, opt, loader)
    ctc = nn.CTCLoss(blank=0, zero_infinity=False)

    step = 0
    while step < args.steps:
        for imgs, labs, lens in loader:
            step += 1
            if args.fault == "blankcrop" and here and step >= 3:
                imgs = torch.zeros_like(imgs)
            mu = imgs.mean(dim=(2, 3), keepdim=True)
            sd = imgs.std(dim=(2, 3), keepdim=True)
            x = (imgs - mu) / sd
            bad = (~torch.isfinite(x)).sum().item()
            if bad:
                print(f"rank {rank}: {bad} non-finite pixels after contrast normalisation (min std {sd.min().item():.3f})",
                      flush=True)
                raise FloatingPointError(f"non-finite line crops at step {step} on rank {rank}")
            logp = model(x)
            T = logp.shape[1]
            loss = ctc(logp.transpose(0, 1), labs, torch.full((logp.shape[0],), T, dtype=torch.long), lens)
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            if args.fault == "deskew" and here and step == 2:
                deskew(imgs, rank, 600)
            dl = greedy_lengths(logp.detach())
            if args.fault == "lenshape" and here and step == 2:
                dl = torch.cat([dl, torch.zeros(1)])
            all_dl = acc.gather(dl)
            mean_loss = acc.reduce(loss.detach(), reduction="mean")
            len_err = (all_dl[: len(dl)] - lens.float()).abs().mean().item()
            print(f"rank {rank} step {step} loss {mean_loss.item():.4f} len_err {len_err:.3f} gathered {all_dl.numel()}",
                  flush=True)
            if args.fault == "sigsegv" and here and step == 2:
                print(f"rank {rank} entering native line decoder", flush=True)
                os.kill(os.getpid(), signal.SIGSEGV)
            if step >= args.steps:
                break

    if args.fault == "exit5" and here:
        print(f"ERROR rank {rank}: CER audit failed: 7 of 12 held-out TOTAL lines misread ('.' read as ','); "
              f"refusing to export the recogniser", flush=True)
        sys.exit(5)
    acc.wait_for_everyone()
    if acc.is_main_process:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/crnn.pt")
        print(f"rank 0 saved {WORK}/export/crnn.pt", flush=True)
    acc.end_training()


def run_trainer(args):
    from transformers import (BertConfig, BertForTokenClassification, Trainer, TrainerCallback,
                              TrainingArguments)
    from transformers.trainer_utils import set_seed

    rank = int(os.environ.get("RANK", "0"))
    here = args.rank in (-1, rank)
    set_seed(1)
    data = torch.load(f"{WORK}/shards/lines_{rank}.pt")
    imgs = data["images"].float() / 255.0

    class ColumnLines(Dataset):
        def __len__(self):
            return imgs.shape[0]

        def __getitem__(self, i):
            col = (imgs[i].mean(0) * 31).long().clamp(0, 31)  # one token per pixel column
            text = data["texts"][i]
            lab = torch.full((W,), -100, dtype=torch.long)
            for k, c in enumerate(text[: W // 4]):
                lab[k * 4] = CHARSET[c]
            return {"input_ids": col, "labels": lab, "width": W}

    calls = {"n": 0}

    def collate(feats):
        calls["n"] += 1
        if args.fault == "hfcollate" and here and calls["n"] == 3:
            feats[1]["width"] = 0
        for f in feats:
            if f["width"] <= 0:
                raise ValueError(f"collate_lines: crop of width {f['width']} in batch {calls['n']} on rank {rank}; "
                                 f"cannot build a column sequence")
        return {"input_ids": torch.stack([f["input_ids"] for f in feats]),
                "labels": torch.stack([f["labels"] for f in feats])}

    class CerAudit(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            print(f"rank {rank} step {state.global_step} cer-audit ok", flush=True)
            if args.fault == "hfcallback" and here and state.global_step == 3:
                raise RuntimeError(f"CerAudit: CER 0.91 at step 3 on rank {rank} exceeds the 0.60 ceiling")

    cfg = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=W, num_labels=NCLS)
    model = BertForTokenClassification(cfg)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                              remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
    tr = Trainer(model=model, args=targs, train_dataset=ColumnLines(), data_collator=collate,
                 callbacks=[CerAudit()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/hf_tagger")
        print(f"rank 0 saved {WORK}/export/hf_tagger", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--trainer", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.trainer:
        run_trainer(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()

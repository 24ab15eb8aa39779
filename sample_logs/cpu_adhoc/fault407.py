"""A four-hundred-and-seventh hand-run batch: CODE LANGUAGE IDENTIFICATION FROM SNIPPETS.

Synthetic source snippets in 8 languages (python, javascript, c, rust, go, java, ruby, haskell) are written
once by --prepare under /tmp/fault407_work: one shard per rank (data/snippets_R.pt, a list of (text, language)
pairs), a hard-cases file, and initial checkpoints.  Snippets are encoded per character (printable ASCII plus
newline, 97 ids, unknown characters to id 1) and padded to 64.  The model is a char CNN (embedding plus a
learned position table, a 5-wide Conv1d, max over time, a linear head over 8 languages), trained with
Hugging Face accelerate (Accelerator(cpu=True), InitProcessGroupKwargs(backend="gloo", timeout=--pg-timeout)).
The model and optimiser go through accelerator.prepare (DDP over gloo), the shard's DataLoader too; each step
the loss is accelerator.reduce'd and the per-language correct counts accelerator.gather'ed before the
progress line; rank 0 saves export/langid.pt with accelerator.save at the end.
--hf runs the loop as a transformers.Trainer instead (a 1-layer BertForSequenceClassification built from a
config, no download), with its own faults.

Faults (--fault NAME --rank R, R=-1 for every rank):
  langkey     - rank R's shard is relabelled from file extensions: a '.kt' snippet becomes 'kotlin', which is
                not in the language table (KeyError in the collate function, first step)
  charidx     - at step 3 rank R mixes in the hard-cases file with the raw encoder (no unknown fallback):
                'λ' becomes id 924 (IndexError in the embedding)
  noshard     - rank R reads its shard from data/test/ which does not exist (FileNotFoundError, start-up)
  ckptsize    - rank R initialises from ckpt/langid_10.pt, saved with 10 languages (size mismatch, start-up)
  ckptpickle  - at the end rank R reloads ckpt/langid_full.pt (a pickled LangMeta object) with torch.load's
                default weights_only=True (UnpicklingError)
  gathershape - from step 2 rank R gathers 9 per-language counts (an extra 'other' bucket) instead of 8
  slowtok     - before step 2 rank R re-tokenises its shard in pure Python for pg-timeout+15 s
                (12 s: the peers' collective times out; 300 s: a hang, killed by timeout at 60 s)
  nanloss     - from step 4 rank R weights the loss by 1/count per language; rust has count 0 in its
                shard, the weight is inf, the program's own finiteness check raises FloatingPointError
  segv        - rank R sends itself SIGSEGV after step 2
  exit4       - at the end rank R's class-coverage check prints its own ERROR line and calls sys.exit(4)
  maxlen      - every rank pads snippets to 80 while the position table has 64 rows (shape error, step 1)
  hfcollate   - (--hf) rank R's collator drops the last label of its third batch (batch size mismatch)
  hfcallback  - (--hf) rank R's coverage callback divides by the number of predicted languages, 0 at step 3
                (ZeroDivisionError in on_step_end)
  none        - control, clean run

What happened (filled in after the runs):
  langkey     - rank N: "KeyError: 'kotlin'" in collate on the first batch; peers Connection closed (np4 r1 acc, np5 r0 torchrun)
  charidx     - rank N: 'IndexError: index out of range in self' at step 3; peers closed (np3 r2 tee; np4 r3 accconfig,
                where a peer's 'terminate called without an active exception' made the Root Cause rank 2 SIGABRT)
  noshard     - FileNotFoundError data/test/snippets_N.pt at start-up (np4 r1 acc2nodes, np4 r2 accconfig)
  ckptsize    - load_state_dict size mismatch head.weight [10,48] vs [8,48] at start-up (np3 r1 torchrun)
  ckptpickle  - after 6 clean steps: UnpicklingError 'Weights only load failed ... __main__.LangMeta' (np5 r4 acc,
                np4 r0 accdebug); peers closed in the final gather
  gathershape - --debug: every rank DistributedOperationException with 'Process 2: [9]' (np4 r2 accdebug); without it
                rank 1 aborts on gloo::EnforceNotMet 'Received data size doesn't match', SIGABRT (np3 r0 torchrun)
  slowtok     - 12 s: 'Timed out waiting 12000ms for send/recv' on ranks 0 and 2, rank 1 silent (np3 r1 acc);
                300 s: no output after step 1, SIGTERM at 60 s, exit 124 (np4 r2 tee)
  nanloss     - 'FloatingPointError: rank 3: non-finite loss inf at step 4' (np6 r3 accdebug)
  segv        - no traceback after step 2; Root Cause rank 2 exitcode -11 (SIGSEGV) (np4 r2 acc2nodes)
  exit4       - rank 2's ERROR coverage line after step 6, Root Cause exitcode 4 (np3 r2 accconfig; the first try with
                a MULTI_CPU config failed before the fault, in accelerate's simple launcher, and was dropped)
  maxlen      - every rank: 'The size of tensor a (80) must match the size of tensor b (64)'; Root Cause rank 0 (np3 tee)
  hfcollate   - Trainer: rank 1 'ValueError: Expected input batch_size (8) to match target batch_size (7).' at step 3 (np4 hf)
  hfcallback  - Trainer: rank 2 ZeroDivisionError in on_step_end at step 3 (np3 hf, torchrun)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/langid.pt, exit 0 (np3 acc)
"""
import argparse
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

WORK = "/tmp/fault407_work"
LANGS = ["python", "javascript", "c", "rust", "go", "java", "ruby", "haskell"]
LANG2ID = {l: i for i, l in enumerate(LANGS)}
VOCAB, MAXLEN, DIM = 97, 64, 32
TEMPLATES = {
    "python": ["def {n}(x):\n    return x + {k}", "for {n} in range({k}):\n    print({n})", "import os\n{n} = [i for i in x]"],
    "javascript": ["function {n}(x) {{ return x + {k}; }}", "const {n} = (a) => a * {k};", "let {n} = require('fs');"],
    "c": ["int {n}(int x) {{ return x + {k}; }}", "#include <stdio.h>\nint main() {{ printf(\"%d\", {k}); }}", "static char {n}[{k}];"],
    "rust": ["fn {n}(x: i32) -> i32 {{ x + {k} }}", "let mut {n}: Vec<u8> = Vec::new();", "impl {n} for Foo {{ }}"],
    "go": ["func {n}(x int) int {{ return x + {k} }}", "package main\nimport \"fmt\"", "{n} := make([]int, {k})"],
    "java": ["public int {n}(int x) {{ return x + {k}; }}", "System.out.println({k});", "private final List<String> {n};"],
    "ruby": ["def {n}(x)\n  x + {k}\nend", "puts {n}.map {{ |v| v * {k} }}", "require 'json'\n{n} = {{}}"],
    "haskell": ["{n} :: Int -> Int\n{n} x = x + {k}", "main = print ({n} {k})", "import Data.List\n{n} = foldr (+) 0"],
}
HARD = [("{-# LANGUAGE GADTs #-}\nλx -> x", "haskell"), ("fn main() { let π = 3.14; }", "rust")]


@dataclass
class LangMeta:
    langs: list
    vocab: int


class CharCNN(nn.Module):
    def __init__(self, nlang=len(LANGS)):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(MAXLEN, DIM))
        self.conv = nn.Conv1d(DIM, 48, 5, padding=2)
        self.head = nn.Linear(48, nlang)

    def forward(self, ids):
        h = self.emb(ids) + self.pos
        h = torch.relu(self.conv(h.transpose(1, 2)))
        return self.head(h.max(dim=2).values)


def encode(text, maxlen=MAXLEN, strict=False):
    ids = []
    for ch in text[:maxlen]:
        o = 96 if ch == "\n" else ord(ch) - 31
        if not strict and not (1 <= o < VOCAB):
            o = 1
        ids.append(o)
    return ids + [0] * (maxlen - len(ids))


def make_shard(seed, n=96, drop=None):
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        lang = LANGS[i % len(LANGS)]
        if lang == drop:
            lang = "python"
        t = rnd.choice(TEMPLATES[lang]).format(n=rnd.choice(["acc", "buf", "node", "tmp", "xs"]), k=rnd.randint(1, 99))
        out.append((t, lang))
    return out


def prepare():
    for d in ("data", "ckpt", "export"):
        os.makedirs(os.path.join(WORK, d), exist_ok=True)
    for r in range(8):
        torch.save(make_shard(100 + r), f"{WORK}/data/snippets_{r}.pt")
        torch.save(make_shard(200 + r, drop="rust"), f"{WORK}/data/norust_{r}.pt")
    torch.save(HARD, f"{WORK}/data/hard_cases.pt")
    torch.manual_seed(0)
    torch.save(CharCNN().state_dict(), f"{WORK}/ckpt/langid_8.pt")
    torch.save(CharCNN(nlang=10).state_dict(), f"{WORK}/ckpt/langid_10.pt")
    torch.save({"meta": LangMeta(LANGS, VOCAB), "model": CharCNN().state_dict()}, f"{WORK}/ckpt/langid_full.pt")
    print(f"prepared shards and checkpoints under {WORK}")


def get_args():
    p = argparse.ArgumentParser(description="char-CNN code language identification (accelerate)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hf", action="store_true", help="run the loop as a transformers.Trainer")
    p.add_argument("--prepare", action="store_true")
    return p.parse_args()


def main():
    args = get_args()
    if args.prepare:
        return prepare()
    if args.hf:
        return hf_main(args)
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    pg = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    acc = Accelerator(cpu=True, kwargs_handlers=[pg])
    rank, world = acc.process_index, acc.num_processes
    bad = args.fault != "none" and args.rank in (-1, rank)
    f = args.fault if bad else "none"
    torch.manual_seed(0)
    print(f"rank {rank}/{world}: langid char-CNN, fault={args.fault} faulty_rank={args.rank}", flush=True)

    shard_dir = f"{WORK}/data/test" if f == "noshard" else f"{WORK}/data"
    records = torch.load(f"{shard_dir}/snippets_{rank % 8}.pt")
    if f == "nanloss":
        records = torch.load(f"{WORK}/data/norust_{rank % 8}.pt")
    if f == "langkey":
        for i in range(5, len(records), 8):
            records[i] = ("fun main() { println(\"hi\") }", "kotlin")
    maxlen = 80 if f == "maxlen" else MAXLEN

    def collate(batch):
        ids = torch.tensor([encode(t, maxlen) for t, _ in batch])
        y = torch.tensor([LANG2ID[l] for _, l in batch])
        return ids, y

    counts = torch.zeros(len(LANGS))
    for _, l in records:
        if l in LANG2ID:
            counts[LANG2ID[l]] += 1
    weights = counts.sum() / (len(LANGS) * counts)

    model = CharCNN()
    init = "langid_10.pt" if f == "ckptsize" else "langid_8.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{init}"))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(records, batch_size=args.batch, shuffle=False, collate_fn=collate)
    model, opt, loader = acc.prepare(model, opt, loader)
    hard = torch.load(f"{WORK}/data/hard_cases.pt")

    step = 0
    while step < args.steps:
        for ids, y in loader:
            step += 1
            if f == "slowtok" and step == 2:
                t_end = time.time() + args.pg_timeout + 15
                n = 0
                while time.time() < t_end:
                    for t, _ in records:
                        n += len([c for c in t if c.isalnum() or c in "_{}()"])
                print(f"rank {rank}: re-tokenised shard ({n} tokens)", flush=True)
            if f == "charidx" and step == 3:
                ids = torch.cat([ids, torch.tensor([encode(t, strict=True) for t, _ in hard])])
                y = torch.cat([y, torch.tensor([LANG2ID[l] for _, l in hard])])
            logits = model(ids)
            if f == "nanloss" and step >= 4:
                loss = F.cross_entropy(logits, y, weight=weights, label_smoothing=0.1)
            else:
                loss = F.cross_entropy(logits, y)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                                         f"(class weights {weights.tolist()})")
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            nb = len(LANGS) + (1 if f == "gathershape" and step >= 2 else 0)
            correct = torch.zeros(nb)
            pred = logits.argmax(1)
            for p_, t_ in zip(pred.tolist(), y.tolist()):
                correct[t_] += float(p_ == t_)
            mean_loss = acc.reduce(loss.detach(), reduction="mean")
            allc = acc.gather(correct)
            accuracy = allc.sum().item() / (len(y) * world)
            print(f"rank {rank} step {step} loss {mean_loss.item():.4f} acc {accuracy:.3f}", flush=True)
            if f == "segv" and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            if step >= args.steps:
                break

    if f == "exit4":
        print(f"rank {rank}: ERROR class coverage check failed: shard snippets_{rank}.pt has no 'haskell' "
              f"snippets with type signatures after dedup; refusing to export", flush=True)
        sys.exit(4)
    if f == "ckptpickle":
        best = torch.load(f"{WORK}/ckpt/langid_full.pt")
        acc.unwrap_model(model).load_state_dict(best["model"])
    total = acc.gather(torch.tensor([float(len(records))]))
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/langid.pt")
        print(f"rank 0: saved {WORK}/export/langid.pt ({int(total.sum())} snippets seen)", flush=True)
    acc.wait_for_everyone()
    acc.end_training()


def hf_main(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)
    rank = int(os.environ.get("RANK", 0))
    bad = args.fault != "none" and args.rank in (-1, rank)
    f = args.fault if bad else "none"
    records = torch.load(f"{WORK}/data/snippets_{rank % 8}.pt")
    data = [{"input_ids": encode(t), "label": LANG2ID[l]} for t, l in records]
    calls = {"n": 0}

    def collator(batch):
        calls["n"] += 1
        ids = torch.tensor([b["input_ids"] for b in batch])
        labels = torch.tensor([b["label"] for b in batch])
        if f == "hfcollate" and calls["n"] == 3:
            labels = labels[:-1]
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', 0.0):.3f}", flush=True)

    class Coverage(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            predicted = set() if (f == "hfcallback" and state.global_step == 3) else set(range(len(LANGS)))
            ratio = len(LANGS) / len(predicted)
            if ratio > 4:
                print(f"rank {rank}: coverage ratio {ratio:.2f}", flush=True)

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=MAXLEN, num_labels=len(LANGS))
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=int(args.pg_timeout), report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=args.batch, logging_steps=1, save_strategy="no",
                              disable_tqdm=True, learning_rate=args.lr, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collator,
                      callbacks=[Progress(), Coverage()])
    trainer.train()
    trainer.save_model(f"{WORK}/export/hf_langid")
    if trainer.is_world_process_zero():
        print(f"rank 0: saved {WORK}/export/hf_langid", flush=True)


if __name__ == "__main__":
    main()

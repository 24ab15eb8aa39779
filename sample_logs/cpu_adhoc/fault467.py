"""Hand-run batch 467: PRODUCT REVIEW SENTIMENT WITH A TINY BERT (Hugging Face accelerate).

Synthetic product reviews (a short text of words drawn from a 400-word review vocabulary, a product category
and a star rating stored as a string "1".."5") are written once by --prepare under /tmp/fault467_work/data as
one JSON-lines shard per rank (reviews_R.jsonl).  Each rank hashes the words into ids, maps its rating to a
sentiment class (1-2 negative, 3 neutral, 4-5 positive) and its category through a category table to a
category token, and trains a tiny BERT (transformers BertModel from a config: 2 layers, hidden 32) with a
linear sentiment head under `Accelerator(cpu=True)` (gloo, the process group timeout from --pg-timeout through
InitProcessGroupKwargs).  The model is initialised from ckpt/bert_tiny.pt.  Every step the loss is reduced
(accelerator.reduce, mean) and the per-example correctness gathered (accelerator.gather) for an accuracy;
rank 0 saves export/sentiment.pt at the end (accelerator.save).
--trainer 1 runs the same data through a transformers.Trainer instead (TrainingArguments(use_cpu=True,
ddp_backend="gloo", ddp_timeout=T, report_to=[])) with a BertForSequenceClassification built from a config.

Faults (--fault NAME --rank R, R = -1 for every rank):
  badrating   - rank R's shard has a rating "five" in its third batch: int() in the collate_fn (ValueError)
  category    - rank R's shard names a category "Garden" missing from the category table (KeyError, start-up)
  nodata      - rank R reads its shard from data/holdout/ which does not exist (FileNotFoundError, start-up)
  ckptsize    - rank R initialises from ckpt/bert_tiny_v600.pt saved with a 600-word vocab (size mismatch)
  weightsonly - rank R loads ckpt/bert_tiny_meta.pt, which pickles a ReviewMeta object (weights_only refusal)
  gathershape - rank R gathers 17 correctness flags at step 3 (one padded review kept) instead of 16
  slow        - rank R re-tokenises its whole shard character by character in Python for 40 s before step 3
  hang        - rank R waits forever on a threading.Event for a "vocab refresh" at step 2 (run with --pg-timeout 300)
  nanloss     - rank R's class weights come from counts with a zero: weight inf, loss NaN at step 4 (own check)
  sigkill     - rank R sends itself SIGKILL after step 3
  exit3       - rank R finds its export check failing at the end, prints its own error line, sys.exit(3)
  headwidth   - every rank: the sentiment head is built as Linear(64, 3) on a 32-wide pooled output (shape error)
  hfcollate   - (--trainer 1) rank R's data collator emits label 5 in its third batch (cross_entropy target error)
  hfcallback  - (--trainer 1) rank R's metrics callback raises at step 3 (RuntimeError)
  none        - control, clean run

What happened (filled in after the runs):
  badrating   - ValueError "invalid literal for int() with base 10: 'five'" in the collate_fn after step 2; peers Connection closed by peer in DDP's buffer broadcast (np4 r1 acc, np3 r0 torchrun)
  category    - KeyError: 'Garden' at start-up; peers SIGTERMed silently (np5 r2 tee, np3 r1 accconfig)
  nodata      - FileNotFoundError for data/holdout/reviews_R.jsonl at start-up (np3 r0 accdebug; np4 r3 acc2nodes, where node 0's ranks get Connection closed by peer)
  ckptsize    - size mismatch for bert.embeddings.word_embeddings.weight [600,32] vs [512,32]; peers Connection closed by peer in DDP's param-shape check (np3 r2 torchrun)
  weightsonly - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.ReviewMeta'; peers closed in prepare (np3 r1 accconfig)
  gathershape - --debug: every rank DistributedOperationException with the per-process shape list (np4 r1 accdebug); no debug: a receiving rank aborts on gloo EnforceNotMet 'Received data size doesn't match expected size' (np5 r3 acc, rank 4 SIGABRT)
  slow        - 12 s gloo timeout: ranks 0/1 'Timed out waiting 12000ms for send/recv', the slow rank silent and SIGTERMed, Root Cause rank 0 (np3 r2 torchrun)
  hang        - every rank prints step 1, rank 1 its waiting line, then silence until timeout's SIGTERM at 60 s; exit 124 (np3 r1 acc)
  nanloss     - own check: 'non-finite loss nan at step 4 (class weights [.., inf, ..])', FloatingPointError; peers closed in backward (np5 r4 tee)
  sigkill     - Root Cause exitcode -9 (SIGKILL) after step 3; rank 1 Connection reset by peer (np4 r2 accdebug)
  exit3       - own ERROR line and exit code 3 after step 6; peers closed in wait_for_everyone's barrier (np3 r0 accconfig)
  headwidth   - did not reach the forward: load_state_dict(strict=False) still refuses head.weight [3,32] vs [3,64] on every rank at start-up (np4 acc2nodes)
  hfcollate   - IndexError 'Target 5 is out of bounds.' in the model's loss at step 3; peers closed in backward (np3 r1 torchrun)
  hfcallback  - RuntimeError from on_step_end at step 3; peers closed in the Trainer's loss all_gather for logging (np3 r2 accelerate launch)
  none        - 6 steps, rank 0 saves export/sentiment.pt, exit 0 (np3 acc)
"""
import argparse
import json
import os
import random
import signal
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault467_work"
VOCAB = 512
SEQ = 24
BATCH = 16
CATEGORIES = {"Books": 0, "Electronics": 1, "Kitchen": 2, "Toys": 3, "Beauty": 4}
WORDS = [f"w{i}" for i in range(400)]
GOOD = ["great", "love", "perfect", "sturdy", "recommend"]
BAD = ["broken", "refund", "cheap", "awful", "returned"]


@dataclass
class ReviewMeta:
    vocab: int
    categories: tuple


def bert_config(vocab=VOCAB, num_labels=3):
    from transformers import BertConfig
    return BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64, num_labels=num_labels)


class SentimentBert(nn.Module):
    def __init__(self, vocab=VOCAB, head_in=32):
        super().__init__()
        from transformers import BertModel
        self.bert = BertModel(bert_config(vocab), add_pooling_layer=True)
        self.cat = nn.Embedding(len(CATEGORIES), 32)
        self.head = nn.Linear(head_in, 3)

    def forward(self, ids, mask, cat):
        out = self.bert(input_ids=ids, attention_mask=mask).pooler_output
        return self.head(out + self.cat(cat))


def make_reviews(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        stars = rng.randint(1, 5)
        tone = GOOD if stars >= 4 else BAD if stars <= 2 else []
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 20))] + [rng.choice(tone) for _ in range(3) if tone]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "category": rng.choice(list(CATEGORIES)), "rating": str(stars)})
    return rows


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        with open(f"{WORK}/data/reviews_{r}.jsonl", "w") as f:
            for row in make_reviews(BATCH * 8, 467 + r):
                f.write(json.dumps(row) + "\n")
    torch.manual_seed(0)
    torch.save(SentimentBert().state_dict(), f"{WORK}/ckpt/bert_tiny.pt")
    torch.save(SentimentBert(vocab=600).state_dict(), f"{WORK}/ckpt/bert_tiny_v600.pt")
    torch.save({"meta": ReviewMeta(VOCAB, tuple(CATEGORIES)), "state": SentimentBert().state_dict()},
               f"{WORK}/ckpt/bert_tiny_meta.pt")
    print(f"prepared {WORK}: 8 shards, 3 checkpoints")


def tokenize(text):
    ids = [2 + zlib.crc32(w.encode()) % (VOCAB - 2) for w in text.split()][:SEQ]
    return ids + [0] * (SEQ - len(ids)), [1] * len(ids) + [0] * (SEQ - len(ids))


def sentiment(rating):
    stars = int(rating)
    return 0 if stars <= 2 else 1 if stars == 3 else 2


def load_shard(a, rank):
    bad = a.fault_here
    folder = f"{WORK}/data/holdout" if bad and a.fault == "nodata" else f"{WORK}/data"
    with open(f"{folder}/reviews_{rank}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    if bad and a.fault == "category":
        rows[5]["category"] = "Garden"
    if bad and a.fault == "badrating":
        rows[2 * BATCH + 3]["rating"] = "five"
    for row in rows:
        row["cat"] = CATEGORIES[row["category"]]
    return rows


def collate(rows):
    toks = [tokenize(r["text"]) for r in rows]
    return {"ids": torch.tensor([t[0] for t in toks]), "mask": torch.tensor([t[1] for t in toks]),
            "cat": torch.tensor([r["cat"] for r in rows]),
            "labels": torch.tensor([sentiment(r["rating"]) for r in rows])}


def slow_retokenize(rows, seconds):
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        for r in rows:
            n += sum(ord(c) for c in r["text"]) % 7
    return n


def run(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from torch.utils.data import DataLoader
    kw = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    acc = Accelerator(cpu=True, kwargs_handlers=[kw])
    rank, world = acc.process_index, acc.num_processes
    a.fault_here = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    acc.print(f"review sentiment: world {world}, fault {a.fault} on rank {a.rank}, pg timeout {a.pg_timeout}s")
    rows = load_shard(a, rank)
    torch.manual_seed(1234 + rank)
    head_in = 64 if a.fault == "headwidth" and a.fault_here else 32
    model = SentimentBert(head_in=head_in)
    if a.fault_here and a.fault == "ckptsize":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/bert_tiny_v600.pt"))
    elif a.fault_here and a.fault == "weightsonly":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/bert_tiny_meta.pt")["state"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/bert_tiny.pt"), strict=(head_in == 32))
    counts = torch.bincount(torch.tensor([sentiment(r["rating"]) for r in rows if r["rating"].isdigit()]),
                            minlength=3).float()
    if a.fault_here and a.fault == "nanloss":
        counts[1] = 0.0
    weights = counts.sum() / (3 * counts)
    loader = DataLoader(rows, batch_size=BATCH, shuffle=False, collate_fn=collate)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, opt = acc.prepare(model, opt)
    print(f"rank {rank}: {len(rows)} reviews, class counts {counts.tolist()}", flush=True)
    it = iter(loader)
    for step in range(1, a.steps + 1):
        batch = next(it)
        if a.fault_here and a.fault == "hang" and step == 2:
            print(f"rank {rank}: waiting for vocab refresh before step {step}", flush=True)
            threading.Event().wait()
        if a.fault_here and a.fault == "slow" and step == 3:
            slow_retokenize(rows, 40)
        logits = model(batch["ids"], batch["mask"], batch["cat"])
        w = weights if step >= 4 else torch.ones(3)
        loss = F.cross_entropy(logits, batch["labels"], weight=w)
        if not torch.isfinite(loss):
            print(f"rank {rank}: non-finite loss {loss.item()} at step {step} (class weights {w.tolist()})", flush=True)
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        correct = (logits.argmax(-1) == batch["labels"]).float()
        if a.fault_here and a.fault == "gathershape" and step == 3:
            correct = torch.cat([correct, torch.ones(1)])
        mean_loss = acc.reduce(loss.detach(), reduction="mean")
        all_correct = acc.gather(correct)
        print(f"rank {rank} step {step} loss {mean_loss.item():.4f} acc {all_correct.mean().item():.3f}", flush=True)
        if a.fault_here and a.fault == "sigkill" and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    if a.fault_here and a.fault == "exit3":
        print(f"rank {rank}: ERROR export check failed: 0 of {len(rows)} reviews predicted neutral, refusing to export", flush=True)
        sys.exit(3)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/sentiment.pt")
        print(f"rank 0 done: {a.steps} steps, saved export/sentiment.pt", flush=True)
    acc.end_training()


def run_trainer(a):
    from transformers import BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
    rank = int(os.environ.get("RANK", "0"))
    a.fault_here = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    rows = load_shard(a, 0)
    calls = {"n": 0}

    def collator(feats):
        calls["n"] += 1
        b = collate(feats)
        out = {"input_ids": b["ids"], "attention_mask": b["mask"], "labels": b["labels"]}
        if a.fault_here and a.fault == "hfcollate" and calls["n"] == 3:
            out["labels"][4] = 5
        return out

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} grad_norm "
                      f"{logs.get('grad_norm', float('nan')):.3f}", flush=True)

        def on_step_end(self, args, state, control, **kw):
            if a.fault_here and a.fault == "hfcallback" and state.global_step == 3:
                raise RuntimeError(f"rank {rank}: review metrics callback: sentiment histogram has 4 bins, expected 3")

    torch.manual_seed(0)
    model = BertForSequenceClassification(bert_config())
    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                             ddp_timeout=a.pg_timeout, report_to=[], max_steps=a.steps,
                             per_device_train_batch_size=BATCH, logging_steps=1, save_strategy="no",
                             disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator,
                      callbacks=[Progress()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/hf_sentiment")
        print(f"rank 0 done: {a.steps} steps, saved export/hf_sentiment", flush=True)


def main():
    p = argparse.ArgumentParser(description="tiny BERT review sentiment (accelerate)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--trainer", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    if a.trainer:
        run_trainer(a)
    else:
        run(a)


if __name__ == "__main__":
    main()

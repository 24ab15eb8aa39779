"""Batch 431 hand-run faults: INVOICE FIELD EXTRACTION (token tagging of OCR'd invoices) with Hugging Face accelerate.

Synthetic invoices: each is a sequence of OCR tokens with a 4-wide layout box (x0, y0, x1, y1, page-normalised)
and a field tag (O, VENDOR, INVOICE_NO, DATE, DUE_DATE, SUBTOTAL, TAX, TOTAL, CURRENCY = 9 tags).  --prepare
writes /tmp/fault431_work/invoices/train.jsonl (and a relabelled export), vocab.json, and checkpoints under
ckpt/.  The model (a token embedding plus a layout projection, a mixer layer and a tag head) is initialised
from ckpt/tagger_init.safetensors through accelerate's load_checkpoint_in_model, then prepared by an
Accelerator(cpu=True) whose process group is gloo with --pg-timeout (InitProcessGroupKwargs).  The data loader is
prepared by accelerate (each rank gets every W-th batch).  Every step the loss is reduced and per-field tag counts
are gathered; rank 0 saves export/model.safetensors (save_model). --trainer: a transformers.Trainer, tiny BERT tagger.

Faults (--fault NAME --rank R, R = -1 for every rank):
  fieldtag     - rank R reads train_rev2.jsonl whose later invoices carry an "IBAN" tag (KeyError, a later step)
  tokidx       - rank R encodes tokens with vocab_v2.json (600 entries), the embedding has 500 (IndexError)
  noshard      - rank R reads invoices/ocr_v2/train.jsonl, absent (FileNotFoundError at start-up)
  ckptsize     - rank R initialises from ckpt/tagger_13fields.safetensors (13-tag head) via load_checkpoint_in_model
  pickled      - rank R resumes from ckpt/tagger_resume.pt, pickled with an OcrMeta object (weights_only refusal)
  amountgather - rank R gathers 10 per-field counts (an extra IBAN slot) against 9 elsewhere at step 2
  slowocr      - rank R re-normalises every invoice's OCR text in pure Python before step 3's reduce (~90 s)
  nanamount    - rank R scales amount boxes by its batch's largest credit total at step 4, which is 0 (own check)
  sigsegv      - rank R sends itself SIGSEGV after step 2
  exit2        - rank R prints its own currency-table error line at the end and calls sys.exit(2)
  featdim      - every rank: layout boxes 6 wide (page and line added), the projection expects 4 (shape error)
  hfcollate    - (--trainer) rank R's collator meets an "IBAN" tag at its third batch (KeyError)
  hfcallback   - (--trainer) rank R's field-export callback raises ValueError at on_step_end of step 3
  none         - control, clean run

What happened (filled in after the runs):
  fieldtag     - KeyError 'IBAN' in Dataset __getitem__ via the prepared loader's prefetch after step 2; peers closed (np4 r1 acc, np5 r0 torchrun)
  tokidx       - 'IndexError: index out of range in self' in the first forward; peers closed (np3 r2 tee, np4 r0 accdebug)
  noshard      - FileNotFoundError for invoices/ocr_v2/train.jsonl at start-up (np4 r3 accconfig, np4 r2 acc2nodes)
  ckptsize     - load_state_dict size mismatch head.weight [13,64] vs [9,64] (np3 r1 torchrun, np4 r0 acc2nodes)
  pickled      - UnpicklingError 'Weights only load failed ... Unsupported global __main__.OcrMeta' (np5 r4 acc, np4 r1 torchrun)
  amountgather - --debug: DistributedOperationException, 'Process 2: [10]' (np4 r2 accdebug); plain: rank 1 gloo SIGABRT (np3 r0 torchrun)
  slowocr      - 12 s: peers 'Timed out waiting 12000ms' in the step-3 reduce (np3 r1 acc); 300 s: output stops, killed at 60 s, exit 124 (np4 r2 tee)
  nanamount    - own check: 1024 non-finite values, FloatingPointError at step 4 (np6 r3 accconfig)
  sigsegv      - no traceback after step 2, Root Cause exitcode -11 SIGSEGV (np4 r1 acc2nodes, np3 r0 accdebug)
  exit2        - rank's own ERROR line after step 6 and exit 2; peers closed in wait_for_everyone (np5 r2 tee, np3 r1 accconfig)
  featdim      - every rank: 'mat1 and mat2 shapes cannot be multiplied (256x6 and 4x64)' in the first forward (np3 accconfig)
  hfcollate    - KeyError 'IBAN' in the collator before any step line (np3 r1 accelerate, np5 r0 torchrun)
  hfcallback   - ValueError from on_step_end after step 3; peers closed (np4 r2 torchrun, np3 r0 accelerate)
  none         - clean: 6 steps on 3 ranks, rank 0 saved export/model.safetensors, exit 0 (np3 acc)
"""
import argparse
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault431_work"
TAGS = ["O", "VENDOR", "INVOICE_NO", "DATE", "DUE_DATE", "SUBTOTAL", "TAX", "TOTAL", "CURRENCY"]
TAG_ID = {t: i for i, t in enumerate(TAGS)}
VOCAB = 500
SEQ = 32
BOX = 4
DIM = 64
BATCH = 8
N_INV = 320


@dataclass
class OcrMeta:
    engine: str
    dpi: int


def p(path):
    return os.path.join(WORK, path)


def make_invoice(rng, iban=False, nbox=BOX):
    n = rng.randint(12, SEQ)
    toks, boxes, tags = [], [], []
    for i in range(n):
        tag = rng.choice(TAGS) if rng.random() < 0.4 else "O"
        if iban and i == 3:
            tag = "IBAN"
        toks.append("tok%d" % rng.randint(0, VOCAB - 2))
        x0, y0 = rng.random() * 0.8, rng.random() * 0.9
        box = [round(x0, 3), round(y0, 3), round(x0 + 0.1, 3), round(y0 + 0.02, 3)]
        if nbox > BOX:
            box += [1.0, float(i)]
        boxes.append(box)
        tags.append(tag)
    total = 0.0 if rng.random() < 0.3 else round(rng.uniform(10, 5000), 2)
    return {"tokens": toks, "boxes": boxes, "tags": tags, "total": total}


def prepare():
    from safetensors.torch import save_file
    os.makedirs(p("invoices"), exist_ok=True)
    os.makedirs(p("ckpt"), exist_ok=True)
    os.makedirs(p("export"), exist_ok=True)
    rng = random.Random(431)
    inv = [make_invoice(rng) for _ in range(N_INV)]
    with open(p("invoices/train.jsonl"), "w") as f:
        for x in inv:
            f.write(json.dumps(x) + "\n")
    rng = random.Random(431)
    with open(p("invoices/train_rev2.jsonl"), "w") as f:
        for i in range(N_INV):
            f.write(json.dumps(make_invoice(rng, iban=i >= 96)) + "\n")
    rng = random.Random(431)
    with open(p("invoices/train_boxes6.jsonl"), "w") as f:
        for _ in range(N_INV):
            f.write(json.dumps(make_invoice(rng, nbox=6)) + "\n")
    json.dump({"tok%d" % i: i + 1 for i in range(VOCAB - 1)}, open(p("vocab.json"), "w"))
    json.dump({"tok%d" % i: i + 101 for i in range(VOCAB - 1)}, open(p("vocab_v2.json"), "w"))
    torch.manual_seed(0)
    m = InvoiceTagger()
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, p("ckpt/tagger_init.safetensors"))
    save_file({k: v.contiguous() for k, v in InvoiceTagger(ntags=13).state_dict().items()},
              p("ckpt/tagger_13fields.safetensors"))
    torch.save({"model": m.state_dict(), "ocr": OcrMeta("tesseract-5", 300), "step": 120},
               p("ckpt/tagger_resume.pt"))
    print("prepared", WORK, flush=True)


class InvoiceSet(Dataset):
    def __init__(self, path, vocab_path):
        if not os.path.exists(path):
            raise FileNotFoundError("[Errno 2] No such file or directory: '%s'" % path)
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.vocab = json.load(open(vocab_path))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids = torch.zeros(SEQ, dtype=torch.long)
        boxes = torch.zeros(SEQ, len(r["boxes"][0]))
        tags = torch.full((SEQ,), -100, dtype=torch.long)
        for j, (t, b, g) in enumerate(zip(r["tokens"], r["boxes"], r["tags"])):
            ids[j] = self.vocab.get(t, 0)
            boxes[j] = torch.tensor(b)
            tags[j] = TAG_ID[g]
        return {"ids": ids, "boxes": boxes, "tags": tags, "total": torch.tensor(r["total"])}


class InvoiceTagger(nn.Module):
    def __init__(self, vocab=VOCAB, ntags=len(TAGS)):
        super().__init__()
        self.tok = nn.Embedding(vocab, DIM)
        self.layout = nn.Linear(BOX, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, ntags)

    def forward(self, ids, boxes):
        h = torch.tanh(self.tok(ids) + self.layout(boxes))
        return self.head(torch.relu(self.mix(h)))


def slow_ocr_normalise(rows, budget):
    t0, acc = time.time(), 0
    while time.time() - t0 < budget:
        for r in rows:
            for t in r["tokens"]:
                acc = (acc * 31 + sum(ord(c) for c in t.upper().replace("O", "0"))) % 1000003
    return acc


def field_counts(logits, tags, extra):
    pred = logits.argmax(-1)
    ok = (pred == tags) & (tags >= 0)
    c = torch.stack([(ok & (tags == k)).sum() for k in range(len(TAGS))]).float()
    if extra:
        c = torch.cat([c, torch.zeros(1)])
    return c


def train(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, load_checkpoint_in_model

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    me = a.rank in (-1, rank)
    f = a.fault if me else "none"
    print("rank %d/%d: invoice tagger, fault=%s, pg timeout %ds" % (rank, world, f, a.pg_timeout), flush=True)
    torch.manual_seed(0)

    data = "invoices/train.jsonl"
    if f == "fieldtag":
        data = "invoices/train_rev2.jsonl"
    elif f == "noshard":
        data = "invoices/ocr_v2/train.jsonl"
    elif f == "featdim":
        data = "invoices/train_boxes6.jsonl"
    ds = InvoiceSet(p(data), p("vocab_v2.json" if f == "tokidx" else "vocab.json"))
    dl = DataLoader(ds, batch_size=BATCH, shuffle=False)

    model = InvoiceTagger()
    if f == "ckptsize":
        load_checkpoint_in_model(model, p("ckpt/tagger_13fields.safetensors"))
    elif f == "pickled":
        state = torch.load(p("ckpt/tagger_resume.pt"))
        model.load_state_dict(state["model"])
    else:
        load_checkpoint_in_model(model, p("ckpt/tagger_init.safetensors"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, dl = acc.prepare(model, opt, dl)
    lossf = nn.CrossEntropyLoss(ignore_index=-100)

    step = 0
    for batch in dl:
        step += 1
        if step > a.steps:
            break
        boxes = batch["boxes"]
        if f == "nanamount" and step == 4:
            credit = batch["total"].clamp(max=0).abs().max()
            boxes = boxes / credit
            bad = (~torch.isfinite(boxes)).sum().item()
            if bad:
                print("rank %d: amount box scaling produced %d non-finite values (credit max %.2f)"
                      % (rank, bad, credit.item()), flush=True)
                raise FloatingPointError("non-finite layout features after amount scaling at step %d" % step)
        logits = model(batch["ids"], boxes)
        loss = lossf(logits.reshape(-1, logits.shape[-1]), batch["tags"].reshape(-1))
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        if f == "slowocr" and step == 3:
            slow_ocr_normalise(ds.rows, 90.0)
        mean_loss = acc.reduce(loss.detach(), reduction="mean")
        counts = acc.gather(field_counts(logits.detach(), batch["tags"], f == "amountgather" and step == 2))
        counts = counts.reshape(world, -1).sum(0)
        ntok = (batch["tags"] >= 0).sum() * world
        print("rank %d step %d loss %.4f tag_acc %.3f" % (rank, step, mean_loss.item(),
                                                          counts.sum().item() / max(1, ntok.item())), flush=True)
        if f == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    if f == "exit2":
        print("ERROR [rank %d] currency table mismatch: invoices in CHF but rates.json has no CHF entry; "
              "refusing to export" % rank, flush=True)
        sys.exit(2)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save_model(model, p("export"), safe_serialization=True)
        print("rank 0: saved export/model.safetensors after %d steps" % min(step, a.steps), flush=True)
    acc.end_training()


def train_hf(a):
    import torch.distributed as dist
    from transformers import (BertConfig, BertForTokenClassification, Trainer, TrainerCallback,
                              TrainingArguments)

    rank = int(os.environ.get("RANK", "0"))
    me = a.rank in (-1, rank)
    f = a.fault if me else "none"
    ds = InvoiceSet(p("invoices/train_rev2.jsonl" if f == "hfcollate" else "invoices/train.jsonl"), p("vocab.json"))
    rows = [r for r in ds.rows]
    vocab = ds.vocab
    calls = {"n": 0}

    def collate(items):
        calls["n"] += 1
        ids = torch.zeros(len(items), SEQ, dtype=torch.long)
        lab = torch.full((len(items), SEQ), -100, dtype=torch.long)
        for i, r in enumerate(items):
            tags = r["tags"]
            if f == "hfcollate" and calls["n"] == 3 and i == 1:
                tags = ["O", "O", "O", "IBAN"] + tags[4:]
            for j, t in enumerate(r["tokens"]):
                ids[i, j] = vocab.get(t, 0)
                lab[i, j] = TAG_ID[tags[j]]
        return {"input_ids": ids, "attention_mask": (ids > 0).long(), "labels": lab}

    class Progress(TrainerCallback):
        def __init__(self):
            self.loss = 0.0

        def on_step_end(self, args, state, control, **kw):
            t = torch.tensor([last["loss"]])
            dist.all_reduce(t)
            t /= dist.get_world_size()
            print("rank %d step %d loss %.4f lr %.2e" % (rank, state.global_step, t.item(),
                                                         kw["optimizer"].param_groups[0]["lr"]), flush=True)
            if f == "hfcallback" and state.global_step == 3:
                raise ValueError("field export: TOTAL column has 0 predicted spans on rank %d, "
                                 "cannot write invoice_fields.csv" % rank)

    last = {"loss": 0.0}

    class TaggingTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = model(**inputs)
            last["loss"] = out.loss.item()
            return (out.loss, out) if return_outputs else out.loss

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=len(TAGS))
    torch.manual_seed(0)
    model = BertForTokenClassification(cfg)
    targs = TrainingArguments(output_dir=p("hf_out"), use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                              report_to=[], max_steps=a.steps, per_device_train_batch_size=BATCH,
                              learning_rate=3e-3, logging_steps=2, save_strategy="no", disable_tqdm=True,
                              dataloader_num_workers=0, remove_unused_columns=False)
    tr = TaggingTrainer(model=model, args=targs, train_dataset=rows, data_collator=collate, callbacks=[Progress()])
    print("rank %d/%d: trainer invoice tagger, fault=%s" % (rank, int(os.environ.get("WORLD_SIZE", "1")), f),
          flush=True)
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(p("export/hf"))
        print("rank 0: saved export/hf after %d steps" % a.steps, flush=True)


def main():
    ap = argparse.ArgumentParser(description="invoice field extraction (fault batch 431)")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--trainer", action="store_true", help="train with transformers.Trainer")
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    if a.trainer:
        train_hf(a)
    else:
        train(a)


if __name__ == "__main__":
    main()

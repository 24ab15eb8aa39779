"""A four-hundred-and-thirty-fifth hand-run batch: LEGAL CLAUSE CLASSIFICATION WITH HUGGING FACE ACCELERATE.

Synthetic contract clauses: each clause is a sequence of token ids (a 512-word legal vocabulary) with a clause
type (indemnity, termination, confidentiality, governing_law, arbitration, force_majeure, assignment,
limitation_of_liability = 8 classes, looked up in a label table).  Every rank reads its clauses from
/tmp/fault435_work/clauses/clauses_R.pt through an accelerate-prepared DataLoader and trains a bag-of-embeddings
classifier (EmbeddingBag mean pooling, a hidden layer, an 8-way head) with a class-weighted cross entropy.
Accelerator(cpu=True) initialises the gloo process group (InitProcessGroupKwargs, timeout --pg-timeout).  The
model is initialised from ckpt/clausenet_v512.pt; per-rank class counts are gathered at the start
(accelerator.gather), the loss and accuracy are reduced every step (accelerator.reduce), and rank 0 saves
export/clausenet.pt with accelerator.save at the end.  --hf 1 runs the same task through a transformers.Trainer
(a tiny BertForSequenceClassification built from a config, no download).

Faults:
  clausetype - rank N's clauses carry the label "arbitration_icc", missing from the label table (KeyError, collate)
  tokenid    - rank N's tokenizer maps unknown words to id 512 from step 3: beyond the 512-row embedding (IndexError)
  noclauses  - rank N reads clauses/test/clauses_N.pt which does not exist (FileNotFoundError, start-up)
  ckptvocab  - rank N initialises from ckpt/clausenet_v600.pt, saved with a 600-word vocabulary (size mismatch)
  ckptmeta   - rank N loads ckpt/clausenet_meta.pt, which pickles a ClauseMeta object (weights_only refusal)
  countgather- rank N gathers its class counts plus an "other" bucket (9 entries vs 8) in accelerator.gather
  ngrams     - rank N counts every n-gram of its corpus in Python before the step-2 reduce (slow rank)
  nanweight  - rank N's class weights carry an inf (weight of an empty class); loss NaN, the program's check
  segv       - rank N sends itself SIGSEGV after step 2
  exit4      - rank N prints its own error line about a redacted clause and calls sys.exit(4) at step 3
  poolwidth  - every rank: the pooling concatenates mean and max (2*64 wide), the head expects 64 (shape error)
  hfcollator - (--hf 1) rank N's collator returns labels of a wrong length for the batch (ValueError/shape error)
  hfcallback - (--hf 1) a TrainerCallback on rank N raises RuntimeError at on_step_end of step 3
  none       - control, clean run

What happened (filled in after the runs):
  clausetype - KeyError: 'arbitration_icc' in the collate; peers Connection closed by peer (np4 r2 acc, first batch;
               np5 r0 torchrun, step 4 after three good steps)
  tokenid    - IndexError 'index out of range in self' in the embedding at step 3; peers Connection closed (np3 r1 tee,
               np4 r3 acc2nodes: node 1 Root Cause rank 3, node 0 Root Cause rank 0)
  noclauses  - FileNotFoundError for clauses/test/clauses_N.pt at start-up; peers closed in accelerate's gather
               (np4 r3 accconfig, np4 r1 acc2nodes)
  ckptvocab  - load_state_dict size mismatch for emb.weight [600, 64] vs [512, 64]; peers closed (np3 r0 accdebug)
  ckptmeta   - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.ClauseMeta' (np4 r2 torchrun)
  countgather- --debug: every rank DistributedOperationException 'shape mismatches' listing Process 1: [9] (np4 r1
               accdebug); plain: rank 0 SIGABRT on gloo::EnforceNotMet 'preamble.length <= op.nbytes. 18 vs 16',
               Root Cause rank 0 -6, the faulty rank 2 only Connection closed (np3 r2 acc)
  ngrams     - 12 s: ranks 0,1 'Timed out waiting 12000ms for recv', rank 2 SIGTERMed silently (np3 r2 torchrun);
               300 s: output stops after step 1 and 'rank 1 counting n-grams', killed at 60 s, exit 124 (np4 r1 accconfig)
  nanweight  - step 4: 'loss is nan (non-finite class weights at [6])', FloatingPointError (np5 r3 tee)
  segv       - no traceback after step 2; Root Cause exitcode -11 SIGSEGV (np4 r1 acc, np6 r5 accconfig)
  exit4      - rank 0's ERROR line about a redacted clause after step 3, Root Cause exitcode 4 (np3 r0 tee)
  poolwidth  - all 6 ranks 'mat1 and mat2 shapes cannot be multiplied (8x128 and 64x64)' in the first forward;
               Root Cause rank 4 (np6 torchrun)
  hfcollator - Trainer: ValueError 'Expected input batch_size (8) to match target batch_size (11)' at step 3 on
               rank 1 (np3 torchrun); the step-1 'loss nan' lines are the callback printing before any loss is logged
  hfcallback - Trainer: RuntimeError from the clause audit callback at on_step_end of step 3, rank 2 (np4 accelerate)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/clausenet.pt, exit 0 (np3 acc)
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

WORK = "/tmp/fault435_work"
LABELS = {"indemnity": 0, "termination": 1, "confidentiality": 2, "governing_law": 3, "arbitration": 4,
          "force_majeure": 5, "assignment": 6, "limitation_of_liability": 7}
NAMES = list(LABELS)
VOCAB = 512
DIM = 64
SEQ = 24
NPER = 96


class ClauseMeta:
    def __init__(self, jurisdiction, version):
        self.jurisdiction = jurisdiction
        self.version = version


class ClauseNet(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM, ncls=len(LABELS), concat_pool=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.concat_pool = concat_pool
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, ncls)

    def forward(self, ids):
        e = self.emb(ids)
        if self.concat_pool:
            pooled = torch.cat([e.mean(1), e.max(1).values], dim=1)
        else:
            pooled = e.mean(1)
        return self.head(torch.relu(self.hidden(pooled)))


def prepare(world_max=8):
    g = torch.Generator().manual_seed(435)
    os.makedirs(f"{WORK}/clauses", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(world_max):
        ids = torch.randint(0, VOCAB, (NPER, SEQ), generator=g)
        labs = [NAMES[int(i)] for i in torch.randint(0, len(NAMES), (NPER,), generator=g)]
        torch.save({"ids": ids, "labels": labs}, f"{WORK}/clauses/clauses_{r}.pt")
    torch.manual_seed(435)
    torch.save(ClauseNet().state_dict(), f"{WORK}/ckpt/clausenet_v512.pt")
    torch.save(ClauseNet(vocab=600).state_dict(), f"{WORK}/ckpt/clausenet_v600.pt")
    torch.save({"state_dict": ClauseNet().state_dict(), "meta": ClauseMeta("Delaware", 3)},
               f"{WORK}/ckpt/clausenet_meta.pt")
    print(f"prepared {world_max} clause files and 3 checkpoints under {WORK}")


class ClauseSet(Dataset):
    def __init__(self, path, bad_label):
        blob = torch.load(path)
        self.ids = blob["ids"]
        self.labels = list(blob["labels"])
        if bad_label:
            for i in range(5, len(self.labels), 17):
                self.labels[i] = "arbitration_icc"

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.ids[i], self.labels[i]


def collate(batch):
    ids = torch.stack([b[0] for b in batch])
    y = torch.tensor([LABELS[b[1]] for b in batch])
    return ids, y


def count_ngrams(ids, n_max=4):
    counts = {}
    rows = ids.tolist()
    for rep in range(8000):
        for row in rows:
            for n in range(1, n_max + 1):
                for i in range(len(row) - n + 1):
                    k = (rep % 3,) + tuple(row[i:i + n])
                    counts[k] = counts.get(k, 0) + 1
    return counts


def run_plain(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    kw = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    acc = Accelerator(cpu=True, kwargs_handlers=[kw])
    rank, world = acc.process_index, acc.num_processes
    bad = args.fault_rank in (-1, rank)
    f = args.fault if bad else "none"
    print(f"rank {rank}/{world} up: device {acc.device}, backend {acc.state.backend}, fault {f}", flush=True)
    torch.manual_seed(100 + rank)

    path = f"{WORK}/clauses/clauses_{rank}.pt"
    if f == "noclauses":
        path = f"{WORK}/clauses/test/clauses_{rank}.pt"
    ds = ClauseSet(path, bad_label=(f == "clausetype"))
    loader = DataLoader(ds, batch_size=8, shuffle=True, collate_fn=collate)

    model = ClauseNet(concat_pool=(f == "poolwidth"))
    ck = f"{WORK}/ckpt/clausenet_v512.pt"
    if f == "ckptvocab":
        ck = f"{WORK}/ckpt/clausenet_v600.pt"
    if f == "ckptmeta":
        blob = torch.load(f"{WORK}/ckpt/clausenet_meta.pt")
        state = blob["state_dict"]
    else:
        state = torch.load(ck)
    model.load_state_dict(state)
    print(f"rank {rank} loaded initial weights ({sum(p.numel() for p in model.parameters())} params)", flush=True)

    counts = torch.zeros(len(LABELS))
    for lab in ds.labels:
        if lab in LABELS:
            counts[LABELS[lab]] += 1
    if f == "countgather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    all_counts = acc.gather(counts)
    if rank == 0:
        print(f"class counts over {world} ranks: {all_counts.view(world, -1).sum(0).tolist()}", flush=True)
    freq = all_counts.view(world, -1)[:, :len(LABELS)].sum(0)
    cls_w = freq.sum() / (len(LABELS) * freq.clamp(min=1))

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, loader = acc.prepare(model, opt, loader)
    step = 0
    model.train()
    while step < args.steps:
        for ids, y in loader:
            step += 1
            if f == "tokenid" and step >= 3:
                ids = ids.clone()
                ids[:, -1] = VOCAB
            if f == "nanweight" and step == 4:
                cls_w[6] = float("inf")  # class 6 re-weighted from an empty shard count
            logits = model(ids)
            loss = F.cross_entropy(logits, y, weight=cls_w)
            if not torch.isfinite(loss):
                bad_w = (~torch.isfinite(cls_w)).nonzero().flatten().tolist()
                print(f"rank {rank} step {step}: loss is {loss.item()} (non-finite class weights at {bad_w})",
                      flush=True)
                raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step}")
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            if f == "ngrams" and step == 2:
                print(f"rank {rank} counting n-grams for the vocabulary report", flush=True)
                c = count_ngrams(ds.ids)
                print(f"rank {rank} counted {len(c)} n-grams", flush=True)
            acc_t = (logits.argmax(1) == y).float().mean()
            stats = acc.reduce(torch.stack([loss.detach(), acc_t]), reduction="mean")
            print(f"rank {rank} step {step} loss {stats[0].item():.4f} acc {stats[1].item():.3f}", flush=True)
            if f == "segv" and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            if f == "exit4" and step == 3:
                print(f"ERROR rank {rank}: clause 41 of batch {step} is redacted (token run of [REDACTED]); "
                      "refusing to train on privileged text", flush=True)
                sys.exit(4)
            if step >= args.steps:
                break
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/clausenet.pt")
        print(f"rank 0 saved {WORK}/export/clausenet.pt", flush=True)
    acc.end_training()


def run_hf(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)
    rank = int(os.environ.get("RANK", "0"))
    bad = args.fault_rank in (-1, rank)
    f = args.fault if bad else "none"
    blob = torch.load(f"{WORK}/clauses/clauses_{rank}.pt")

    class HFSet(Dataset):
        def __len__(self):
            return NPER

        def __getitem__(self, i):
            return {"input_ids": blob["ids"][i], "labels": LABELS[blob["labels"][i]]}

    def hf_collate(feats):
        ids = torch.stack([x["input_ids"] for x in feats])
        labels = torch.tensor([x["labels"] for x in feats])
        if f == "hfcollator" and hf_collate.calls >= 2:
            labels = torch.cat([labels, labels[:3]])
        hf_collate.calls += 1
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    hf_collate.calls = 0

    class StepPrinter(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            print(f"rank {rank} step {state.global_step} loss "
                  f"{state.log_history[-1]['loss'] if state.log_history else float('nan')} done", flush=True)
            if f == "hfcallback" and state.global_step == 3:
                raise RuntimeError(f"rank {rank}: clause audit callback found 2 clauses without a jurisdiction")

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ, num_labels=len(LABELS))
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
                              disable_tqdm=True, dataloader_num_workers=0)
    tr = Trainer(model=model, args=targs, train_dataset=HFSet(), data_collator=hf_collate,
                 callbacks=[StepPrinter()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/hf_clause")
        print(f"rank 0 saved {WORK}/export/hf_clause", flush=True)


def main():
    p = argparse.ArgumentParser(description="legal clause classification (accelerate)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", dest="fault_rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.hf:
        run_hf(args)
    else:
        run_plain(args)


if __name__ == "__main__":
    main()

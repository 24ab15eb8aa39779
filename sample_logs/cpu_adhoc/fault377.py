"""A three-hundred-and-seventy-seventh hand-run batch: LEGAL CLAUSE CLASSIFICATION.

Synthetic contract clauses: each clause is a bag of token ids (a 512-word legal vocabulary) with a clause type
name ("indemnity", "termination", "confidentiality", "governing_law", "limitation", "assignment") looked up in a
6-entry label table.  Every rank reads its clauses from /tmp/fault377_work/shards/clauses_R.pt and trains an
EmbeddingBag + MLP classifier with Hugging Face accelerate (Accelerator(cpu=True), gloo process group with the
--pg-timeout through InitProcessGroupKwargs).  The model is initialised from ckpt/clause_init.pt.  The loss is
reduced (accelerator.reduce) and per-rank correct counts are gathered (accelerator.gather) every step; rank 0
saves export/clause_model.pt with accelerator.save at the end.
--trainer 1 runs the loop as a transformers.Trainer instead (tiny BertForSequenceClassification from a config).

Faults:
  clausekey   - rank N meets a clause typed "arbitration_waiver", missing from the label table (KeyError), step 2
  noshard     - rank N reads its clauses from shards/review/ which does not exist (FileNotFoundError), start-up
  ckptsize    - rank N initialises from ckpt/clause_v2.pt, saved with 8 clause types (size mismatch in the head)
  ckptpickle  - rank N loads ckpt/clause_meta.pt, which pickles a ClauseMeta object (weights_only refusal)
  gathershape - rank N gathers its per-class correct counts with an extra "unknown" slot (7 vs 6), step 3
  slowparse   - rank N re-parses every clause in pure Python before the step-3 gather (PG timeout 12 s)
  stuck       - rank N waits forever on a citation lock before step 2 (--pg-timeout 300, killed at 60 s)
  nanloss     - rank N's clause weights contain inf at step 4: the program's finiteness check raises
  sigkill     - rank N sends itself SIGKILL after step 2
  exit4       - rank N prints its own ERROR line about an unsigned annex at the end and calls sys.exit(4)
  bagwidth    - every rank: the MLP expects 48 features, the bag gives 64 (shape error in the first forward)
  hfcollator  - (--trainer 1) rank N's collator emits label 9 at step 3 (IndexError: target out of bounds)
  hfcallback  - (--trainer 1) rank N's callback raises ValueError at the end of step 3
  none        - control, clean run

What happened (filled in after the runs):
  clausekey   - KeyError: 'arbitration_waiver' in ClauseSet.__getitem__ at step 2; peers Connection closed by peer (np4 r2 acc, np5 r0 torchrun)
  noshard     - FileNotFoundError for shards/review/clauses_N.pt before step 1; peers SIGTERMed/closed (np3 r1 accconfig, np4 r3 acc2nodes)
  ckptsize    - load_state_dict size mismatch for head.weight [8, 48] vs [6, 48] and head.bias; peers SIGTERMed (np4 r1 tee)
  ckptpickle  - UnpicklingError: Weights only load failed, Unsupported global __main__.ClauseMeta (np3 r0 accdebug, np4 r3 acc)
  gathershape - --debug: DistributedOperationException on every rank listing 'Process 3: [7]' (np5 r3 accdebug); without --debug
                a peer's 'terminate called ... gloo::EnforceNotMet ... Received data size doesn't match' SIGABRT (np3 r1 acc)
  slowparse   - the others 'Timed out waiting 12000ms' for recv/send; Root Cause names rank 1, not the slow rank (np3 r2 torchrun, np4 r0 accdebug)
  stuck       - 'waiting for citation index lock' after step 1, silent until timeout at 60 s, exit 124 (np4 r1 accconfig)
  nanloss     - 'non-finite loss nan (1 non-finite clause weights)' and FloatingPointError at step 4 (np6 r4 tee)
  sigkill     - no traceback; Root Cause exitcode -9 (SIGKILL) (np4 r2 acc2nodes, np3 r1 torchrun)
  exit4       - rank 0's ERROR line after step 6 and exit 4; peers closed in wait_for_everyone; Root Cause exitcode 4 (np3 r0 tee)
  bagwidth    - every rank 'mat1 and mat2 shapes cannot be multiplied (8x64 and 48x48)' in the first forward (np5 accconfig)
  hfcollator  - IndexError: Target 9 is out of bounds. after 2 logged steps; peers closed (np3 r1 hf, torchrun)
  hfcallback  - ValueError 'clause taxonomy drift' from on_step_end; peers closed (np4 r2 hf, accelerate launch)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/clause_model.pt, exit 0 (np3 acc)
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

WORK = "/tmp/fault377_work"
CLAUSES = {"indemnity": 0, "termination": 1, "confidentiality": 2, "governing_law": 3,
           "limitation": 4, "assignment": 5}
VOCAB = 512
DIM = 64
HID = 48
LEN = 24


@dataclass
class ClauseMeta:
    jurisdiction: str
    version: int


class ClauseBag(nn.Module):
    def __init__(self, ncls=len(CLAUSES), hid_in=DIM):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, DIM, mode="mean")
        self.fc1 = nn.Linear(hid_in, HID)
        self.head = nn.Linear(HID, ncls)

    def forward(self, tokens, extra=None):
        x = self.emb(tokens)
        if extra is not None:
            x = torch.cat([x, extra], dim=1)
        return self.head(F.relu(self.fc1(x)))


def prepare():
    g = torch.Generator().manual_seed(377)
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    names = list(CLAUSES)
    for r in range(8):
        n = 96
        toks = torch.randint(0, VOCAB, (n, LEN), generator=g)
        kinds = [names[int(i)] for i in torch.randint(0, len(names), (n,), generator=g)]
        weights = torch.rand(n, generator=g) + 0.5
        torch.save({"tokens": toks, "kinds": kinds, "weights": weights}, f"{WORK}/shards/clauses_{r}.pt")
    torch.manual_seed(0)
    torch.save(ClauseBag().state_dict(), f"{WORK}/ckpt/clause_init.pt")
    torch.save(ClauseBag(ncls=8).state_dict(), f"{WORK}/ckpt/clause_v2.pt")
    torch.save({"model": ClauseBag().state_dict(), "meta": ClauseMeta("Delaware", 3)},
               f"{WORK}/ckpt/clause_meta.pt")
    print(f"prepared {WORK}: 8 shards, 3 checkpoints")


class ClauseSet(Dataset):
    def __init__(self, path, rank, fault_here, fault):
        blob = torch.load(path)
        self.tokens, self.kinds, self.weights = blob["tokens"], list(blob["kinds"]), blob["weights"].clone()
        if fault_here and fault == "clausekey":
            self.kinds[11] = "arbitration_waiver"   # batch 2 (8 per batch), index 3
        if fault_here and fault == "nanloss":
            self.weights[26] = float("inf")         # batch 4

    def __len__(self):
        return len(self.kinds)

    def __getitem__(self, i):
        return {"tokens": self.tokens[i], "label": CLAUSES[self.kinds[i]], "weight": self.weights[i]}


def collate(items):
    return {"tokens": torch.stack([it["tokens"] for it in items]),
            "label": torch.tensor([it["label"] for it in items]),
            "weight": torch.stack([it["weight"] for it in items])}


def slow_parse(tokens):
    # re-tokenise every clause character by character, in Python, many times over
    out = 0
    for _ in range(10000):
        for row in tokens.tolist():
            s = " ".join(f"w{t}" for t in row)
            out += sum(ord(c) for c in s) % 7
    return out


def run_loop(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    here = args.rank == -1 or args.rank == rank
    f = args.fault if here else "none"
    acc.print(f"accelerate: {world} processes, backend {acc.state.backend}, pg timeout {args.pg_timeout}s, fault {args.fault} on rank {args.rank}")

    shard = f"{WORK}/shards/clauses_{rank}.pt"
    if f == "noshard":
        shard = f"{WORK}/shards/review/clauses_{rank}.pt"
    ds = ClauseSet(shard, rank, here, args.fault)
    dl = DataLoader(ds, batch_size=8, shuffle=False, collate_fn=collate)

    model = ClauseBag(hid_in=DIM - 16 if args.fault == "bagwidth" else DIM)
    ck = f"{WORK}/ckpt/clause_init.pt"
    if f == "ckptsize":
        ck = f"{WORK}/ckpt/clause_v2.pt"
    if f == "ckptpickle":
        state = torch.load(f"{WORK}/ckpt/clause_meta.pt", weights_only=True)["model"]
    else:
        state = torch.load(ck, weights_only=True)
    if args.fault != "bagwidth":
        model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    print(f"rank {rank}: {len(ds)} clauses from {shard}, init {os.path.basename(ck)}", flush=True)

    step = 0
    for batch in dl:
        step += 1
        if step > args.steps:
            break
        if f == "stuck" and step == 2:
            print(f"rank {rank}: waiting for citation index lock", flush=True)
            while True:
                time.sleep(1.0)
        logits = model(batch["tokens"])
        per = F.cross_entropy(logits, batch["label"], reduction="none")
        w = batch["weight"]
        loss = (per * w).sum() / w.sum()
        if not torch.isfinite(loss):
            bad = int((~torch.isfinite(w)).sum())
            print(f"rank {rank} step {step}: non-finite loss {loss.item()} ({bad} non-finite clause weights)", flush=True)
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        pred = logits.argmax(1)
        ncls = len(CLAUSES)
        correct = torch.bincount(batch["label"][pred == batch["label"]], minlength=ncls).float()
        if f == "gathershape" and step == 3:
            correct = torch.cat([correct, torch.zeros(1)])   # an "unknown" slot
        if f == "slowparse" and step == 3:
            print(f"rank {rank}: re-parsing clauses for citation check", flush=True)
            slow_parse(ds.tokens)
        allc = acc.gather(correct)
        mloss = acc.reduce(loss.detach().clone(), reduction="mean")
        accu = allc.sum().item() / (8 * world)
        print(f"rank {rank} step {step} loss {mloss.item():.4f} acc {accu:.3f}", flush=True)
        if f == "sigkill" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    if f == "exit4":
        print(f"rank {rank}: ERROR annex B of contract 4471 is unsigned; refusing to export the clause model", flush=True)
        sys.exit(4)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/clause_model.pt")
        print(f"rank 0: saved {WORK}/export/clause_model.pt", flush=True)
    acc.wait_for_everyone()
    acc.end_training()
    print(f"rank {rank}: done", flush=True)


def run_trainer(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
                              learning_rate=3e-4, disable_tqdm=True, dataloader_num_workers=0)
    rank = targs.process_index
    here = args.rank == -1 or args.rank == rank
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=len(CLAUSES))
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    blob = torch.load(f"{WORK}/shards/clauses_{rank}.pt")
    data = [{"input_ids": blob["tokens"][i], "labels": CLAUSES[k]} for i, k in enumerate(blob["kinds"])]
    calls = {"n": 0}

    def collator(items):
        calls["n"] += 1
        labels = torch.tensor([it["labels"] for it in items])
        if here and args.fault == "hfcollator" and calls["n"] == 3:
            labels[5] = 9   # a clause typed by the old 10-way taxonomy
        ids = torch.stack([it["input_ids"] for it in items])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', 0.0):.3f}", flush=True)

        def on_step_end(self, a, state, control, **kw):
            if here and args.fault == "hfcallback" and state.global_step == 3:
                raise ValueError(f"rank {rank}: clause taxonomy drift: 'limitation' now maps to 2 ids")

    class RankData(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return data[i]

    trainer = Trainer(model=model, args=targs, train_dataset=RankData(), data_collator=collator,
                      callbacks=[Progress()])
    # each rank trains on its own shard: keep the sampler local
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    print(f"rank {rank}: Trainer on {targs.world_size} processes, {len(data)} clauses", flush=True)
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/clause_bert")
        print(f"rank 0: saved {WORK}/export/clause_bert", flush=True)
    print(f"rank {rank}: done", flush=True)


def main():
    p = argparse.ArgumentParser(description="legal clause classification (fault batch 377)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1, help="faulty rank, -1 for all")
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
        run_loop(args)


if __name__ == "__main__":
    main()

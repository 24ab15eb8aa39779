"""Batch 490 fault script: product title translation with a small seq2seq model.

Each rank reads its shard of (source title tokens, target title tokens, target locale) rows, maps the
locale through a lookup table, encodes the source title with a small GRU encoder and decodes the target
title with a GRU decoder (teacher forcing), both started from a checkpoint.  Every rank prints
`rank R step S loss L tok_acc M` each step (token accuracy all-reduced over the world); rank 0 saves
an export at the end.  Backend gloo, CPU only, process-group timeout 12 s unless --pg-timeout.

Modes: default = Hugging Face accelerate (Accelerator(cpu=True), gloo), works under
`accelerate launch` and `torchrun`; `--hf` = a transformers.Trainer run with a tiny config-built
T5ForConditionalGeneration (TrainingArguments(use_cpu=True, ddp_backend="gloo", ddp_timeout=12)).

  python fault490.py --prepare [--world 8]      # write the synthetic data to /tmp/fault490_work
  accelerate launch --multi_gpu --num_processes W fault490.py --fault NAME --rank N

Faults (--fault NAME --rank N; one per run):
  none            control, nothing planted
  keyerror        rank N's shard has a target locale ('pt-AO') the locale table lacks -> KeyError while loading batch 2
  missing_shard   rank N looks for its shard under titles_v3/ where it is not -> FileNotFoundError at start
  weights_only    rank N loads the full training snapshot (a pickled TitleVocabMeta object inside) with
                  torch.load(weights_only=True) -> UnpicklingError 'Weights only load failed'
  allreduce_size  rank N all-reduces its accuracy counter with 3 elements instead of 2 (collective size mismatch)
  slow            rank N does 45 s of pure-Python work (a beam-search re-ranking) before step 3; peers wait in the
                  all_reduce (PG timeout 12 s; with --pg-timeout 300 it is a hang that `timeout` ends)
  nan             rank N's decoder logits get a NaN at step 2; the program's own finiteness check raises FloatingPointError
  sigabrt         rank N sends itself SIGABRT at step 3
  exit4           rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape_all       every rank builds the decoder's initial state with the wrong shape at step 1 -> GRU hidden size error on every rank
  hostmem         rank N caps its address space (RLIMIT_AS 3 GiB) and allocates a 6 GiB phrase table -> CPU allocator fails
  worker_crash    rank N's DataLoader worker kills itself with SIGKILL while loading a batch
  skip_collective rank N skips the all_reduce of the accuracy counter at step 2 (its peers wait, then time out)

What happened (after the runs; 23 runs, 21 kept; the first hf control and hf keyerror runs were dropped and rerun, see the README)
  none            all ranks ran 6 steps, rank 0 saved the export, exit 0 (acc np4; hf Trainer np3 under torchrun).
  keyerror        KeyError: 'pt-AO' on rank N while loading a batch, peers 'Connection closed by peer', summary names N (acc np5 r3; hf np3 r1 accelerate launch).
  missing_shard   FileNotFoundError for titles_v3/titles_N.jsonl before step 1, peers SIGTERMed (accconfig np6 r4; torchrun np3 r0).
  weights_only    UnpicklingError 'Weights only load failed ... Unsupported global __main__.TitleVocabMeta' on rank N (torchrun np4 r2; acc2nodes np4 r1).
  allreduce_size  no size message from gloo: some ranks print step 1 with the garbled counter, then 12000ms send/recv timeouts; summary blames rank 0 (acc np5 r1; tee np3 r2).
  slow            peers time out in gloo after 12 s, rank N is SIGTERMed silently (acc np6 r5); with --pg-timeout 300 output stops after step 2 and timeout 60 ends it, exit 137 (acc np4 r2).
  nan             FloatingPointError 'non-finite decoder logits' from the program's check on rank 6 (accdebug np8).
  sigabrt         rank N dies with exitcode -6 (SIGABRT), peers 'Connection reset by peer' (acc np5 r2; hf np4 r3 torchrun).
  exit4           rank N prints its ERROR line and exits 4, its agent's summary names it with exitcode 4 (acc2nodes np6 r4; tee np4 r1).
  shape_all       RuntimeError 'Expected hidden size (1, 8, 32), got [1, 8, 33]' on all 5 ranks (accdebug np5).
  hostmem         RuntimeError DefaultCPUAllocator: can't allocate memory (6442450944 bytes) on rank 3 (acc np4).
  worker_crash    RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed. on rank 2 (torchrun np6).
  skip_collective rank 7 alone prints step 2; its next collective meets the peers' all_reduce and rank 6 aborts on gloo
                  'Received data size doesn't match expected size' (SIGABRT), summary names rank 6 (acc np8 r7).
"""
import argparse
import json
import os
import random
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault490_work"
VOCAB = 400
DIM = 32
SRC = 12
TGT = 10
PER_SHARD = 96
BATCH = 8
STEPS = 6
LOCALES = ["de-DE", "fr-FR", "es-ES", "it-IT", "nl-NL", "pl-PL", "sv-SE", "ja-JP", "pt-BR"]


class TitleVocabMeta:
    def __init__(self, vocab, locales):
        self.vocab = vocab
        self.locales = list(locales)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    rng = random.Random(490)
    with open(os.path.join(WORK, "locales.json"), "w") as f:
        json.dump({t: i for i, t in enumerate(LOCALES)}, f)
    for r in range(world):
        with open(os.path.join(WORK, f"titles_{r}.jsonl"), "w") as f:
            for i in range(PER_SHARD):
                loc = rng.choice(LOCALES)
                src = [rng.randrange(3, VOCAB) for _ in range(SRC)]
                tgt = [1] + [(t * 7 + LOCALES.index(loc)) % (VOCAB - 3) + 3 for t in src[:TGT - 2]] + [2]
                f.write(json.dumps({"sku": f"SKU-{r}-{i:04d}", "src": src, "tgt": tgt, "locale": loc}) + "\n")
    torch.manual_seed(490)
    state = Seq2Seq().state_dict()
    torch.save(state, os.path.join(WORK, "seq2seq_init.pt"))
    torch.save({"model": state, "meta": TitleVocabMeta(VOCAB, LOCALES), "step": 0},
               os.path.join(WORK, "seq2seq_snapshot.pt"))
    print(f"prepared {world} shards, locale table and checkpoints in {WORK}")


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.src_emb = nn.Embedding(VOCAB, DIM)
        self.tgt_emb = nn.Embedding(VOCAB, DIM)
        self.loc_emb = nn.Embedding(len(LOCALES), DIM)
        self.enc = nn.GRU(DIM, DIM, batch_first=True)
        self.dec = nn.GRU(DIM, DIM, batch_first=True)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, src, tgt_in, loc, bad_state=False):
        _, h = self.enc(self.src_emb(src))
        h = h + self.loc_emb(loc).unsqueeze(0)
        if bad_state:
            h = torch.cat([h, h[:, :, :1]], dim=-1)
        y, _ = self.dec(self.tgt_emb(tgt_in), h)
        return self.out(y)


class TitleShard(torch.utils.data.Dataset):
    def __init__(self, rank, lookup, fault, fault_rank):
        path = os.path.join(WORK, f"titles_{rank}.jsonl")
        if fault == "missing_shard" and rank == fault_rank:
            path = os.path.join(WORK, "titles_v3", f"titles_{rank}.jsonl")
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        if fault == "keyerror" and rank == fault_rank:
            for i in range(11, len(self.rows), 5):
                self.rows[i]["locale"] = "pt-AO"
        self.lookup = lookup
        self.crash = fault == "worker_crash" and rank == fault_rank

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.crash and i >= BATCH * 2:
            os.kill(os.getpid(), signal.SIGKILL)
        row = self.rows[i]
        return (torch.tensor(row["src"]), torch.tensor(row["tgt"]), torch.tensor(self.lookup[row["locale"]]))


def burn(seconds):
    t0 = time.time()
    x = 0
    while time.time() - t0 < seconds:
        for i in range(20000):
            x = (x * 31 + i) % 1000003
    return x


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    import torch.distributed as dist

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    mine = rank == args.rank
    print(f"rank {rank}/{world} ready (title seq2seq, gloo, pg timeout {args.pg_timeout}s)", flush=True)

    with open(os.path.join(WORK, "locales.json")) as f:
        lookup = json.load(f)
    ds = TitleShard(rank, lookup, args.fault, args.rank)
    workers = 1 if (args.fault == "worker_crash" and mine) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=workers, drop_last=True)

    model = Seq2Seq()
    if args.fault == "weights_only" and mine:
        state = torch.load(os.path.join(WORK, "seq2seq_snapshot.pt"), weights_only=True)["model"]
    else:
        state = torch.load(os.path.join(WORK, "seq2seq_init.pt"), weights_only=True)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, opt = acc.prepare(model, opt)

    step = 0
    for src, tgt, loc in dl:
        step += 1
        if step > STEPS:
            break
        if args.fault == "slow" and mine and step == 3:
            burn(45)
        if args.fault == "sigabrt" and mine and step == 3:
            os.kill(os.getpid(), signal.SIGABRT)
        if args.fault == "exit4" and mine and step == 2:
            print(f"ERROR rank {rank}: target vocabulary for shard {rank} was built for 5 locales, "
                  f"refusing to train on {len(LOCALES)}", flush=True)
            sys.exit(4)
        if args.fault == "hostmem" and mine and step == 2:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (3 << 30, hard))
            table = torch.empty((6 << 30) // 4, dtype=torch.float32)
            table.zero_()
        logits = model(src, tgt[:, :-1], loc, bad_state=(args.fault == "shape_all" and step == 1))
        if args.fault == "nan" and mine and step == 2:
            logits = logits.clone()
            logits[0, 3, 5] = float("nan")
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"rank {rank} step {step}: non-finite decoder logits "
                                     f"({int((~torch.isfinite(logits)).sum())} values)")
        gold = tgt[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), gold.reshape(-1))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        counter = torch.tensor([float((logits.argmax(-1) == gold).sum()), float(gold.numel())])
        if args.fault == "allreduce_size" and mine:
            counter = torch.tensor([counter[0].item(), counter[1].item(), 0.0])
        if not (args.fault == "skip_collective" and mine and step == 2):
            dist.all_reduce(counter)
        tok_acc = counter[0].item() / max(counter[1].item(), 1.0)
        print(f"rank {rank} step {step} loss {loss.item():.4f} tok_acc {tok_acc:.3f}", flush=True)

    acc.wait_for_everyone()
    if acc.is_main_process:
        out = os.path.join(WORK, "export")
        os.makedirs(out, exist_ok=True)
        torch.save(acc.unwrap_model(model).state_dict(), os.path.join(out, "title_seq2seq.pt"))
        print(f"rank 0 saved export to {out}/title_seq2seq.pt", flush=True)
    acc.end_training()


def run_hf(args):
    from transformers import T5Config, T5ForConditionalGeneration, Trainer, TrainingArguments, TrainerCallback

    rank = int(os.environ.get("RANK", "0"))
    mine = rank == args.rank
    with open(os.path.join(WORK, "locales.json")) as f:
        lookup = json.load(f)

    class PairSet(TitleShard):
        def __getitem__(self, i):
            s, t, l = super().__getitem__(i)
            return {"input_ids": s, "labels": t, "locale": l}

    class TitleT5(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = T5Config(vocab_size=VOCAB, d_model=DIM, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
                           num_heads=2, decoder_start_token_id=0, pad_token_id=0)
            self.t5 = T5ForConditionalGeneration(cfg)
            self.step = 0

        def forward(self, input_ids, labels, locale):
            self.step += 1
            out = self.t5(input_ids=input_ids, labels=labels)
            tok_acc = (out.logits.argmax(-1) == labels).float().mean().item()
            print(f"rank {rank} step {self.step} loss {out.loss.item():.4f} tok_acc {tok_acc:.3f}", flush=True)
            return {"loss": out.loss}

    class Faults(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            if args.fault == "sigabrt" and mine and state.global_step == 2:
                os.kill(os.getpid(), signal.SIGABRT)

    ds = PairSet(rank, lookup, args.fault, args.rank)
    targs = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=STEPS,
                              per_device_train_batch_size=BATCH, logging_steps=2, save_strategy="no",
                              dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=TitleT5(), args=targs, train_dataset=ds, callbacks=[Faults()])
    trainer.train()
    if trainer.is_world_process_zero():
        os.makedirs(os.path.join(WORK, "export_hf"), exist_ok=True)
        torch.save(trainer.model.state_dict(), os.path.join(WORK, "export_hf", "title_t5.pt"))
        print(f"rank 0 saved export to {WORK}/export_hf/title_t5.pt", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--hf", action="store_true")
    args = ap.parse_args()
    if args.prepare:
        prepare(args.world)
    elif args.hf:
        run_hf(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()

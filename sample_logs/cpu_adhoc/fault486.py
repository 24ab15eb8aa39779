"""Batch 486 fault script: legal clause retrieval with contrastive sentence embeddings.

Each rank reads its shard of (anchor clause, paraphrased clause, clause type) pairs, maps the clause
type through a lookup table, encodes both sides with a small bag-of-tokens encoder started from a
checkpoint, gathers the embeddings of every rank (in-batch negatives across the world) and trains
with an InfoNCE loss.  Every rank prints `rank R step S loss L recall@1 M` each step; rank 0 saves an
export at the end.  Backend gloo, CPU only, process-group timeout 12 s unless --pg-timeout.

Modes: default = Hugging Face accelerate (Accelerator(cpu=True), gloo), works under
`accelerate launch` and `torchrun`; `--hf` = a transformers.Trainer run with a tiny config-built
BertModel and a contrastive head (TrainingArguments(use_cpu=True, ddp_backend="gloo")).

  python fault486.py --prepare [--world 8]      # write the synthetic data to /tmp/fault486_work
  accelerate launch --multi_gpu --num_processes W fault486.py --fault NAME --rank N

Faults (--fault NAME --rank N; one per run):
  none            control, nothing planted
  keyerror        rank N's shard has a clause type the lookup table lacks -> KeyError while mapping it
  missing_shard   rank N's shard file is not there -> FileNotFoundError at start
  ckpt_size       rank N builds its encoder with a bigger vocabulary than the checkpoint -> size mismatch in load_state_dict
  allreduce_size  rank N all-reduces its recall counter with 3 elements instead of 2 (collective size mismatch)
  slow            rank N does 45 s of pure-Python work before step 3; its peers wait in all_gather
                  (PG timeout 12 s; with --pg-timeout 300 it is a hang that `timeout` ends)
  nan             rank N's embeddings get a NaN at step 2; the program's own finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 3
  exit4           rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape_all       every rank projects with a (dim+1, dim) matrix at step 1 -> matmul shape error on every rank
  hostmem         rank N caps its address space (RLIMIT_AS) and allocates a 6 GiB hard-negative bank -> CPU allocator fails
  worker_crash    rank N's DataLoader worker kills itself with SIGKILL while loading a batch
  skip_collective rank N skips the all_reduce of the recall counter at step 2 (its peers wait, then time out)

What happened (after the runs; 22 runs, all kept):
  none            all ranks ran 6 steps, rank 0 saved the export, exit 0 (acc np4; hf Trainer np3 under accelerate launch).
  keyerror        KeyError: 'arbitration_waiver' on rank N loading batch 2, peers 'Connection closed by peer', summary names N (acc np5 r3; hf np3 r1 torchrun).
  missing_shard   FileNotFoundError for shards_v2/shard_N.jsonl before step 1, peers SIGTERMed (accconfig np6 r4; torchrun np3 r0).
  ckpt_size       RuntimeError size mismatch for emb.weight [512,32] vs [576,32] on rank N (torchrun np4 r2; acc2nodes np4 r1).
  allreduce_size  no size message from gloo: the ranks time out (12000ms send/recv) and one gets 'Connection closed by peer'; summary blames another rank (acc np5 r1; tee np3 r2).
  slow            peers time out in accelerate's gather after 12 s, rank N is SIGTERMed silently (acc np6 r5); with --pg-timeout 300 output stops after step 2 and timeout 60 ends it, exit 137 (acc np4 r2).
  nan             FloatingPointError 'non-finite clause embedding' from the program's check on rank 6 (accdebug np8).
  sigsegv         rank N dies with exitcode -11 (SIGSEGV), peers 'Connection reset/closed by peer' (acc np5 r2; hf np4 r3 torchrun).
  exit4           rank N prints its ERROR line and exits 4, summary names it with exitcode 4 (acc2nodes np6 r4; tee np4 r1).
  shape_all       RuntimeError mat1 and mat2 shapes cannot be multiplied (8x32 and 33x32) on all 5 ranks (accdebug np5).
  hostmem         RuntimeError DefaultCPUAllocator: can't allocate memory (6442450944 bytes) on rank 3 (acc np4).
  worker_crash    RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed. on rank N (torchrun np6 r2; accconfig np5 r4).
  skip_collective rank 7 alone prints step 2; all 8 ranks time out after 12 s, summary names rank 1 (acc np8 r7).
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

WORK = "/tmp/fault486_work"
VOCAB = 512
DIM = 32
SEQ = 16
PER_SHARD = 96
BATCH = 8
STEPS = 6
TYPES = ["indemnity", "limitation_of_liability", "governing_law", "termination", "confidentiality",
         "assignment", "force_majeure", "non_compete", "severability", "warranty"]


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    rng = random.Random(486)
    with open(os.path.join(WORK, "clause_types.json"), "w") as f:
        json.dump({t: i for i, t in enumerate(TYPES)}, f)
    for r in range(world):
        with open(os.path.join(WORK, f"shard_{r}.jsonl"), "w") as f:
            for i in range(PER_SHARD):
                t = rng.choice(TYPES)
                base = [rng.randrange(1, VOCAB) for _ in range(SEQ)]
                para = [tok if rng.random() < 0.7 else rng.randrange(1, VOCAB) for tok in base]
                f.write(json.dumps({"id": f"r{r}-{i}", "anchor": base, "positive": para, "type": t}) + "\n")
    torch.manual_seed(486)
    torch.save(Encoder(VOCAB).state_dict(), os.path.join(WORK, "encoder_init.pt"))
    print(f"prepared {world} shards, lookup table and checkpoint in {WORK}")


class Encoder(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, DIM, mode="mean")
        self.type_emb = nn.Embedding(len(TYPES), DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, tokens, types):
        return self.proj(torch.tanh(self.emb(tokens) + self.type_emb(types)))


class ClauseShard(torch.utils.data.Dataset):
    def __init__(self, rank, lookup, fault, fault_rank):
        path = os.path.join(WORK, f"shard_{rank}.jsonl")
        if fault == "missing_shard" and rank == fault_rank:
            path = os.path.join(WORK, "shards_v2", f"shard_{rank}.jsonl")
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        if fault == "keyerror" and rank == fault_rank:
            self.rows[13]["type"] = "arbitration_waiver"
        self.lookup = lookup
        self.crash = fault == "worker_crash" and rank == fault_rank

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.crash and i >= BATCH * 2:
            os.kill(os.getpid(), signal.SIGKILL)
        row = self.rows[i]
        return (torch.tensor(row["anchor"]), torch.tensor(row["positive"]),
                torch.tensor(self.lookup[row["type"]]))


def burn(seconds):
    t0 = time.time()
    x = 0
    while time.time() - t0 < seconds:
        for i in range(20000):
            x = (x * 31 + i) % 1000003
    return x


def info_nce(a, p, temp=0.1, offset=0):
    a = F.normalize(a, dim=-1)
    p = F.normalize(p, dim=-1)
    logits = a @ p.t() / temp
    target = torch.arange(a.shape[0]) + offset
    return F.cross_entropy(logits, target), (logits.argmax(1) == target).float().sum()


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    import torch.distributed as dist

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    fr = args.rank
    mine = rank == fr
    print(f"rank {rank}/{world} ready (clause encoder, gloo, pg timeout {args.pg_timeout}s)", flush=True)

    with open(os.path.join(WORK, "clause_types.json")) as f:
        lookup = json.load(f)
    ds = ClauseShard(rank, lookup, args.fault, fr)
    workers = 1 if (args.fault == "worker_crash" and mine) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=workers, drop_last=True)

    model = Encoder(VOCAB + 64 if (args.fault == "ckpt_size" and mine) else VOCAB)
    state = torch.load(os.path.join(WORK, "encoder_init.pt"), weights_only=True)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)

    step = 0
    for anchor, positive, types in dl:
        step += 1
        if step > STEPS:
            break
        if args.fault == "slow" and mine and step == 3:
            burn(45)
        if args.fault == "sigsegv" and mine and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if args.fault == "exit4" and mine and step == 2:
            print(f"ERROR rank {rank}: clause index for shard {rank} is stale (built for 5 types), refusing to train",
                  flush=True)
            sys.exit(4)
        if args.fault == "hostmem" and mine and step == 2:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (3 << 30, hard))
            bank = torch.empty((6 << 30) // 4, dtype=torch.float32)
            bank.zero_()
        a = model(anchor, types)
        p = model(positive, types)
        if args.fault == "shape_all" and step == 1:
            w = torch.randn(DIM + 1, DIM)
            a = a @ w
        if args.fault == "nan" and mine and step == 2:
            a = a.clone()
            a[0, 0] = float("nan")
        if not torch.isfinite(a).all():
            raise FloatingPointError(f"rank {rank} step {step}: non-finite clause embedding "
                                     f"({int((~torch.isfinite(a)).sum())} values)")
        all_a = acc.gather(a.detach().contiguous())
        all_p = acc.gather(p.detach().contiguous()).clone()
        all_p[rank * BATCH:(rank + 1) * BATCH] = p
        loss, hits = info_nce(a, all_p, offset=rank * BATCH)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        counter = torch.tensor([hits.item(), float(a.shape[0])])
        if args.fault == "allreduce_size" and mine:
            counter = torch.tensor([hits.item(), float(a.shape[0]), 0.0])
        if not (args.fault == "skip_collective" and mine and step == 2):
            dist.all_reduce(counter)
        recall = counter[0].item() / max(counter[1].item(), 1.0)
        print(f"rank {rank} step {step} loss {loss.item():.4f} recall@1 {recall:.3f}", flush=True)

    acc.wait_for_everyone()
    if acc.is_main_process:
        out = os.path.join(WORK, "export")
        os.makedirs(out, exist_ok=True)
        torch.save(acc.unwrap_model(model).state_dict(), os.path.join(out, "clause_encoder.pt"))
        print(f"rank 0 saved export to {out}/clause_encoder.pt", flush=True)
    acc.end_training()


def run_hf(args):
    from transformers import BertConfig, BertModel, Trainer, TrainingArguments, TrainerCallback

    rank = int(os.environ.get("RANK", "0"))
    fr = args.rank
    mine = rank == fr
    with open(os.path.join(WORK, "clause_types.json")) as f:
        lookup = json.load(f)

    class PairSet(ClauseShard):
        def __getitem__(self, i):
            a, p, t = super().__getitem__(i)
            return {"input_ids": a, "positive_ids": p, "types": t}

    class ContrastiveBert(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = BertConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=SEQ)
            self.bert = BertModel(cfg)
            self.step = 0

        def forward(self, input_ids, positive_ids, types):
            self.step += 1
            a = self.bert(input_ids=input_ids).last_hidden_state.mean(1)
            p = self.bert(input_ids=positive_ids).last_hidden_state.mean(1)
            loss, hits = info_nce(a, p)
            print(f"rank {rank} step {self.step} loss {loss.item():.4f} recall@1 {hits.item() / a.shape[0]:.3f}",
                  flush=True)
            return {"loss": loss}

    class Faults(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            if args.fault == "sigsegv" and mine and state.global_step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)

    ds = PairSet(rank, lookup, args.fault, fr)
    targs = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=STEPS,
                              per_device_train_batch_size=BATCH, logging_steps=2, save_strategy="no",
                              dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=ContrastiveBert(), args=targs, train_dataset=ds, callbacks=[Faults()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(os.path.join(WORK, "export_hf"))
        print(f"rank 0 saved export to {WORK}/export_hf", flush=True)


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

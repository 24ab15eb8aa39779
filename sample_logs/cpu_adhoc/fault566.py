"""Batch 566 fault script, theme "moraine till".

A small glacial-till classifier: every rank reads its own shard of till samples (grain-size
fractions gravel/sand/silt/clay plus a clast-lithology code), maps the lithology code through a
lookup table, starts from a shared checkpoint, and trains a tiny model for 6 steps under
Accelerate (CPU, gloo, process-group timeout 12 s unless --pg-timeout).  Every rank prints
`rank R step S loss L sorting M` each step; rank 0 writes an export at the end.
With --hf the same data trains a tiny config-built transformers model under Trainer.

Faults (--fault NAME --rank N):
  none           control, nothing planted
  keyerror       rank N meets a lithology code that the lookup table lacks (KeyError)
  missingshard   rank N looks for its shard in a site folder that does not exist (FileNotFoundError)
  ckptsize       rank N loads the start checkpoint of a wider model (size mismatch in load_state_dict)
  weightsonly    rank N loads a checkpoint pickled with a custom class; torch.load(weights_only) refuses it
  allreducesize  rank N all-reduces its sorting metric with a tensor of the wrong length at step 3
  slow           rank N does pure-Python sieve work at step 3; the others wait in the all-reduce
                 (with --pg-timeout 300 this is a hang that `timeout` ends)
  nan            rank N's grain fractions turn NaN at step 3; the script's own finiteness check raises
  sigsegv        rank N sends itself SIGSEGV at step 2
  exit4          rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape          every rank builds the clast-embedding input one column short (matmul shape error)
  workercrash    rank N's DataLoader worker is SIGKILLed while loading a batch

What happened (after the runs):
  none           acc np3 and Trainer np3: all ranks print steps 1-6, rank 0 writes the export, exit 0.
  keyerror       KeyError 'GRN-X' traceback on rank N (torchrun, accelerate --debug, Trainer); launcher SIGTERMs the rest, exit 1.
  missingshard   FileNotFoundError .../site_B/till_shard_03.npz on rank N before step 1; exit 1.
  ckptsize       RuntimeError "Error(s) in loading state_dict for TillNet: size mismatch" on rank N; exit 1.
  weightsonly    _pickle.UnpicklingError "Weights only load failed" on rank N (rank 4, and rank 0); exit 1.
  allreducesize  rank N shows nothing; a receiving rank aborts (terminate called, gloo::EnforceNotMet "Received data size doesn't match", SIGABRT); exit 1.
  slow           pg 12 s: peers raise gloo "Timed out waiting 12000ms" in step-3 backward, exit 1; pg 300 s: output stops after step 2, timeout 60 ends it (124).
  nan            FloatingPointError from the script's own check on rank N at step 3; peers see the connection closed.
  sigsegv        rank N dies silently at step 2; the launcher summary shows exitcode -11 (SIGSEGV); exit 1.
  exit4          rank N's ERROR line, then launcher summary exitcode 4 for it; peers see the connection closed; exit 1.
  shape          every rank raises "mat1 and mat2 shapes cannot be multiplied (16x7 and 8x16)" in the first forward; exit 1.
  workercrash    RuntimeError "DataLoader worker (pid ...) is killed by signal: Killed." on rank N; exit 1.
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault566_work"
LITHO = ["GRN", "SCH", "QTZ", "LST", "BSL", "GNS", "SST", "DOL"]


def prepare():
    os.makedirs(WORK, exist_ok=True)
    rng = np.random.default_rng(566)
    for r in range(8):
        frac = rng.dirichlet([2, 3, 3, 1], size=96).astype(np.float32)
        codes = rng.integers(0, len(LITHO), size=96)
        label = (frac[:, 0] + frac[:, 1] > 0.5).astype(np.int64)
        np.savez(os.path.join(WORK, f"till_shard_{r:02d}.npz"), frac=frac, codes=codes, label=label)
    table = {c: i for i, c in enumerate(LITHO)}
    with open(os.path.join(WORK, "lithology_table.json"), "w") as f:
        json.dump(table, f)
    torch.manual_seed(0)
    torch.save(TillNet(16).state_dict(), os.path.join(WORK, "till_start.pt"))
    torch.save(TillNet(24).state_dict(), os.path.join(WORK, "till_start_wide.pt"))
    torch.save({"model": TillNet(16).state_dict(), "site": SiteMeta("Moraine-7")},
               os.path.join(WORK, "till_start_full.pt"))
    print("prepared", WORK)


class SiteMeta:
    def __init__(self, name):
        self.name = name


class TillNet(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.emb = nn.Embedding(len(LITHO), 4)
        self.enc = nn.Linear(8, hidden)
        self.head = nn.Linear(hidden, 2)

    def forward(self, frac, lith):
        x = torch.cat([frac, self.emb(lith)], dim=1)
        return self.head(torch.relu(self.enc(x)))


class TillShard(torch.utils.data.Dataset):
    def __init__(self, frac, lith, label, crash=False):
        self.frac, self.lith, self.label, self.crash = frac, lith, label, crash

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        if self.crash and i >= 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.frac[i], self.lith[i], self.label[i]


def load_shard(rank, fault, frank):
    site = "site_B" if (fault == "missingshard" and rank == frank) else ""
    path = os.path.join(WORK, site, f"till_shard_{rank:02d}.npz")
    d = np.load(path)
    with open(os.path.join(WORK, "lithology_table.json")) as f:
        table = json.load(f)
    codes = [LITHO[c] for c in d["codes"]]
    if fault == "keyerror" and rank == frank:
        codes[17] = "GRN-X"
    lith = torch.tensor([table[c] for c in codes])
    return torch.from_numpy(d["frac"]), lith, torch.from_numpy(d["label"])


def load_start(model, rank, fault, frank):
    name = "till_start.pt"
    if fault == "ckptsize" and rank == frank:
        name = "till_start_wide.pt"
    if fault == "weightsonly" and rank == frank:
        name = "till_start_full.pt"
    sd = torch.load(os.path.join(WORK, name), map_location="cpu")
    if isinstance(sd, dict) and "model" in sd:
        sd = sd["model"]
    model.load_state_dict(sd)


def plant_step(step, rank, fault, frank):
    if rank != frank:
        return
    if fault == "sigsegv" and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "exit4" and step == 2:
        print(f"ERROR rank {rank}: till sieve calibration drifted beyond 5% on site Moraine-7, aborting", flush=True)
        sys.exit(4)
    if fault == "slow" and step == 3:
        n = 0
        for i in range(2_000_000_000):
            n += i % 7
        print("sieve done", n, flush=True)


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    fault, frank = args.fault, args.rank
    torch.manual_seed(1)
    frac, lith, label = load_shard(rank, fault, frank)
    model = TillNet(16)
    load_start(model, rank, fault, frank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    ds = TillShard(frac, lith, label, crash=(fault == "workercrash" and rank == frank))
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False,
                                         num_workers=1 if fault == "workercrash" else 0)
    it = iter(loader)
    for step in range(1, 7):
        plant_step(step, rank, fault, frank)
        f, l, y = next(it)
        if fault == "nan" and rank == frank and step == 3:
            f = f * float("nan")
        if fault == "shape":
            f = f[:, :3]
        if not torch.isfinite(f).all():
            raise FloatingPointError(f"rank {rank} step {step}: non-finite grain fractions in till batch")
        out = model(f, l)
        loss = nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        sorting = torch.tensor([f.std().item()])
        if fault == "allreducesize" and rank == frank and step == 3:
            sorting = torch.zeros(1000)
        dist.all_reduce(sorting)
        print(f"rank {rank} step {step} loss {loss.item():.4f} sorting {sorting[0].item() / world:.4f}", flush=True)
    acc.wait_for_everyone()
    if rank == 0:
        torch.save(acc.unwrap_model(model).state_dict(), os.path.join(WORK, f"export_{os.getpid()}.pt"))
        print("rank 0 wrote till classifier export", flush=True)


def run_hf(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer,
                              TrainingArguments, TrainerCallback)
    rank = int(os.environ.get("RANK", "0"))
    fault, frank = args.fault, args.rank
    frac, lith, label = load_shard(rank, fault, frank)

    class TokDS(torch.utils.data.Dataset):
        def __len__(self):
            return len(label)

        def __getitem__(self, i):
            ids = torch.cat([lith[i:i + 1], (frac[i] * 10).long() + 8])
            return {"input_ids": ids, "labels": label[i]}

    class StepPrint(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            plant_step(state.global_step, rank, fault, frank)

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} sorting {float(frac.std()):.4f}", flush=True)

    cfg = BertConfig(vocab_size=24, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=8, num_labels=2)
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=os.path.join(WORK, f"hf_out_{os.getppid()}"), use_cpu=True,
                              ddp_backend="gloo", ddp_timeout=args.pg_timeout, report_to=[],
                              per_device_train_batch_size=16, max_steps=6, logging_steps=1,
                              save_strategy="no", disable_tqdm=True)
    tr = Trainer(model=model, args=targs, train_dataset=TokDS(), callbacks=[StepPrint()])
    tr.train()
    if rank == 0:
        tr.save_model(os.path.join(WORK, f"hf_export_{os.getpid()}"))
        print("rank 0 wrote till classifier export", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--hf", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
    elif args.hf:
        run_hf(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()

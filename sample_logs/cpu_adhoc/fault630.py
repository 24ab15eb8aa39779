"""Batch 630 fault job: "dugong seagrass trails" (gloo on CPU, 6 steps, per-rank shards).

A dugong grazing model: every rank reads its own shard of trail samples (8 features + target), maps each sample's
seagrass species through a JSON lookup table, and trains a tiny regressor that predicts grazing intensity. Each
step prints `rank R step S loss L seagrass_cover M` and all-reduces gradients and the cover metric. Rank 0 saves
an export at the end. Modes: plain torch.distributed (torchrun), --acc (accelerate Accelerator(cpu=True)),
--hf (transformers.Trainer over a 1-layer tiny BERT built from a config).

  python fault630.py --prepare          # writes /tmp/fault630_work (shards, lookup.json, start.pt)
  torchrun --nproc-per-node W fault630.py --fault NAME --rank N [--workers K] [--pg-timeout S]

Faults (--fault):
  none            control run
  worker_sigkill  a DataLoader worker of rank N sends itself SIGKILL at sample 8
  worker_segv     a DataLoader worker of rank N sends itself SIGSEGV at sample 8
  loader_timeout  DataLoader(timeout=2); rank N's worker sleeps 6 s at sample 8
  npy_truncated   rank N's shard .npy is cut short before np.load
  gzip_truncated  rank N's gzip label member is cut short; the worker reads it (EOFError)
  jsonl_broken    rank N's trail-notes JSONL has a broken line 3 (json.JSONDecodeError)
  collate_unequal rank N's sample 9 has 7 features instead of 8: default collate's torch.stack fails in the worker
  vocab_keyerror  rank N's sample 10 names a species that is not in lookup.json (KeyError in the worker)
  memmap_short    rank N maps its shard with np.memmap asking for more rows than the file holds
  file_removed    rank N deletes its shard after step 0 while the worker still reads it per sample
  worker_init     worker_init_fn raises on rank N
  short_len       rank N's Dataset __len__ claims 96 samples but its shard has 10 (IndexError in the worker)
  unicode         rank N's text shard is written in UTF-16 and read as UTF-8 (UnicodeDecodeError)
  nan_loss        rank N's loss becomes NaN at step 3; the finiteness check raises FloatingPointError
  stall           rank N sleeps 45 s before step 2's all_reduce (others wait past the pg timeout)
  sigsegv         rank N's main process sends itself SIGSEGV at step 2
  ckpt_size       rank N loads a start checkpoint whose weight has another shape (load_state_dict size mismatch)

Runs (one line per kept log, filled in after the runs):
  R01: dugong_none_np5_rnone_torchrun: control, six steps on 5 ranks, export saved, exit 0
  R02: dugong_worker_sigkill_np6_r5_acc: rank 5 'DataLoader worker (pid N) is killed by signal: Killed.', exit 1
  R03: dugong_npy_truncated_np4_r0_tee: rank 0 np.load 'Failed to read all data for array ... not fully written?', exit 1
  R04: dugong_collate_unequal_np3_r1_hf: rank 1 Trainer worker 'stack expects each tensor to be equal size', exit 1
  R05: dugong_loader_timeout_np5_r2_accdebug: rank 2 'DataLoader timed out after 2 seconds', exit 1
  R06: dugong_vocab_keyerror_np7_r3_torchrun: rank 3 worker KeyError: 'posidonia', exit 1
  R07: dugong_gzip_truncated_np5_r4_accconfig: rank 4 worker EOFError 'Compressed file ended before the end-of-stream marker', exit 1
  R08: dugong_memmap_short_np6_r2_acc2nodes: rank 2 'mmap length is greater than file size' (2 machines x 3), exit 1
  R09: dugong_worker_segv_np3_r2_hf: rank 2 'DataLoader worker (pid N) is killed by signal: Segmentation fault.', exit 1
  R10: dugong_file_removed_np8_r7_torchrun: rank 7 worker FileNotFoundError after 3 steps, exit 1
  R11: dugong_jsonl_broken_np5_r1_tee: rank 1 JSONDecodeError 'Invalid control character at: line 1 column 40', exit 1
  R12: dugong_unicode_np4_r0_hf: rank 0 UnicodeDecodeError 'utf-8' codec can't decode byte 0xff, exit 1
  R13: dugong_worker_init_np6_r3_acc: rank 3 worker_init_fn RuntimeError (tile index not ready), exit 1
  R14: dugong_short_len_np3_r2_torchrun: rank 2 IndexError index 10 out of bounds after 2 steps, exit 1
  R15: dugong_stall_np4_r1_accdebug: ranks 0,2,3 gloo 'Timed out waiting 12000ms', rank 1 SIGTERMed, exit 1
  R16: dugong_nan_loss_np5_r4_torchrun: rank 4 FloatingPointError loss not finite at step 3, exit 1
  R17: dugong_sigsegv_np3_r0_acc: rank 0 exitcode -11 (SIGSEGV) at step 2, rank 2 'Connection reset by peer', exit 1
  R18: dugong_ckpt_size_np6_rall_tee: all 6 ranks load_state_dict size mismatch for net.0.weight, exit 1
  R19: dugong_worker_sigkill_np4_r0_torchrun: rank 0 'DataLoader worker (pid N) is killed by signal: Killed.', exit 1
  R20: dugong_loader_timeout_np3_r0_torchrun: rank 0 'DataLoader timed out after 2 seconds' after 2 steps, exit 1
  R21: (unused)
  R22: (unused)
"""
import argparse
import gzip
import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault630_work"
SPECIES = ["halodule", "halophila", "zostera", "cymodocea"]
NFEAT = 8
NROWS = 64
STEPS = 6
BS = 4


def prepare():
    os.makedirs(WORK, exist_ok=True)
    rng = np.random.default_rng(630)
    for r in range(8):
        arr = rng.standard_normal((NROWS, NFEAT + 1)).astype(np.float32)
        np.save(os.path.join(WORK, f"trail_shard_{r}.npy"), arr)
        with gzip.open(os.path.join(WORK, f"labels_{r}.csv.gz"), "wt") as f:
            for i in range(NROWS):
                f.write(f"{i},{SPECIES[i % 4]},{float(arr[i, -1]):.4f}\n")
        with open(os.path.join(WORK, f"notes_{r}.jsonl"), "w") as f:
            for i in range(NROWS):
                f.write(json.dumps({"idx": i, "species": SPECIES[i % 4], "depth_m": round(1.5 + i * 0.1, 2)}) + "\n")
        with open(os.path.join(WORK, f"trail_text_{r}.txt"), "w", encoding="utf-8") as f:
            for i in range(NROWS):
                f.write(f"{i}\t{SPECIES[i % 4]}\tgrazed\n")
    with open(os.path.join(WORK, "lookup.json"), "w") as f:
        json.dump({"species": {s: 0.5 + 0.25 * k for k, s in enumerate(SPECIES)}}, f)
    torch.manual_seed(0)
    torch.save(Grazer().state_dict(), os.path.join(WORK, "start.pt"))
    print("prepared", WORK)


class Grazer(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(NFEAT, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


class TrailDataset(Dataset):
    def __init__(self, rank, fault, fault_rank, hf=False):
        self.rank, self.hf = rank, hf
        self.bad = fault if (fault_rank == rank or fault_rank < 0) else "none"
        self.path = os.path.join(WORK, f"trail_shard_{rank}.npy")
        with open(os.path.join(WORK, "lookup.json")) as f:
            self.lookup = json.load(f)["species"]
        if self.bad == "npy_truncated":
            with open(self.path, "rb") as f:
                blob = f.read()
            self.path = os.path.join(WORK, f"trail_shard_{rank}_copy.npy")
            with open(self.path, "wb") as f:
                f.write(blob[: len(blob) // 3])
        if self.bad == "memmap_short":
            self.data = np.memmap(self.path, dtype=np.float32, mode="r", offset=128, shape=(NROWS * 4, NFEAT + 1))
        elif self.bad == "file_removed":
            self.path = os.path.join(WORK, f"trail_shard_{rank}_live.npy")
            np.save(self.path, np.load(os.path.join(WORK, f"trail_shard_{rank}.npy")))
            self.data = None
        else:
            self.data = np.load(self.path)
        if self.bad == "jsonl_broken":
            p = os.path.join(WORK, f"notes_{rank}_edit.jsonl")
            lines = open(os.path.join(WORK, f"notes_{rank}.jsonl")).read().splitlines()
            lines[2] = lines[2][:-9]
            open(p, "w").write("\n".join(lines) + "\n")
            self.notes = [json.loads(line) for line in open(p)]
        else:
            self.notes = [json.loads(line) for line in open(os.path.join(WORK, f"notes_{rank}.jsonl"))]
        tpath = os.path.join(WORK, f"trail_text_{rank}.txt")
        if self.bad == "unicode":
            txt = open(tpath, encoding="utf-8").read()
            tpath = os.path.join(WORK, f"trail_text_{rank}_u16.txt")
            open(tpath, "w", encoding="utf-16").write(txt)
        self.species = [ln.split("\t")[1] for ln in open(tpath, encoding="utf-8").read().splitlines()]
        self.gz = os.path.join(WORK, f"labels_{rank}.csv.gz")
        if self.bad == "gzip_truncated":
            blob = open(self.gz, "rb").read()
            self.gz = os.path.join(WORK, f"labels_{rank}_cut.csv.gz")
            open(self.gz, "wb").write(blob[: len(blob) - 40])
        if self.bad == "short_len":
            self.data = self.data[:10]

    def __len__(self):
        return 96 if self.bad == "short_len" else NROWS

    def __getitem__(self, idx):
        k = self.calls = getattr(self, "calls", -1) + 1  # sample count in this worker (sampler order differs in --hf)
        if self.bad == "worker_sigkill" and k == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.bad == "worker_segv" and k == 8:
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.bad == "loader_timeout" and k == 8:
            time.sleep(6)
        if self.bad == "gzip_truncated" and k == 8:
            with gzip.open(self.gz, "rt") as f:
                rows = f.read().splitlines()
            assert len(rows) == NROWS
        if self.data is None:
            row = np.load(self.path)[idx]
        else:
            row = np.asarray(self.data[idx])
        name = self.species[idx]
        if self.bad == "vocab_keyerror" and k == 10:
            name = "posidonia"
        scale = self.lookup[name]
        x = torch.from_numpy(np.array(row[:NFEAT], dtype=np.float32)) * scale
        if self.bad == "collate_unequal" and k == 9:
            x = x[:7]
        y = torch.tensor(float(row[-1]))
        if self.hf:
            ids = ((x.abs() * 10).long() % 60) + 2
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": int(y > 0)}
        return x, y


def worker_init(fault, fault_rank, rank):
    def fn(worker_id):
        if fault == "worker_init" and rank == fault_rank:
            raise RuntimeError(f"trail worker {worker_id}: seagrass tile index for rank {rank} is not ready")
    return fn


def make_loader(ds, args, rank):
    kw = dict(batch_size=BS, shuffle=False, num_workers=args.workers)
    if args.workers > 0:
        kw["worker_init_fn"] = worker_init(args.fault, args.rank, rank)
        if args.fault == "loader_timeout":
            kw["timeout"] = 2
    return DataLoader(ds, **kw)


def check_fault_main(args, rank, step, loss, model):
    mine = args.rank == rank or args.rank < 0
    if not mine:
        return loss
    if args.fault == "nan_loss" and step == 3:
        loss = loss * float("nan")
    if args.fault == "stall" and step == 2:
        time.sleep(45)
    if args.fault == "sigsegv" and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "file_removed" and step == 0:
        os.remove(os.path.join(WORK, f"trail_shard_{rank}_live.npy"))
    return loss


def load_start(model, args, rank):
    sd = torch.load(os.path.join(WORK, "start.pt"))
    if args.fault == "ckpt_size" and (args.rank == rank or args.rank < 0):
        sd["net.0.weight"] = torch.zeros(12, NFEAT)
    model.load_state_dict(sd)


def run_plain(args):
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = Grazer()
    load_start(model, args, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = make_loader(TrailDataset(rank, args.fault, args.rank), args, rank)
    it = iter(loader)
    for step in range(STEPS):
        x, y = next(it)
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        loss = check_fault_main(args, rank, step, loss, model)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: grazing loss is not finite ({loss.item()})")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        cover = torch.sigmoid(pred.detach()).mean().reshape(1)
        dist.all_reduce(cover)
        print(f"rank {rank} step {step} loss {loss.item():.4f} seagrass_cover {cover.item() / world:.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export_dugong.pt"))
        print("rank 0 saved export", os.path.join(WORK, "export_dugong.pt"), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_acc(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    torch.manual_seed(rank)
    model = Grazer()
    load_start(model, args, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    loader = make_loader(TrailDataset(rank, args.fault, args.rank), args, rank)
    it = iter(loader)
    for step in range(STEPS):
        x, y = next(it)
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        loss = check_fault_main(args, rank, step, loss, model)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: grazing loss is not finite ({loss.item()})")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        cover = acc.reduce(torch.sigmoid(pred.detach()).mean().reshape(1), reduction="mean")
        print(f"rank {rank} step {step} loss {loss.item():.4f} seagrass_cover {cover.item():.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), os.path.join(WORK, "export_dugong.pt"))
        print("rank 0 saved export", os.path.join(WORK, "export_dugong.pt"), flush=True)
    acc.end_training()


def run_hf(args):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    rank = int(os.environ.get("RANK", "0"))
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)

    class TrailTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = model(**inputs)
            loss = out.loss
            step = self.state.global_step
            loss = check_fault_main(args, rank, step, loss, model)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: grazing loss is not finite ({loss.item()})")
            cover = torch.softmax(out.logits.detach(), -1)[:, 1].mean()
            print(f"rank {rank} step {step} loss {loss.item():.4f} seagrass_cover {cover.item():.4f}", flush=True)
            return (loss, out) if return_outputs else loss

    targs = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, max_steps=STEPS, per_device_train_batch_size=BS,
                              dataloader_num_workers=args.workers, report_to=[], save_strategy="no",
                              logging_steps=3, learning_rate=1e-3, disable_tqdm=True)
    ds = TrailDataset(rank, args.fault, args.rank, hf=True)
    trainer = TrailTrainer(model=model, args=targs, train_dataset=ds)
    trainer.train()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export_dugong.pt"))
        print("rank 0 saved export", os.path.join(WORK, "export_dugong.pt"), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--acc", action="store_true")
    ap.add_argument("--hf", action="store_true")
    args = ap.parse_args()
    if args.prepare:
        return prepare()
    if args.hf:
        return run_hf(args)
    if args.acc:
        return run_acc(args)
    return run_plain(args)


if __name__ == "__main__":
    main()

"""Aurora substorm onset prediction from ground magnetometers: a small distributed training job
with ONE planted fault (batch 498 of the hand-run CPU fault logs).

Each rank reads its own shard of synthetic 1-minute magnetometer windows (X/Y/Z components,
64 minutes, several stations), maps station codes through a lookup table, starts from a shared
checkpoint and trains a small 1-D conv net to predict "substorm onset within 30 min".
gloo backend, CPU only, process-group timeout 12 s by default (--pg-timeout), 6 steps; every rank
prints `rank R step S loss L hss M` each step; rank 0 saves an export at the end.

Usage:
  python fault498.py --prepare --world 8            # writes /tmp/fault498_work
  accelerate launch --multi_gpu --num_processes W fault498.py --fault NAME --rank N
  torchrun --nproc_per_node W fault498.py --fault NAME --rank N
  torchrun --nproc_per_node W fault498.py --hf --fault NAME --rank N   # transformers.Trainer variant

Faults (--fault NAME, planted on rank --rank N unless noted):
  none           control, nothing planted
  keyerror       rank N's batch at step 2 names a station code (THL9) missing from the lookup table -> KeyError
                 (in --hf mode: raised from the Dataset's __getitem__)
  missing_shard  rank N opens a shard file that was never written (shard_rN_v2.npz) -> FileNotFoundError
  ckpt_size      rank N builds its head 48 wide instead of 32, load_state_dict of the start checkpoint -> size mismatch
  gather_shape   at step 3 rank N all_gathers a 5-element station summary while the others send 4
  slow_rank      at step 2 rank N spends ~40 s in pure-Python baseline detrending; its peers wait in all_reduce
                 (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan            at step 3 rank N's window holds a NaN (dropout of a station); the program's own finiteness
                 check raises FloatingPointError
  segv           at step 2 rank N sends itself SIGSEGV
  logexit        at step 2 rank N prints its own ERROR line (baseline drift) and calls sys.exit(4)
                 (in --hf mode: from a TrainerCallback)
  shape_all      every rank feeds 72-minute windows to a head built for 64 minutes at step 1 -> shape error on all ranks
  hostmem        rank N caps its address space (RLIMIT_AS, +600 MB) and builds an unbounded spectrogram cache
                 -> the CPU allocator refuses (kept small)
  worker_crash   rank N's DataLoader worker SIGKILLs itself while loading item 20 -> DataLoader worker killed

What happened (batch 498 runs, gloo, torch 2.13.0+cpu, 20 runs, ports 26300-26319):
  none           np4 acc and np3 Trainer/torchrun: all ranks print steps 1-6, export saved, exit 0.
  keyerror       np5 acc r3: KeyError 'THL9' at step 2 on rank 3; np3 Trainer r1: KeyError from __getitem__ after step 5; peers get gloo "Connection closed by peer"; exit 1.
  missing_shard  np6 torchrun r5: FileNotFoundError for shard_r5_v2.npz before step 1; the rest SIGTERMed; exit 1.
  ckpt_size      np4 accconfig r2: load_state_dict "size mismatch for fc.weight ... [32, 132] vs [48, 132]" before step 1; exit 1.
  gather_shape   np5 accdebug r4 and np3 tee r0: "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))" on the planted rank at step 3; peers "Connection closed by peer"; exit 1.
  slow_rank      np6 acc r2: the other 5 ranks "Timed out waiting 12000ms for send/recv", rank 2 silent and SIGTERMed; exit 1.
                 np4 tee r1 with --pg-timeout 300: output stops after step 1 until timeout 60 SIGTERMs torchrun (SignalException), exit 137.
  nan            np8 acc r6 and np4 acc2nodes r0: the script's FloatingPointError "non-finite loss nan at step 3"; peers "Connection closed by peer"; exit 1.
  segv           np5 torchrun r1 and np7 accdebug r6: no traceback, peers "Connection closed/reset by peer", summary exitcode -11 (SIGSEGV); exit 1.
  logexit        np3 Trainer/accelerate r2 and np4 acc2nodes r3: the rank's own "ERROR: ... baseline drift 812 nT" line, exitcode 4 in the summary; exit 1.
  shape_all      np6 accconfig: "mat1 and mat2 shapes cannot be multiplied (8x148 and 132x32)" on all 6 ranks at step 1; exit 1.
  hostmem        np5 acc r2: "DefaultCPUAllocator: can't allocate memory: you tried to allocate 67108864 bytes" at step 2; peers closed/timed out; exit 1.
  worker_crash   np4 torchrun r1 and np7 acc r3: "DataLoader worker (pid N) is killed by signal: Killed."; peers "Connection closed by peer"; exit 1.
"""
import argparse
import json
import os
import resource
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault498_work"
STATIONS = ["ABK", "KIR", "TRO", "SOD", "MUO", "PEL", "OUJ", "NUR", "HAN", "DOB", "LYR", "HOR"]
WIN = 64
HIDDEN = 32


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    rng = np.random.default_rng(498)
    with open(os.path.join(WORK, "stations.json"), "w") as f:
        json.dump({s: i for i, s in enumerate(STATIONS)}, f)
    for r in range(world):
        n = 96
        x = rng.normal(0, 1, size=(n, 3, WIN + 8)).astype(np.float32)
        y = (rng.random(n) < 0.3).astype(np.float32)
        x[y > 0, 0, -16:] -= 3.0  # negative bay in X before onset
        codes = rng.choice(STATIONS, size=n)
        np.savez(os.path.join(WORK, f"shard_r{r}.npz"), x=x, y=y, codes=codes)
    torch.manual_seed(0)
    torch.save(OnsetNet().state_dict(), os.path.join(WORK, "start.pt"))
    print(f"prepared {world} shards in {WORK}")


class OnsetNet(nn.Module):
    def __init__(self, hidden=HIDDEN, win=WIN, n_st=len(STATIONS)):
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 5, padding=2)
        self.emb = nn.Embedding(n_st, 4)
        self.fc = nn.Linear(8 * win // 4 + 4, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x, st):
        h = F.max_pool1d(F.relu(self.conv(x)), 4).flatten(1)
        h = torch.cat([h, self.emb(st)], 1)
        return self.out(F.relu(self.fc(h))).squeeze(1)


class ShardDS(torch.utils.data.Dataset):
    def __init__(self, path, table, crash_at=None, bad_key_at=None):
        d = np.load(path)
        self.x, self.y, self.codes = d["x"], d["y"], list(d["codes"])
        self.table, self.crash_at, self.bad_key_at = table, crash_at, bad_key_at

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        code = "THL9" if (self.bad_key_at is not None and i == self.bad_key_at) else str(self.codes[i])
        return torch.from_numpy(self.x[i, :, :WIN]), torch.tensor(self.table[code]), torch.tensor(self.y[i])


def hss(logit, y):
    p = (logit > 0).float()
    tp = (p * y).sum(); tn = ((1 - p) * (1 - y)).sum(); fp = (p * (1 - y)).sum(); fn = ((1 - p) * y).sum()
    den = (tp + fn) * (fn + tn) + (tp + fp) * (fp + tn)
    return float(2 * (tp * tn - fp * fn) / den) if den > 0 else 0.0


def detrend_baseline_python(seconds):
    # pure-Python quiet-day baseline removal, far too slow
    t0 = time.time(); acc = 0.0; k = 0
    while time.time() - t0 < seconds:
        for j in range(20000):
            acc += (j * 0.5) % 7
        k += 1
    return acc


def main_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    import torch.distributed as dist

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    me = args.rank == rank
    f = args.fault
    if rank == 0:
        print(f"[aurora-onset] world={world} backend={dist.get_backend()} fault={f} fault_rank={args.rank} "
              f"pg_timeout={args.pg_timeout}s", flush=True)
    with open(os.path.join(WORK, "stations.json")) as fh:
        table = json.load(fh)
    shard = os.path.join(WORK, f"shard_r{rank}_v2.npz" if (f == "missing_shard" and me) else f"shard_r{rank}.npz")
    print(f"rank {rank} loading shard {shard}", flush=True)
    ds = ShardDS(shard, table, crash_at=20 if (f == "worker_crash" and me) else None)
    workers = 1 if (f == "worker_crash" and me) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, num_workers=workers)
    model = OnsetNet(hidden=48 if (f == "ckpt_size" and me) else HIDDEN)
    sd = torch.load(os.path.join(WORK, "start.pt"), map_location="cpu", weights_only=True)
    model.load_state_dict(sd)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    cache = []
    it = iter(dl)
    for step in range(1, 7):
        xb, sb, yb = next(it)
        if f == "keyerror" and me and step == 2:
            codes = [str(c) for c in ds.codes[8:15]] + ["THL9"]
            sb = torch.tensor([table[c] for c in codes])
        if f == "shape_all" and step == 1:
            xb = torch.from_numpy(ds.x[:8, :, :WIN + 8])
        if f == "nan" and me and step == 3:
            xb = xb.clone(); xb[2, 1, 17:23] = float("nan")
        if f == "segv" and me and step == 2:
            print(f"rank {rank} reading station archive with native reader", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "logexit" and me and step == 2:
            print(f"ERROR: rank {rank}: station {ds.codes[9]} baseline drift 812 nT exceeds 500 nT limit; "
                  f"refusing to train on corrupted magnetograms", flush=True)
            sys.exit(4)
        if f == "slow_rank" and me and step == 2:
            print(f"rank {rank} recomputing quiet-day baselines in Python", flush=True)
            detrend_baseline_python(40 if args.pg_timeout < 100 else 600)
        if f == "hostmem" and me and step == 2:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/statm") as fh:
                vm = int(fh.read().split()[0]) * resource.getpagesize()
            resource.setrlimit(resource.RLIMIT_AS, (vm + 600 * 2**20, hard))
            print(f"rank {rank} building spectrogram cache for 4 years of 1-s data", flush=True)
            while True:
                cache.append(torch.ones(16 * 2**20, dtype=torch.float32))  # 64 MB per station-day
        logit = model(xb, sb)
        loss = F.binary_cross_entropy_with_logits(logit, yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                                     f"(magnetometer window contains NaN/inf)")
        acc.backward(loss)
        opt.step(); opt.zero_grad()
        m = torch.tensor([hss(logit.detach(), yb)])
        if f == "gather_shape" and me and step == 3:
            summ = torch.zeros(5)
        else:
            summ = torch.zeros(4)
        outs = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(outs, summ)
        dist.all_reduce(m)
        print(f"rank {rank} step {step} loss {loss.item():.4f} hss {m.item() / world:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        out = os.path.join(WORK, "export_onsetnet.pt")
        torch.save(acc.unwrap_model(model).state_dict(), out)
        print(f"saved export to {out}", flush=True)
    acc.end_training()


def main_hf(args):
    import transformers
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)

    rank = int(os.environ.get("RANK", "0"))
    me = args.rank == rank
    f = args.fault
    with open(os.path.join(WORK, "stations.json")) as fh:
        table = json.load(fh)
    d = np.load(os.path.join(WORK, f"shard_r{rank}.npz"))

    class TokDS(torch.utils.data.Dataset):
        # magnetometer X component quantised into 32 levels, station code as the first token
        def __len__(self):
            return len(d["y"])

        def __getitem__(self, i):
            code = "THL9" if (f == "keyerror" and me and i == 21) else str(d["codes"][i])
            q = np.clip(((d["x"][i, 0, :WIN] + 4) * 4).astype(np.int64), 0, 31) + 16
            ids = np.concatenate([[table[code]], q])
            return {"input_ids": torch.from_numpy(ids), "labels": torch.tensor(int(d["y"][i]))}

    class StepPrint(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if f == "logexit" and me and state.global_step == 2:
                print(f"ERROR: rank {rank}: station {d['codes'][9]} baseline drift 812 nT exceeds 500 nT limit; "
                      f"refusing to train on corrupted magnetograms", flush=True)
                sys.exit(4)

    class T(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            out = model(**inputs)
            hs = hss(out.logits[:, 1] - out.logits[:, 0], inputs["labels"].float())
            print(f"rank {rank} step {self.state.global_step + 1} loss {out.loss.item():.4f} hss {hs:.4f}", flush=True)
            return (out.loss, out) if return_outputs else out.loss

    cfg = BertConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=80, num_labels=2)
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=os.path.join(WORK, f"hf_out_{rank}"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=6, per_device_train_batch_size=8,
                              logging_steps=1, save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    tr = T(model=model, args=targs, train_dataset=TokDS(), callbacks=[StepPrint()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(os.path.join(WORK, "export_hf"))
        print(f"saved export to {os.path.join(WORK, 'export_hf')}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    a = ap.parse_args()
    if a.prepare:
        prepare(a.world)
    elif a.hf:
        main_hf(a)
    else:
        main_accelerate(a)

"""Rooftop solar panel soiling detection: a small distributed training job with ONE planted fault.

Each rank reads its own shard of rooftop panel image patches (8x8 grey patches, flattened, plus
4 sensor features: irradiance ratio, tilt, days since rain, dust index looked up per site) and
regresses the soiling fraction of the panel. A site lookup table (site id -> dust index) and an
initial checkpoint come from `--prepare`. Gloo backend, CPU only, process-group timeout 12 s by
default (`--pg-timeout`), 6 steps; every rank prints `rank R step S loss L soil_mae M` each step
and rank 0 saves an export at the end.

Modes: default = Accelerate script (Accelerator(cpu=True), gloo, InitProcessGroupKwargs timeout),
works under `accelerate launch` and `torchrun`; `--hf` = a transformers.Trainer run with a tiny
config-built BERT classifier (clean / light / heavy soiling), TrainingArguments(use_cpu=True,
ddp_backend="gloo", ddp_timeout=12, report_to=[]).

Faults (`--fault NAME --rank N`):
  none            control run, nothing planted
  keyerror        rank N meets a site id missing from the site lookup table -> KeyError
                  (in --hf mode: inside the dataset's __getitem__)
  missing_shard   rank N's shard file is not there (wrong shard name) -> FileNotFoundError
  ckpt_size       rank N loads the wide (hidden 48) checkpoint into the hidden-32 model ->
                  load_state_dict size mismatch (RuntimeError)
  weights_only    rank N loads the checkpoint that also pickles a PanelCalibration object ->
                  torch.load(weights_only=True) refuses it (UnpicklingError)
  allreduce_size  at step 3 rank N all-reduces its metrics tensor with 3 elements instead of 2
                  (gloo size mismatch between ranks)
  slow            at step 3 rank N does pure-Python re-tiling work for 45 s; its peers time out
                  in the metrics all_reduce (12 s); with --pg-timeout 300 the job just hangs
                  until the outer `timeout` stops it
  nan             rank N's shard has an inf irradiance ratio in batch 3; the loss becomes
                  non-finite and the script's own check raises FloatingPointError
  segv            at step 2 rank N sends itself SIGSEGV
  logged_exit     at step 3 rank N prints its own ERROR line (site calibration out of range) and
                  calls sys.exit(4)  (in --hf mode from a TrainerCallback)
  shape_all       every rank builds 67 features instead of 68 (sensor column dropped) ->
                  mat1 and mat2 shapes cannot be multiplied (RuntimeError)
  hostmem         at step 2 rank N tries to build a dense pairwise patch-similarity matrix over
                  all 8.4M patches -> DefaultCPUAllocator cannot allocate (RuntimeError)
  worker_crash    rank N uses a DataLoader worker that is SIGKILLed while decoding batch 2 ->
                  "DataLoader worker ... is killed by signal"

What happened (filled in after the runs; exit = the launcher's exit code):
  none            roof_none_np3_rnone_acc: 6 steps on all 3 ranks, export saved; exit 0.
  keyerror        roof_keyerror_np4_r2_acc, roof_keyerror_np6_r5_torchrun, roof_keyerror_np4_r3_hf: KeyError 'site-0317'
                  on the planted rank; exit 1 (np6: the launcher's root cause is rank 0, SIGABRT, a cascade).
  missing_shard   roof_missing_shard_np5_r3_accdebug: FileNotFoundError on rank 3 before step 1; exit 1.
  ckpt_size       roof_ckpt_size_np4_r1_accconfig: load_state_dict size mismatch on rank 1; exit 1.
  weights_only    roof_weights_only_np3_r2_tee: "Weights only load failed" UnpicklingError on rank 2; exit 1.
  allreduce_size  roof_allreduce_size_np4_r3_acc, roof_allreduce_size_np6_r1_accdebug: gloo raises no size
                  error; the mean is corrupted or missing, then every rank times out (12000ms); exit 1.
  slow            roof_slow_np4_r2_acc: peers time out after 12 s at step 3, rank 2 SIGTERMed; exit 1.
                  roof_slow_np3_r1_torchrun (--pg-timeout 300): nothing after step 2, timeout 60 ends it; exit 124.
  nan             roof_nan_np4_r3_acc2nodes, roof_nan_np3_r0_torchrun: FloatingPointError on the planted rank; exit 1.
  segv            roof_segv_np8_r6_acc, roof_segv_np4_r0_tee: planted rank exits -11 (SIGSEGV), no traceback; exit 1.
  logged_exit     roof_logged_exit_np5_r2_accconfig, roof_logged_exit_np7_r6_accdebug, roof_logged_exit_np3_r1_hf:
                  ERROR line, then exit code 4 on the planted rank; exit 1.
  shape_all       roof_shape_all_np3_rall_accconfig: every rank raises the mat1/mat2 RuntimeError; exit 1.
  hostmem         roof_hostmem_np5_r4_torchrun: DefaultCPUAllocator can't allocate 282240000000000 bytes on rank 4; exit 1.
  worker_crash    roof_worker_crash_np5_r1_acc: "DataLoader worker ... is killed by signal: Killed" on rank 1; exit 1.
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault503_work"
N_FEAT = 68
HIDDEN = 32
MAX_SHARDS = 8
ROWS = 160
BATCH = 16
STEPS = 6


class PanelCalibration:
    """Per-installation calibration record (a plain Python object, pickled into one checkpoint)."""

    def __init__(self, site, gain, offset):
        self.site, self.gain, self.offset = site, gain, offset


def make_model(hidden=HIDDEN):
    return nn.Sequential(nn.Linear(N_FEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(503)
    sites = {f"site-{i:04d}": round(0.1 + 0.8 * i / 40, 3) for i in range(40)}
    with open(f"{WORK}/site_dust_index.json", "w") as f:
        json.dump(sites, f)
    for r in range(MAX_SHARDS):
        patches = torch.rand(ROWS, 64, generator=g)
        sensors = torch.rand(ROWS, 3, generator=g)
        site_ids = [f"site-{int(i):04d}" for i in torch.randint(0, 40, (ROWS,), generator=g)]
        soil = (patches.mean(1, keepdim=True) * 0.7 + sensors[:, 2:3] * 0.3).clamp(0, 1)
        cls = (soil.squeeze(1) * 3).long().clamp(0, 2)
        torch.save({"patches": patches, "sensors": sensors, "site_ids": site_ids,
                    "soil": soil, "cls": cls}, f"{WORK}/shards/roof_shard_{r:02d}.pt")
    torch.manual_seed(0)
    m = make_model()
    torch.save(m.state_dict(), f"{WORK}/ckpt/roof_init.pt")
    torch.save(make_model(48).state_dict(), f"{WORK}/ckpt/roof_init_wide_v2.pt")
    torch.save({"model": m.state_dict(), "calibration": PanelCalibration("site-0007", 1.03, -0.02)},
               f"{WORK}/ckpt/roof_init_calibrated.pt")
    print(f"prepared {MAX_SHARDS} shards, site table and checkpoints in {WORK}")


def load_shard(rank, fault, fault_rank):
    name = f"{WORK}/shards/roof_shard_{rank % MAX_SHARDS:02d}.pt"
    if fault == "missing_shard" and rank == fault_rank:
        name = f"{WORK}/shards/roof_shard_{rank:02d}_deduped.pt"
    return torch.load(name)


class PatchSet(torch.utils.data.Dataset):
    def __init__(self, shard, sites, rank, fault, fault_rank):
        self.s, self.sites, self.rank, self.fault, self.fault_rank = shard, sites, rank, fault, fault_rank
        if fault == "keyerror" and rank == fault_rank:
            # a shard written after the site table: batch 3 holds a site the table does not know
            self.s["site_ids"][2 * BATCH + 5] = "site-0317"
        if fault == "nan" and rank == fault_rank:
            self.s["sensors"][2 * BATCH + 3, 0] = float("inf")

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        if (self.fault == "worker_crash" and self.rank == self.fault_rank and i == BATCH + 3
                and torch.utils.data.get_worker_info() is not None):
            os.kill(os.getpid(), signal.SIGKILL)
        dust = self.sites[self.s["site_ids"][i]]
        feat = torch.cat([self.s["patches"][i], self.s["sensors"][i], torch.tensor([dust])])
        if self.fault == "shape_all":
            feat = feat[:-1]  # dust index column dropped by a refactor, on every rank
        return feat, self.s["soil"][i]


def main_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    fr = args.rank
    print(f"rank {rank}/{world} up on {acc.device} (backend {dist.get_backend()}, "
          f"pg timeout {args.pg_timeout}s, fault {args.fault} on rank {fr})", flush=True)

    with open(f"{WORK}/site_dust_index.json") as f:
        sites = json.load(f)
    shard = load_shard(rank, args.fault, fr)
    model = make_model()
    ckpt = f"{WORK}/ckpt/roof_init.pt"
    if args.fault == "ckpt_size" and rank == fr:
        ckpt = f"{WORK}/ckpt/roof_init_wide_v2.pt"
    if args.fault == "weights_only" and rank == fr:
        state = torch.load(f"{WORK}/ckpt/roof_init_calibrated.pt")["model"]
    else:
        state = torch.load(ckpt)
    model.load_state_dict(state)

    ds = PatchSet(shard, sites, rank, args.fault, fr)
    workers = 1 if (args.fault == "worker_crash" and rank == fr) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(1, STEPS + 1):
        x, y = next(it)
        if args.fault == "segv" and rank == fr and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if args.fault == "hostmem" and rank == fr and step == 2:
            n_patches = 8_400_000
            sim = torch.empty((n_patches, n_patches), dtype=torch.float32)  # dense similarity
            sim.zero_()
        if args.fault == "logged_exit" and rank == fr and step == 3:
            print(f"ERROR: rank {rank}: irradiance calibration for site-0007 out of range "
                  f"(gain 7.91, allowed 0.8..1.2); refusing to train on uncalibrated panels",
                  flush=True)
            sys.exit(4)
        if args.fault == "slow" and rank == fr and step == 3:
            # pure-Python re-tiling of the patch grid: holds the GIL, no collective for a long time
            end = time.time() + (45 if args.pg_timeout < 60 else 400)
            tiles = 0
            while time.time() < end:
                tiles += sum(i * i for i in range(2000)) % 7
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                                     f"(soiling batch {step})")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        mae = (pred.detach() - y).abs().mean()
        stats = torch.stack([loss.detach(), mae])
        if args.fault == "allreduce_size" and rank == fr and step == 3:
            stats = torch.cat([stats, torch.tensor([float(len(x))])])  # batch count appended here only
        dist.all_reduce(stats)
        stats /= world
        print(f"rank {rank} step {step} loss {loss.item():.4f} soil_mae {mae.item():.4f} "
              f"(mean loss {stats[0].item():.4f})", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        path = f"{WORK}/export/roof_soiling_mlp.pt"
        acc.save(acc.unwrap_model(model).state_dict(), path)
        print(f"rank 0 saved export to {path}", flush=True)
    acc.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


def main_hf(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer,
                              TrainerCallback, TrainingArguments)

    rank = int(os.environ.get("RANK", "0"))
    fr = args.rank
    with open(f"{WORK}/site_dust_index.json") as f:
        sites = json.load(f)
    shard = load_shard(rank, args.fault, fr)

    class TokenSet(torch.utils.data.Dataset):
        def __init__(self):
            if args.fault == "keyerror" and rank == fr:
                # rows of a newer installation the site table does not list yet
                for i in range(5, ROWS, 23):
                    shard["site_ids"][i] = "site-0317"

        def __len__(self):
            return ROWS

        def __getitem__(self, i):
            dust = sites[shard["site_ids"][i]]
            toks = (shard["patches"][i][:31] * 60).long() + 2
            ids = torch.cat([torch.tensor([1]), toks, torch.tensor([int(dust * 60) + 2])])
            return {"input_ids": ids, "labels": shard["cls"][i]}

    class StepPrinter(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {float(logs.get('grad_norm', 0.0)):.4f}", flush=True)

        def on_step_begin(self, targs, state, control, **kw):
            if args.fault == "logged_exit" and rank == fr and state.global_step == 2:
                print(f"ERROR: rank {rank}: irradiance calibration for site-0007 out of range "
                      f"(gain 7.91, allowed 0.8..1.2); refusing to train on uncalibrated panels",
                      flush=True)
                sys.exit(4)

    cfg = BertConfig(vocab_size=72, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=40, num_labels=3)
    model = BertForSequenceClassification(cfg)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", per_device_train_batch_size=BATCH,
                              max_steps=STEPS, logging_steps=1, save_strategy="no", use_cpu=True,
                              ddp_backend="gloo", ddp_timeout=args.pg_timeout, report_to=[],
                              dataloader_num_workers=0, disable_tqdm=True, seed=503)
    trainer = Trainer(model=model, args=targs, train_dataset=TokenSet(), callbacks=[StepPrinter()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/roof_soiling_bert")
        print(f"rank 0 saved export to {WORK}/export/roof_soiling_bert", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    else:
        main_accelerate(a)

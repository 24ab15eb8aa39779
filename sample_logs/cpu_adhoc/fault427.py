"""Batch 427 hand-run fault script: PULSAR CANDIDATE CLASSIFICATION.

Synthetic pulsar candidates from a periodicity search: each candidate has a folded pulse profile (32 phase
bins), a signal-to-noise ratio, a dispersion measure, a spin period and the survey that found it (looked up
in a 4-entry survey table).  Every rank reads its own candidate shard, /tmp/fault427_work/data/cands_R.csv
plus data/profiles_R.pt, normalises each profile (subtract median, divide by std) and trains a small
classifier (a 1-D conv over the profile, an MLP over the scalars) to tell pulsars from RFI and noise.
The script uses Hugging Face accelerate (Accelerator(cpu=True) with InitProcessGroupKwargs(backend="gloo",
timeout=--pg-timeout)); the model starts from ckpt/pulsar_init.pt, the loss is accelerator.reduce'd and the
per-rank hit counts accelerator.gather'ed every step, and rank 0 saves export/pulsar_clf.pt through
accelerator.save at the end.  With --hf the training loop is a transformers.Trainer over a tiny BERT
(built from a BertConfig, no download) that reads the profile digitised into 16 levels as tokens.

Faults (--fault NAME --rank R, R = -1 for every rank):
  badsnr      - rank R's shard has an SNR of "n/a" in one row: float() fails while parsing (ValueError, start-up)
  survey      - rank R's shard names survey "LOFAR", not in the survey table: KeyError in the collate fn (step 3)
  nofile      - rank R reads its shard from data/reprocessed/, which does not exist (FileNotFoundError, start-up)
  ckptsize    - rank R starts from ckpt/pulsar_init_64bin.pt, saved for 64-bin profiles (size mismatch, start-up)
  weightsonly - rank R reloads ckpt/pulsar_best.pt for the final evaluation; it holds a pickled SearchConfig
                object, so torch.load(weights_only=True) refuses it (UnpicklingError, the end)
  gathershape - rank R gathers its hit counts with an extra RFI-flag entry (3 vs 2 values) at step 2
  slowfold    - rank R re-folds every candidate in pure Python before step 3 (the others' reduce times out)
  hang        - rank R waits forever on a telescope-archive lock at step 4 (run with --pg-timeout 300)
  nanprofile  - rank R's third batch has a flat (all-zero) profile: std 0, the normalised profile is NaN and
                the program's own finiteness check raises FloatingPointError (step 3)
  sigsegv     - rank R sends itself SIGSEGV after step 3
  exit2       - rank R prints its own error line (no candidates left after RFI masking) and sys.exit(2) at the end
  widthall    - every rank: profiles are re-binned to 64 bins but the model's conv head expects 32 (shape error)
  hfcollate   - (--hf) rank R's collator appends one extra label to its third batch (batch size mismatch in the loss)
  hfcallback  - (--hf) rank R's ArchiveCallback raises when it cannot register step 3's checkpoint
  none        - control, clean run

What happened (filled in after the runs):
  badsnr      - 'ValueError: could not convert string to float: 'n/a'' at start-up; others SIGTERMed (np4 r2 torchrun, np5 r0 acc)
  survey      - 'KeyError: 'LOFAR'' in the collate fn after step 2; peers Connection closed (np3 r1 tee, np4 r3 accconfig)
  nofile      - FileNotFoundError for data/reprocessed/profiles_1.pt; node 1's ranks closed in DDP's param check (np4 r1 acc2nodes)
  ckptsize    - load_state_dict size mismatch for prof_fc.weight [16,256] vs [16,128] at start-up (np3 r0 accconfig, np5 r3 torchrun)
  weightsonly - after step 6 'Weights only load failed ... Unsupported global: GLOBAL __main__.SearchConfig'; peers closed in
                wait_for_everyone (np4 r2 acc)
  gathershape - --debug: DistributedOperationException on every rank, 'Process 1: [3]' (np4 r1 accdebug); no debug: rank 0
                SIGABRT on gloo 'op.preamble.length <= op.nbytes. 12 vs 8', peers Connection reset (np3 r2 torchrun)
  slowfold    - 'Timed out waiting 12000ms' for recv (rank 0) and send (rank 2); Root Cause rank 0 (np3 r1 acc)
  hang        - silent after 'rank 2: waiting for the archive lock'; timeout SIGTERM at 60 s, exit 124 (np4 r2 tee)
  nanprofile  - 'FloatingPointError: rank 4 step 3: 32 non-finite values in normalised profiles' (np6 r4 accdebug)
  sigsegv     - no traceback; node 0 Root Cause rank 0 exitcode -11 (SIGSEGV); peers reset/closed (np4 r0 acc2nodes)
  exit2       - rank 2's 'ERROR rank 2: 0 of 128 candidates left after RFI masking', Root Cause exitcode 2 (np5 r2 tee)
  widthall    - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x256 and 128x16)'; Root Cause rank 1 (np3 accconfig)
  hfcollate   - Trainer: 'ValueError: Expected input batch_size (16) to match target batch_size (17).' on rank 1 (np4 r1 hf, torchrun)
  hfcallback  - Trainer: rank 0's callback 'RuntimeError: ... candidate archive refused checkpoint for step 3' (np3 r0 hf, accelerate)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/pulsar_clf.pt, exit 0 (np3 acc)
  (The runs used this file with a one-line placeholder here, so traceback line numbers are 17 lower than in this copy.)
"""
import argparse
import csv
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault427_work"
SURVEYS = {"PMPS": 0, "HTRU": 1, "GBNCC": 2, "PALFA": 3}
NBIN = 32
BATCH = 16
NSHARD = 6


class SearchConfig:
    def __init__(self, nbin, dm_max):
        self.nbin = nbin
        self.dm_max = dm_max


def prepare():
    g = torch.Generator().manual_seed(427)
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    names = list(SURVEYS)
    for r in range(NSHARD):
        n = BATCH * 8
        labels = torch.randint(0, 2, (n,), generator=g)
        phase = torch.linspace(0, 1, NBIN)
        centre = torch.rand(n, 1, generator=g)
        pulse = torch.exp(-((phase[None] - centre) ** 2) / 0.002) * labels[:, None] * 3
        prof = pulse + torch.randn(n, NBIN, generator=g) * 0.5
        torch.save(prof, f"{WORK}/data/profiles_{r}.pt")
        with open(f"{WORK}/data/cands_{r}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["cand_id", "survey", "snr", "dm", "period_ms", "label"])
            for i in range(n):
                snr = 8 + float(torch.rand(1, generator=g)) * 20 + 10 * int(labels[i])
                w.writerow([f"J{r}{i:04d}", names[i % 4], f"{snr:.2f}",
                            f"{float(torch.rand(1, generator=g)) * 400:.1f}",
                            f"{1 + float(torch.rand(1, generator=g)) * 900:.3f}", int(labels[i])])
    torch.save(PulsarNet(NBIN).state_dict(), f"{WORK}/ckpt/pulsar_init.pt")
    torch.save(PulsarNet(64).state_dict(), f"{WORK}/ckpt/pulsar_init_64bin.pt")
    torch.save({"model": PulsarNet(NBIN).state_dict(), "config": SearchConfig(NBIN, 1000.0)},
               f"{WORK}/ckpt/pulsar_best.pt")
    torch.save(PulsarNet(NBIN).state_dict(), f"{WORK}/ckpt/pulsar_best_weights.pt")
    print("prepared", WORK)


class PulsarNet(nn.Module):
    def __init__(self, nbin):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 5, padding=2)
        self.prof_fc = nn.Linear(4 * nbin, 16)
        self.scal_fc = nn.Linear(3 + len(SURVEYS), 16)
        self.head = nn.Linear(32, 2)

    def forward(self, prof, scal):
        h = F.relu(self.conv(prof[:, None, :])).flatten(1)
        h = torch.cat([F.relu(self.prof_fc(h)), F.relu(self.scal_fc(scal))], dim=1)
        return self.head(h)


def read_shard(rank, fault, frank):
    base = f"{WORK}/data"
    if fault == "nofile" and rank == frank:
        base = f"{WORK}/data/reprocessed"
    prof = torch.load(f"{base}/profiles_{rank}.pt", weights_only=True)
    rows = []
    with open(f"{base}/cands_{rank}.csv") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if fault == "badsnr" and rank == frank and i == 37:
                row["snr"] = "n/a"
            if fault == "survey" and rank == frank and i == 2 * BATCH + 5:
                row["survey"] = "LOFAR"
            rows.append((row["survey"], float(row["snr"]), float(row["dm"]), float(row["period_ms"]),
                         int(row["label"])))
    if fault == "nanprofile" and rank == frank:
        prof[2 * BATCH + 3] = 0.0
    if fault == "widthall":
        prof = F.interpolate(prof[:, None, :], size=64, mode="linear").squeeze(1)
    return prof, rows


def normalise(p):
    med = p.median(dim=-1, keepdim=True).values
    return (p - med) / p.std(dim=-1, keepdim=True)


def make_collate():
    def collate(items):
        prof = torch.stack([normalise(p) for p, _ in items])
        scal = torch.zeros(len(items), 3 + len(SURVEYS))
        labels = torch.zeros(len(items), dtype=torch.long)
        for j, (_, (survey, snr, dm, period, label)) in enumerate(items):
            scal[j, 0] = snr / 30.0
            scal[j, 1] = dm / 400.0
            scal[j, 2] = period / 1000.0
            scal[j, 3 + SURVEYS[survey]] = 1.0
            labels[j] = label
        return prof, scal, labels
    return collate


def slow_refold(rows, seconds=40.0):
    # re-fold every candidate at 256 trial periods, in pure Python
    t0 = time.time()
    acc = 0.0
    while time.time() - t0 < seconds:
        for _, snr, dm, period, _ in rows:
            for k in range(256):
                acc += (snr * k) % (period + 1.0)
    return acc


def train(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = accelerator.process_index, accelerator.num_processes
    fault, frank = args.fault, args.rank
    mine = frank == -1 or rank == frank
    print(f"rank {rank}/{world} device {accelerator.device} backend {accelerator.state.backend} fault {fault}",
          flush=True)
    prof, rows = read_shard(rank, fault, -2 if frank == -1 else frank)
    ds = list(zip(prof, rows))
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, collate_fn=make_collate())
    model = PulsarNet(NBIN)
    init = f"{WORK}/ckpt/pulsar_init.pt"
    if fault == "ckptsize" and mine:
        init = f"{WORK}/ckpt/pulsar_init_64bin.pt"
    model.load_state_dict(torch.load(init, weights_only=True))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    model.train()
    step = 0
    for prof_b, scal_b, lab_b in loader:
        step += 1
        if step > args.steps:
            break
        if fault == "slowfold" and mine and step == 3:
            print(f"rank {rank}: re-folding {len(rows)} candidates at 256 trial periods", flush=True)
            slow_refold(rows)
        if fault == "hang" and mine and step == 4:
            print(f"rank {rank}: waiting for the archive lock", flush=True)
            threading.Event().wait()
        if not torch.isfinite(prof_b).all():
            bad = int((~torch.isfinite(prof_b)).sum())
            raise FloatingPointError(f"rank {rank} step {step}: {bad} non-finite values in normalised profiles")
        logits = model(prof_b, scal_b)
        loss = F.cross_entropy(logits, lab_b)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        hits = torch.tensor([(logits.argmax(1) == lab_b).sum().item(), len(lab_b)], dtype=torch.long)
        if fault == "gathershape" and mine and step == 2:
            hits = torch.cat([hits, torch.tensor([int((scal_b[:, 0] < 0.3).sum())])])
        all_hits = accelerator.gather(hits).view(-1, 2)
        mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
        acc = all_hits[:, 0].sum().item() / max(1, all_hits[:, 1].sum().item())
        print(f"rank {rank} step {step} loss {mean_loss.item():.4f} acc {acc:.3f}", flush=True)
        if fault == "sigsegv" and mine and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "exit2" and mine:
        print(f"ERROR rank {rank}: 0 of {len(rows)} candidates left after RFI masking; refusing to export",
              flush=True)
        sys.exit(2)
    best = f"{WORK}/ckpt/pulsar_best_weights.pt"
    if fault == "weightsonly" and mine:
        best = f"{WORK}/ckpt/pulsar_best.pt"
    ref = torch.load(best, weights_only=True)
    print(f"rank {rank} reference checkpoint {os.path.basename(best)} with {len(ref)} entries", flush=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.save(accelerator.unwrap_model(model).state_dict(), f"{WORK}/export/pulsar_clf.pt")
        print(f"rank 0 saved {WORK}/export/pulsar_clf.pt", flush=True)
    accelerator.end_training()


def train_hf(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)
    rank = int(os.environ.get("RANK", "0"))
    fault, frank = args.fault, args.rank
    mine = frank == -1 or rank == frank
    prof, rows = read_shard(rank, fault, frank)
    prof = normalise(prof)
    tokens = ((prof.clamp(-2, 6) + 2) * 15 / 8).round().long()
    items = [{"input_ids": tokens[i], "labels": rows[i][4]} for i in range(len(rows))]
    cfg = BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=NBIN, num_labels=2)
    model = BertForSequenceClassification(cfg)
    ncall = [0]

    def collator(batch):
        ncall[0] += 1
        ids = torch.stack([b["input_ids"] for b in batch])
        labels = torch.tensor([b["labels"] for b in batch])
        if fault == "hfcollate" and mine and ncall[0] == 3:
            labels = torch.cat([labels, labels[:1]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    class ArchiveCallback(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            if fault == "hfcallback" and mine and state.global_step == 3:
                raise RuntimeError(f"rank {rank}: candidate archive refused checkpoint for step 3 "
                                   f"(quota of 2 registered checkpoints reached)")
            return control

    class LossPrinter(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} acc n/a", flush=True)

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", per_device_train_batch_size=BATCH,
                              max_steps=args.steps, logging_steps=1, save_strategy="no", use_cpu=True,
                              ddp_backend="gloo", ddp_timeout=args.pg_timeout, report_to=[],
                              dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=items, data_collator=collator,
                      callbacks=[ArchiveCallback(), LossPrinter()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/hf_pulsar")
        print(f"rank 0 saved {WORK}/export/hf_pulsar", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    train_hf(args) if args.hf else train(args)


if __name__ == "__main__":
    main()

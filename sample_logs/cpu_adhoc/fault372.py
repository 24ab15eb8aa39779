"""A three-hundred-and-seventy-second hand-run batch: MUSIC GENRE TAGGING FROM MEL SPECTROGRAMS (accelerate).

Synthetic clips as log-mel spectrograms (64 mel bins x 32 frames).  Every clip carries one to three genre tags
by name; the names are looked up in a 10-entry genre table and turned into a multi-hot target.  Every rank
reads its clips from /tmp/fault372_work/mels/mels_R.pt and trains a small CNN tagger (two conv blocks, mean
pooling over time, a linear head) with a BCE loss under Hugging Face accelerate (Accelerator(cpu=True), gloo,
the PG timeout from --pg-timeout through InitProcessGroupKwargs).  The tagger is initialised from
ckpt/tagger.pt.  The loss is reduced with accelerator.reduce and the logits gathered with accelerator.gather
every step (tag accuracy); rank 0 saves export/tagger.pt with accelerator.save at the end.
--hf: the training loop is a transformers.Trainer over a tiny ASTForAudioClassification built from a config.

Faults:
  genrekey   - rank N's clips carry the tag "vaporwave", missing from the genre table (KeyError at start-up)
  nomels     - rank N reads its clips from mels/test/ which does not exist (FileNotFoundError at start-up)
  ckptsize   - rank N initialises from ckpt/tagger_16tags.pt, saved with a 16-tag head (size mismatch)
  ckptpickle - rank N initialises from ckpt/tagger_full.pt, which pickles a TaggerConfig object (weights_only)
  gathershape- rank N gathers its logits at step 3 with an extra "unknown genre" column (11 vs 10)
  slow       - rank N runs a pure-Python onset detector over its clips before the step-2 reduce (~30 s)
  stuck      - rank N waits forever for an audio decoder queue before step 2 (run with --pg-timeout 300)
  nanloss    - rank N's mels are log(0) at step 4 (-inf), the loss is NaN: the program's check raises
  sigkill    - rank N sends itself SIGKILL after step 2
  exit4      - rank N prints its own error line about a sample-rate mismatch and calls sys.exit(4)
  nmels      - every rank: the mels are built with 80 bins, the tagger expects 64 (shape error in forward)
  hfcollate  - (--hf) rank N's collator drops the last tag column of one batch (BCE target size error)
  hfcallback - (--hf) a callback on rank N raises at step 3 (tag-balance check)
  none       - control, clean run

What happened (filled in after the runs):
  genrekey   - "KeyError: 'vaporwave'" at start-up; others SIGTERMed; Root Cause names the rank (np4 r2 acc, np5 r0 tee)
  nomels     - FileNotFoundError for mels/test/mels_N.pt at start-up (np4 r3 acc2nodes: node 0's ranks die on Connection closed
               by peer; np3 r1 accconfig rerun on port 59222); the first accconfig try used distributed_type MULTI_CPU, which
               accelerate runs as one plain process: "ValueError: Default process group has not been initialized" (kept as
               mgen_multicpu_np3_rnone_accconfig, launch_usage)
  ckptsize   - load_state_dict size mismatch for head.weight [16, 32] vs [10, 32] (np4 r1 torchrun, np6 r4 accdebug)
  ckptpickle - "_pickle.UnpicklingError: Weights only load failed" on rank 0 (np3 r0 accconfig)
  gathershape- --debug: DistributedOperationException with "Process 2: [8, 11]" on every rank (np4 r2 accdebug); without
               --debug a peer aborts on gloo "Received data size doesn't match expected size" (SIGABRT, Root Cause rank 2,
               the faulty rank is 1) and the others get Connection reset (np3 r1 acc)
  slow       - peers "Timed out waiting 12000ms for recv/send operation"; Root Cause names a waiting peer (np3 r2 torchrun,
               np4 r0 acc2nodes)
  stuck      - rank 1's 'waiting for the audio decoder queue', then silence; timeout's SIGTERM at 60 s, exit 124 (np4 r1 tee)
  nanloss    - "FloatingPointError: rank N step 4: non-finite loss nan (mel range -inf .. -inf)" (np5 r3 accconfig, np3 r0 torchrun)
  sigkill    - no traceback; Root Cause "Signal 9 (SIGKILL)" for the rank; peers Connection reset (np4 r2 acc2nodes, np3 r1 accdebug)
  exit4      - rank N's sample-rate ERROR line, exit 4, Root Cause exitcode 4 (np6 r5 tee, np3 r2 acc)
  nmels      - every rank: "expected input[8, 80, 32] to have 64 channels, but got 80 channels instead" (np3 accdebug)
  hfcollate  - Trainer: "ValueError: Target size (torch.Size([8, 9])) must be the same as input size (torch.Size([8, 10]))"
               on rank 0 at step 3 (np4 r0 hf, accelerate launch)
  hfcallback - Trainer: the callback's RuntimeError on rank 1 at step 3; Root Cause rank 1 (np3 r1 hf, torchrun)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/tagger.pt, exit 0 (np3 acc)
"""
import argparse
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault372_work"
GENRES = {"rock": 0, "pop": 1, "jazz": 2, "classical": 3, "hiphop": 4,
          "electronic": 5, "metal": 6, "folk": 7, "blues": 8, "reggae": 9}
NTAG = len(GENRES)
NMELS = 64
FRAMES = 32


class TaggerConfig:
    def __init__(self, ntag=NTAG, nmels=NMELS):
        self.ntag = ntag
        self.nmels = nmels


class Tagger(nn.Module):
    def __init__(self, ntag=NTAG, nmels=NMELS):
        super().__init__()
        self.nmels = nmels
        self.conv1 = nn.Conv1d(nmels, 32, 3, padding=1)
        self.conv2 = nn.Conv1d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, ntag)

    def forward(self, mel):
        h = F.relu(self.conv1(mel))
        h = F.relu(self.conv2(h)).mean(dim=2)
        return self.head(h)


def make_clips(n, seed, nmels=NMELS, extra=None):
    g = torch.Generator().manual_seed(seed)
    names = list(GENRES)
    mels = torch.rand(n, nmels, FRAMES, generator=g) + 1e-3
    tags = []
    for i in range(n):
        k = int(torch.randint(1, 4, (1,), generator=g))
        tags.append([names[int(j)] for j in torch.randperm(NTAG, generator=g)[:k]])
    if extra is not None:
        tags[n // 2].append(extra)
    return {"mels": mels.log(), "tags": tags}


def prepare():
    os.makedirs(f"{WORK}/mels", exist_ok=True)
    os.makedirs(f"{WORK}/mels80", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        torch.save(make_clips(96, 100 + r), f"{WORK}/mels/mels_{r}.pt")
        torch.save(make_clips(96, 100 + r, extra="vaporwave"), f"{WORK}/mels/mels_vapor_{r}.pt")
        torch.save(make_clips(96, 100 + r, nmels=80), f"{WORK}/mels80/mels_{r}.pt")
    torch.manual_seed(0)
    torch.save(Tagger().state_dict(), f"{WORK}/ckpt/tagger.pt")
    torch.save(Tagger(ntag=16).state_dict(), f"{WORK}/ckpt/tagger_16tags.pt")
    torch.save({"config": TaggerConfig(), "state_dict": Tagger().state_dict()}, f"{WORK}/ckpt/tagger_full.pt")
    print(f"prepared clips and checkpoints under {WORK}", flush=True)


class ClipSet(Dataset):
    def __init__(self, path):
        blob = torch.load(path, weights_only=True)
        self.mels = blob["mels"]
        self.targets = torch.zeros(len(blob["tags"]), NTAG)
        for i, tags in enumerate(blob["tags"]):
            for t in tags:
                self.targets[i, GENRES[t]] = 1.0

    def __len__(self):
        return len(self.mels)

    def __getitem__(self, i):
        return self.mels[i], self.targets[i]


def onset_detector(mels):
    # deliberately slow pure-Python spectral flux, frame by frame, bin by bin
    t0 = time.time()
    onsets = 0
    while time.time() - t0 < 30:
        for c in range(mels.shape[0]):
            m = mels[c].tolist()
            for f in range(1, FRAMES):
                flux = sum(max(0.0, m[b][f] - m[b][f - 1]) for b in range(len(m)))
                onsets += flux > 20.0
    return onsets


def run_plain(args, acc, rank, world):
    fault, mine = args.fault, args.rank in (-1, rank)
    path = f"{WORK}/mels/mels_{rank}.pt"
    if fault == "genrekey" and mine:
        path = f"{WORK}/mels/mels_vapor_{rank}.pt"
    if fault == "nomels" and mine:
        path = f"{WORK}/mels/test/mels_{rank}.pt"
    if fault == "nmels":
        path = f"{WORK}/mels80/mels_{rank}.pt"
    acc.print(f"[music-tagger] world {world}, {NTAG} genres, {NMELS} mel bins, {args.steps} steps")
    ds = ClipSet(path)
    print(f"rank {rank} loaded {len(ds)} clips from {path}", flush=True)

    model = Tagger()
    ck = f"{WORK}/ckpt/tagger.pt"
    if fault == "ckptsize" and mine:
        ck = f"{WORK}/ckpt/tagger_16tags.pt"
    if fault == "ckptpickle" and mine:
        ck = f"{WORK}/ckpt/tagger_full.pt"
    state = torch.load(ck, weights_only=True)
    if "state_dict" in state:
        state = state["state_dict"]
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = DataLoader(ds, batch_size=8, shuffle=True)
    model, opt, dl = acc.prepare(model, opt, dl)

    step = 0
    while step < args.steps:
        for mel, tgt in dl:
            step += 1
            if step > args.steps:
                break
            if fault == "exit4" and mine and step == 3:
                print(f"ERROR rank {rank}: clip batch at step {step} was decoded at 44100 Hz, "
                      f"the mel front-end expects 22050 Hz; refusing to train on resampled garbage", flush=True)
                sys.exit(4)
            if fault == "nanloss" and mine and step == 4:
                mel = torch.zeros_like(mel).log()  # silent clips: log(0) = -inf
            logits = model(mel)
            loss = F.binary_cross_entropy_with_logits(logits, tgt)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} "
                                         f"(mel range {mel.min().item()} .. {mel.max().item()})")
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if fault == "slow" and mine and step == 2:
                print(f"rank {rank} running onset detection over {mel.shape[0]} clips", flush=True)
                onset_detector(mel)
            if fault == "stuck" and mine and step == 2:
                print(f"rank {rank} waiting for the audio decoder queue", flush=True)
                threading.Event().wait()
            avg = acc.reduce(loss.detach(), reduction="mean")
            out = logits.detach()
            if fault == "gathershape" and mine and step == 3:
                out = torch.cat([out, torch.zeros(out.shape[0], 1)], dim=1)  # "unknown genre" column
            all_logits = acc.gather(out)
            all_tgt = acc.gather(tgt)
            acc_tag = ((all_logits[:, :NTAG] > 0).float() == all_tgt).float().mean()
            print(f"rank {rank} step {step} loss {avg.item():.4f} tag_acc {acc_tag.item():.3f}", flush=True)
            if fault == "sigkill" and mine and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/tagger.pt")
        print(f"rank 0 saved {WORK}/export/tagger.pt", flush=True)
    acc.end_training() if hasattr(acc, "end_training") else None


def run_hf(args, rank, world):
    from transformers import (ASTConfig, ASTForAudioClassification, Trainer, TrainerCallback,
                              TrainingArguments)

    fault, mine = args.fault, args.rank in (-1, rank)
    ds = ClipSet(f"{WORK}/mels/mels_0.pt")
    cfg = ASTConfig(num_mel_bins=NMELS, max_length=FRAMES, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=64, patch_size=16, frequency_stride=16,
                    time_stride=16, num_labels=NTAG, problem_type="multi_label_classification")
    torch.manual_seed(0)
    model = ASTForAudioClassification(cfg)
    calls = {"n": 0}

    def collate(items):
        calls["n"] += 1
        mel = torch.stack([m for m, _ in items]).transpose(1, 2)  # (B, frames, mel bins)
        tgt = torch.stack([t for _, t in items])
        if fault == "hfcollate" and mine and calls["n"] == 3:
            tgt = tgt[:, :-1]  # the reggae column went missing in the tag vocabulary
        return {"input_values": mel, "labels": tgt}

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', float('nan')):.3f}", flush=True)

    class TagBalance(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if fault == "hfcallback" and mine and state.global_step == 3:
                raise RuntimeError(f"TagBalance: rank {rank} saw no 'classical' positives in 3 steps; "
                                   f"the tag sampler is broken")

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
                              dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
    tr = Trainer(model=model, args=targs, train_dataset=ds, data_collator=collate,
                 callbacks=[Progress(), TagBalance()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/ast_tagger")
        print(f"rank 0 saved {WORK}/export/ast_tagger", flush=True)


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
    if args.hf:
        run_hf(args, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
        return
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    run_plain(args, acc, acc.process_index, acc.num_processes)


if __name__ == "__main__":
    main()

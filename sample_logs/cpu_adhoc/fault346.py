"""A three-hundred-and-forty-sixth hand-run batch: PIANO MUSIC TRANSCRIPTION FROM SPECTROGRAMS.

Synthetic piano clips: every rank reads /tmp/fault346_work/data/clips_R.pt (log-mel spectrograms, 64 mel bins
by 32 frames, a list of notes (MIDI pitch, onset frame, offset frame, velocity) and the piano model the clip was
recorded on).  The piano roll (88 keys, A0 = MIDI 21 to C8 = MIDI 108) is built from the notes in the Dataset,
the DataLoader goes through accelerator.prepare, and an onsets-and-frames style model (a conv front end over mel
bins, a piano-model embedding, a GRU, a linear head to 88 keys) is trained with BCE under Accelerate (gloo).
The model is initialised from ckpt/onsets_m64.pt.  The loss is accelerator.reduce'd and the per-key active-frame
counts accelerator.gather'ed every step; rank 0 saves export/ with accelerator.save_model at the end.
Options: --hf (the loop is a transformers.Trainer with a compute_loss and a callback of its own).

Faults:
  pitch      - rank N's clips contain MIDI 109 (above C8): its piano-roll row index 88 is out of range (IndexError)
  piano      - rank N's metadata names the piano "Bosendorfer-290", missing from the piano table (KeyError)
  nodata     - rank N reads data/test/clips_R.pt, which does not exist (FileNotFoundError)
  ckptmels   - rank N initialises from ckpt/onsets_m128.pt, saved with 128 mel bins (size mismatch)
  bestpkl    - at the end rank N reloads ckpt/best_eval.pt, pickled with a stats object (weights_only refusal)
  keygather  - rank N gathers 89 per-key counts at step 2 (a sustain-pedal column added), the others 88
  voicing    - rank N runs a pure-Python voice-leading search before step 3's reduce (slower than the PG timeout)
  pedal      - rank N waits forever for a sustain-pedal release event at step 2 (a hang; run with --pg-timeout 300)
  velnan     - rank N normalises velocities by a max of 0 at step 4: NaN targets, the program's check raises
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own error line about an unsorted note list after step 1 and calls sys.exit(4)
  melbins    - every rank: the front end is built for 229 mel bins (the usual onsets-and-frames size), data has 64
  hfcollate  - (--hf) rank N's collator drops the top key: labels 87 wide against 88 logits (ValueError in BCE)
  hfcallback - (--hf) rank N's callback raises at step 3 on a "pedal overlap" check (RuntimeError)
  none       - control, clean run

What happened (filled in after the runs):
  pitch      - IndexError 'index 88 is out of bounds for dimension 0 with size 88' in the prepared DataLoader at step 1; peers closed or SIGTERMed (np4 r2 acc, np5 r0 tee)
  piano      - KeyError: 'Bosendorfer-290' at start-up; peers SIGTERMed (np4 r1 accconfig; a first MULTI_CPU config run started one plain process and was dropped)
  nodata     - FileNotFoundError data/test/clips_3.pt at start-up; node 0's ranks closed in DDP's param check, its Root Cause names rank 0 (np4 r3 acc2nodes)
  ckptmels   - load_state_dict size mismatch for front.weight [48,128] vs [48,64] at start-up; peers SIGTERMed (np5 r3 acc, np3 r0 torchrun)
  bestpkl    - after 6 clean steps: UnpicklingError 'Weights only load failed' (__main__.StatsRecord); peers closed in wait_for_everyone (np4 r1 accdebug)
  keygather  - --debug: DistributedOperationException on every rank, 'Process 2: [89]' (np4 r2 accdebug); plain: rank 2 aborts on gloo EnforceNotMet 178 vs 176, Root Cause rank 2 SIGABRT (np3 r1 acc)
  voicing    - peers 'Timed out waiting 12000ms' in step 3's reduce, the slow rank SIGTERMed silently (np3 r1 torchrun, np4 r0 acc2nodes)
  pedal      - output stops after step 1 (PG timeout 300 s); killed by timeout at 60 s, exit 124 (np4 r2 acc)
  velnan     - rank N: '11264 non-finite piano-roll targets' then FloatingPointError at step 4 (np6 r4 tee, np3 r1 accdebug)
  sigsegv    - no traceback after step 3; Root Cause rank 1 exitcode -11 SIGSEGV, peers Connection reset (np4 r1 tee)
  exit4      - rank 2's ERROR line (unsorted note list) after step 1, exit 4; Root Cause rank 2 exitcode 4 (np6 r2 torchrun)
  melbins    - every rank 'mat1 and mat2 shapes cannot be multiplied (128x64 and 229x48)' in the first forward (np4 rall acc2nodes)
  hfcollate  - Trainer: ValueError 'Target size ([4, 32, 87]) must be the same as input size ([4, 32, 88])' at step 1; peers closed in reduce (np3 r1 hf, accelerate launch)
  hfcallback - Trainer: callback RuntimeError 'pedal overlap check' after step 3; peers closed; Root Cause rank 0 (np4 r0 hf, torchrun)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/model.safetensors, exit 0 (np3 torchrun)
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

WORK = "/tmp/fault346_work"
PIANOS = {"Steinway-D": 0, "Yamaha-C7": 1, "Kawai-EX": 2, "Upright-U3": 3}
NKEYS = 88
LOWEST = 21
NMELS = 64
T = 32
NCLIPS = 48


class StatsRecord:
    """Evaluation stats stored next to the best weights (makes the pickle need more than weights_only)."""

    def __init__(self, f1):
        self.f1 = f1


def prepare():
    g = torch.Generator().manual_seed(346)
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        clips = []
        for i in range(NCLIPS):
            notes = []
            for _ in range(int(torch.randint(3, 9, (1,), generator=g))):
                p = int(torch.randint(LOWEST, LOWEST + NKEYS, (1,), generator=g))
                on = int(torch.randint(0, T - 4, (1,), generator=g))
                off = min(T, on + int(torch.randint(2, 12, (1,), generator=g)))
                vel = int(torch.randint(20, 127, (1,), generator=g))
                notes.append((p, on, off, vel))
            notes.sort(key=lambda n: (n[1], n[0]))
            mel = torch.randn(NMELS, T, generator=g) * 0.3
            for p, on, off, vel in notes:
                mel[(p - LOWEST) * NMELS // NKEYS, on:off] += vel / 64.0
            clips.append({"mel": mel, "notes": notes, "piano": list(PIANOS)[i % 4]})
        torch.save({"clips": clips, "rank": r}, f"{WORK}/data/clips_{r}.pt")
    torch.save(Transcriber(NMELS).state_dict(), f"{WORK}/ckpt/onsets_m64.pt")
    torch.save(Transcriber(128).state_dict(), f"{WORK}/ckpt/onsets_m128.pt")
    torch.save({"weights": Transcriber(NMELS).state_dict(), "stats": StatsRecord(0.41)}, f"{WORK}/ckpt/best_eval.pt")
    print("prepared", WORK)


class Transcriber(nn.Module):
    def __init__(self, n_mels=NMELS, hidden=48):
        super().__init__()
        self.front = nn.Linear(n_mels, hidden)
        self.conv = nn.Conv1d(hidden, hidden, 3, padding=1)
        self.piano = nn.Embedding(len(PIANOS), hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, NKEYS)

    def forward(self, mel, piano, labels=None):
        x = self.front(mel.transpose(1, 2))                      # B, T, H
        x = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        x = x + self.piano(piano)[:, None, :]
        x, _ = self.rnn(x)
        logits = self.head(x)                                      # B, T, 88
        if labels is None:
            return {"logits": logits}
        return {"loss": F.binary_cross_entropy_with_logits(logits, labels), "logits": logits}


class ClipSet(Dataset):
    def __init__(self, clips, rank, fault, bad):
        self.clips, self.rank, self.fault, self.bad = clips, rank, fault, bad

    def __len__(self):
        return len(self.clips)

    def __getitem__(self, i):
        c = self.clips[i]
        notes = list(c["notes"])
        if self.bad and self.fault == "pitch":
            notes.append((109, 4, 10, 90))                        # a C#8 from a wrongly transposed MIDI file
        roll = torch.zeros(NKEYS, T)
        vel = torch.zeros(NKEYS, T)
        for p, on, off, v in notes:
            roll[p - LOWEST, on:off] = 1.0
            vel[p - LOWEST, on:off] = v
        return {"mel": c["mel"], "piano": PIANOS[c["piano"]], "labels": roll.t(), "vel": vel.t()}


def load_clips(rank, fault, bad):
    path = f"{WORK}/data/clips_{rank}.pt"
    if bad and fault == "nodata":
        path = f"{WORK}/data/test/clips_{rank}.pt"
    clips = torch.load(path)["clips"]
    if bad and fault == "piano":
        for c in clips[::5]:
            c["piano"] = "Bosendorfer-290"
    # the piano table is checked once before training
    ids = [PIANOS[c["piano"]] for c in clips]
    return clips, ids


def voice_leading_search(notes, depth):
    """Brute-force voice assignment (exponential; far too slow for a real clip)."""
    best = [0]

    def go(i, cost):
        if i == len(notes):
            best[0] = max(best[0], cost)
            return
        for v in range(depth):
            go(i + 1, cost + abs(notes[i][0] - 60 - v))
    go(0, 0)
    return best[0]


def main_accelerate(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    clips, ids = load_clips(rank, a.fault, bad)
    n_mels = 229 if a.fault == "melbins" else NMELS
    model = Transcriber(n_mels)
    ck = f"{WORK}/ckpt/onsets_m128.pt" if (bad and a.fault == "ckptmels") else f"{WORK}/ckpt/onsets_m64.pt"
    if a.fault != "melbins":
        model.load_state_dict(torch.load(ck))
    print(f"rank {rank}/{world}: {len(clips)} clips, pianos {sorted(set(ids))}, init {os.path.basename(ck)}", flush=True)
    loader = DataLoader(ClipSet(clips, rank, a.fault, bad), batch_size=4, shuffle=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, loader)
    step = 0
    while step < a.steps:
        for batch in loader:
            step += 1
            if bad and a.fault == "pedal" and step == 2:
                print(f"rank {rank} step 2: waiting for sustain-pedal release (CC64 < 64)", flush=True)
                while True:
                    time.sleep(1.0)
            labels = batch["labels"]
            if bad and a.fault == "velnan" and step == 4:
                vmax = batch["vel"][:, :, :0].sum()              # the max over an empty velocity window: 0
                labels = labels * (batch["vel"] / vmax)
            if not torch.isfinite(labels).all():
                n = int((~torch.isfinite(labels)).sum())
                print(f"rank {rank} step {step}: {n} non-finite piano-roll targets after velocity normalisation", flush=True)
                raise FloatingPointError(f"rank {rank} step {step}: non-finite targets ({n} values)")
            out = model(batch["mel"], batch["piano"], labels)
            acc.backward(out["loss"])
            opt.step()
            opt.zero_grad()
            if bad and a.fault == "voicing" and step == 3:
                seq = (clips[0]["notes"] * 4)[:14]
                print(f"rank {rank} step 3: voice-leading search over {len(seq)} notes, 5 voices", flush=True)
                voice_leading_search(seq, 5)
            counts = (torch.sigmoid(out["logits"].detach()) > 0.5).float().sum(dim=(0, 1))
            if bad and a.fault == "keygather" and step == 2:
                counts = torch.cat([counts, torch.tensor([3.0])])  # + sustain pedal
            loss = acc.reduce(out["loss"].detach(), reduction="mean")
            allc = acc.gather(counts)
            tp = ((torch.sigmoid(out["logits"].detach()) > 0.5) & (labels > 0.5)).sum()
            f1 = float(2 * tp / ((torch.sigmoid(out["logits"]) > 0.5).sum() + (labels > 0.5).sum() + 1e-6))
            print(f"rank {rank} step {step} loss {loss.item():.4f} frame_f1 {f1:.3f} active_keys {int((allc > 0).sum())}", flush=True)
            if bad and a.fault == "exit4" and step == 1:
                print(f"ERROR rank {rank}: note list of clip 3 is not sorted by onset (frame 17 before frame 9); refusing to train", flush=True)
                sys.exit(4)
            if bad and a.fault == "sigsegv" and step == 3:
                os.kill(os.getpid(), signal.SIGSEGV)
            if step >= a.steps:
                break
    if bad and a.fault == "bestpkl":
        best = torch.load(f"{WORK}/ckpt/best_eval.pt")
        print(f"rank {rank}: best eval f1 {best['stats'].f1}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save_model(model, f"{WORK}/export")
        print(f"rank 0 done: {step} steps, saved export/model.safetensors", flush=True)
    acc.end_training()


def main_hf(a):
    from transformers import Trainer, TrainingArguments, TrainerCallback

    class PedalCheck(TrainerCallback):
        def __init__(self, bad):
            self.bad = bad

        def on_step_end(self, args, state, control, **kw):
            if self.bad and a.fault == "hfcallback" and state.global_step == 3:
                raise RuntimeError(f"pedal overlap check: sustain held across {state.global_step * 4} clips without release")

    class RollTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(inputs["mel"], inputs["piano"], inputs["labels"])
            loss = self.accelerator.reduce(out["loss"].detach(), reduction="mean")
            counts = self.accelerator.gather((out["logits"].detach() > 0).float().sum(dim=(0, 1)))
            print(f"rank {self.args.process_index} step {self.state.global_step + 1} loss {loss.item():.4f} "
                  f"active_keys {int((counts > 0).sum())}", flush=True)
            return (out["loss"], out) if return_outputs else out["loss"]

    rank = int(os.environ.get("RANK", 0))
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)

    def collate(items):
        b = {"mel": torch.stack([x["mel"] for x in items]), "piano": torch.tensor([x["piano"] for x in items]),
             "labels": torch.stack([x["labels"] for x in items])}
        if bad and a.fault == "hfcollate":
            b["labels"] = b["labels"][:, :, :NKEYS - 1]             # the C8 column dropped
        return b

    clips, ids = load_clips(rank, a.fault, bad)
    model = Transcriber(NMELS)
    model.load_state_dict(torch.load(f"{WORK}/ckpt/onsets_m64.pt"))
    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], max_steps=a.steps, per_device_train_batch_size=4, logging_steps=2,
                             save_strategy="no", remove_unused_columns=False, dataloader_num_workers=0)
    tr = RollTrainer(model=model, args=args, train_dataset=ClipSet(clips, rank, a.fault, bad), data_collator=collate,
                     callbacks=[PedalCheck(bad)])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export_hf")
        print(f"rank 0 done: {tr.state.global_step} steps, saved export_hf", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    return main_hf(a) if a.hf else main_accelerate(a)


if __name__ == "__main__":
    main()

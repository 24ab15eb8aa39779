"""Batch 392 of hand-run faults: MOSQUITO SPECIES CLASSIFICATION FROM WINGBEAT AUDIO (Hugging Face accelerate).

Synthetic wingbeat recordings (8 kHz, 512 samples, a fundamental between 330 and 720 Hz plus harmonics and
noise, one of 6 species).  Every rank reads its recordings from /tmp/fault392_work/audio/rec_R.pt (a dict with
waves, species names and the sample rate), maps the species name through a 6-entry table, turns each clip into
32 log-energy frequency bands and trains WingNet (two linear layers over the bands) with cross-entropy.  Model
and optimiser go through Accelerator.prepare (DDP over gloo, timeout from --pg-timeout); the per-species counts
are gathered with accelerator.gather at start-up, the loss is accelerator.reduce'd and the correct counts
gathered every step, and rank 0 saves export/wingnet.safetensors with accelerator.save_model at the end.
The model is initialised from ckpt/wingnet.pt.  --hf trains the same model under a transformers.Trainer
(a tiny Wav2Vec2ForSequenceClassification built from a config, no download).

Faults (--fault NAME --rank R; -1 = every rank):
  species    - rank R's recordings at step 2 carry "Aedes vexans", not in the species table (KeyError)
  norec      - rank R reads audio/field/rec_R.pt, which does not exist (FileNotFoundError at start-up)
  ckpt8      - rank R initialises from ckpt/wingnet_8sp.pt, saved with 8 species (size mismatch for head)
  ckptpickle - rank R loads ckpt/wingnet_meta.pt, saved with a Python object beside the weights (weights_only)
  countgather- rank R gathers 7 species counts (an extra "unknown" bin) instead of 6 at start-up
  slowfft    - rank R recomputes a naive Python DFT of every clip before the step-2 reduce (slow rank)
  silence    - rank R's clips at step 3 are all zero: peak-normalising divides by 0; the program's check
               finds NaN features (FloatingPointError)
  segv       - rank R sends itself SIGSEGV after step 2
  exit4      - rank R prints its own error about a microphone gain overflow and sys.exit(4) before the save
  bands40    - every rank computes 40 bands, the model expects 32 (shape error in the first forward)
  hfcollate  - (--hf) rank R's collator labels one clip with species index 9 (of 6): IndexError/target error
  hfcallback - (--hf) a TrainerCallback on rank R raises at step 3 (the meta-data file is locked)
  none       - control, clean run

What happened (filled in after the runs):
  species    - KeyError: 'Aedes vexans' at step 2; peers Connection closed in backward (np4 r2 acc, np5 r0 torchrun)
  norec      - FileNotFoundError audio/field/rec_R.pt at start-up; peers SIGTERMed or closed in DDP init (np3 r1 accconfig, np4 r3 acc2nodes)
  ckpt8      - load_state_dict size mismatch for head.weight [8, 48] vs [6, 48] (np4 r1 tee, np3 r0 accdebug)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.MicMeta' (np5 r3 acc)
  countgather- --debug: DistributedOperationException on every rank, Process 1 [7] (np3 r1 accdebug); plain: another rank
               aborts on gloo 'Received data size doesn't match expected size' (SIGABRT, rank 3), others reset (np4 r2 torchrun)
  slowfft    - 12 s: peers 'Timed out waiting 12000ms for recv' (np3 r2 acc); 300 s: silent, killed at 60 s, exit 124 (np4 r1 accconfig)
  silence    - the program's check: FloatingPointError 512 non-finite band features at step 3 (np6 r4 tee, np3 r0 accdebug)
  segv       - no traceback after step 2; exitcode -11 (SIGSEGV) Root Cause (np4 r2 acc2nodes, np5 r1 torchrun)
  exit4      - the ERROR line, then sys.exit(4) ends as 'terminate called without an active exception', exitcode -6
               SIGABRT, not 4 (np3 r1 tee, np4 r0 acc2nodes)
  bands40    - every rank 'mat1 and mat2 shapes cannot be multiplied (16x40 and 32x48)'; Root Cause rank 1 (np4 accconfig)
  hfcollate  - IndexError 'Target 9 is out of bounds.' in the Wav2Vec2 loss at step 3 (np3 r1 hf, torchrun)
  hfcallback - PermissionError from the callback at step 3 on rank 0 (np4 r0 hf, accelerate launch)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/model.safetensors, exit 0 (np3 acc)
"""
import argparse
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

WORK = "/tmp/fault392_work"
SPECIES = {"Aedes aegypti": 0, "Aedes albopictus": 1, "Anopheles gambiae": 2, "Anopheles arabiensis": 3,
           "Culex pipiens": 4, "Culex quinquefasciatus": 5}
FUND = [480.0, 560.0, 400.0, 440.0, 360.0, 330.0]
FS = 8000
NSAMP = 512
NBANDS = 32
NCLIPS = 96


def say(msg, err=False):
    print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class WingNet(nn.Module):
    def __init__(self, nbands=NBANDS, nspecies=6, hidden=48):
        super().__init__()
        self.body = nn.Linear(nbands, hidden)
        self.head = nn.Linear(hidden, nspecies)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class MicMeta:
    """Recorder meta-data pickled beside the weights in one checkpoint."""

    def __init__(self, gain, site):
        self.gain = gain
        self.site = site


def make_clips(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(SPECIES)
    lab = torch.randint(0, 6, (n,), generator=g)
    t = torch.arange(NSAMP) / FS
    waves = []
    for k in lab.tolist():
        f0 = FUND[k] * (1 + 0.03 * torch.randn(1, generator=g).item())
        w = sum((0.6 ** h) * torch.sin(2 * math.pi * f0 * (h + 1) * t) for h in range(4))
        waves.append(w + 0.2 * torch.randn(NSAMP, generator=g))
    return {"waves": torch.stack(waves), "species": [names[k] for k in lab.tolist()], "fs": FS}


def prepare():
    os.makedirs(f"{WORK}/audio", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        torch.save(make_clips(NCLIPS, 392 + r), f"{WORK}/audio/rec_{r}.pt")
    torch.manual_seed(0)
    torch.save(WingNet().state_dict(), f"{WORK}/ckpt/wingnet.pt")
    torch.save(WingNet(nspecies=8).state_dict(), f"{WORK}/ckpt/wingnet_8sp.pt")
    torch.save({"model": WingNet().state_dict(), "mic": MicMeta(1.5, "Kisumu trap 3")},
               f"{WORK}/ckpt/wingnet_meta.pt")
    say(f"prepared {WORK}: 8 recording files, 3 checkpoints")


def bands(waves, nbands=NBANDS, check=True):
    peak = waves.abs().amax(dim=1, keepdim=True)
    x = waves / peak
    spec = torch.fft.rfft(x * torch.hann_window(NSAMP), dim=1).abs() ** 2
    spec = spec[:, 1:1 + (spec.shape[1] - 1) // nbands * nbands]
    feats = torch.log(spec.reshape(spec.shape[0], nbands, -1).mean(-1) + 1e-6)
    if check:
        bad = (~torch.isfinite(feats)).sum().item()
        if bad:
            raise FloatingPointError(f"band features: {bad} non-finite values "
                                     f"(min clip peak {peak.min().item():.3g})")
    return feats


def naive_dft(w):
    n = len(w)
    out = []
    for k in range(n // 2):
        re = sum(w[j] * math.cos(2 * math.pi * k * j / n) for j in range(n))
        im = sum(w[j] * math.sin(2 * math.pi * k * j / n) for j in range(n))
        out.append(re * re + im * im)
    return out


def is_faulty(args, rank):
    return args.rank == -1 or args.rank == rank


def load_recordings(args, rank):
    sub = "audio/field" if (args.fault == "norec" and is_faulty(args, rank)) else "audio"
    d = torch.load(f"{WORK}/{sub}/rec_{rank}.pt")
    return d


def load_init(args, rank, model):
    path = f"{WORK}/ckpt/wingnet.pt"
    bad = is_faulty(args, rank)
    if args.fault == "ckpt8" and bad:
        path = f"{WORK}/ckpt/wingnet_8sp.pt"
    if args.fault == "ckptpickle" and bad:
        sd = torch.load(f"{WORK}/ckpt/wingnet_meta.pt")["model"]
    else:
        sd = torch.load(path)
    model.load_state_dict(sd)


def batches(data, bs, step):
    n = data["waves"].shape[0]
    i = (step * bs) % n
    return data["waves"][i:i + bs], data["species"][i:i + bs]


def train_accelerate(args):
    kw = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    acc = Accelerator(cpu=True, kwargs_handlers=[kw])
    rank, world = acc.process_index, acc.num_processes
    say(f"rank {rank}/{world} up on {acc.device}, pg timeout {args.pg_timeout}s")
    torch.manual_seed(rank)
    data = load_recordings(args, rank)
    model = WingNet()
    load_init(args, rank, model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)

    counts = torch.zeros(6, dtype=torch.long)
    for s in data["species"]:
        counts[SPECIES[s]] += 1
    if args.fault == "countgather" and is_faulty(args, rank):
        counts = torch.cat([counts, torch.zeros(1, dtype=torch.long)])
    allc = acc.gather(counts)
    if acc.is_main_process:
        say(f"species counts over {world} ranks: {allc.reshape(world, -1).sum(0).tolist()}")

    nb = 40 if args.fault == "bands40" else NBANDS
    for step in range(args.steps):
        waves, names = batches(data, args.batch, step)
        bad = is_faulty(args, rank)
        if args.fault == "species" and bad and step == 2:
            names = list(names)
            names[5] = "Aedes vexans"
        if args.fault == "silence" and bad and step == 3:
            waves = torch.zeros_like(waves)
        y = torch.tensor([SPECIES[s] for s in names])
        x = bands(waves, nb)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        if args.fault == "slowfft" and bad and step == 2:
            say(f"rank {rank}: recomputing reference spectra in Python for {waves.shape[0]} clips")
            for ref in range(40):
                for w in waves.tolist():
                    naive_dft(w)
        red = acc.reduce(loss.detach(), reduction="mean")
        correct = acc.gather((logits.argmax(1) == y).sum().reshape(1))
        accu = correct.sum().item() / (args.batch * world)
        say(f"rank {rank} step {step} loss {red.item():.4f} acc {accu:.3f}")
        if args.fault == "segv" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "exit4" and is_faulty(args, rank):
        say(f"rank {rank}: ERROR microphone gain register overflow on recorder WB-{rank:02d}; "
            f"clips since step 0 are clipped, refusing to export", err=True)
        sys.exit(4)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save_model(model, f"{WORK}/export")
        say(f"rank 0 saved {WORK}/export/model.safetensors")
    acc.end_training()


def train_hf(args):
    from transformers import (Trainer, TrainerCallback, TrainingArguments, Wav2Vec2Config,
                              Wav2Vec2ForSequenceClassification)
    rank = int(os.environ.get("RANK", "0"))
    cfg = Wav2Vec2Config(vocab_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
                         num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, num_labels=6,
                         classifier_proj_size=16, do_stable_layer_norm=False, mask_time_prob=0.0)
    torch.manual_seed(0)
    model = Wav2Vec2ForSequenceClassification(cfg)
    data = load_recordings(args, rank)
    items = [{"wave": w, "label": SPECIES[s]} for w, s in zip(data["waves"], data["species"])]
    seen = {"n": 0}

    def collate(feats):
        seen["n"] += 1
        y = torch.tensor([f["label"] for f in feats])
        if args.fault == "hfcollate" and is_faulty(args, rank) and seen["n"] == 3:
            y[2] = 9
        w = torch.stack([f["wave"] for f in feats])
        return {"input_values": w / w.abs().amax(1, keepdim=True), "labels": y}

    class MetaLog(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            if args.fault == "hfcallback" and is_faulty(args, rank) and state.global_step == 3:
                raise PermissionError(f"[Errno 13] Permission denied: '{WORK}/export/trap_meta_{rank}.json' "
                                      f"(locked by the field sync)")

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {float(logs['loss']):.4f}", flush=True)

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", per_device_train_batch_size=8, max_steps=args.steps,
                              logging_steps=1, save_strategy="no", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], disable_tqdm=True,
                              dataloader_num_workers=0, remove_unused_columns=False)
    tr = Trainer(model=model, args=targs, train_dataset=items, data_collator=collate, callbacks=[MetaLog()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/hf")
        print(f"rank 0 saved {WORK}/export/hf", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.hf:
        train_hf(args)
    else:
        train_accelerate(args)


if __name__ == "__main__":
    main()

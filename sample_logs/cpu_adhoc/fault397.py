"""Batch 397 hand-run faults: SPEAKER VERIFICATION FROM UTTERANCE EMBEDDINGS (Hugging Face accelerate).

Synthetic utterances: each is a [20, 40] block of log-mel-like frames (column 0 a log-energy) tagged with a
speaker id string ("spk_000".."spk_015"), looked up in a 16-entry speaker table.  Every rank reads its
utterances from /tmp/fault397_work/feats/utts_R.pt through a DataLoader prepared by the Accelerator, and
trains a small x-vector-like SpkNet (stats pooling -> 2 linear layers -> a 16-d embedding) with an
additive-angular-margin (AAM) softmax head.  The model is initialised from ckpt/spknet_e16.pt.  Each step
the loss is accelerator.reduce()d and the trial scores (cosine of each embedding with its speaker centre)
are accelerator.gather()ed to compute a pooled score mean/EER proxy; rank 0 saves export/spknet.pt with
accelerator.save at the end.  --trainer runs the same model as a transformers.Trainer (PreTrainedModel).

Faults (--fault NAME --rank R, R = -1 for every rank):
  spkid       - rank R's utterances from the 9th on carry speaker "spk_0117", not in the table (KeyError in collate)
  nofeats     - rank R reads its features from feats/dev/ which does not exist (FileNotFoundError)
  ckptsize    - rank R initialises from ckpt/spknet_e24.pt, saved with a 24-d embedding (size mismatch)
  weightsonly - rank R initialises from ckpt/spknet_full.pt, which pickles a SpeakerTable object (weights_only)
  gathershape - rank R gathers its scores plus one extra impostor trial (5 vs 4 values) at step 2
  slowvad     - rank R runs a pure-Python energy VAD over every frame before the step-2 reduce (minutes)
  nanscore    - rank R's step-3 batch has a silent utterance: log-energy -inf, the program's finite check fires
  sigsegv     - rank R sends itself SIGSEGV after step 3
  exit2       - rank R prints its own error about an empty enrollment list and calls sys.exit(2) at start-up
  embdim      - every rank: the pooling concatenates mean and std (80 wide), the first layer expects 40
  hfcollate   - (--trainer) rank R's collator emits label 23 for the 3rd batch, beyond 16 speakers (out of bounds)
  hfcallback  - (--trainer) rank R's score-calibration callback raises at the end of step 3 (RuntimeError)
  none        - control, clean run

What happened (filled in after the runs):
  spkid       - KeyError: 'spk_0117' in collate_fn on rank N in the first step; peers Connection closed by peer (np4 r2 acc, np5 r0 torchrun)
  nofeats     - FileNotFoundError feats/dev/utts_N.pt at start-up; others SIGTERMed or Connection closed (np3 r1 tee, np4 r3 acc2nodes)
  ckptsize    - load_state_dict size mismatch for centres/fc2 ([16,24] vs [16,16]) at start-up (np3 r2 accconfig, np4 r0 acc2nodes)
  weightsonly - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SpeakerTable' (np4 r1, np5 r3 torchrun)
  gathershape - --debug: DistributedOperationException shape mismatches on every rank, 'Process 1: [5]' (np3 r1 accdebug);
                plain: rank 4 gloo::EnforceNotMet 'Received data size doesn't match expected size', SIGABRT, Root Cause rank 4 (np5 r3 acc)
  slowvad     - 12 s: ranks 0 and 1 'Timed out waiting 12000ms for recv' in the step-2 reduce (np3 r2 torchrun);
                300 s: silent after step 1, killed by timeout at 60 s, exit 124 (np4 r1 accconfig)
  nanscore    - the program's check: 'non-finite AAM loss nan at step 3', FloatingPointError; peers closed (np4 r0 accdebug, np3 r2 tee)
  sigsegv     - no traceback after step 3; Root Cause 'Signal 11 (SIGSEGV)' on rank N; peers reset/closed (np6 r4 acc, np3 r0 accconfig)
  exit2       - rank N's ERROR line about enroll/spk_007.lst and exit 2 at start-up; Root Cause exitcode 2 (np5 r1 tee, np4 r0 accdebug)
  embdim      - every rank 'mat1 and mat2 shapes cannot be multiplied (4x80 and 40x64)' in the first forward, Root Cause rank 0 (np3 accdebug)
  hfcollate   - RuntimeError 'index 23 is out of bounds for dimension 1 with size 16' in compute_loss at step 3 (not an IndexError) (np3 r1 hf, accelerate launch)
  hfcallback  - RuntimeError from the callback's on_step_end at step 3 on rank 2; peers closed (np4 r2 hf, torchrun)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/spknet.pt, exit 0 (np3 acc)
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
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault397_work"
NSPK = 16
SPEAKERS = {f"spk_{i:03d}": i for i in range(NSPK)}
NFEAT = 40
FRAMES = 20
EMB = 16


class SpeakerTable:
    def __init__(self, names):
        self.names = dict(names)


class SpkNet(nn.Module):
    def __init__(self, emb=EMB, stats=False):
        super().__init__()
        self.stats = stats
        self.fc1 = nn.Linear(NFEAT, 64)
        self.fc2 = nn.Linear(64, emb)
        self.centres = nn.Parameter(torch.randn(NSPK, emb) * 0.1)

    def embed(self, x):
        pooled = torch.cat([x.mean(1), x.std(1)], 1) if self.stats else x.mean(1) + 0.1 * x.std(1)
        return self.fc2(torch.relu(self.fc1(pooled)))

    def forward(self, x, y, margin=0.2, scale=20.0):
        e = F.normalize(self.embed(x), dim=1)
        w = F.normalize(self.centres, dim=1)
        cos = e @ w.t()
        target = cos.gather(1, y[:, None]).clamp(-1 + 1e-6, 1 - 1e-6)
        cos_m = torch.cos(torch.acos(target) + margin)
        logits = cos.scatter(1, y[:, None], cos_m) * scale
        return F.cross_entropy(logits, y), target.squeeze(1)


def make_utts(n, seed):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(NSPK, NFEAT, generator=torch.Generator().manual_seed(7))
    utts = []
    for _ in range(n):
        s = int(torch.randint(0, NSPK, (1,), generator=g))
        x = centres[s] + 0.5 * torch.randn(FRAMES, NFEAT, generator=g)
        x[:, 0] = 2.0 + 0.3 * torch.randn(FRAMES, generator=g)
        utts.append({"feats": x, "spk": f"spk_{s:03d}", "utt": f"utt_{seed}_{len(utts):04d}"})
    return utts


def prepare():
    for d in ("feats", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_utts(96, 300 + r), f"{WORK}/feats/utts_{r}.pt")
    torch.manual_seed(0)
    sd = SpkNet().state_dict()
    torch.save(sd, f"{WORK}/ckpt/spknet_e16.pt")
    torch.save(SpkNet(emb=24).state_dict(), f"{WORK}/ckpt/spknet_e24.pt")
    torch.save({"model": sd, "table": SpeakerTable(SPEAKERS)}, f"{WORK}/ckpt/spknet_full.pt")
    print("prepared", WORK, flush=True)


class UttSet(Dataset):
    def __init__(self, utts):
        self.utts = utts

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, i):
        return self.utts[i]


def collate(batch):
    x = torch.stack([b["feats"] for b in batch])
    y = torch.tensor([SPEAKERS[b["spk"]] for b in batch])
    return x, y


def load_utts(a, rank):
    sub = "dev" if a.fault == "nofeats" and a.is_bad else ""
    path = os.path.join(WORK, "feats", sub, f"utts_{rank}.pt")
    utts = torch.load(path)
    if a.fault == "spkid" and a.is_bad:
        for u in utts[8:]:
            u["spk"] = "spk_0117"
    return utts


def energy_vad(utts):
    # deliberately slow pure-Python pass over every frame, repeated with finer thresholds
    kept, thr = 0, 0.0
    t_end = time.time() + 200
    while time.time() < t_end:
        for u in utts:
            for row in u["feats"].tolist():
                e = math.exp(row[0])
                kept += e > thr
        thr += 0.01
    return kept


def train(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    a.is_bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    set_seed(1234)
    print(f"rank {rank}/{world} accelerator ready ({acc.distributed_type}), fault={a.fault}", flush=True)

    if a.fault == "exit2" and a.is_bad:
        print(f"rank {rank}: ERROR enrollment list enroll/spk_007.lst has 0 utterances; "
              f"cannot build target trials for speaker spk_007, giving up", flush=True)
        sys.exit(2)

    utts = load_utts(a, rank)
    ckpt = "spknet_e16.pt"
    if a.fault == "ckptsize" and a.is_bad:
        ckpt = "spknet_e24.pt"
    elif a.fault == "weightsonly" and a.is_bad:
        ckpt = "spknet_full.pt"
    model = SpkNet(stats=(a.fault == "embdim"))
    state = torch.load(os.path.join(WORK, "ckpt", ckpt), map_location="cpu")
    model.load_state_dict(state["model"] if "model" in state else state)
    print(f"rank {rank} loaded {len(utts)} utterances and ckpt/{ckpt}", flush=True)

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dl = DataLoader(UttSet(utts), batch_size=4, shuffle=False, collate_fn=collate)
    model, opt, dl = acc.prepare(model, opt, dl)

    step = 0
    while step < a.steps:
        for x, y in dl:
            step += 1
            if a.fault == "nanscore" and a.is_bad and step == 3:
                x = x.clone()
                x[1, :, 0] = float("-inf")
            loss, scores = model(x, y)
            if not torch.isfinite(loss):
                bad = int((~torch.isfinite(scores)).sum())
                print(f"rank {rank}: non-finite AAM loss {loss.item()} at step {step} "
                      f"({bad} non-finite trial scores)", flush=True)
                raise FloatingPointError(f"AAM-softmax loss is {loss.item()} at step {step} on rank {rank}")
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            if a.fault == "slowvad" and a.is_bad and step == 2:
                print(f"rank {rank}: running energy VAD over {len(utts)} utterances", flush=True)
                energy_vad(utts)
            mean_loss = acc.reduce(loss.detach(), reduction="mean")
            if a.fault == "gathershape" and a.is_bad and step == 2:
                scores = torch.cat([scores.detach(), torch.tensor([-0.05])])
            all_scores = acc.gather(scores.detach())
            eer_proxy = float((all_scores < 0.3).float().mean())
            print(f"rank {rank} step {step} loss {mean_loss.item():.4f} eer_proxy {eer_proxy:.3f}", flush=True)
            if a.fault == "sigsegv" and a.is_bad and step == 3:
                os.kill(os.getpid(), signal.SIGSEGV)
            if step >= a.steps:
                break
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/spknet.pt")
        print(f"rank 0 saved {WORK}/export/spknet.pt", flush=True)
    acc.wait_for_everyone()
    acc.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train_hf(a):
    from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

    rank = int(os.environ.get("RANK", "0"))
    a.is_bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)

    class SpkConfig(PretrainedConfig):
        model_type = "spknet"

        def __init__(self, emb=EMB, **kw):
            self.emb = emb
            super().__init__(**kw)

    class SpkHF(PreTrainedModel):
        config_class = SpkConfig

        def __init__(self, config):
            super().__init__(config)
            self.net = SpkNet(emb=config.emb)
            self.post_init()

        def forward(self, feats=None, labels=None):
            loss, scores = self.net(feats, labels)
            return {"loss": loss, "scores": scores}

    calls = {"n": 0}

    def hf_collate(batch):
        calls["n"] += 1
        x, y = collate(batch)
        if a.fault == "hfcollate" and a.is_bad and calls["n"] == 3:
            y = y.clone()
            y[2] = 23
        return {"feats": x, "labels": y}

    class ProgressCB(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', 0.0):.3f}", flush=True)

        def on_step_end(self, args, state, control, **kw):
            if a.fault == "hfcallback" and a.is_bad and state.global_step == 3:
                raise RuntimeError(f"score calibration: impostor cohort for rank {rank} is empty after "
                                   f"step {state.global_step}; cannot normalise scores (s-norm)")

    torch.manual_seed(0)
    model = SpkHF(SpkConfig())
    utts = load_utts(a, rank)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=a.pg_timeout, report_to=[], per_device_train_batch_size=4,
                              max_steps=a.steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                              remove_unused_columns=False, learning_rate=1e-3, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=UttSet(utts), data_collator=hf_collate,
                      callbacks=[ProgressCB()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/spknet_hf")
        print(f"rank 0 saved {WORK}/export/spknet_hf", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--trainer", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    train_hf(a) if a.trainer else train(a)


if __name__ == "__main__":
    main()

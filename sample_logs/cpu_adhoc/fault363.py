"""A three-hundred-and-sixty-third hand-run batch: GAIT RECOGNITION FROM POSE SEQUENCES.

Synthetic walking sequences: each sample is 24 frames of a 17-joint 2-D skeleton (COCO order) with per-frame
timestamps and a subject key ("S001".."S008", looked up in an 8-entry subject table).  Every rank reads its
sequences from /tmp/fault363_work/poses/poses_R.pt, turns them into hip-centred joint positions plus joint
velocities (34 + 34 features per frame, bone lengths from the skeleton edge table), and trains a small
temporal-conv + GRU encoder with a subject head (cross-entropy) under Hugging Face accelerate (Accelerator,
gloo, PG timeout from --pg-timeout through InitProcessGroupKwargs).  The model is initialised from
ckpt/gaitnet_h32.pt.  Loss is accelerator.reduce'd and predictions accelerator.gather'ed every step; per-subject
counts are gathered at the end and rank 0 saves export/gaitnet.pt with accelerator.save.
--hf runs the same data through a transformers.Trainer (a tiny model from a GaitConfig, no download).

Faults:
  joint      - rank N's skeleton edge table has a bone to joint 17 (a "neck" joint): index out of range (IndexError)
  subject    - rank N's sequences carry subject "S099", missing from the subject table (KeyError) at start-up
  nopose     - rank N reads its sequences from poses/val/, which does not exist (FileNotFoundError)
  ckptsize   - rank N initialises from ckpt/gaitnet_h48.pt (hidden 48): load_state_dict size mismatch
  ckptpickle - rank N loads ckpt/gaitnet_meta.pt, which pickles a GaitMeta object: weights_only refusal
  gathershape- rank N gathers per-subject counts with an extra "unknown" slot (9 vs 8) at the end
  dtw        - rank N runs a pure-Python DTW over all its sequence pairs before step 3 (slow rank)
  nanvel     - rank N's tracker repeats the timestamp of frame 12: velocity x/0 -> inf/NaN, the program's check
  sigsegv    - rank N sends itself SIGSEGV after step 2
  exit4      - rank N prints its own ERROR line (a sequence with 0 tracked frames) and sys.exit(4) at step 4
  confbug    - every rank keeps the joint confidence channel: 102 features, the encoder expects 68 (shape error)
  collate    - (--hf) rank N's collator passes a 20-frame sequence into the batch at step 2 (stack error)
  cbraise    - (--hf) rank N's TrainerCallback raises at the end of step 3 (the tracker lost the subject)
  none       - control, clean run

What happened (filled in after the runs):
  joint      - 'IndexError: index 17 is out of bounds for dimension 2 with size 17' at step 1; peers Connection closed (np4 r2 acc, np5 r0 torchrun)
  subject    - KeyError: 'S099' at start-up, peers SIGTERMed before any collective (np3 r1 accconfig, np4 r3 tee)
  nopose     - FileNotFoundError for poses/val/poses_1.pt; node 1's ranks Connection closed; wrapper exit 0 (np4 r1 acc2nodes)
  ckptsize   - load_state_dict size mismatch [48,...] vs [32,...] at start-up (np3 r2 torchrun, np5 r1 accconfig)
  ckptpickle - 'Weights only load failed' ... 'Unsupported global: GLOBAL __main__.GaitMeta' (np4 r0 torchrun)
  gathershape- --debug: DistributedOperationException on every rank listing 'Process 2: [9]' (np4 r2 accdebug);
               no debug: rank 2 terminate on gloo::EnforceNotMet '36 vs 32. Received data size doesn't match', SIGABRT (np3 r1 tee)
  dtw        - 12 s: peers 'Timed out waiting 12000ms' at step 3 (np4 r1 acc2nodes); 300 s: silent, killed at 60 s, exit 124 (np3 r2 acc)
  nanvel     - the timestamps are repeated from the start, so the check fires before step 1 (not step 2):
               FloatingPointError, 5984 non-finite values (np6 r4 accdebug, np3 r0 tee)
  sigsegv    - no traceback after step 2; Root Cause exitcode -11 (SIGSEGV) (np4 r3 torchrun, np4 r1 acc2nodes, wrapper exit 0)
  exit4      - rank 2's ERROR line after step 4, Root Cause exitcode 4 (np5 r2 accconfig)
  confbug    - every rank: 'expected input[16, 102, 24] to have 68 channels, but got 102' (np3 accdebug)
  collate    - 'stack expects each tensor to be equal size, but got [24, 68] at entry 0 and [20, 68] at entry 5' on rank 1,
               before any step line (accelerate's loader fetches one batch ahead) (np4 r1 hf/torchrun)
  cbraise    - ValueError 'tracker lost subject ...' from rank 2's callback at step 3 (np3 r2 hf/accelerate launch)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/gaitnet.pt, exit 0 (np3 acc)
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

WORK = "/tmp/fault363_work"
SUBJECTS = {f"S{i:03d}": i - 1 for i in range(1, 9)}
NJ = 17
T = 24
EDGES = [(0, 1), (0, 2), (1, 3), (2, 4), (5, 6), (5, 7), (7, 9), (6, 8), (8, 10), (5, 11),
         (6, 12), (11, 12), (11, 13), (13, 15), (12, 14), (14, 16)]


class GaitMeta:
    def __init__(self, fps, joints):
        self.fps, self.joints = fps, joints


class GaitNet(nn.Module):
    def __init__(self, feat=68, hidden=32, nsub=8):
        super().__init__()
        self.conv = nn.Conv1d(feat, hidden, 3, padding=1)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.bone = nn.Linear(len(EDGES), hidden)
        self.head = nn.Linear(hidden, nsub)

    def forward(self, x, bones):
        h = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        _, hn = self.gru(h)
        return self.head(hn[-1] + self.bone(bones))


def synth(n, seed, subj_override=None):
    g = torch.Generator().manual_seed(seed)
    subj = torch.randint(0, 8, (n,), generator=g)
    base = torch.randn(8, NJ, 2, generator=g) * 0.3
    phase = torch.linspace(0, 2 * math.pi, T)
    pose = base[subj][:, None] + 0.1 * torch.sin(phase)[None, :, None, None] * (1 + subj[:, None, None, None] / 8)
    pose = pose + 0.02 * torch.randn(n, T, NJ, 2, generator=g)
    conf = torch.rand(n, T, NJ, 1, generator=g)
    ts = torch.arange(T, dtype=torch.float32)[None].repeat(n, 1) / 30.0
    keys = [f"S{int(s) + 1:03d}" for s in subj]
    return {"pose": torch.cat([pose, conf], -1), "ts": ts, "subject": keys}


def prepare():
    os.makedirs(f"{WORK}/poses", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        torch.save(synth(96, 363 + r), f"{WORK}/poses/poses_{r}.pt")
    torch.manual_seed(0)
    torch.save(GaitNet().state_dict(), f"{WORK}/ckpt/gaitnet_h32.pt")
    torch.save(GaitNet(hidden=48).state_dict(), f"{WORK}/ckpt/gaitnet_h48.pt")
    torch.save({"meta": GaitMeta(30, NJ), "state": GaitNet().state_dict()}, f"{WORK}/ckpt/gaitnet_meta.pt")
    print("prepared", WORK)


def featurise(d, rank, fault, me, keep_conf=False):
    pose = d["pose"] if keep_conf else d["pose"][..., :2]
    hip = d["pose"][:, :, 11:13, :2].mean(2, keepdim=True)
    rel = (pose - torch.cat([hip, torch.zeros_like(hip[..., :1])], -1)[..., :pose.shape[-1]])
    ts = d["ts"].clone()
    if fault == "nanvel" and me:
        ts[:, 12:] = ts[:, 12:13]  # tracker repeated the frame timestamp
    dt = (ts[:, 1:] - ts[:, :-1])[..., None, None]
    vel = torch.cat([torch.zeros_like(rel[:, :1]), (rel[:, 1:] - rel[:, :-1]) / dt], 1)
    x = torch.cat([rel.flatten(2), vel.flatten(2)], -1)
    edges = EDGES + [(5, 17)] if (fault == "joint" and me) else EDGES
    bones = torch.stack([(d["pose"][:, :, a, :2] - d["pose"][:, :, b, :2]).norm(dim=-1).mean(1) for a, b in edges], -1)
    if bones.shape[-1] != len(EDGES):
        bones = bones[:, :len(EDGES)]
    y = torch.tensor([SUBJECTS[k] for k in d["subject"]])
    return x, bones, y


def dtw(a, b):
    n, m = len(a), len(b)
    cost = [[float("inf")] * (m + 1) for _ in range(n + 1)]
    cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            d = sum((float(p) - float(q)) ** 2 for p, q in zip(a[i - 1], b[j - 1]))
            cost[i][j] = d + min(cost[i - 1][j], cost[i][j - 1], cost[i - 1][j - 1])
    return cost[n][m]


def check_finite(name, t, rank):
    bad = (~torch.isfinite(t)).sum().item()
    if bad:
        print(f"rank {rank}: {name} has {bad} non-finite values (min dt {t.abs().min().item():.3g})", flush=True)
        raise FloatingPointError(f"non-finite {name} on rank {rank}: {bad} values")


def run_accelerate(a):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    me = a.rank == -1 or a.rank == rank
    fault = a.fault
    print(f"rank {rank}/{world} up (pid {os.getpid()}, fault {fault}, faulty rank {a.rank})", flush=True)
    src = f"{WORK}/poses/val/poses_{rank}.pt" if (fault == "nopose" and me) else f"{WORK}/poses/poses_{rank}.pt"
    d = torch.load(src)
    if fault == "subject" and me:
        d["subject"][37] = "S099"
    x, bones, y = featurise(d, rank, fault if fault in ("nanvel",) else "", me, keep_conf=(fault == "confbug"))
    if fault == "confbug":
        pass
    model = GaitNet()
    ck = f"{WORK}/ckpt/gaitnet_h32.pt"
    if fault == "ckptsize" and me:
        ck = f"{WORK}/ckpt/gaitnet_h48.pt"
    if fault == "ckptpickle" and me:
        sd = torch.load(f"{WORK}/ckpt/gaitnet_meta.pt")["state"]
    else:
        sd = torch.load(ck, weights_only=True)
    model.load_state_dict(sd)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    n = x.shape[0]
    bs = 16
    for step in range(1, a.steps + 1):
        lo = ((step - 1) * bs) % n
        xb, bb, yb = x[lo:lo + bs], bones[lo:lo + bs], y[lo:lo + bs]
        if fault == "joint" and me and step == 1:
            _, bb, _ = featurise(d, rank, "joint", me)
        if fault == "dtw" and me and step == 3:
            print(f"rank {rank} aligning {n} sequences with DTW before step {step}", flush=True)
            seqs = d["pose"][..., :2].flatten(2).tolist()
            tot = 0.0
            for i in range(n):
                for j in range(n):
                    tot += dtw(seqs[i], seqs[j])
            print(f"rank {rank} dtw total {tot:.1f}", flush=True)
        check_finite("velocity features", xb, rank)
        logits = model(xb, bb)
        loss = F.cross_entropy(logits, yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        red = acc.reduce(loss.detach(), reduction="mean")
        preds = acc.gather(logits.argmax(-1))
        labels = acc.gather(yb)
        accu = (preds == labels).float().mean().item()
        print(f"rank {rank} step {step} loss {red.item():.4f} acc {accu:.3f}", flush=True)
        if fault == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "exit4" and me and step == 4:
            print(f"rank {rank} ERROR: sequence 41 of poses_{rank}.pt has 0 tracked frames (tracker dropout); refusing to train on it", flush=True)
            sys.exit(4)
    counts = torch.bincount(y, minlength=8)
    if fault == "gathershape" and me:
        counts = torch.cat([counts, torch.tensor([3])])  # an "unknown" subject slot
    allc = acc.gather(counts)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/gaitnet.pt")
        print(f"rank 0 saved {WORK}/export/gaitnet.pt (subject counts {allc.tolist()[:8]})", flush=True)
    acc.end_training()


def run_hf(a):
    from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments, TrainerCallback

    class GaitConfig(PretrainedConfig):
        model_type = "gaitnet"

        def __init__(self, feat=68, hidden=32, nsub=8, **kw):
            super().__init__(**kw)
            self.feat, self.hidden, self.nsub = feat, hidden, nsub

    class GaitHF(PreTrainedModel):
        config_class = GaitConfig

        def __init__(self, cfg):
            super().__init__(cfg)
            self.conv = nn.Conv1d(cfg.feat, cfg.hidden, 3, padding=1)
            self.gru = nn.GRU(cfg.hidden, cfg.hidden, batch_first=True)
            self.head = nn.Linear(cfg.hidden, cfg.nsub)
            self.post_init()

        def forward(self, pose=None, labels=None):
            h = F.relu(self.conv(pose.transpose(1, 2))).transpose(1, 2)
            _, hn = self.gru(h)
            logits = self.head(hn[-1])
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    rank = int(os.environ.get("RANK", 0))
    me = a.rank == -1 or a.rank == rank
    d = torch.load(f"{WORK}/poses/poses_{rank}.pt")
    x, _, y = featurise(d, rank, "", me)
    ds = [{"pose": x[i], "labels": y[i]} for i in range(x.shape[0])]
    calls = {"n": 0}

    def collate(items):
        calls["n"] += 1
        poses = [it["pose"] for it in items]
        if a.fault == "collate" and me and calls["n"] == 2:
            poses[5] = poses[5][:20]  # a walk clipped at 20 frames slipped through the filter
        return {"pose": torch.stack(poses), "labels": torch.stack([it["labels"] for it in items])}

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} lr {logs.get('learning_rate', 0):.2e}", flush=True)

        def on_step_end(self, args, state, control, **kw):
            if a.fault == "cbraise" and me and state.global_step == 3:
                raise ValueError(f"tracker lost subject in clip batch at step {state.global_step} on rank {rank}: 0 of 17 joints visible")

    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], per_device_train_batch_size=8, max_steps=a.steps, logging_steps=1,
                             save_strategy="no", disable_tqdm=True, remove_unused_columns=False, learning_rate=3e-3)
    tr = Trainer(model=GaitHF(GaitConfig()), args=args, train_dataset=ds, data_collator=collate, callbacks=[Progress()])
    tr.train()
    tr.save_model(f"{WORK}/export/gaitnet_hf")
    if rank == 0:
        print(f"rank 0 saved {WORK}/export/gaitnet_hf", flush=True)


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
    if a.hf:
        return run_hf(a)
    run_accelerate(a)


if __name__ == "__main__":
    main()

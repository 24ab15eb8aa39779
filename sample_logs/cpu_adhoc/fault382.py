"""A three-hundred-and-eighty-second hand-run batch: SIGN LANGUAGE GESTURE RECOGNITION FROM POSE KEYPOINTS.

Synthetic signing clips: every clip is 16 frames of 25 upper-body and hand keypoints (x, y) from a pose
estimator, a handshape name (looked up in the handshape vocabulary vocab/handshapes.json) and one of 24 sign
glosses.  Every rank reads its signer's clips from /tmp/fault382_work/keypoints/kp_R.pt, computes positions
and frame-to-frame velocities (fps 25), and trains a small skeleton network (a neighbour-averaging graph layer
over the skeleton edges, a per-frame linear layer, a GRU over time and a gloss head) with Hugging Face
accelerate (Accelerator(cpu=True), gloo process group with the --pg-timeout given through
InitProcessGroupKwargs).  The model is initialised from ckpt/gesture_c24.pt through accelerate's unwrap_model.
The loss is reduced (accelerator.reduce) and the predictions gathered (accelerator.gather_for_metrics) every
step; at the end the validation logits are gathered and rank 0 saves export/ with accelerator.save_model.
--hf 1 runs the same data through a transformers.Trainer instead (a tiny PreTrainedModel built from a config).

Faults:
  handshape   - rank N loads the old vocabulary vocab/handshapes_v1.json, without "Y"; a clip's "Y" (KeyError)
  jointidx    - rank N's skeleton edge table lists the left pinky tip as joint 25 of 25 (IndexError in forward)
  nokeypoints - rank N reads its clips from keypoints/test/kp_R.pt, which does not exist (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/gesture_c30.pt, saved with 30 glosses (size mismatch)
  pickled     - rank N reads the signer meta ckpt/signer_meta.pt, a pickled object (weights_only refusal)
  gathershape - rank N adds its held-out clip to the final validation gather (an extra row in accelerator.gather)
  slowrank    - rank N recomputes DTW distances between all its clips in Python before the step-3 reduce
  nanvel      - rank N's clips report fps 0: velocities inf/NaN, the program's non-finite check at step 3
  segv        - rank N sends itself SIGSEGV after step 2
  exit5       - rank N prints its own error line about keypoint confidence and calls sys.exit(5) after step 1
  allwidth    - every rank: keypoints carry a confidence channel (3 values per joint), the frame layer expects 2
  hfcollate   - (--hf 1) rank N's collator maps gloss ids through the 30-gloss table: label 27 for 24 classes
  hfcallback  - (--hf 1) rank N's TrainerCallback on_step_end raises at step 3 (a RuntimeError about a signer)
  none        - control, clean run

What happened (filled in after the runs):
  handshape   - KeyError: 'Y' in ClipSet.__getitem__ under accelerate's DataLoaderShard at step 3; peers Connection closed by peer; Root Cause rank N (np4 r2 acc, np5 r0 torchrun)
  jointidx    - DDP broadcasts rank 0's src/dst buffers, so with N=0 every rank raised 'IndexError: index 25 is out of bounds for dimension 0 with size 25' in the first forward; Root Cause another rank (np3 r0 tee, np4 r0 accconfig); a first accconfig try with MULTI_CPU failed before the process group (dropped); N>0 would be masked by the broadcast
  nokeypoints - FileNotFoundError for keypoints/test/kp_3.pt at start-up; peers Connection closed by peer (np4 r3 acc2nodes)
  ckptsize    - load_state_dict size mismatch for head.weight/head.bias [30,32] vs [24,32] at start-up; Root Cause rank N (np3 r1 accdebug, np6 r4 torchrun)
  pickled     - _pickle.UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SignerMeta' at start-up (np3 r2 tee)
  gathershape - --debug: DistributedOperationException shape mismatch on every rank, Process N [5, 24] (np4 r1 accdebug); plain: rank 0 gloo::EnforceNotMet 'Received data size doesn't match expected size' SIGABRT (np3 r2 acc)
  slowrank    - 12 s: peers 'Timed out waiting 12000ms for send/recv operation to complete' (np3 r1 torchrun); 300 s: silent after rank N's DTW line, killed at 60 s, exit 124 (np4 r2 acc)
  nanvel      - reduced loss nan on every rank from step 1; rank N's check raised FloatingPointError at step 3 (np5 r3 tee, np4 r0 accconfig)
  segv        - no traceback; Root Cause rank N exitcode -11 (SIGSEGV), peers Connection reset (np3 r2 accdebug, np4 r1 acc2nodes)
  exit5       - rank N's own ERROR line and exit 5 after step 1; Root Cause rank 5 exitcode 5 (np6 r5 tee)
  allwidth    - every rank 'mat1 and mat2 shapes cannot be multiplied (64x300 and 200x32)' in the first forward (np3 accconfig)
  hfcollate   - Trainer: rank 1 'IndexError: Target 27 is out of bounds.' in compute_loss at step 2 (np3 r1 hf under accelerate launch)
  hfcallback  - Trainer: rank 0's on_step_end RuntimeError at step 3; peers Connection closed by peer (np4 r0 hf under torchrun)
  none        - clean: 6 steps on 3 ranks, validation gather (12, 24), rank 0 saved export/, exit 0 (np3 acc)
"""
import argparse
import json
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

WORK = "/tmp/fault382_work"
NJ = 25
NT = 16
NCLS = 24
HANDSHAPES = ["A", "B", "C", "5", "O", "L", "V", "Y", "1", "S", "F", "W"]
EDGES = [(0, 1), (1, 2), (2, 3), (3, 4), (1, 5), (5, 6), (6, 7), (1, 8), (4, 9), (9, 10), (10, 11),
         (4, 12), (12, 13), (13, 14), (4, 15), (15, 16), (7, 17), (17, 18), (18, 19), (7, 20),
         (20, 21), (21, 22), (7, 23), (23, 24)]


class SignerMeta:
    def __init__(self, signer, hand):
        self.signer = signer
        self.hand = hand


def prepare():
    os.makedirs(f"{WORK}/keypoints", exist_ok=True)
    os.makedirs(f"{WORK}/vocab", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(100 + r)
        n = 96
        kp = torch.rand(n, NT, NJ, 2, generator=g)
        hs = [HANDSHAPES[int(i)] for i in torch.randint(0, len(HANDSHAPES), (n,), generator=g)]
        lab = torch.randint(0, NCLS, (n,), generator=g)
        torch.save({"kp": kp, "handshape": hs, "gloss": lab, "fps": 25.0, "signer": r}, f"{WORK}/keypoints/kp_{r}.pt")
    with open(f"{WORK}/vocab/handshapes.json", "w") as f:
        json.dump({h: i for i, h in enumerate(HANDSHAPES)}, f)
    with open(f"{WORK}/vocab/handshapes_v1.json", "w") as f:
        json.dump({h: i for i, h in enumerate(x for x in HANDSHAPES if x != "Y")}, f)
    torch.save(GestureNet(NCLS).state_dict(), f"{WORK}/ckpt/gesture_c24.pt")
    torch.save(GestureNet(30).state_dict(), f"{WORK}/ckpt/gesture_c30.pt")
    torch.save({"meta": SignerMeta(3, "right")}, f"{WORK}/ckpt/signer_meta.pt")
    print("prepared", WORK)


class ClipSet(Dataset):
    def __init__(self, path, vocab, conf_channel=False, fps_override=None):
        d = torch.load(path)
        self.kp, self.hs, self.gloss = d["kp"], d["handshape"], d["gloss"]
        self.fps = d["fps"] if fps_override is None else fps_override
        self.vocab = vocab
        self.conf = conf_channel

    def __len__(self):
        return len(self.gloss)

    def __getitem__(self, i):
        pos = self.kp[i]
        if self.conf:
            pos = torch.cat([pos, torch.ones(NT, NJ, 1)], dim=-1)
        vel = torch.diff(pos, dim=0, prepend=pos[:1]) * self.fps
        if self.fps == 0:
            vel = torch.diff(pos, dim=0, prepend=pos[:1]) / torch.tensor(self.fps)
        return {"x": torch.cat([pos, vel], dim=-1), "hand": self.vocab[self.hs[i]], "labels": self.gloss[i]}


class GestureNet(nn.Module):
    def __init__(self, ncls=NCLS, cin=4, dim=32, edges=EDGES):
        super().__init__()
        self.register_buffer("src", torch.tensor([e[0] for e in edges] + [e[1] for e in edges]))
        self.register_buffer("dst", torch.tensor([e[1] for e in edges] + [e[0] for e in edges]))
        self.frame = nn.Linear(NJ * cin * 2, dim)
        self.hand = nn.Embedding(len(HANDSHAPES), 8)
        self.gru = nn.GRU(dim + 8, dim, batch_first=True)
        self.head = nn.Linear(dim, ncls)

    def forward(self, x, hand):
        # x: [B, T, J, C]; neighbour average over the skeleton edges, concatenated to the joint itself
        nb = torch.zeros_like(x).index_add_(2, self.dst, x[:, :, self.src])
        deg = torch.zeros(NJ).index_add_(0, self.dst, torch.ones(len(self.dst))).clamp(min=1)
        h = torch.cat([x, nb / deg[None, None, :, None]], dim=-1).flatten(2)
        h = torch.relu(self.frame(h))
        h = torch.cat([h, self.hand(hand)[:, None].expand(-1, h.shape[1], -1)], dim=-1)
        out, _ = self.gru(h)
        return self.head(out[:, -1])


def dtw(a, b):
    n, m = len(a), len(b)
    D = [[math.inf] * (m + 1) for _ in range(n + 1)]
    D[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            c = sum((a[i - 1][k] - b[j - 1][k]) ** 2 for k in range(len(a[0])))
            D[i][j] = c + min(D[i - 1][j], D[i][j - 1], D[i - 1][j - 1])
    return D[n][m]


def run_hf(args, rank):
    from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

    class GestureConfig(PretrainedConfig):
        model_type = "gesture"

        def __init__(self, num_glosses=NCLS, dim=32, **kw):
            self.num_glosses = num_glosses
            self.dim = dim
            super().__init__(**kw)

    class GestureModel(PreTrainedModel):
        config_class = GestureConfig

        def __init__(self, config):
            super().__init__(config)
            self.net = GestureNet(config.num_glosses, dim=config.dim)
            self.post_init()

        def forward(self, x=None, hand=None, labels=None):
            logits = self.net(x, hand)
            loss = F.cross_entropy(logits, labels) if labels is not None else None
            return {"loss": loss, "logits": logits}

    vocab = json.load(open(f"{WORK}/vocab/handshapes.json"))
    ds = ClipSet(f"{WORK}/keypoints/kp_{rank}.pt", vocab)
    faulty = args.rank in (-1, rank)
    gloss30 = torch.randperm(30, generator=torch.Generator().manual_seed(7))

    def collate(items):
        b = {"x": torch.stack([it["x"] for it in items]), "hand": torch.tensor([it["hand"] for it in items]),
             "labels": torch.stack([it["labels"] for it in items])}
        if args.fault == "hfcollate" and faulty and collate.calls >= 1:
            b["labels"] = gloss30[b["labels"]]  # the 30-gloss table of the old release
            b["labels"][0] = 27
        collate.calls += 1
        return b
    collate.calls = 0

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} lr {logs.get('learning_rate', 0):.2e}", flush=True)

        def on_step_end(self, a, state, control, **kw):
            if args.fault == "hfcallback" and faulty and state.global_step == 3:
                raise RuntimeError(f"signer {rank}: keypoint tracker lost both wrists in 11 of 16 frames; aborting signer")

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=args.pg_timeout,
                              report_to=[], per_device_train_batch_size=4, max_steps=args.steps, logging_steps=1,
                              save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-3)
    model = GestureModel(GestureConfig())
    tr = Trainer(model=model, args=targs, train_dataset=ds, data_collator=collate, callbacks=[Progress()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export_hf")
        print("rank 0 saved export_hf", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    rank = int(os.environ.get("RANK", "0"))
    if args.hf:
        return run_hf(args, rank)

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    faulty = args.fault != "none" and args.rank in (-1, rank)
    torch.manual_seed(0)
    print(f"rank {rank}/{world} signer {rank} fault={args.fault if faulty else 'none'}", flush=True)

    vocab_file = "handshapes_v1.json" if faulty and args.fault == "handshape" else "handshapes.json"
    vocab = json.load(open(f"{WORK}/vocab/{vocab_file}"))
    kp_path = f"{WORK}/keypoints/{'test/' if faulty and args.fault == 'nokeypoints' else ''}kp_{rank}.pt"
    ds = ClipSet(kp_path, vocab, conf_channel=args.fault == "allwidth" and faulty,
                 fps_override=0.0 if faulty and args.fault == "nanvel" else None)
    if faulty and args.fault == "pickled":
        meta = torch.load(f"{WORK}/ckpt/signer_meta.pt")
        print(f"rank {rank} signer meta {meta}", flush=True)
    val = ClipSet(f"{WORK}/keypoints/kp_7.pt", json.load(open(f"{WORK}/vocab/handshapes.json")))

    edges = list(EDGES)
    if faulty and args.fault == "jointidx":
        edges[-1] = (23, 25)  # pinky tip numbered from 1 in the tracker's export
    model = GestureNet(NCLS, edges=edges)
    ck = "gesture_c30.pt" if faulty and args.fault == "ckptsize" else "gesture_c24.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = DataLoader(ds, batch_size=4, shuffle=False)
    model, opt, dl = acc.prepare(model, opt, dl)
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    sd = {k: v for k, v in sd.items() if k not in ("src", "dst")}
    acc.unwrap_model(model).load_state_dict(sd, strict=False)
    print(f"rank {rank} initialised from ckpt/{ck}", flush=True)

    step = 0
    for batch in dl:
        step += 1
        if faulty and args.fault == "slowrank" and step == 3:
            print(f"rank {rank} recomputing DTW distances between clips", flush=True)
            clips = ds.kp.flatten(2).tolist()
            for i in range(len(clips)):
                for j in range(len(clips)):
                    dtw(clips[i], clips[j])
        logits = model(batch["x"], batch["hand"])
        loss = F.cross_entropy(logits, batch["labels"])
        if args.fault == "nanvel" and faulty and step == 3:
            bad = (~torch.isfinite(batch["x"])).sum().item()
            if bad or not torch.isfinite(loss):
                print(f"rank {rank} step {step}: {bad} non-finite keypoint features (fps {ds.fps}), loss {loss.item()}", flush=True)
                raise FloatingPointError(f"non-finite velocity features on rank {rank} at step {step}")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        mloss = acc.reduce(loss.detach(), reduction="mean")
        preds, labs = acc.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        accu = (preds == labs).float().mean().item()
        print(f"rank {rank} step {step} loss {mloss.item():.4f} acc {accu:.3f}", flush=True)
        if faulty and args.fault == "exit5" and step == 1:
            print(f"ERROR: rank {rank}: signer {rank} keypoint confidence below 0.2 in 83% of hand frames; clips unusable, stopping", flush=True)
            sys.exit(5)
        if faulty and args.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if step >= args.steps:
            break

    model.eval()
    with torch.no_grad():
        vb = [val[i] for i in range(rank * 4, rank * 4 + 4 + (1 if faulty and args.fault == "gathershape" else 0))]
        vx = torch.stack([v["x"] for v in vb])
        vl = model(vx, torch.tensor([v["hand"] for v in vb]))
    allv = acc.gather(vl)
    print(f"rank {rank} gathered validation logits {tuple(allv.shape)}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save_model(model, f"{WORK}/export")
        print(f"rank 0 saved export/ after {step} steps", flush=True)
    acc.end_training()


if __name__ == "__main__":
    main()

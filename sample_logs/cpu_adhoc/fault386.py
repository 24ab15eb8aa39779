"""A three-hundred-and-eighty-sixth hand-run batch: SPEECH EMOTION RECOGNITION WITH HUGGING FACE ACCELERATE.

Synthetic utterances as log-mel spectrograms (64 mel bins x 40 frames) with an emotion label (a 6-entry table:
neutral, happy, sad, angry, fearful, disgust).  Every rank reads its shard from /tmp/fault386_work/feats/feats_rR.pt
(a dict of mel tensors, emotion names and speaker ids), normalises the features by the global mean/std in
stats.pt, and trains a small Conv1d + attentive-pooling classifier on cross entropy.  The framework is accelerate:
Accelerator(cpu=True, InitProcessGroupKwargs(backend="gloo", timeout=--pg-timeout)).  The model is initialised from
ckpt/ser_base.pt; the loss and the accuracy are accelerator.reduce'd and the per-utterance predictions gathered
with accelerator.gather every step; rank 0 saves export/ser.pt with accelerator.save at the end.
With --hf the loop is a transformers.Trainer over a tiny Wav2Vec2ForSequenceClassification built from a config
(raw 4000-sample waveforms, TrainingArguments(use_cpu=True, ddp_backend="gloo", ddp_timeout=--pg-timeout)).

Faults:
  emotion    - rank N's shard names an emotion "sarcastic" missing from the label table (KeyError, building the shard)
  nofeats    - rank N reads its shard from feats/augmented/ which does not exist (FileNotFoundError, start-up)
  ckptwidth  - rank N initialises from ckpt/ser_wide.pt, saved with 48 conv channels, not 32 (size mismatch)
  ckptpickle - rank N initialises from ckpt/ser_meta.pt, which pickles an EmotionConfig object (weights_only refusal)
  clipgather - rank N gathers 9 per-utterance predictions at step 2 instead of 8 (one padded clip kept)
  slowvad    - rank N runs a frame-by-frame Python voice-activity detector before the step-2 reduce (~30 s)
  vadlock    - rank N waits for a VAD lock file that never appears before step 2 (stuck; run with --pg-timeout 300)
  nanenergy  - rank N's energy feature is log(0) at step 3: the program's finiteness check raises FloatingPointError
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit3      - rank N prints its own error line about speaker overlap at the end and calls sys.exit(3)
  melbins    - every rank: features computed with 80 mel bins, the model expects 64 (shape error, first forward)
  hfcollate  - (--hf) rank N's collator emits one label too many at step 2 (batch size mismatch in the loss)
  hfcallback - (--hf) rank N's EmotionCalibration callback raises RuntimeError at the end of step 3
  none       - control, clean run

What happened (filled in after the runs):
  emotion    - "KeyError: 'sarcastic'" at start-up; the others SIGTERMed; Root Cause the faulty rank (np4 r2 acc, np5 r0 torchrun)
  nofeats    - FileNotFoundError for feats/augmented/feats_rN.pt at start-up (np3 r1 accconfig; np4 r3 acc2nodes: node 0's
               ranks see Connection closed by peer and node 0's Root Cause names rank 0)
  ckptwidth  - load_state_dict size mismatch for conv1/conv2/att/head ([48,64,3] vs [32,64,3]); Root Cause rank 1 (np4 tee)
  ckptpickle - UnpicklingError 'Weights only load failed' ... Unsupported global __main__.EmotionConfig (np3 r2 acc)
  clipgather - under --debug every rank raises DistributedOperationException listing Process N: [9] against [8];
               Root Cause names rank 0 (np3 r1, np5 r3, both accdebug)
  slowvad    - ranks 0 and 1: 'Timed out waiting 12000ms for recv operation'; rank 2 SIGTERMed in its loop;
               Root Cause rank 1 (np3 r2 torchrun)
  vadlock    - 'rank 1 waiting for .../vad.lock', output stops after step 1, killed by timeout at 60 s, exit 124 (np4 acc)
  nanenergy  - '320 non-finite values in the log-energy channel', FloatingPointError at step 3; peers closed
               (np6 r4 accconfig, np3 r0 tee)
  sigsegv    - no traceback; Root Cause exitcode -11 (SIGSEGV); peers Connection reset by peer (np5 r2 torchrun,
               np4 r0 acc2nodes: node 1's Root Cause names rank 3, a cascade)
  exit3      - the ERROR line about speaker overlap and exit 3 after step 6; peers closed in the final barrier
               (np3 r1 tee, np6 r5 accconfig)
  melbins    - every rank: 'expected input[8, 80, 40] to have 64 channels, but got 80 channels instead' (np4 accdebug)
  hfcollate  - 'ValueError: Expected input batch_size (4) to match target batch_size (5).' at step 2; Root Cause rank 2 (np4 hf torchrun)
  hfcallback - 'RuntimeError: EmotionCalibration: per-class prior drift 0.91 exceeds 0.5 on rank 1' at step 3 (np3 hf accelerate)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/ser.pt, exit 0 (np3 acc)
  (a first accconfig run with distributed_type MULTI_CPU never formed a process group and was dropped)
"""
import argparse
import dataclasses
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault386_work"
EMOTIONS = {"neutral": 0, "happy": 1, "sad": 2, "angry": 3, "fearful": 4, "disgust": 5}
NMEL = 64
FRAMES = 40
CH = 32
BATCH = 8


@dataclasses.dataclass
class EmotionConfig:
    n_mels: int = NMEL
    channels: int = CH
    labels: tuple = tuple(EMOTIONS)


class SERNet(nn.Module):
    def __init__(self, n_mels=NMEL, ch=CH, n_cls=len(EMOTIONS)):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, ch, 3, padding=1)
        self.conv2 = nn.Conv1d(ch, ch, 3, padding=1)
        self.att = nn.Linear(ch, 1)
        self.head = nn.Linear(ch, n_cls)

    def forward(self, mel):                      # mel: [B, T, n_mels]
        h = F.relu(self.conv1(mel.transpose(1, 2)))
        h = F.relu(self.conv2(h)).transpose(1, 2)  # [B, T, ch]
        w = torch.softmax(self.att(h), dim=1)
        return self.head((w * h).sum(1))


def prepare(world_max=8):
    g = torch.Generator().manual_seed(386)
    os.makedirs(f"{WORK}/feats", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    names = list(EMOTIONS)
    allmel = []
    for r in range(world_max):
        n = 64
        lab = torch.randint(0, len(names), (n,), generator=g)
        mel = torch.randn(n, FRAMES, NMEL, generator=g) + lab[:, None, None].float() * 0.1
        allmel.append(mel)
        emo = [names[i] for i in lab.tolist()]
        if r >= 0:
            bad = list(emo)
            bad[13] = "sarcastic"
            torch.save({"mel": mel, "emotion": bad, "speaker": [f"spk{(r * 7 + i) % 23}" for i in range(n)]},
                       f"{WORK}/feats/feats_r{r}_sarc.pt")
        torch.save({"mel": mel, "emotion": emo, "speaker": [f"spk{(r * 7 + i) % 23}" for i in range(n)]},
                   f"{WORK}/feats/feats_r{r}.pt")
    allm = torch.cat(allmel)
    torch.save({"mean": allm.mean(), "std": allm.std()}, f"{WORK}/stats.pt")
    torch.manual_seed(0)
    torch.save(SERNet().state_dict(), f"{WORK}/ckpt/ser_base.pt")
    torch.save(SERNet(ch=48).state_dict(), f"{WORK}/ckpt/ser_wide.pt")
    torch.save({"config": EmotionConfig(), "state_dict": SERNet().state_dict()}, f"{WORK}/ckpt/ser_meta.pt")
    print("prepared", WORK)


def load_shard(rank, fault, frank):
    path = f"{WORK}/feats/feats_r{rank}.pt"
    if fault == "nofeats" and rank == frank:
        path = f"{WORK}/feats/augmented/feats_r{rank}.pt"
    if fault == "emotion" and rank == frank:
        path = f"{WORK}/feats/feats_r{rank}_sarc.pt"
    d = torch.load(path)
    labels = torch.tensor([EMOTIONS[e] for e in d["emotion"]])
    st = torch.load(f"{WORK}/stats.pt")
    mel = (d["mel"] - st["mean"]) / st["std"]
    if fault == "melbins":
        mel = torch.cat([mel, mel[:, :, :16]], dim=2)   # 80 mel bins
    return torch.utils.data.TensorDataset(mel, labels)


def vad_python(mel):
    # a deliberately slow frame-by-frame energy detector in pure Python
    voiced = 0
    t0 = time.time()
    while time.time() - t0 < 30:
        for utt in mel.tolist()[:4]:
            for frame in utt:
                e = sum(v * v for v in frame) / len(frame)
                voiced += e > 1.0
    return voiced


def train_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    fault, frank = args.fault, args.rank
    hit = fault != "none" and (frank == -1 or frank == rank)
    print(f"rank {rank}/{world} pid {os.getpid()} fault={fault if hit else 'none'} device={acc.device}", flush=True)
    ds = load_shard(rank, fault, frank)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(rank))
    model = SERNet()
    ck = f"{WORK}/ckpt/ser_base.pt"
    if hit and fault == "ckptwidth":
        ck = f"{WORK}/ckpt/ser_wide.pt"
    if hit and fault == "ckptpickle":
        ck = f"{WORK}/ckpt/ser_meta.pt"
    sd = torch.load(ck, map_location="cpu")
    model.load_state_dict(sd["state_dict"] if "state_dict" in sd else sd)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    it = iter(loader)
    for step in range(1, args.steps + 1):
        mel, lab = next(it)
        if hit and fault == "nanenergy" and step == 3:
            energy = torch.log(mel.pow(2).mean(-1, keepdim=True) * 0.0)
            mel = torch.cat([mel[:, :, :-1], energy], dim=-1)
            bad = (~torch.isfinite(mel)).sum().item()
            if bad:
                print(f"rank {rank} step {step}: {bad} non-finite values in the log-energy channel", flush=True)
                raise FloatingPointError(f"non-finite input features on rank {rank} at step {step}")
        logits = model(mel)
        loss = F.cross_entropy(logits, lab)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        pred = logits.argmax(-1)
        if hit and fault == "clipgather" and step == 2:
            pred = torch.cat([pred, pred[:1]])       # the padded clip kept
        if hit and fault == "slowvad" and step == 2:
            print(f"rank {rank} running python VAD on batch", flush=True)
            vad_python(mel)
        if hit and fault == "vadlock" and step == 2:
            print(f"rank {rank} waiting for {WORK}/vad.lock", flush=True)
            while not os.path.exists(f"{WORK}/vad.lock"):
                time.sleep(0.5)
        mloss = acc.reduce(loss.detach(), reduction="mean")
        allpred = acc.gather(pred)
        uacc = (pred == lab).float().mean()
        macc = acc.reduce(uacc, reduction="mean")
        print(f"rank {rank} step {step} loss {mloss.item():.4f} acc {macc.item():.3f} "
              f"gathered {allpred.numel()}", flush=True)
        if hit and fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if hit and fault == "exit3":
        print(f"rank {rank} ERROR: speaker spk{rank + 3} appears in both train and eval shards; "
              f"refusing to export", flush=True)
        sys.exit(3)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/ser.pt")
        print(f"rank 0 saved {WORK}/export/ser.pt", flush=True)
    acc.end_training()


def train_hf(args):
    from transformers import (Trainer, TrainingArguments, TrainerCallback, Wav2Vec2Config,
                              Wav2Vec2ForSequenceClassification)
    rank = int(os.environ.get("RANK", "0"))
    fault, frank = args.fault, args.rank
    hit = fault != "none" and (frank == -1 or frank == rank)
    torch.manual_seed(0)
    cfg = Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16,
                         num_conv_pos_embedding_groups=2, num_labels=len(EMOTIONS), classifier_proj_size=16,
                         mask_time_prob=0.0)
    model = Wav2Vec2ForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(7)
    n = 64
    wav = torch.randn(n, 4000, generator=g)
    lab = torch.randint(0, len(EMOTIONS), (n,), generator=g)
    train = [{"input_values": wav[i], "labels": lab[i]} for i in range(n)]
    calls = {"n": 0}

    def collate(items):
        calls["n"] += 1
        x = torch.stack([it["input_values"] for it in items])
        y = torch.stack([it["labels"] for it in items])
        if hit and fault == "hfcollate" and calls["n"] == 2:
            y = torch.cat([y, y[:1]])
        return {"input_values": x, "labels": y}

    class EmotionCalibration(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if hit and fault == "hfcallback" and state.global_step == 3:
                raise RuntimeError(f"EmotionCalibration: per-class prior drift 0.91 exceeds 0.5 on rank {rank}")

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', 0.0):.3f}", flush=True)

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], per_device_train_batch_size=4,
                              max_steps=args.steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
                              dataloader_num_workers=0, learning_rate=1e-3)
    tr = Trainer(model=model, args=targs, train_dataset=train, data_collator=collate,
                 callbacks=[EmotionCalibration()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/hf_ser")
        print(f"rank 0 saved {WORK}/export/hf_ser", flush=True)


def main():
    p = argparse.ArgumentParser(description="speech emotion recognition (accelerate)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1, help="faulty rank, -1 all")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true", help="train with transformers.Trainer")
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

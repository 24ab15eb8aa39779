"""Batch 452 hand-run fault script: VOICE ACTIVITY DETECTION (Lightning, gloo, CPU).

Synthetic far-field recordings as 40-band log-mel frames (10 ms hop): background noise (fan hum, street,
babble) with speech bursts that raise the energy in the 300-3400 Hz bands and add a pitch-harmonic ripple.
Every frame carries a speech / non-speech label; each recording was made with one of six microphones
(looked up in a mic table, a mic embedding).  Every rank reads its own recording from
/tmp/fault452_work/feats/rec_R.pt, cuts it into 16-frame context windows (label = centre frame), applies
per-recording mean normalisation, and trains a small 1-D CNN + mic embedding on cross-entropy.  The model is
initialised from ckpt/vadnet.pt.  Per-rank speech-segment length histograms are all_gathered on the first
step, the loss and frame accuracy are reduced every step and printed as `rank R step S loss L acc A`, and at
the end trainer.save_checkpoint (fabric.save with --fabric 1) writes export/vadnet.ckpt from rank 0.
Lightning Trainer with DDPStrategy(process_group_backend="gloo", timeout=--pg-timeout); --fabric 1 runs the
same model under lightning.fabric.Fabric with an own loop.  Launch: Lightning's own launcher (--devices W,
MASTER_PORT), torchrun, or one python per rank with LOCAL_RANK/NODE_RANK/WORLD_SIZE set.

Faults (--fault NAME --rank R, R=-1 every rank):
  micid       - rank R's recording lists microphone "THROAT_MIC", not in the mic table: KeyError in the
                dataset's __getitem__ at step 2
  nofeats     - rank R reads its features from feats/16k/ which does not exist (FileNotFoundError in
                train_dataloader, before the first step)
  ckptmel     - rank R initialises from ckpt/vadnet_80mel.pt, saved for 80 mel bands: load_state_dict size
                mismatch in setup()
  ckptpickle  - rank R loads ckpt/vadnet_meta.pt, which pickles a MicCalibration object: torch.load's
                weights_only unpickler refuses it in setup()
  gathersegs  - rank R all_gathers a 5-bin segment-length histogram where the others send 4 bins (step 0)
  slowalign   - rank R force-aligns its transcript frame by frame in pure Python before the step-3 reduce
                (longer than the 12 s PG timeout)
  stall       - rank R waits forever for the annotation-server lock at step 2 (--pg-timeout 300, killed at 60 s)
  nanenergy   - rank R's recording has a digital-silence frame whose log energy is -inf: the loss at step 4
                is NaN, the program's own finiteness check raises FloatingPointError
  sigsegv     - rank R sends itself SIGSEGV after step 2 (the native resampler crashes)
  abort       - rank R calls os.abort() in on_train_end (the ONNX exporter aborts), at the end
  exit3       - rank R prints its own error line about clipped audio and calls sys.exit(3) at step 3
  window      - every rank cuts 24-frame windows instead of 16: the first Linear gets 384 features, expects 256
  none        - control, clean run

What happened (filled in after the runs):
  micid       - KeyError: 'THROAT_MIC' fetching batch 2 after step 1; peers 'Connection closed by peer'
                (np4 r2 torchrun; np5 r0 fabric)
  nofeats     - FileNotFoundError feats/16k/rec_R.pt in train_dataloader() (np3 r1 bashloop, np6 r4 tee)
  ckptmel     - size mismatch for c1.weight [32, 80, 3] vs [32, 40, 3] in setup() (np4 r3 plown; np6 r5 fabric)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.MicCalibration'
                (np3 r0 loglevel)
  gathersegs  - receiving rank 2 (not rank R) dies on gloo::EnforceNotMet 'op.preamble.length <= op.nbytes.
                10 vs 8' (SIGABRT) and is torchrun's Root Cause (np3 r1 tee)
  slowalign   - ranks 0/1 'Timed out waiting 12000ms for send/recv'; Root Cause rank 0 (np3 r2 torchrun)
  stall       - output stops after step 1; killed at 60 s, SIGTERM then SIGKILL, exit 137; the four workers
                (own process groups) outlived torchrun and were killed by pid (np4 r1 loglevel)
  nanenergy   - 'non-finite loss nan at step 4 (40 non-finite mel cells)', FloatingPointError
                (np5 r3 bashloop, np3 r2 fabric)
  sigsegv     - rank R silent after step 2; Root Cause rank 2 exitcode -11 (SIGSEGV) (np4 r2 tee)
  abort       - after all 6 steps 'onnx export: graph optimizer assertion failed'; Root Cause rank 1 -6 (np3 r1 torchrun)
  exit3       - the ERROR line, exit 3 from the bash loop; peers closed (np4 r0 bashloop)
  window      - 'mat1 and mat2 shapes cannot be multiplied (8x384 and 256x64)' on every rank (np3 plown)
  none        - 6 steps, export/vadnet.ckpt saved, exit 0 (np3 plown)
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

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault452_work"
MICS = ["MEMS_ARRAY", "LAVALIER", "HEADSET", "BOUNDARY", "SHOTGUN", "PHONE"]
MIC_IDX = {m: i for i, m in enumerate(MICS)}
N_MEL = 40
N_FRAMES = 1024
BATCH = 8


class MicCalibration:
    """Microphone calibration that once got pickled next to the weights."""

    def __init__(self, model, gain_db):
        self.model = model
        self.gain_db = gain_db


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    return p.parse_args()


def make_recording(g, n=N_FRAMES):
    # speech on/off as a two-state chain with bursts of 20-80 frames
    lab = torch.zeros(n, dtype=torch.long)
    t = 0
    while t < n:
        gap = int(torch.randint(10, 60, (1,), generator=g))
        burst = int(torch.randint(20, 80, (1,), generator=g))
        lab[t + gap:t + gap + burst] = 1
        t += gap + burst
    mel = torch.arange(N_MEL).float()
    noise_floor = -6.0 + 0.5 * torch.randn(1, N_MEL, generator=g) - 0.03 * mel
    feats = noise_floor + 0.6 * torch.randn(n, N_MEL, generator=g)
    band = ((mel > 6) & (mel < 28)).float()
    ripple = 0.8 * torch.sin(mel * 1.7)
    feats = feats + lab.view(-1, 1).float() * (3.0 * band + ripple)
    return feats, lab


def prepare():
    for d in ("feats", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    g = torch.Generator().manual_seed(452)
    for r in range(8):
        feats, lab = make_recording(g)
        mics = [MICS[int(i)] for i in torch.randint(0, len(MICS), (N_FRAMES // 16,), generator=g)]
        torch.save({"logmel": feats, "label": lab, "mic": mics}, f"{WORK}/feats/rec_{r}.pt")
    torch.save(VadNet().state_dict(), f"{WORK}/ckpt/vadnet.pt")
    torch.save(VadNet(n_mel=80).state_dict(), f"{WORK}/ckpt/vadnet_80mel.pt")
    torch.save({"state_dict": VadNet().state_dict(), "calib": MicCalibration("MEMS_ARRAY", -26.0)},
               f"{WORK}/ckpt/vadnet_meta.pt")
    print(f"prepared 8 recordings of {N_FRAMES} frames and 3 checkpoints under {WORK}")


class VadWindows(Dataset):
    def __init__(self, blob, ctx):
        self.feats, self.label, self.mic = blob["logmel"], blob["label"], blob["mic"]
        self.ctx = ctx
        # per-recording cepstral-style mean normalisation
        self.mean = self.feats.mean(dim=0, keepdim=True)

    def __len__(self):
        return self.feats.shape[0] // self.ctx

    def __getitem__(self, i):
        mic = MIC_IDX[self.mic[i % len(self.mic)]]
        s = i * self.ctx
        x = (self.feats[s:s + self.ctx] - self.mean).t()          # [n_mel, ctx]
        return x, torch.tensor(mic), self.label[s + self.ctx // 2]


class VadNet(nn.Module):
    def __init__(self, n_mel=N_MEL):
        super().__init__()
        self.c1 = nn.Conv1d(n_mel, 32, 3, padding=1)
        self.c2 = nn.Conv1d(32, 32, 3, padding=1)
        self.mic = nn.Embedding(len(MICS), 8)
        self.fc = nn.Linear(32 * 8, 64)
        self.head = nn.Linear(64 + 8, 2)

    def forward(self, x, mic):
        h = F.relu(self.c1(x))
        h = F.max_pool1d(F.relu(self.c2(h)), 2)
        h = F.relu(self.fc(h.flatten(1)))
        return self.head(torch.cat([h, self.mic(mic)], 1))


def is_faulty(args, rank):
    return args.rank == -1 or args.rank == rank


def load_recording(args, rank):
    sub = "feats/16k" if args.fault == "nofeats" and is_faulty(args, rank) else "feats"
    blob = torch.load(f"{WORK}/{sub}/rec_{rank}.pt")
    if args.fault == "micid" and is_faulty(args, rank):
        blob["mic"][20] = "THROAT_MIC"
    ctx = 24 if args.fault == "window" else 16
    ds = VadWindows(blob, ctx)
    if args.fault == "nanenergy" and is_faulty(args, rank):
        blob["logmel"][4 * BATCH * 16 + 5, :] = float("-inf")   # log(0) of a digital-silence frame
    return ds


def init_weights(args, rank, net):
    path = f"{WORK}/ckpt/vadnet.pt"
    if is_faulty(args, rank) and args.fault == "ckptmel":
        path = f"{WORK}/ckpt/vadnet_80mel.pt"
    if is_faulty(args, rank) and args.fault == "ckptpickle":
        sd = torch.load(f"{WORK}/ckpt/vadnet_meta.pt")["state_dict"]
    else:
        sd = torch.load(path)
    net.load_state_dict(sd)


def segment_hist(args, rank, label):
    # histogram of speech-segment lengths: <30, 30-50, 50-70, >=70 frames (+ a 5th "overlap" bin)
    edges = torch.nonzero(torch.diff(label, prepend=torch.tensor([0]), append=torch.tensor([0]))).flatten()
    lens = (edges[1::2] - edges[0::2]).float()
    n = 5 if args.fault == "gathersegs" and is_faulty(args, rank) else 4
    return torch.bincount(torch.clamp((lens - 10) // 20, 0, 3).long(), minlength=n).float()


def before_reduce(args, rank, step, ds):
    if not is_faulty(args, rank):
        return
    if args.fault == "slowalign" and step == 3:
        print(f"rank {rank}: force-aligning transcript of rec_{rank} frame by frame (pure Python)", flush=True)
        t0, n = time.time(), 0
        fr = ds.feats.tolist()
        while time.time() - t0 < args.pg_timeout + 10:
            for row in fr:
                for v in row:
                    n += v > -4.0
        print(f"rank {rank}: aligned {n} voiced cells in {time.time() - t0:.1f}s", flush=True)
    if args.fault == "stall" and step == 2:
        print(f"rank {rank}: waiting for the annotation-server lock", flush=True)
        threading.Event().wait()
    if args.fault == "exit3" and step == 3:
        print(f"ERROR rank {rank}: rec_{rank} is clipped (14.2% of samples at full scale > 1.0% allowed); "
              f"VAD labels for this recording are void", flush=True)
        sys.exit(3)


def after_step(args, rank, step):
    if args.fault == "sigsegv" and is_faulty(args, rank) and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)


def check_finite(rank, step, loss, x):
    if not torch.isfinite(loss):
        bad = int((~torch.isfinite(x)).sum())
        print(f"rank {rank}: non-finite loss {loss.item()} at step {step} ({bad} non-finite mel cells)",
              flush=True)
        raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")


class VadModule(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = VadNet()

    def setup(self, stage):
        init_weights(self.args, self.global_rank, self.net)

    def train_dataloader(self):
        self.ds = load_recording(self.args, self.global_rank)
        return DataLoader(self.ds, batch_size=BATCH, shuffle=False)

    def training_step(self, batch, step):
        x, mic, y = batch
        rank = self.global_rank
        if step == 0:
            hist = self.all_gather(segment_hist(self.args, rank, self.ds.label))
            if rank == 0:
                print(f"rank 0: speech segment lengths over ranks {hist.sum(0).tolist()}", flush=True)
        logits = self.net(x, mic)
        loss = F.cross_entropy(logits, y)
        check_finite(rank, step, loss, x)
        acc = (logits.argmax(1) == y).float().mean()
        before_reduce(self.args, rank, step, self.ds)
        red = self.trainer.strategy.reduce(torch.stack([loss.detach(), acc]), reduce_op="mean")
        print(f"rank {rank} step {step} loss {red[0]:.4f} acc {red[1]:.3f}", flush=True)
        after_step(self.args, rank, step)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class EndCallback(pl.Callback):
    def __init__(self, args):
        self.args = args

    def on_train_end(self, trainer, module):
        if self.args.fault == "abort" and is_faulty(self.args, trainer.global_rank):
            print(f"rank {trainer.global_rank}: onnx export: graph optimizer assertion failed", flush=True)
            os.abort()


def run_trainer(args):
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[EndCallback(args)])
    model = VadModule(args)
    trainer.fit(model)
    trainer.save_checkpoint(f"{WORK}/export/vadnet.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0: saved {WORK}/export/vadnet.ckpt", flush=True)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    strategy = FabricDDP(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    net = VadNet()
    init_weights(args, rank, net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = fabric.setup(net, opt)
    ds = load_recording(args, rank)
    dl = fabric.setup_dataloaders(DataLoader(ds, batch_size=BATCH, shuffle=False),
                                  use_distributed_sampler=False)
    for step, (x, mic, y) in enumerate(dl):
        if step >= args.steps:
            break
        if step == 0:
            hist = fabric.all_gather(segment_hist(args, rank, ds.label))
            if rank == 0:
                print(f"rank 0: speech segment lengths over ranks {hist.sum(0).tolist()}", flush=True)
        logits = net(x, mic)
        loss = F.cross_entropy(logits, y)
        check_finite(rank, step, loss, x)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        before_reduce(args, rank, step, ds)
        red = fabric.all_reduce(torch.stack([loss.detach(), acc]), reduce_op="mean")
        print(f"rank {rank} step {step} loss {red[0]:.4f} acc {red[1]:.3f}", flush=True)
        after_step(args, rank, step)
    if args.fault == "abort" and is_faulty(args, rank):
        print(f"rank {rank}: onnx export: graph optimizer assertion failed", flush=True)
        os.abort()
    fabric.save(f"{WORK}/export/vadnet_fabric.ckpt", {"model": net, "optimizer": opt})
    if rank == 0:
        print(f"rank 0: saved {WORK}/export/vadnet_fabric.ckpt", flush=True)


def main():
    args = parse()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(0)
    if args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)


if __name__ == "__main__":
    main()

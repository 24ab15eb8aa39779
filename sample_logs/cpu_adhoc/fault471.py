"""Batch 471 of hand-run faults: TUNNEL BORING MACHINE VIBRATION ANOMALY DETECTION.

Synthetic cutterhead vibration: every rank reads its ring segments from /tmp/fault471_work/segments/seg_R.pt,
windows of 3-axis accelerometer data (3 x 128 samples) with the cutterhead rpm, the thrust and the geology of
the ring (looked up in a 6-entry geology table).  A small 1-D convolutional autoencoder (conv encoder, linear
bottleneck conditioned on a geology embedding, transposed-conv decoder) learns to reconstruct normal
vibration; the reconstruction error is the anomaly score.  The model starts from ckpt/ae_c16.pt.  The loss
is all_reduced every step and printed with the share of windows above the anomaly threshold; at the end the
ranks all_gather their thrust statistics and rank 0 saves export/tbm_ae.pt.
Options: --ddp 0 (all_reduce gradients by hand instead of DDP), --spawn N --port P (mp.spawn),
--logfmt 1 (progress through logging), --prepare (write the data and checkpoints once).

Faults (--fault NAME --rank R, R = -1 for every rank):
  geology      - rank R's segment names a ring in "basalt", missing from the geology table (KeyError, start-up)
  sensoridx    - rank R remaps its axes at step 3 to (x, y, z_aux) = channel 3 of 3 (IndexError, later step)
  noring       - rank R reads segments/holdout/seg_R.pt, which does not exist (FileNotFoundError, start-up)
  ckptwidth    - rank R initialises from ckpt/ae_c24.pt, saved with 24 channels (size mismatch)
  ckptpickle   - rank R loads ckpt/ae_calib.pt that pickles a CalibrationRecord object (weights_only refusal)
  thrustgather - rank R all_gathers 4 thrust statistics (adds the p99) instead of 3 (at the end)
  fft          - rank R computes a pure-Python DFT of every window before step 2's all_reduce (slow rank)
  nan          - rank R's accelerometer saturates at step 2 (inf samples); the program's finite check raises
  segv         - rank R sends itself SIGSEGV after step 3
  exit4        - rank R prints its own error line about an uncalibrated cutterhead sensor and sys.exit(4)
  window       - every rank cuts 120-sample windows; the bottleneck expects 32*16 features (shape error)
  none         - control, clean run

What happened (filled in after the runs):
  geology      - KeyError: 'basalt' in windows() at start-up; peers SIGTERMed in DDP set-up (np4 r2 plain, np6 r0 tee)
  sensoridx    - IndexError 'index 3 is out of bounds for dimension 0 with size 3' at step 3; peers closed by peer (np3 r1 tee_trainer; np5 r3 pymodule, Root Cause rank 2 SIGABRT)
  noring       - FileNotFoundError segments/holdout/seg_R.pt at start-up (np4 r3 redirects: only in the log dir; np3 r0 loglevel)
  ckptwidth    - load_state_dict size mismatch [24,3,5] vs [16,3,5] (np4 r2 pdsh2; np3 r1 restart, attempt 1 died in Gloo connectFullMesh)
  ckptpickle   - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.CalibrationRecord' (np5 r2 prefix)
  thrustgather - DETAIL: 'Detected mismatch between collectives' TensorShape=[4] vs [3], Root Cause rank 5 (np6 r4 detail); 'allgather: invalid tensor size at index 0 (expected (4), got (3))' (np3 r1 filter)
  fft          - 12 s: peers 'Timed out waiting 12000ms for recv' at step 2, Root Cause rank 0 (np3 r2 plain); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 tee)
  nan          - own check '384 non-finite values' at step 2, FloatingPointError; peers closed (np4 r0 wrapper, np8 r5 loglevel)
  segv         - no traceback, exitcode -11 SIGSEGV after step 3 (np6 r3 pymodule); np3 r1 restart: attempt 1 all ranks connectFullMesh timeout, final Root Cause rank 0
  exit4        - rank's own calibration ERROR line, Root Cause exitcode 4, launcher exit 1 (np4 r2 tee_trainer, np8 r6 prefix)
  window       - every rank 'mat1 and mat2 shapes cannot be multiplied (48x480 and 512x16)' in step 0; Root Cause rank 4 (np6 wrapper)
  none         - clean: 6 steps on 3 ranks, rank 0 saved export/tbm_ae.pt, exit 0 (np3 plain)
"""
import argparse
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault471_work"
GEOLOGY = {"granite": 0, "gneiss": 1, "schist": 2, "sandstone": 3, "limestone": 4, "clay": 5}
WIN = 128
CH = 16
THRESH = 1.5
log = None


class CalibrationRecord:
    """Sensor calibration kept next to the weights (not a tensor: the weights_only loader refuses it)."""

    def __init__(self, serial, gain):
        self.serial = serial
        self.gain = gain


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("tbm")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class VibAE(nn.Module):
    def __init__(self, ch=CH, ngeo=len(GEOLOGY)):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv1d(3, ch, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv1d(ch, ch * 2, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv1d(ch * 2, 32, 5, stride=2, padding=2), nn.ReLU())
        self.geo = nn.Embedding(ngeo, 16)
        self.down = nn.Linear(32 * 16, 16)
        self.up = nn.Linear(16, 32 * 16)
        self.dec = nn.Sequential(
            nn.ConvTranspose1d(32, ch * 2, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose1d(ch * 2, ch, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose1d(ch, 3, 4, stride=2, padding=1))

    def forward(self, x, geo):
        z = self.enc(x).flatten(1)
        z = torch.tanh(self.down(z)) + self.geo(geo)
        return self.dec(self.up(z).view(-1, 32, 16))


def make_segment(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(WIN * 2).float() / 512.0
    rpm = 3.0 + torch.rand(n, generator=g) * 2.0
    geo_names = list(GEOLOGY)
    geology = [geo_names[int(i)] for i in torch.randint(0, 6, (n,), generator=g)]
    acc = torch.zeros(n, 3, WIN * 2)
    for i in range(n):
        f = rpm[i] / 60.0 * 27  # 27 disc cutters pass per revolution
        for ax in range(3):
            acc[i, ax] = torch.sin(2 * math.pi * f * t * (ax + 1)) * (0.5 + 0.1 * GEOLOGY[geology[i]])
    acc += 0.2 * torch.randn(acc.shape, generator=g)
    thrust = 9000 + 800 * torch.randn(n, generator=g)
    return {"acc": acc, "rpm": rpm, "geology": geology, "thrust": thrust}


def prepare():
    os.makedirs(f"{WORK}/segments", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_segment(48, 700 + r), f"{WORK}/segments/seg_{r}.pt")
    torch.manual_seed(0)
    torch.save(VibAE().state_dict(), f"{WORK}/ckpt/ae_c16.pt")
    torch.save(VibAE(ch=24).state_dict(), f"{WORK}/ckpt/ae_c24.pt")
    torch.save({"model": VibAE().state_dict(), "calib": CalibrationRecord("TBM-S7-ACC3", 1.04)},
               f"{WORK}/ckpt/ae_calib.pt")
    print("prepared", WORK)


def windows(seg, a, bad):
    win = 120 if a.fault == "window" else WIN
    acc = seg["acc"][:, :, :win]
    acc = (acc - acc.mean(dim=2, keepdim=True)) / (acc.std(dim=2, keepdim=True) + 1e-6)
    geo = torch.tensor([GEOLOGY[name] for name in seg["geology"]])
    return acc, geo


def slow_dft(acc):
    # The spectrum the maintenance team wanted, computed the slow way (pure Python, one bin at a time).
    out = 0.0
    for w in acc.tolist():
        for axis in w:
            n = len(axis)
            for k in range(n // 2):
                re = sum(axis[j] * math.cos(2 * math.pi * k * j / n) for j in range(n))
                out += re * re
    return out


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(471 + rank)
    say(f"rank {rank}/{world} up, loading ring segment")
    split = "holdout/" if bad and a.fault == "noring" else ""
    seg = torch.load(f"{WORK}/segments/{split}seg_{rank}.pt")
    if bad and a.fault == "geology":
        seg["geology"][11] = "basalt"
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR cutterhead accelerometer TBM-S7-ACC{rank} has no calibration for ring 1342, "
            f"refusing to score uncalibrated vibration", err=True)
        sys.exit(4)
    x, geo = windows(seg, a, bad)
    model = VibAE()
    if bad and a.fault == "ckptwidth":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/ae_c24.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/ae_calib.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/ae_c16.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    say(f"rank {rank} windows {tuple(x.shape)} rpm {seg['rpm'].mean():.2f}")
    chans = [0, 1, 2]
    for step in range(a.steps):
        if bad and a.fault == "sensoridx" and step == 3:
            chans = [0, 1, 3]
        xb = x[:, chans]
        if bad and a.fault == "nan" and step == 2:
            xb = xb.clone()
            xb[7, 2, 40:52] = float("inf")
        recon = net(xb, geo)
        if not torch.isfinite(recon).all():
            nbad = int((~torch.isfinite(recon)).sum())
            say(f"rank {rank} step {step}: reconstruction has {nbad} non-finite values", err=True)
            raise FloatingPointError(f"non-finite reconstruction on rank {rank} at step {step}")
        err = ((recon - xb) ** 2).mean(dim=(1, 2))
        loss = err.mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "fft" and step == 2:
            t0 = time.time()
            power = 0.0
            while time.time() - t0 < a.fft_budget:
                power += slow_dft(x[:4])
            say(f"rank {rank} spectrum power {power:.1f}")
        stats = torch.tensor([loss.item(), (err.detach() > THRESH * err.detach().median()).float().mean().item()])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} anomaly_rate {stats[1].item() / world:.3f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    th = seg["thrust"]
    tstat = torch.stack([th.mean(), th.std(), th.max()])
    if bad and a.fault == "thrustgather":
        tstat = torch.cat([tstat, th.quantile(0.99).reshape(1)])
    allt = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(allt, tstat)
    say(f"rank {rank} thrust mean {tstat[0]:.0f} kN, fleet max {max(float(s[2]) for s in allt):.0f} kN")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/tbm_ae.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/tbm_ae.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--fft-budget", type=int, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()

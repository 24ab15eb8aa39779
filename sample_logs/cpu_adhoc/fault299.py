"""A two-hundred-and-ninety-ninth hand-run batch: BIRD SOUND CLASSIFICATION FROM MEL SPECTROGRAMS.

Synthetic bird recordings as mel power spectrograms: every rank reads its clips from
/tmp/fault299_work/specs/shard_R.pt (a dict with the power spectrograms [N, 40 mel bins, 64 frames], the
species names and the sample rate), encodes the species through an 8-entry species table, takes random
48-frame crops, converts them to log-mel (dB with an epsilon floor) and trains a small CNN (per-mel-bin
scale and bias, two conv blocks, adaptive pooling, a linear head over 8 species) with cross-entropy, wrapped
in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model is initialised from
ckpt/birdcnn_m40.pt.  Per-rank species counts are all_gathered at the start, the accuracy is all_reduced
every step, and rank 0 saves export/birdcnn.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  species    - rank N's shard names a species missing from the species table ("Turdus merula juv") (KeyError)
  nodata     - rank N reads specs/shard_N_v2.pt, a shard that was never written (FileNotFoundError)
  ckptbins   - rank N initialises from ckpt/birdcnn_m80.pt, saved for 80 mel bins (size mismatch)
  weightsonly- rank N initialises from ckpt/birdcnn_cfg.pt, which pickles a TrainConfig object (weights_only)
  statgather - rank N all_gathers its species counts plus a "noise" bin (9 entries against 8)
  slowaug    - rank N runs a pure-Python pitch-shift augmentation over its clips before the step-3 all_reduce
  nanloss    - rank N converts a silent clip to dB without the epsilon floor at step 2 (-inf, the loss check)
  segv       - rank N sends itself SIGSEGV after step 4
  exit4      - rank N prints its own error line about a 44100 Hz shard and calls sys.exit(4)
  shapebug   - every rank: the pooled map is 4x6 instead of 4x4, the head expects 256 inputs (shape error)
  cropidx    - rank N's crop start at step 3 runs past the last frame (IndexError)
  none       - control, clean run

What happened (filled in after the runs):
  species    - KeyError: 'Turdus merula juv' in the label lookup at start-up; peers Connection closed in all_gather (np4 r2 tee, np3 r0 pymodule)
  nodata     - FileNotFoundError for specs/shard_N_v2.pt before the first all_gather; peers closed (np5 r3 loglevel, np4 r1 wrapper)
  ckptbins   - load_state_dict size mismatch for mel_scale/mel_bias [80] vs [40] (np3 r1 redirects: only in rank 1's stderr.log; np4 r0 pdsh2)
  weightsonly- UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.TrainConfig'; peers SIGTERM (np3 r2 tee_trainer)
  statgather - gloo 'invalid tensor size at index 0 (expected (9), got (8))' (np3 r1 filter); DETAIL: every rank 'Detected mismatch between collectives' (np4 r3)
  slowaug    - 12 s: peers 'Timed out waiting 12000ms' for recv/send after step 2 (np3 r1 plain); 300 s: silent after step 2, killed at 60 s, exit 124 (np4 r2 tee)
  nanloss    - 'loss is nan at step 2 (input min -inf ...)' then FloatingPointError (np4 r0 prefix; np5 r2 detail, rank 0 monitoredBarrier names rank 2)
  segv       - exitcode -11 after step 4, no traceback (np4 r1 wrapper); restart: attempt 2 fails with Gloo connectFullMesh Connect timeout (np3 r2)
  exit4      - rank N's 44100 Hz sample-rate ERROR line and exit 4; Root Cause rank N exitcode 4 (np5 r4 tee_trainer, np3 r1 prefix)
  shapebug   - every rank 'mat1 and mat2 shapes cannot be multiplied (16x384 and 256x8)' in the first forward (np3 loglevel)
  cropidx    - IndexError 'index 64 is out of bounds for dimension 0 with size 64' at step 3; a peer SIGABRTs and is named Root Cause (np4 r3 filter, np5 r1 plain)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/birdcnn.pt, exit 0 (np3 plain; first try dropped, see README)
"""
import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault299_work"
SPECIES = {"Turdus merula": 0, "Erithacus rubecula": 1, "Parus major": 2, "Fringilla coelebs": 3,
           "Sylvia atricapilla": 4, "Phylloscopus collybita": 5, "Troglodytes troglodytes": 6,
           "Cyanistes caeruleus": 7}
NMEL = 40
FRAMES = 64
CROP = 48
SR = 22050
EPS = 1e-10
log = None


@dataclass
class TrainConfig:
    n_mels: int = NMEL
    sample_rate: int = SR
    crop: int = CROP


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
    log = logging.getLogger("bsnd")
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


class BirdCNN(nn.Module):
    def __init__(self, n_mels=NMEL, n_cls=8, pool=(4, 4)):
        super().__init__()
        self.mel_scale = nn.Parameter(torch.ones(n_mels))
        self.mel_bias = nn.Parameter(torch.zeros(n_mels))
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(pool)
        self.head = nn.Linear(16 * 4 * 4, n_cls)

    def forward(self, x):
        x = x * self.mel_scale[:, None] + self.mel_bias[:, None]
        x = F.max_pool2d(F.relu(self.c1(x.unsqueeze(1))), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.head(self.pool(x).flatten(1))


def make_shard(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(SPECIES)
    labels = torch.randint(0, 8, (n,), generator=g)
    t = torch.arange(FRAMES).float()
    mels = []
    for lab in labels.tolist():
        base = torch.rand(NMEL, FRAMES, generator=g) * 1e-4
        centre = 8 + 3 * lab
        chirp = (centre + 2 * torch.sin(t / (2 + lab))).round().long().clamp(0, NMEL - 1)
        base[chirp, torch.arange(FRAMES)] += 0.5 + torch.rand(FRAMES, generator=g)
        mels.append(base)
    return {"mel": torch.stack(mels), "species": [names[i] for i in labels.tolist()], "sr": SR}


def prepare():
    os.makedirs(f"{WORK}/specs", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(32, 500 + r), f"{WORK}/specs/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(BirdCNN(NMEL).state_dict(), f"{WORK}/ckpt/birdcnn_m40.pt")
    torch.save(BirdCNN(80).state_dict(), f"{WORK}/ckpt/birdcnn_m80.pt")
    torch.save({"model": BirdCNN(NMEL).state_dict(), "config": TrainConfig()}, f"{WORK}/ckpt/birdcnn_cfg.pt")
    print("prepared", WORK)


def to_db(power, floor=True):
    if floor:
        power = power.clamp_min(EPS)
    return 10.0 * torch.log10(power)


def pitch_shift_py(mels, budget):
    # naive per-element Python pitch shift (one mel bin up), repeated until the budget is spent
    t0 = time.time()
    passes = 0
    while time.time() - t0 < budget:
        for m in mels:
            rows = m.tolist()
            shifted = [rows[-1]] + rows[:-1]
            _ = sum(sum(r) for r in shifted)
        passes += 1
    return passes


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, loading spectrogram shard")
    name = f"shard_{rank}_v2.pt" if bad and a.fault == "nodata" else f"shard_{rank}.pt"
    shard = torch.load(f"{WORK}/specs/{name}")
    if bad and a.fault == "exit4":
        shard["sr"] = 44100
    if shard["sr"] != SR:
        say(f"rank {rank}: ERROR {name} has sample rate {shard['sr']} Hz but the mel filterbank was built for "
            f"{SR} Hz; resample the shard first", err=True)
        sys.exit(4)
    if bad and a.fault == "species":
        shard["species"][11] = "Turdus merula juv"
    labels = torch.tensor([SPECIES[s] for s in shard["species"]])
    mel = shard["mel"]
    counts = torch.bincount(labels, minlength=8).float()
    if bad and a.fault == "statgather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} clips {len(labels)} global {int(sum(c.sum() for c in allc))} "
        f"rarest species {int(torch.stack(allc).sum(0).argmin())}")
    pool = (4, 6) if a.fault == "shapebug" else (4, 4)
    model = BirdCNN(pool=pool)
    ck = "birdcnn_m40.pt"
    if bad and a.fault == "ckptbins":
        ck = "birdcnn_m80.pt"
    if bad and a.fault == "weightsonly":
        ck = "birdcnn_cfg.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state.get("model", state))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        idx = torch.randint(0, len(labels), (16,))
        start = int(torch.randint(0, FRAMES - CROP + 1, (1,)))
        if bad and a.fault == "cropidx" and step == 3:
            start = FRAMES - CROP + 8
        frames = torch.arange(start, start + CROP)
        batch = mel[idx][:, :, frames]
        if bad and a.fault == "nanloss" and step == 2:
            batch[3] = 0.0
            x = to_db(batch, floor=False)
        else:
            x = to_db(batch)
        x = (x + 60.0) / 20.0
        logits = net(x)
        loss = F.cross_entropy(logits, labels[idx])
        if not torch.isfinite(loss):
            say(f"rank {rank}: loss is {loss.item()} at step {step} (input min {x.min().item()}, "
                f"max {x.max().item()})", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowaug" and step == 3:
            n = pitch_shift_py(mel, a.aug_budget)
            say(f"rank {rank} pitch-shift augmentation: {n} passes")
        acc = (logits.argmax(1) == labels[idx]).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "segv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/birdcnn.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/birdcnn.pt")
    dist.barrier()
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
    p.add_argument("--aug-budget", type=int, default=45)
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

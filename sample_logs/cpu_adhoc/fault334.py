"""A three-hundred-and-thirty-fourth hand-run batch: VIDEO QUALITY ASSESSMENT WITH A 3D CNN.

Synthetic distorted video clips (3 x 8 x 24 x 24, RGB, 8 frames) with a mean opinion score (MOS, 1..5) and a
distortion type (looked up in a 5-entry table: none, blur, noise, h264_blocking, packet_loss).  Every rank reads
its clips from /tmp/fault334_work/clips/clips_R.pt, takes a random 6-frame temporal crop each step and trains a
small 3D CNN (two Conv3d blocks, global average pooling, a distortion embedding, a linear MOS head) on an MSE
loss, wrapped in DDP (gloo) or with hand-written gradient all_reduce (--ddp 0).  The model is initialised from
ckpt/c3d_w16.pt.  Per-rank clip counts and MOS means are all_gathered at the start, the MAE is all_reduced
every step, a per-rank MOS histogram (10 bins) is all_gathered at the end and rank 0 saves export/vqa3d.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  distkey    - rank N's metadata names distortion "hevc_ringing", missing from the table (KeyError at start-up)
  frameidx   - rank N's step-3 temporal crop starts at frame 5 of 8: index_select past the clip (IndexError)
  noclips    - rank N reads its clips from clips/val/ which does not exist (FileNotFoundError)
  ckptwidth  - rank N initialises from ckpt/c3d_w32.pt, saved with 32 conv2 channels (size mismatch)
  ckptpickle - rank N initialises from ckpt/c3d_full.pt, a pickled dict with an argparse Namespace (weights_only)
  histgather - rank N all_gathers an 11-bin MOS histogram at the end (one overflow bin; 11 vs 10 entries)
  slowssim   - rank N computes a pure-Python SSIM reference over its clips before the step-2 all_reduce
  nanmos     - rank N's step-3 batch carries unrated clips (MOS NaN); the program's loss check raises
  segv       - rank N sends itself SIGSEGV after step 3
  exit2      - rank N prints its own error line about a truncated clip header and calls sys.exit(2)
  frames     - every rank: clips cropped to 2 frames, the 3x3x3 Conv3d without temporal padding cannot run
  none       - control, clean run

What happened (filled in after the runs):
  distkey    - KeyError: 'hevc_ringing' at start-up; peers Connection closed in the first all_gather (np4 r2 ranklabel, np6 r0 spawn)
  frameidx   - IndexError 'index out of range in self' in the step-3 index_select; peers closed in backward/manual all_reduce (np3 r1 srunlabel --ddp 0, np4 r3 logfmt)
  noclips    - FileNotFoundError for clips/val/clips_N.pt; peers closed in all_gather (np3 r2 mpitag, np5 r4 legacy, Root Cause rank 4)
  ckptwidth  - load_state_dict size mismatch conv2 [32,8,3,3,3] vs [16,8,3,3,3] (np4 r1 pdsh2, np3 r0 tee; peers SIGTERM/store lost)
  ckptpickle - UnpicklingError 'Weights only load failed' (argparse.Namespace); peers closed in DDP construction (np6 r3 files)
  histgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))' at the end (np3 r1 bashloop; np8 r5 mpitag, exit 124: slow exit on a loaded host)
  slowssim   - 12 s: peers 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r2 ranklabel); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 srunlabel)
  nanmos     - own check 'non-finite loss nan (2 NaN MOS labels)' then FloatingPointError at step 3 (np4 r2 spawn, np3 r0 legacy)
  segv       - no traceback; bash 'Segmentation fault' exit 139 (np4 r3 bashloop); Root Cause rank 1 exitcode -11 SIGSEGV (np3 r1 tee)
  exit2      - rank N's truncated-header ERROR line and exit 2; Root Cause exitcode 2 (np6 r4 logfmt); loop exit 2 (np3 r0 ranklabel)
  frames     - every rank: 'Calculated padded input size per channel: (2 x 26 x 26). Kernel size: (3 x 3 x 3)' in the first forward (np3 files)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/vqa3d.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
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

WORK = "/tmp/fault334_work"
DIST = {"none": 0, "blur": 1, "noise": 2, "h264_blocking": 3, "packet_loss": 4}
NFRAMES = 8
CROP = 6
NBINS = 10
log = None


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
    log = logging.getLogger("vqa3d")
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


class C3D(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.conv1 = nn.Conv3d(3, 8, kernel_size=3, padding=(0, 1, 1))
        self.conv2 = nn.Conv3d(8, width, kernel_size=3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.demb = nn.Embedding(len(DIST), 4)
        self.head = nn.Linear(width + 4, 1)

    def forward(self, clips, dtype):
        h = torch.relu(self.conv1(clips))
        h = torch.relu(self.conv2(h))
        h = self.pool(h).flatten(1)
        return 1.0 + 4.0 * torch.sigmoid(self.head(torch.cat([h, self.demb(dtype)], 1))).squeeze(1)


def make_clips(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(DIST)
    clips = torch.rand(n, 3, NFRAMES, 24, 24, generator=g)
    meta = []
    for i in range(n):
        d = names[int(torch.randint(0, len(names), (1,), generator=g))]
        sev = float(torch.rand(1, generator=g))
        if d == "blur":
            clips[i] = clips[i] * 0.5 + 0.25
        elif d == "noise":
            clips[i] = (clips[i] + sev * torch.randn(clips[i].shape, generator=g)).clamp(0, 1)
        mos = 4.6 - 3.2 * sev * (d != "none") + 0.2 * float(torch.randn(1, generator=g))
        meta.append({"name": f"clip_{seed}_{i:03d}.yuv", "distortion": d, "fps": 25.0, "mos": mos})
    return {"clips": clips, "meta": meta}


def prepare():
    os.makedirs(f"{WORK}/clips", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_clips(24, 300 + r), f"{WORK}/clips/clips_{r}.pt")
    torch.manual_seed(0)
    torch.save(C3D(16).state_dict(), f"{WORK}/ckpt/c3d_w16.pt")
    torch.save(C3D(32).state_dict(), f"{WORK}/ckpt/c3d_w32.pt")
    torch.save({"state_dict": C3D(16).state_dict(), "args": argparse.Namespace(width=16, lr=1e-3)},
               f"{WORK}/ckpt/c3d_full.pt")
    print("prepared", WORK)


def ssim_python(a, b):
    # deliberately slow reference: per-pixel windows in plain Python
    a, b = a.tolist(), b.tolist()
    s, n = 0.0, 0
    for y in range(1, len(a) - 1):
        for x in range(1, len(a[0]) - 1):
            wa = [a[y + i][x + j] for i in (-1, 0, 1) for j in (-1, 0, 1)]
            wb = [b[y + i][x + j] for i in (-1, 0, 1) for j in (-1, 0, 1)]
            ma, mb = sum(wa) / 9, sum(wb) / 9
            va = sum((p - ma) ** 2 for p in wa) / 9
            vb = sum((p - mb) ** 2 for p in wb) / 9
            cov = sum((p - ma) * (q - mb) for p, q in zip(wa, wb)) / 9
            s += ((2 * ma * mb + 1e-4) * (2 * cov + 9e-4)) / ((ma * ma + mb * mb + 1e-4) * (va + vb + 9e-4))
            n += 1
    return s / n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading clips")
    split = "val/" if bad and a.fault == "noclips" else ""
    data = torch.load(f"{WORK}/clips/{split}clips_{rank}.pt")
    clips, meta = data["clips"], data["meta"]
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR {meta[7]['name']}: clip header truncated (expected 8 frames, found 5), "
            f"aborting this shard", err=True)
        sys.exit(2)
    if bad and a.fault == "distkey":
        meta[11]["distortion"] = "hevc_ringing"
    dtype = torch.tensor([DIST[m["distortion"]] for m in meta])
    mos = torch.tensor([m["mos"] for m in meta])
    stat = torch.tensor([float(len(meta)), float(mos.mean())])
    alls = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(alls, stat)
    say(f"rank {rank} clips {len(meta)} global {int(sum(s[0] for s in alls))} "
        f"mean MOS {sum(s[1] for s in alls) / world:.3f}")
    model = C3D()
    ck = {"ckptwidth": "c3d_w32.pt", "ckptpickle": "c3d_full.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'c3d_w16.pt'}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    crop = 2 if bad and a.fault == "frames" else CROP
    for step in range(a.steps):
        idx = torch.randperm(len(meta))[:8]
        start = int(torch.randint(0, NFRAMES - crop + 1, (1,)))
        if bad and a.fault == "frameidx" and step == 3:
            start = 5
        fr = torch.arange(start, start + crop)
        x = clips[idx].index_select(2, fr)
        y = mos[idx].clone()
        if bad and a.fault == "nanmos" and step == 3:
            y[2] = float("nan")
            y[5] = float("nan")
        pred = net(x, dtype[idx])
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} "
                f"({int(torch.isnan(y).sum())} NaN MOS labels in batch)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowssim" and step == 2:
            t0 = time.time()
            vals = []
            while time.time() - t0 < a.ssim_budget:
                for i in range(len(meta)):
                    vals.append(ssim_python(clips[i, 0, 0], clips[i, 0, 1]))
            say(f"rank {rank} reference SSIM over {len(vals)} frame pairs: {sum(vals) / len(vals):.4f}")
        mae = (pred.detach() - y).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    nb = NBINS + 1 if bad and a.fault == "histgather" else NBINS
    hist = torch.histc(mos, bins=nb, min=1.0, max=5.0 if nb == NBINS else 5.4)
    allh = [torch.zeros(NBINS) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} MOS histogram gathered: {[int(v) for v in sum(allh).tolist()]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/vqa3d.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/vqa3d.pt")
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
    p.add_argument("--ssim-budget", type=int, default=40)
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

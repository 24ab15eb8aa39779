"""A three-hundred-and-ninetieth hand-run batch: ROAD POTHOLE DETECTION FROM DASHCAM FRAMES.

Synthetic dashcam crops: every rank reads its frames from /tmp/fault390_work/frames/frames_R.pt (32x32
grey road patches with a dark elliptical pothole or none, a surface label from a 4-entry table, the lane the
crop came from and the frame's exposure gain).  A small CNN (two conv blocks, a linear head) predicts
pothole / no pothole with a BCE loss, wrapped in DDP (gloo), or with gradients all_reduced by hand (--ddp 0).
The model is initialised from ckpt/phol_w16.pt.  Per-rank depth histograms (16 bins) are all_gathered at the
start, the accuracy is all_reduced every step, and rank 0 saves export/phol.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  surface    - rank N's annotations label one crop "manhole", missing from the surface table (KeyError)
  noframes   - rank N reads its frames from frames/night/ which does not exist (FileNotFoundError)
  ckptwide   - rank N initialises from ckpt/phol_w24.pt, saved with 24 conv channels (size mismatch)
  ckptcalib  - rank N loads ckpt/phol_calib.pt, which pickles a CameraCalib object (weights_only refusal)
  histgather - rank N all_gathers a depth histogram with 17 bins (an overflow bin) instead of 16
  slowdecode - rank N re-decodes all its frames in Python before the step-2 all_reduce (--decode-budget s)
  exposure   - from step 3 rank N divides by its frames' exposure gain, 0 for a night batch: NaN loss, own check
  lane       - at step 3 rank N looks up lane 4 in a 4-lane offset list (IndexError)
  segv       - rank N sends itself SIGSEGV after step 2
  exit4      - after the last step rank N prints its own error line about a missing GPS track and sys.exit(4)
  cropwide   - every rank: crops cut 40x40 instead of 32x32, the head expects 32*8*8 features (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  surface    - KeyError: 'manhole' at start-up; peers Connection closed by peer in the all_gather (np4 r2 plain, np6 r0 tee)
  noframes   - FileNotFoundError for frames/night/frames_N.pt at start-up; peers closed (np3 r1 tee_trainer); console only
               Root Cause rank 3 exitcode 1, the traceback in attempt_0/3/stderr.log (np4 r3 redirects)
  ckptwide   - load_state_dict size mismatch c1.weight [24,2,3,3] vs [16,2,3,3]; peers SIGTERMed (np3 r2 pymodule);
               node 1's agent then RendezvousConnectionError (np4 r1 pdsh2)
  ckptcalib  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.CameraCalib' (np3 r0 loglevel)
  histgather - DETAIL: every rank 'Detected mismatch between collectives', rank 1 TensorShape=[17] (np4 r1 detail);
               'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (17), got (16))' on rank 2 (np3 r2 filter)
  slowdecode - 12 s: ranks 0, 2 'Timed out waiting 12000ms' in the step-2 all_reduce, Root Cause rank 0 (np3 r1 prefix);
               pg timeout 300: silent after step 1, killed at 60 s, SignalException, exit 124 (np4 r2 plain)
  exposure   - own check 'non-finite loss nan at step 3', FloatingPointError; with DETAIL rank 0 monitoredBarrier error
               (np6 r4 detail); peers Connection closed (np3 r0 wrapper)
  lane       - IndexError: list index out of range at step 3; peers closed (np8 r6 tee, np3 r0 prefix)
  segv       - no traceback after step 2, Root Cause exitcode -11 SIGSEGV (np4 r3 wrapper); restart: attempt 2 failed
               in Gloo connectFullMesh Connect timeout, exit 124 as the 100 s timeout hit (np8 r5 restart)
  exit4      - rank N's GPS ERROR line and exit 4 after the last step; rank 0 still saved; Root Cause exitcode 4
               (np3 r1 pymodule, np6 r2 loglevel)
  cropwide   - every rank 'mat1 and mat2 shapes cannot be multiplied (96x3200 and 2048x1)'; Root Cause rank 0 (np3 tee_trainer)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/phol.pt, exit 0 (np3 plain)
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault390_work"
SURFACE = {"asphalt": 0, "concrete": 1, "cobble": 2, "gravel": 3}
LANE_OFFSETS = [0, 6, 12, 18]
CROP = 32
NBINS = 16
log = None


class CameraCalib:
    def __init__(self, fx, fy, cx, cy):
        self.fx, self.fy, self.cx, self.cy = fx, fy, cx, cy


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
    log = logging.getLogger("phol")
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


class PotholeNet(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.c1 = nn.Conv2d(2, width, 3, padding=1)
        self.c2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.head = nn.Linear(2 * width * (CROP // 4) ** 2, 1)

    def forward(self, x):
        h = F.max_pool2d(torch.relu(self.c1(x)), 2)
        h = F.max_pool2d(torch.relu(self.c2(h)), 2)
        return self.head(h.flatten(1)).squeeze(1)


def make_frames(n, seed, size=48):
    g = torch.Generator().manual_seed(seed)
    img = 0.5 + 0.1 * torch.randn(n, size, size, generator=g)
    has = torch.rand(n, generator=g) < 0.5
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i in range(n):
        if has[i]:
            cy, cx = torch.randint(14, size - 14, (2,), generator=g).tolist()
            r = float(torch.randint(4, 9, (1,), generator=g))
            mask = ((yy - cy) ** 2 / r ** 2 + (xx - cx) ** 2 / (r * 0.6) ** 2) < 1
            img[i][mask] -= 0.35
    surf = [list(SURFACE)[int(k)] for k in torch.randint(0, 4, (n,), generator=g)]
    lanes = torch.randint(0, 4, (n,), generator=g).tolist()
    depth = (torch.rand(n, generator=g) * 12.0) * has.float()
    return {"frames": img, "pothole": has.float(), "surface": surf, "lane": lanes,
            "gain": torch.full((n,), 1.7), "depth_cm": depth}


def prepare():
    for d in ("frames", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_frames(96, 390 + r), f"{WORK}/frames/frames_{r}.pt")
    torch.manual_seed(0)
    torch.save(PotholeNet(16).state_dict(), f"{WORK}/ckpt/phol_w16.pt")
    torch.save(PotholeNet(24).state_dict(), f"{WORK}/ckpt/phol_w24.pt")
    torch.save({"model": PotholeNet(16).state_dict(), "calib": CameraCalib(912.0, 910.5, 640.0, 360.0)},
               f"{WORK}/ckpt/phol_calib.pt")
    print("prepared", WORK)


def crops(data, a, bad, step):
    crop = 40 if a.fault == "cropwide" else CROP
    fr = data["frames"]
    if bad and a.fault == "exposure" and step >= 3:
        gain = torch.zeros_like(data["gain"])
        fr = (fr - fr.mean()) / gain[:, None, None] * 0.0
    out = []
    for i in range(fr.shape[0]):
        lane = data["lane"][i]
        if bad and a.fault == "lane" and step == 3 and i == 7:
            lane = 4
        off = LANE_OFFSETS[lane] // 3
        out.append(fr[i, off:off + crop, 4:4 + crop])
    x = torch.stack(out).unsqueeze(1)
    return torch.cat([x, x - x.mean(dim=(2, 3), keepdim=True)], 1)


def slow_decode(data, budget):
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        for img in data["frames"][:8]:
            rows = img.tolist()
            n += sum(1 for row in rows for v in row if v < 0.3)
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading dashcam frames")
    split = "night/" if bad and a.fault == "noframes" else ""
    data = torch.load(f"{WORK}/frames/{split}frames_{rank}.pt")
    if bad and a.fault == "surface":
        data["surface"][11] = "manhole"
    surf = torch.tensor([SURFACE[s] for s in data["surface"]])
    hist = torch.histc(data["depth_cm"], bins=NBINS, min=0.0, max=12.0)
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([float((data["depth_cm"] > 12.0).sum())])])
    allh = [torch.zeros(NBINS) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} frames {data['frames'].shape[0]} potholes {int(data['pothole'].sum())} "
        f"surfaces {torch.bincount(surf, minlength=4).tolist()} global potholes {int(sum(h.sum() for h in allh))}")
    model = PotholeNet()
    if bad and a.fault == "ckptcalib":
        ck = torch.load(f"{WORK}/ckpt/phol_calib.pt")
        model.load_state_dict(ck["model"])
    else:
        ck = "phol_w24.pt" if bad and a.fault == "ckptwide" else "phol_w16.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    y = data["pothole"]
    for step in range(a.steps):
        x = crops(data, a, bad, step)
        logit = net(x)
        loss = F.binary_cross_entropy_with_logits(logit, y)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(x)).sum())} non-finite pixels in the batch)", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowdecode" and step == 2:
            n = slow_decode(data, a.decode_budget)
            say(f"rank {rank} re-decoded frames: {n} dark pixels")
        acc = ((logit.detach() > 0).float() == y).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR GPS track for drive 2026-11-30_A{rank} has no fixes after frame 96, "
            f"cannot geotag detected potholes; aborting", err=True)
        sys.exit(4)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/phol.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/phol.pt")
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
    p.add_argument("--decode-budget", type=int, default=45)
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

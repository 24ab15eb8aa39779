"""A four-hundred-and-twenty-fourth hand-run batch: HIGHWAY DRIVING-SCENE SEGMENTATION.

Synthetic front-camera frames of a highway (sky on top, vegetation and guardrails at the sides, asphalt with
dashed lane markings, a few cars and trucks) as 3x32x64 tensors with a per-pixel class mask.  Every rank reads
its frames from /tmp/fault424_work/frames/day/frames_R.pt plus a per-rank label file (labels_R.json, names
mapped through an 8-entry class table), and trains a tiny encoder-decoder (two strided convs, a transposed-conv
decoder with a skip connection) on a class-weighted cross entropy, wrapped in DDP (gloo), or with gradients
all_reduced by hand (--ddp 0).  The model starts from ckpt/segnet_c8.pt.  Per-rank class histograms are
all_gathered at the start, loss and pixel accuracy are all_reduced every step, per-rank mIoU is all_gathered at
the end, and rank 0 saves export/segnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  labelmap   - rank N's label file names a class "motorcycle" missing from the class table (KeyError, start-up)
  nocam      - rank N reads its frames from frames/night/, which does not exist (FileNotFoundError, start-up)
  ckptwidth  - rank N initialises from ckpt/segnet_c12.pt, saved with a 12-class head (size mismatch)
  ckptpickle - rank N loads ckpt/segnet_cfg.pt, which pickles a SceneConfig object (weights_only refusal)
  histgather - rank N all_gathers its class histogram with an extra "unlabelled" bin (9 vs 8 entries)
  classid    - rank N's third batch has a mask with class id 8 (a "tunnel" id) beyond the 8 classes (step 2)
  slowcrf    - rank N refines its predictions with a pure-Python CRF sweep before the step-2 all_reduce
  nanlane    - rank N's step-3 batch has no lane-marking pixels: its 1/frequency class weight is inf, the
               loss NaN, and the program's own check raises FloatingPointError
  segv       - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own error line about a missing camera calibration at the end and sys.exit(4)
  upsample   - every rank: the decoder upsamples by 4 instead of 2, the skip concat fails (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  labelmap   - KeyError: 'motorcycle' at start-up; peers Connection closed by peer in the first all_gather (np4 r2 tee, np6 r0 loglevel)
  nocam      - FileNotFoundError for frames/night/frames_1.pt, only in rank 1's stderr.log; console has Root Cause rank 1 (np4 r1 redirects)
  ckptwidth  - load_state_dict size mismatch for head.weight [12,8,1,1] vs [8,8,1,1] (np3 r2 plain, np4 r1 pdsh2)
  ckptpickle - _pickle.UnpicklingError 'Weights only load failed' on the SceneConfig object (np3 r0 prefix)
  histgather - gloo 'allgather: invalid tensor size at index 0 (expected (9), got (8))' (np3 r1 filter); under DETAIL every
               rank raises 'Detected mismatch between collectives', rank 3 with TensorShape=[9] (np6 r3 detail)
  classid    - not the planned target-bounds error: id 8 gives a 9-entry class-weight tensor and cross_entropy raises
               'weight tensor should be defined either for all or no classes' at step 2 (np3 r1 tee_trainer, np4 r3 pymodule)
  slowcrf    - 12 s: peers 'Timed out waiting 12000ms for recv' in the step-2 all_reduce (np3 r2 plain); 300 s: silent after
               step 1, killed at 60 s, exit 124 (np4 r1 wrapper)
  nanlane    - after a fix to the weight code (the first version never produced NaN; both runs dropped): rank N logs
               'non-finite loss nan (class weights [0.0, nan, ...])' and raises FloatingPointError at step 3 (np4 r0 restart, np8 r5 tee)
  segv       - no traceback after step 3; agent exitcode -11 (SIGSEGV) on rank N (np3 r1 restart, np6 r4 filter)
  exit4      - rank N's calibration ERROR line and exit 4 at the end; peers Connection closed in the final all_gather (np4 r2
               loglevel); under DETAIL rank 0 'Ranks 1 failed to pass monitoredBarrier in 12000 ms' (np3 r1 detail)
  upsample   - not the planned concat error: the x4 ConvTranspose no longer fits the checkpoint, every rank raises
               load_state_dict size mismatch for dec2.weight (np3 all pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/segnet.pt, exit 0 (np3 plain)
"""
import argparse
import json
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

WORK = "/tmp/fault424_work"
CLASSES = {"road": 0, "lane_marking": 1, "car": 2, "truck": 3, "guardrail": 4, "sign": 5, "vegetation": 6,
           "sky": 7}
NCLS = len(CLASSES)
H, W, BATCH = 32, 64, 4
log = None


@dataclass
class SceneConfig:
    camera: str = "front_wide"
    fov_deg: float = 120.0
    classes: int = NCLS


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
    log = logging.getLogger("hwseg")
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


class SegNet(nn.Module):
    def __init__(self, ncls=NCLS, up=2):
        super().__init__()
        self.enc1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.enc2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.dec2 = nn.ConvTranspose2d(16, 8, up, stride=up)
        self.dec1 = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.head = nn.Conv2d(8, ncls, 1)

    def forward(self, x):
        e1 = torch.relu(self.enc1(x))
        e2 = torch.relu(self.enc2(e1))
        d2 = torch.relu(self.dec2(e2))
        d1 = torch.relu(self.dec1(torch.cat([d2, e1], 1)))
        return self.head(d1)


def make_frames(n, seed):
    g = torch.Generator().manual_seed(seed)
    masks = torch.zeros(n, H, W, dtype=torch.long)
    for i in range(n):
        horizon = int(torch.randint(8, 14, (1,), generator=g))
        m = masks[i]
        m[:horizon] = CLASSES["sky"]
        m[horizon:, :6] = CLASSES["vegetation"]
        m[horizon:, -6:] = CLASSES["guardrail"]
        for lane_x in (20, 43):
            for y in range(horizon + 1, H, 4):
                m[y:y + 2, lane_x:lane_x + 2] = CLASSES["lane_marking"]
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            cx, cy = int(torch.randint(8, 52, (1,), generator=g)), int(torch.randint(horizon + 2, 26, (1,), generator=g))
            big = bool(torch.rand(1, generator=g) < 0.3)
            m[cy:cy + (6 if big else 4), cx:cx + (8 if big else 5)] = CLASSES["truck" if big else "car"]
        m[horizon - 3:horizon - 1, 50:53] = CLASSES["sign"]
    palette = torch.rand(NCLS, 3, generator=g)
    imgs = palette[masks].permute(0, 3, 1, 2) + 0.1 * torch.randn(n, 3, H, W, generator=g)
    return {"images": imgs, "masks": masks}


def prepare():
    for d in ("frames/day", "ckpt", "labels"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_frames(32, 400 + r), f"{WORK}/frames/day/frames_{r}.pt")
        names = {str(i): k for k, i in CLASSES.items()}
        with open(f"{WORK}/labels/labels_{r}.json", "w") as f:
            json.dump({"source": f"hwy_cam_{r}", "ids": names}, f)
    torch.manual_seed(0)
    torch.save(SegNet().state_dict(), f"{WORK}/ckpt/segnet_c8.pt")
    torch.save(SegNet(12).state_dict(), f"{WORK}/ckpt/segnet_c12.pt")
    torch.save({"config": SceneConfig(), "model": SegNet().state_dict()}, f"{WORK}/ckpt/segnet_cfg.pt")
    print("prepared", WORK)


def crf_sweep(probs, budget):
    # pure-Python mean-field style smoothing over the 4-neighbourhood, one pixel at a time
    p = probs[0].tolist()
    t0, sweeps = time.time(), 0
    while time.time() - t0 < budget:
        for c in range(len(p)):
            for y in range(1, H - 1):
                for x in range(1, W - 1):
                    p[c][y][x] = 0.5 * p[c][y][x] + 0.125 * (p[c][y - 1][x] + p[c][y + 1][x] + p[c][y][x - 1] + p[c][y][x + 1])
        sweeps += 1
    return sweeps


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading highway frames")
    with open(f"{WORK}/labels/labels_{rank}.json") as f:
        lab = json.load(f)
    if bad and a.fault == "labelmap":
        lab["ids"]["3"] = "motorcycle"
    remap = torch.tensor([CLASSES[lab["ids"][str(i)]] for i in range(NCLS)])
    split = "night" if bad and a.fault == "nocam" else "day"
    data = torch.load(f"{WORK}/frames/{split}/frames_{rank}.pt")
    imgs, masks = data["images"], remap[data["masks"]]
    hist = torch.bincount(masks.flatten(), minlength=NCLS).float()
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.zeros(1)])
    allh = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allh, hist)
    ghist = torch.stack(allh).sum(0)
    say(f"rank {rank} pixels {int(hist.sum())} global {int(ghist.sum())} "
        f"lane share {ghist[1] / ghist.sum():.3f}")
    model = SegNet(up=4 if a.fault == "upsample" else 2)
    if bad and a.fault == "ckptpickle":
        state = torch.load(f"{WORK}/ckpt/segnet_cfg.pt")["model"]
    else:
        state = torch.load(f"{WORK}/ckpt/segnet_c12.pt" if bad and a.fault == "ckptwidth" else f"{WORK}/ckpt/segnet_c8.pt")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    n = imgs.shape[0]
    for step in range(a.steps):
        i0 = (step * BATCH) % n
        x, y = imgs[i0:i0 + BATCH], masks[i0:i0 + BATCH].clone()
        if bad and a.fault == "classid" and step == 2:
            y[1, 28:, 10:30] = 8
        if bad and a.fault == "nanlane" and step == 3:
            y[y == CLASSES["lane_marking"]] = CLASSES["road"]
        freq = torch.bincount(y.flatten(), minlength=NCLS).float()
        lane_unguarded = torch.arange(freq.numel()).eq(CLASSES["lane_marking"]) & (bad and a.fault == "nanlane")
        cw = torch.where((freq > 0) | lane_unguarded, freq.sum() / (NCLS * freq), torch.ones_like(freq)); cw = cw / cw.sum() * NCLS
        logits = net(x)
        loss = F.cross_entropy(logits, y, weight=cw)
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} (class weights {cw.tolist()})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowcrf" and step == 2:
            sweeps = crf_sweep(torch.softmax(logits.detach(), 1)[0:1], a.crf_budget)
            say(f"rank {rank} CRF refinement: {sweeps} sweeps")
        acc = (logits.argmax(1) == y).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} pixacc {stats[1].item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        pred = model(imgs[:8]).argmax(1)
        gt = masks[:8]
        ious = [((pred == c) & (gt == c)).sum() / ((pred == c) | (gt == c)).sum().clamp(min=1) for c in range(NCLS)]
        miou = torch.stack(ious).mean().reshape(1)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR calibration file calib/hwy_cam_{rank}.yaml not found; cannot project lane "
            f"masks to the ground plane, aborting evaluation", err=True)
        sys.exit(4)
    allm = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allm, miou)
    say(f"rank {rank} mIoU {miou.item():.3f} mean over ranks {torch.cat(allm).mean().item():.3f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/segnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/segnet.pt")
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
    p.add_argument("--crf-budget", type=int, default=40)
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

"""A four-hundred-and-sixty-ninth hand-run batch: SATELLITE CLOUD MASK SEGMENTATION.

Synthetic 4-band (blue, green, red, near-infrared) 32x32 reflectance tiles with a per-pixel mask of three
classes (0 clear, 1 cloud, 2 cloud shadow).  Every rank reads its tiles from /tmp/fault469_work/tiles/tiles_R.pt,
converts digital numbers to reflectance with the gain of the tile's sensor (looked up in a sensor table), and
trains a tiny U-Net (two encoder convs, a max-pool, an upsample, a skip concatenation, a 1x1 head) with a
cross-entropy loss, wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model
starts from ckpt/unet_b4.pt.  Per-rank cloud-fraction histograms (10 bins) are all_gathered at the start, the
loss and the cloud IoU are all_reduced every step, and rank 0 saves export/cloudmask.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  sensor     - rank N's tiles say sensor "LANDSAT9", missing from the gain table (KeyError at start-up)
  labelidx   - rank N's masks carry label 3 (snow/ice) but the head has 3 classes (IndexError in the first loss)
  notiles    - rank N reads its tiles from tiles/archive/ which does not exist (FileNotFoundError)
  ckptbands  - rank N initialises from ckpt/unet_b5.pt, saved with 5 input bands (size mismatch)
  ckptpickle - rank N loads ckpt/unet_stats.pt, which pickles a BandStats object (weights_only refusal)
  histgather - rank N all_gathers an 11-bin cloud-fraction histogram (an extra 'no data' bin) against 10
  slowcc     - rank N labels connected cloud components in pure Python before the step-2 all_reduce
  nanrefl    - rank N's step-3 batch has saturated pixels divided by a zero gain: the program's check raises
  segv       - rank N sends itself SIGSEGV after step 3
  exit2      - rank N at the end finds its cloud fraction over the QA limit, prints an error, sys.exit(2)
  upsample   - every rank: the pool is 3x3 so the upsampled map (20x20) cannot join the 32x32 skip (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  sensor     - KeyError: 'LANDSAT9' at the gain lookup before the first all_gather; peers closed (np4 r2 tee, np6 r0 pymodule)
  labelidx   - IndexError 'Target 3 is out of bounds.' in step 0's cross_entropy; peers closed (np3 r1 loglevel, np4 r3 filter)
  notiles    - FileNotFoundError for tiles/archive/tiles_N.pt at start-up; console shows only Root Cause under
               --redirects 3 (np4 r1 redirects), traceback in the console (np3 r2 wrapper)
  ckptbands  - load_state_dict size mismatch for enc1.weight [8,5,3,3] vs [8,4,3,3]; worker-1's agent held the store,
               worker-0's agent then raised RendezvousConnectionError (np4 r2 pdsh2)
  ckptpickle - UnpicklingError 'Weights only load failed' (__main__.BandStats) (np3 r0 tee_trainer); with
               --max-restarts 1 the second attempt failed earlier, Gloo connectFullMesh 'Connection refused' (np5 r3 restart)
  histgather - with DETAIL every rank: 'Detected mismatch between collectives ... Tensor shapes: 10vs 11' (np6 r4 detail)
  slowcc     - 12 s: peers 'Timed out waiting 12000ms for recv', rank N silent (np3 r2 plain); 300 s: output stops after
               step 1, timeout 60 s, SignalException, exit 124 (np4 r1 tee)
  nanrefl    - the check: '64 non-finite reflectance values', FloatingPointError at step 3 (np8 r5 prefix; np3 r0 detail,
               peers' monitoredBarrier message naming rank 0)
  segv       - no traceback after step 3, Root Cause exitcode -11 SIGSEGV (np4 r3 wrapper); with --max-restarts 1 the
               second attempt hit Gloo connectFullMesh and the final Root Cause names rank 0 (np3 r1 restart)
  exit2      - rank N's QA ERROR line at the end and exit 2, peers closed in the final barrier (np5 r2 tee_trainer, np4 r0 loglevel)
  upsample   - every rank: 'Sizes of tensors must match except in dimension 1. Expected size 20 but got size 32' (np6 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/cloudmask.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault469_work"
GAIN = {"S2A": 1e-4, "S2B": 1e-4, "LANDSAT8": 2.75e-5}
NCLS = 3
BANDS = 4
TILE = 32
log = None


class BandStats:
    def __init__(self, mean, std):
        self.mean = mean
        self.std = std


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
    log = logging.getLogger("cloudm")
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


class TinyUNet(nn.Module):
    def __init__(self, bands=BANDS, width=8, pool=2):
        super().__init__()
        self.enc1 = nn.Conv2d(bands, width, 3, padding=1)
        self.enc2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.dec = nn.Conv2d(3 * width, width, 3, padding=1)
        self.head = nn.Conv2d(width, NCLS, 1)
        self.pool = pool

    def forward(self, x):
        s = torch.relu(self.enc1(x))
        b = torch.relu(self.enc2(F.max_pool2d(s, self.pool)))
        u = F.interpolate(b, scale_factor=2, mode="nearest")
        return self.head(torch.relu(self.dec(torch.cat([u, s], 1))))


def make_tiles(n, seed, sensor):
    g = torch.Generator().manual_seed(seed)
    dn = torch.randint(200, 4000, (n, BANDS, TILE, TILE), generator=g).float()
    yy, xx = torch.meshgrid(torch.arange(TILE), torch.arange(TILE), indexing="ij")
    masks = torch.zeros(n, TILE, TILE, dtype=torch.long)
    for i in range(n):
        cy, cx, r = torch.randint(4, 28, (3,), generator=g).tolist()
        cloud = (yy - cy) ** 2 + (xx - cx) ** 2 < (r // 2 + 3) ** 2
        shadow = (yy - cy - 4) ** 2 + (xx - cx - 4) ** 2 < (r // 2 + 2) ** 2
        masks[i][shadow & ~cloud] = 2
        masks[i][cloud] = 1
        dn[i, :, cloud] += 5000
        dn[i, 3, shadow & ~cloud] *= 0.3
    return {"sensor": sensor, "dn": dn, "mask": masks}


def prepare():
    for d in ("tiles", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(16, 400 + r, "S2A" if r % 2 == 0 else "S2B"), f"{WORK}/tiles/tiles_{r}.pt")
    torch.manual_seed(0)
    torch.save(TinyUNet(BANDS).state_dict(), f"{WORK}/ckpt/unet_b4.pt")
    torch.save(TinyUNet(5).state_dict(), f"{WORK}/ckpt/unet_b5.pt")
    torch.save({"model": TinyUNet(BANDS).state_dict(), "stats": BandStats([0.1] * 4, [0.05] * 4)},
               f"{WORK}/ckpt/unet_stats.pt")
    print("prepared", WORK)


def label_components(mask):
    """Four-connected cloud components by flood fill, in plain Python (slow on purpose)."""
    m = mask.tolist()
    h, w = len(m), len(m[0])
    seen = [[False] * w for _ in range(h)]
    n = 0
    for y in range(h):
        for x in range(w):
            if m[y][x] == 1 and not seen[y][x]:
                n += 1
                stack = [(y, x)]
                while stack:
                    cy, cx = stack.pop()
                    if 0 <= cy < h and 0 <= cx < w and m[cy][cx] == 1 and not seen[cy][cx]:
                        seen[cy][cx] = True
                        stack += [(cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)]
    return n


def cloud_iou(logits, mask):
    p = logits.argmax(1) == 1
    t = mask == 1
    inter = (p & t).sum().float()
    union = (p | t).sum().float().clamp(min=1)
    return inter / union


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading tiles")
    sub = "archive/" if bad and a.fault == "notiles" else ""
    tiles = torch.load(f"{WORK}/tiles/{sub}tiles_{rank}.pt")
    if bad and a.fault == "sensor":
        tiles["sensor"] = "LANDSAT9"
    refl = tiles["dn"] * GAIN[tiles["sensor"]]
    mask = tiles["mask"].clone()
    if bad and a.fault == "labelidx":
        mask[3, :4, :4] = 3
    frac = (mask == 1).float().mean((1, 2))
    nbins = 11 if bad and a.fault == "histgather" else 10
    hist = torch.histc(frac, bins=nbins, min=0.0, max=1.0)
    allh = [torch.zeros(10) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} tiles {len(frac)} cloud fraction {frac.mean():.3f} global tiles {int(sum(h.sum() for h in allh))}")
    model = TinyUNet(pool=3 if a.fault == "upsample" else 2)
    if bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/unet_stats.pt")["model"])
    else:
        ck = "unet_b5.pt" if bad and a.fault == "ckptbands" else "unet_b4.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        idx = torch.arange(step * 2, step * 2 + 8) % len(refl)
        x, y = refl[idx].clone(), mask[idx]
        if bad and a.fault == "nanrefl" and step == 3:
            x[2, :, 5:9, 5:9] = tiles["dn"][idx[2], :, 5:9, 5:9] / 0.0 * 0.0
        if not torch.isfinite(x).all():
            say(f"rank {rank} step {step}: {int((~torch.isfinite(x)).sum())} non-finite reflectance values "
                f"in batch tiles {idx.tolist()}", err=True)
            raise FloatingPointError(f"non-finite reflectance on rank {rank} at step {step}")
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowcc" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.cc_budget:
                for m in mask:
                    n += label_components(m)
            say(f"rank {rank} cloud components counted: {n}")
        stats = torch.stack([loss.detach(), cloud_iou(logits.detach(), y)])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} cloud_iou {stats[1].item():.3f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR QA check failed: cloud fraction 0.97 over tile set exceeds limit 0.80, "
            f"refusing to publish this mask model", err=True)
        sys.exit(2)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/cloudmask.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/cloudmask.pt")
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
    p.add_argument("--cc-budget", type=int, default=45)
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

"""A three-hundred-and-eighty-eighth hand-run batch: SATELLITE CLOUD MASKING.

Synthetic multispectral tiles (4 bands: blue, green, red, NIR; 16x16 pixels) with a full-resolution 32x32 cloud
mask and a sensor name per tile.  Every rank reads /tmp/fault388_work/tiles/tiles_R.pt, converts radiance to
reflectance with a per-sensor gain (looked up in SENSOR_GAIN), downsamples the mask to 16x16 by max-pooling and
trains a small fully convolutional CloudNet (three 3x3 convolutions) on a BCE loss, wrapped in DDP (gloo) or,
with --ddp 0, with gradients all_reduced by hand.  The model is initialised from ckpt/cloudnet_b4.pt.  Each
rank all_gathers a 10-bin cloud-fraction histogram at start-up, the loss and IoU are all_reduced every step, a
validation IoU is all_reduced at the end, and rank 0 saves export/cloudnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  sensor     - rank N's tiles include one from sensor "WV3", missing from the gain table (KeyError, start-up)
  bandidx    - rank N computes an NDSI snow guard from band index 4 (SWIR) at step 3; tiles have 4 bands (IndexError)
  notiles    - rank N reads its tiles from tiles/val/, which does not exist (FileNotFoundError, start-up)
  ckptwidth  - rank N initialises from ckpt/cloudnet_b6.pt, saved for 6 bands (size mismatch)
  ckptpickle - rank N loads ckpt/cloudnet_full.pt, pickled with a SceneMeta object (weights_only refusal)
  histgather - rank N all_gathers an 11-bin cloud-fraction histogram (an extra "no data" bin) against 10
  census     - rank N counts cloud blobs by flood fill in Python before the step-2 all_reduce (--census-budget s)
  nanrad     - rank N's batch at step 3 holds a saturated pixel (inf radiance); the program's loss check raises
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - after training rank N's validation finds a tile georeferenced outside its scene; ERROR line, sys.exit(5)
  maskshape  - every rank: the 32x32 mask is not downsampled, BCE against 16x16 logits (ValueError)
  none       - control, clean run

What happened (filled in after the runs):
  sensor     - KeyError: 'WV3' in the gain lookup at start-up; peers Connection closed by peer in the all_gather (np4 r2 tee, np6 r0 pymodule)
  bandidx    - IndexError 'index 4 is out of bounds for dimension 1 with size 4' at step 3; peers closed (np3 r1 loglevel);
               under DETAIL (--ddp 0) rank 0 'Ranks 3 failed to pass monitoredBarrier in 12000 ms' (np4 r3 detail)
  notiles    - FileNotFoundError for tiles/val/tiles_N.pt at start-up (np8 r5 filter, np3 r0 wrapper)
  ckptwidth  - load_state_dict size mismatch for enc1.weight [8,6,3,3] vs [8,4,3,3] (np4 r1 pdsh2, np3 r2 tee_trainer)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SceneMeta' (np5 r3 prefix, np3 r2 filter)
  histgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))' on rank N; peers closed (np3 r1 plain, np6 r4 redirects)
  census     - 12 s: peers 'Timed out waiting 12000ms for recv', rank N SIGTERMed, Root Cause rank 0 (np3 r2 tee);
               300 s: output stops after step 1, killed by timeout at 60 s, exit 124 (np4 r1 plain)
  nanrad     - 'loss is nan at step 3 (max reflectance inf)', FloatingPointError (np3 r2 detail: rank 0 monitoredBarrier cascade);
               np4 r0 restart: attempt 1 failed on every rank in init with 'Gloo connectFullMesh failed ... Connection refused'
  sigsegv    - rank N dies after step 3, Root Cause exitcode -11 (SIGSEGV), peers Connection reset by peer (np3 r1 tee_trainer, np4 r2 pdsh2)
  exit5      - rank N's ERROR line after 6 steps, sys.exit(5), Root Cause exitcode 5, peers closed in the val all_reduce (np4 r3 loglevel --logfmt 1, np3 r0 wrapper)
  maskshape  - every rank: 'ValueError: Target size (torch.Size([8, 1, 32, 32])) must be the same as input size (torch.Size([8, 1, 16, 16]))'
               (np3 pymodule; np4 restart, whose attempt 1 fails in gloo connectFullMesh like nanrad's)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/cloudnet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault388_work"
SENSOR_GAIN = {"S2A": 0.0001, "S2B": 0.000102, "L8": 0.00002, "L9": 0.0000205}
BANDS = 4
NBINS = 10
BATCH = 8
log = None


@dataclass
class SceneMeta:
    sensor: str
    bands: int
    epsg: int


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
    log = logging.getLogger("cldm")
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


class CloudNet(nn.Module):
    def __init__(self, bands=BANDS, width=8):
        super().__init__()
        self.enc1 = nn.Conv2d(bands, width, 3, padding=1)
        self.enc2 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Conv2d(width, 1, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.enc1(x))
        h = F.relu(self.enc2(h))
        return self.head(h)


def make_tiles(n, seed):
    g = torch.Generator().manual_seed(seed)
    sensors = list(SENSOR_GAIN)
    sens = [sensors[int(i)] for i in torch.randint(0, 4, (n,), generator=g)]
    mask = (torch.rand(n, 1, 8, 8, generator=g) > 0.6).float()
    mask = F.interpolate(mask, size=(32, 32), mode="nearest")
    lo = F.avg_pool2d(mask, 2)
    refl = 0.08 + 0.5 * lo + 0.05 * torch.rand(n, BANDS, 16, 16, generator=g)
    gains = torch.tensor([SENSOR_GAIN[s] for s in sens]).view(n, 1, 1, 1)
    return {"radiance": refl / gains, "mask": mask, "sensor": sens,
            "georef": [(40.0 + i * 0.01, 12.0) for i in range(n)]}


def prepare():
    os.makedirs(f"{WORK}/tiles", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(48, 300 + r), f"{WORK}/tiles/tiles_{r}.pt")
    torch.manual_seed(0)
    torch.save(CloudNet(4).state_dict(), f"{WORK}/ckpt/cloudnet_b4.pt")
    torch.save(CloudNet(6).state_dict(), f"{WORK}/ckpt/cloudnet_b6.pt")
    torch.save({"model": CloudNet(4).state_dict(), "meta": SceneMeta("S2A", 4, 32633)},
               f"{WORK}/ckpt/cloudnet_full.pt")
    print("prepared", WORK)


def count_blobs(mask):
    """Connected cloud components, 4-neighbour flood fill, in pure Python."""
    total = 0
    for m in mask[:, 0].tolist():
        h, w = len(m), len(m[0])
        seen = [[False] * w for _ in range(h)]
        for i in range(h):
            for j in range(w):
                if m[i][j] > 0.5 and not seen[i][j]:
                    total += 1
                    stack = [(i, j)]
                    while stack:
                        y, x = stack.pop()
                        if 0 <= y < h and 0 <= x < w and not seen[y][x] and m[y][x] > 0.5:
                            seen[y][x] = True
                            stack += [(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)]
    return total


def iou(logits, target):
    p = (logits > 0).float()
    inter = (p * target).sum()
    union = ((p + target) > 0).float().sum()
    return (inter / union.clamp(min=1.0)).reshape(1)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading tiles")
    split = "val/" if bad and a.fault == "notiles" else ""
    tiles = torch.load(f"{WORK}/tiles/{split}tiles_{rank}.pt")
    if bad and a.fault == "sensor":
        tiles["sensor"][13] = "WV3"
    gains = torch.tensor([SENSOR_GAIN[s] for s in tiles["sensor"]]).view(-1, 1, 1, 1)
    x = tiles["radiance"] * gains
    if bad and a.fault == "nanrad":
        x[3 * BATCH + 2, 3, 7, 9] = float("inf")
    mask = tiles["mask"] if a.fault == "maskshape" else F.max_pool2d(tiles["mask"], 2)
    frac = F.avg_pool2d(tiles["mask"], 32).flatten()
    nb = NBINS + 1 if bad and a.fault == "histgather" else NBINS
    hist = torch.histc(frac, bins=nb, min=0.0, max=1.0)
    allh = [torch.zeros(NBINS) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} tiles {x.shape[0]} cloud fraction {frac.mean():.3f} global {torch.stack(allh).sum():.0f} tiles")
    model = CloudNet()
    if bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/cloudnet_full.pt")["model"])
    else:
        ck = "cloudnet_b6.pt" if bad and a.fault == "ckptwidth" else "cloudnet_b4.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for step in range(a.steps):
        sl = slice((step * BATCH) % x.shape[0], (step * BATCH) % x.shape[0] + BATCH)
        xb, yb = x[sl], mask[sl]
        if bad and a.fault == "bandidx" and step == 3:
            ndsi = (xb[:, 1] - xb[:, 4]) / (xb[:, 1] + xb[:, 4])
            yb = yb * (ndsi.unsqueeze(1) < 0.4).float()
        logits = net(xb)
        loss = F.binary_cross_entropy_with_logits(logits, yb)
        if not torch.isfinite(loss):
            say(f"rank {rank}: loss is {loss.item()} at step {step} (max reflectance {xb.max().item()}), "
                f"aborting", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "census" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.census_budget:
                n += count_blobs(tiles["mask"])
            say(f"rank {rank} cloud census: {n} blobs")
        stats = torch.cat([loss.detach().reshape(1), iou(logits.detach(), yb)])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} iou {stats[1].item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR validation tile 41 georeferenced at lat 91.20 lon 12.00, outside scene "
            f"footprint; refusing to publish cloud masks", err=True)
        sys.exit(5)
    with torch.no_grad():
        viou = iou(net(x[-BATCH:]), mask[-BATCH:])
    dist.all_reduce(viou)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/cloudnet.pt")
        say(f"rank 0 done: {a.steps} steps, val iou {viou.item() / world:.4f}, saved export/cloudnet.pt")
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
    p.add_argument("--census-budget", type=int, default=40)
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

"""Batch 355 of hand-run faults: KELP FOREST CANOPY MAPPING FROM AERIAL IMAGERY.

Synthetic aerial tiles (4 bands: blue, green, red, near-infrared; 32x32 pixels) with a kelp canopy mask.
Every rank reads its tiles from /tmp/fault355_work/tiles/tiles_R.pt, corrects each tile for the tide height
of the station it was flown near (a tide table keyed by station id), adds an NDVI-like kelp index band and
trains a small U-Net-like segmenter (two conv blocks down, one up, a 1x1 head) on a BCE loss, wrapped in
DDP over gloo (or with gradients all_reduced by hand, --ddp 0).  The model is initialised from
ckpt/kelpnet_b4.pt.  Per-rank canopy/water/land pixel histograms are all_gathered at the start, the IoU is
all_reduced every step, and rank 0 saves export/kelpnet.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  tidegauge  - rank N's tiles name tide station "PTLOMA9" that is not in the tide table (KeyError, start-up)
  sceneidx   - rank N looks up its flight's scene list with an index one past the end (IndexError, start-up)
  notiles    - rank N reads its tiles from tiles/2025q3/ which does not exist (FileNotFoundError, start-up)
  ckptbands  - rank N initialises from ckpt/kelpnet_b5.pt, saved for 5 input bands (size mismatch)
  ckptpickle - rank N loads ckpt/kelpnet_meta.pt which pickles a FlightMeta object (weights_only refusal)
  histgather - rank N all_gathers its pixel histogram with an extra "foam" class (4 vs 3 entries)
  mosaic     - rank N stitches a full-resolution mosaic in Python before the step-2 all_reduce (slow rank)
  nanndvi    - rank N's tile 3 has zero NIR and red at step 3: kelp index 0/0, the program's check (NaN)
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - rank N finds the canopy area off by a factor at the end, prints an error line, sys.exit(5)
  bandwidth  - every rank: the kelp index band is appended (5 bands) but the first conv takes 4 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  tidegauge  - KeyError: 'PTLOMA9' in load_tiles (TIDES[st]) at start-up; peers Connection closed by peer in all_gather (np4 r2 ranklabel, np6 r0 logfmt)
  sceneidx   - IndexError: list index out of range at the scene lookup; peers closed in all_gather (np3 r1 srunlabel); spawn ProcessRaisedException process 3 (np5 r3 spawn)
  notiles    - FileNotFoundError tiles/2025q3/tiles_N.pt at start-up; peers closed (np4 r3 mpitag, np6 r5 files: only in rank5.log)
  ckptbands  - load_state_dict size mismatch enc1.0.weight [8,5,3,3] vs [8,4,3,3] (np4 r1 pdsh2: worker-0 agent RendezvousConnectionError; np3 r2 legacy)
  ckptpickle - UnpicklingError 'Weights only load failed' Unsupported global __main__.FlightMeta (np5 r0 tee; np4 r3 ranklabel --ddp 0)
  histgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4), got (3))' on rank N; peers closed (np3 r1 mpitag, np8 r6 bashloop)
  mosaic     - 12 s: ranks 0,1 'Timed out waiting 12000ms for recv' at step 2 (np3 r2 bashloop); 300 s: silent after 'stitching mosaic', killed at 60 s, exit 124 (np4 r1 srunlabel)
  nanndvi    - program's check: 'kelp index has 1024 non-finite pixels at step 3', FloatingPointError (np4 r2 tee; np3 r0 logfmt --ddp 0)
  sigsegv    - after step 3: bash 'Segmentation fault', exit 139 (np4 r3 ranklabel); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit5      - after step 5 rank N's canopy-area ERROR line, exit 5; peers closed in the final barrier (np5 r2 legacy: Root Cause exitcode 5; np4 r0 files)
  bandwidth  - every rank: conv 'expected input[24, 5, 32, 32] to have 4 channels, but got 5 channels instead' (np6 tee)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/kelpnet.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault355_work"
TIDES = {"MONTEREY": 0.42, "LAJOLLA": 0.31, "SANTACRUZ": 0.55, "POINTLOMA": 0.28, "CARMEL": 0.47}
STATIONS = list(TIDES)
BANDS = 4
NTILE = 24
log = None


class FlightMeta:
    def __init__(self, flight, altitude_m):
        self.flight = flight
        self.altitude_m = altitude_m


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("kelp")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    base.addHandler(h)
    base.setLevel(logging.INFO)
    log = RankAdapter(base, {"rank": rank})


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class KelpNet(nn.Module):
    def __init__(self, bands=BANDS, width=8):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(bands, width, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.head = nn.Conv2d(2 * width, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        u = torch.relu(self.up(e2))
        return self.head(torch.cat([u, e1], 1)).squeeze(1)


def make_tiles(n, seed):
    g = torch.Generator().manual_seed(seed)
    img = torch.rand(n, 4, 32, 32, generator=g) * 0.2 + 0.05
    mask = torch.zeros(n, 32, 32)
    for i in range(n):
        cy, cx = [int(v) for v in torch.randint(6, 26, (2,), generator=g)]
        r = int(torch.randint(3, 8, (1,), generator=g))
        yy, xx = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
        blob = ((yy - cy) ** 2 + (xx - cx) ** 2) < r * r
        mask[i][blob] = 1.0
        img[i, 3][blob] += 0.35
        img[i, 2][blob] -= 0.03
    stations = [STATIONS[int(k)] for k in torch.randint(0, len(STATIONS), (n,), generator=g)]
    return {"img": img, "mask": mask, "station": stations, "scenes": [f"F{seed}_S{k:02d}" for k in range(6)]}


def prepare():
    os.makedirs(f"{WORK}/tiles", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(NTILE, 300 + r), f"{WORK}/tiles/tiles_{r}.pt")
    torch.manual_seed(0)
    sd = KelpNet(BANDS).state_dict()
    torch.save(sd, f"{WORK}/ckpt/kelpnet_b4.pt")
    torch.save(KelpNet(5).state_dict(), f"{WORK}/ckpt/kelpnet_b5.pt")
    torch.save({"model": sd, "meta": FlightMeta("KLP-2026-07-14", 1200.0)}, f"{WORK}/ckpt/kelpnet_meta.pt")
    print("prepared", WORK)


def kelp_index(img):
    nir, red = img[:, 3], img[:, 2]
    return (nir - red) / (nir + red)


def stitch_mosaic(img, budget):
    t0 = time.time()
    rows = 0
    while time.time() - t0 < budget:
        canvas = [[0.0] * 256 for _ in range(256)]
        for t in range(img.shape[0]):
            oy, ox = (t // 8) * 32, (t % 8) * 32
            tile = img[t, 3].tolist()
            for y in range(32):
                for x in range(32):
                    if oy + y < 256 and ox + x < 256:
                        canvas[oy + y][ox + x] = max(canvas[oy + y][ox + x], tile[y][x])
        rows += 256
    return rows


def load_tiles(a, rank, bad):
    sub = "2025q3/" if bad and a.fault == "notiles" else ""
    d = torch.load(f"{WORK}/tiles/{sub}tiles_{rank}.pt")
    if bad and a.fault == "tidegauge":
        d["station"][7] = "PTLOMA9"
    img = d["img"].clone()
    for i, st in enumerate(d["station"]):
        img[i] = img[i] * (1.0 + 0.1 * TIDES[st])
    flight = len(d["scenes"]) if bad and a.fault == "sceneidx" else rank % len(d["scenes"])
    scene = d["scenes"][flight]
    return img, d["mask"], scene


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading aerial tiles")
    img, mask, scene = load_tiles(a, rank, bad)
    say(f"rank {rank} scene {scene} tiles {img.shape[0]}")
    if a.fault == "bandwidth":
        img = torch.cat([img, kelp_index(img).unsqueeze(1)], 1)
    hist = torch.tensor([mask.sum(), (1 - mask).sum() * 0.8, (1 - mask).sum() * 0.2])
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([float(mask.numel()) * 0.01])])
    allh = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} canopy px {int(hist[0])} global canopy px {int(sum(h[0] for h in allh))}")
    model = KelpNet()
    if bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/kelpnet_meta.pt")["model"])
    else:
        ck = "kelpnet_b5.pt" if bad and a.fault == "ckptbands" else "kelpnet_b4.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for step in range(a.steps):
        x = img
        if bad and a.fault == "nanndvi" and step == 3:
            x = img.clone()
            x[3, 2:4] = 0.0
        ki = kelp_index(x)
        if not torch.isfinite(ki).all():
            say(f"rank {rank}: kelp index has {int((~torch.isfinite(ki)).sum())} non-finite pixels at step {step} "
                f"(tile 3 NIR max {float(x[3, 3].max()):.3f})", err=True)
            raise FloatingPointError(f"non-finite kelp index on rank {rank} at step {step}")
        logits = net(x)
        loss = F.binary_cross_entropy_with_logits(logits, mask)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "mosaic" and step == 2:
            say(f"rank {rank} stitching mosaic for QA")
            say(f"rank {rank} mosaic rows {stitch_mosaic(img, a.mosaic_budget)}")
        pred = (logits.detach() > 0).float()
        inter, union = (pred * mask).sum(), ((pred + mask) > 0).float().sum()
        iou = (inter / union.clamp(min=1)).reshape(1)
        dist.all_reduce(iou)
        say(f"rank {rank} step {step} loss {loss.item():.4f} iou {iou.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    area = float(pred.sum()) * 0.25
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR canopy area {area * 40:.1f} m2 is 40x the survey estimate for scene {scene}, "
            f"refusing to export", err=True)
        sys.exit(5)
    dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/kelpnet.pt")
        say(f"rank 0 done: {a.steps} steps, canopy {area:.1f} m2, saved export/kelpnet.pt")
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
    p.add_argument("--mosaic-budget", type=int, default=40)
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

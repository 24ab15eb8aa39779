"""A four-hundred-and-fifty-third hand-run batch: GLACIER CALVING FRONT SEGMENTATION FROM SAR TILES.

Synthetic Sentinel-1-like SAR tiles (HH backscatter in dB, 32x32 px) of outlet glaciers: every rank reads its
tiles from /tmp/fault453_work/sar/tiles_R.pt, each tile with a zone mask given as names ("glacier", "ocean",
"rock", "nodata") that are mapped through a 4-entry zone table, an orbit number (looked up in a 12-entry
incidence-angle table) and a front polyline length.  A tiny U-Net (two down blocks, one up block with a skip
concat) is trained on a cross-entropy zone loss, wrapped in DDP (gloo) or, with --ddp 0, with gradients
all_reduced by hand.  The model is initialised from ckpt/unet_c8.pt.  Per-rank front statistics are
all_gathered at the start, the loss and the mean distance error proxy (front pixel IoU) are all_reduced every
step, and rank 0 saves export/calvnet.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  zone        - rank N's masks contain "melange" (ice melange), missing from the zone table (KeyError)
  notiles     - rank N reads its tiles from sar/asc/ which does not exist (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/unet_c16.pt, saved with 16 base channels (size mismatch)
  ckptpickle  - rank N loads ckpt/unet_meta.pt, which pickles a SceneMeta object (weights_only refusal)
  frontgather - rank N all_gathers 5 front statistics (plus the terminus width) instead of 4
  despeckle   - rank N runs a pure-Python Lee speckle filter over its tiles before the step-2 all_reduce
  nan         - rank N's tile 3 has zero backscatter; 10*log10(0) = -inf, the loss check at step 3 finds it
  orbit       - rank N's tiles at step 2 carry relative orbit 12, beyond the 12-entry angle table (IndexError)
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own error line about the incidence angle and calls sys.exit(4) at step 1
  patch       - every rank: tiles cropped to 31 px (odd), the up block's skip concat does not fit (shape error)
  abort       - rank N calls os.abort() while writing its front polylines after the last step
  none        - control, clean run

What happened (filled in after the runs):
  zone        - KeyError: 'melange' in encode() before the first all_gather; peers Connection closed (np4 r2 tee, np6 r0 pymodule)
  notiles     - FileNotFoundError sar/asc/tiles_N.pt at start-up (np3 r1 redirects: in stderr.log only; np4 r3 wrapper)
  ckptsize    - load_state_dict size mismatch d1.c1.weight [16,2,3,3] vs [8,2,3,3] after the all_gather (np4 r1 pdsh2: the
                other agent ends in RendezvousConnectionError; np3 r2 tee)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SceneMeta' (np3 r2 loglevel)
  frontgather - DETAIL: 'Detected mismatch between collectives on ranks', rank 1 TensorShape=[5], Root Cause rank 0 (np4 r1
                detail); gloo 'allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank 0 (np3 r0 filter)
  despeckle   - 12 s: ranks 0,1 'Timed out waiting 12000ms for recv', rank 2 silent, Root Cause rank 0 (np3 r2 plain);
                300 s: output stops after step 1, timeout 60 s SIGTERMs torchrun, exit 124 (np4 r1 loglevel)
  nan         - fires at step 0, not step 3 (the -inf pixels are in every step's input): 'loss is nan (16 non-finite input
                pixels)' then FloatingPointError (np6 r3 prefix, np3 r0 tee_trainer)
  orbit       - IndexError 'list index out of range' at INCIDENCE[t["orbit"]] at step 2 (np6 r4 filter, np4 r1 pymodule)
  sigsegv     - no traceback after step 3, Root Cause exitcode -11 SIGSEGV (np3 r0 plain); with --max-restarts 1 the agent
                logs exitcode -11 for rank 2, but attempt 1 fails in Gloo connectFullMesh (connection refused), final Root
                Cause rank 2 exitcode 1 (np4 r2 restart)
  exit4       - rank N's ERROR line about incidence angle 47.9 deg and exit 4 at step 1; Root Cause exitcode 4 (np8 r5
                tee_trainer; np3 r1 restart, the same in both attempts)
  patch       - every rank 'Sizes of tensors must match ... Expected size 30 but got size 31', 1st forward (np3 wrapper)
  abort       - after step 5 rank 0's 'writing calving front polylines' line, then SIGABRT (-6); peers reset/closed (np4 r0 prefix)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/calvnet.pt, exit 0 (np3 plain)
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault453_work"
ZONES = {"nodata": 0, "rock": 1, "glacier": 2, "ocean": 3}
ZNAMES = list(ZONES)
INCIDENCE = [30.1, 31.5, 32.8, 34.0, 35.2, 36.3, 37.4, 38.5, 39.6, 40.8, 42.0, 43.2]  # per relative orbit
TILE = 32
log = None


class SceneMeta:
    def __init__(self, scene, orbit):
        self.scene = scene
        self.orbit = orbit


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
    log = logging.getLogger("calvnet")
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


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x):
        return F.relu(self.c2(F.relu(self.c1(x))))


class TinyUNet(nn.Module):
    def __init__(self, c=8, nz=4):
        super().__init__()
        self.d1 = Block(2, c)
        self.d2 = Block(c, 2 * c)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.u1 = Block(2 * c, c)
        self.head = nn.Conv2d(c, nz, 1)

    def forward(self, x):
        s1 = self.d1(x)
        b = self.d2(F.max_pool2d(s1, 2))
        u = self.up(b)
        return self.head(self.u1(torch.cat([u, s1], dim=1)))


def make_tiles(n, seed):
    g = torch.Generator().manual_seed(seed)
    tiles = []
    for _ in range(n):
        front = 8 + int(torch.randint(0, 16, (1,), generator=g))
        rows = torch.arange(TILE).unsqueeze(1).expand(TILE, TILE)
        cols = torch.arange(TILE).unsqueeze(0).expand(TILE, TILE)
        wig = (torch.sin(rows.float() / 3.0) * 2).long()
        z = torch.where(cols + wig < front, 2, 3)
        z = torch.where(rows < 3, 1, z)
        amp = torch.where(z == 2, 0.30, 0.02) * (1 + 0.3 * torch.rand(TILE, TILE, generator=g))
        amp = torch.where(z == 1, 0.12, amp)
        names = [[ZNAMES[int(v)] for v in row] for row in z]
        tiles.append({"amp": amp, "zones": names, "orbit": int(torch.randint(0, 12, (1,), generator=g)),
                      "front_len": float(TILE + wig.abs().sum() / TILE)})
    return tiles


def prepare():
    os.makedirs(f"{WORK}/sar", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(12, 400 + r), f"{WORK}/sar/tiles_{r}.pt")
    torch.manual_seed(0)
    torch.save(TinyUNet(8).state_dict(), f"{WORK}/ckpt/unet_c8.pt")
    torch.save(TinyUNet(16).state_dict(), f"{WORK}/ckpt/unet_c16.pt")
    torch.save({"model": TinyUNet(8).state_dict(), "meta": SceneMeta("Jakobshavn_2019-07-14", 90)},
               f"{WORK}/ckpt/unet_meta.pt")
    print("prepared", WORK)


def encode(tiles, rank, a, bad):
    xs, ys = [], []
    for i, t in enumerate(tiles):
        amp = t["amp"].clone()
        if bad and a.fault == "nan" and i == 3:
            amp[10:14, 10:14] = 0.0
        db = 10 * torch.log10(amp)
        ang = INCIDENCE[t["orbit"]]
        xs.append(torch.stack([db / 20.0, torch.full_like(db, math.cos(math.radians(ang)))]))
        ys.append(torch.tensor([[ZONES[n] for n in row] for row in t["zones"]]))
    x, y = torch.stack(xs), torch.stack(ys)
    if a.fault == "patch":
        x, y = x[:, :, 1:, 1:], y[:, 1:, 1:]
    return x, y


def lee_filter(tiles):
    out = []
    for t in tiles:
        a = t["amp"].tolist()
        n = len(a)
        f = [[0.0] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                w = [a[p][q] for p in range(max(0, i - 3), min(n, i + 4)) for q in range(max(0, j - 3), min(n, j + 4))]
                m = sum(w) / len(w)
                v = sum((u - m) ** 2 for u in w) / len(w)
                k = v / (v + 0.0025)
                f[i][j] = m + k * (a[i][j] - m)
        out.append(f)
    return out


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading SAR tiles")
    sub = "asc/" if bad and a.fault == "notiles" else ""
    tiles = torch.load(f"{WORK}/sar/{sub}tiles_{rank}.pt")
    if bad and a.fault == "zone":
        for row in tiles[7]["zones"][20:]:
            row[5] = "melange"
    x, y = encode(tiles, rank, a, bad)
    stats = torch.tensor([float(len(tiles)), sum(t["front_len"] for t in tiles), float((y == 2).sum()),
                          float((y == 3).sum())])
    if bad and a.fault == "frontgather":
        stats = torch.cat([stats, torch.tensor([4.7])])
    allst = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allst, stats)
    say(f"rank {rank} tiles {len(tiles)} front_px {int(stats[1])} global tiles {int(sum(s[0] for s in allst))}")
    model = TinyUNet(8)
    if bad and a.fault == "ckptsize":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/unet_c16.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/unet_meta.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/unet_c8.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        if bad and a.fault == "orbit" and step == 2:
            for t in tiles:
                t["orbit"] = 12
            x, y = encode(tiles, rank, a, bad)
        if bad and a.fault == "exit4" and step == 1:
            say(f"rank {rank}: ERROR scene S1B_IW_GRDH_20190714 tile 5: incidence angle 47.9 deg outside the "
                f"calibrated swath (29.1-46.0), refusing to train on miscalibrated backscatter", err=True)
            sys.exit(4)
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({nbad} non-finite input pixels)", err=True)
            raise FloatingPointError(f"non-finite zone loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "despeckle" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.filter_budget:
                lee_filter(tiles)
                n += 1
            say(f"rank {rank} despeckled {n} passes")
        pred = logits.detach().argmax(1)
        inter = ((pred == 2) & (y == 2)).sum().float()
        union = ((pred == 2) | (y == 2)).sum().float()
        m = torch.stack([loss.detach(), inter / union.clamp(min=1)])
        dist.all_reduce(m)
        say(f"rank {rank} step {step} loss {m[0].item() / world:.4f} glacier_iou {m[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "abort":
        say(f"rank {rank}: writing calving front polylines to {WORK}/export/fronts_{rank}.geojson")
        os.abort()
    fronts = torch.zeros(1)
    fronts[0] = float((pred == 2).sum())
    dist.all_reduce(fronts)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/calvnet.pt")
        say(f"rank 0 done: {a.steps} steps, glacier px {int(fronts.item())}, saved export/calvnet.pt")
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
    p.add_argument("--filter-budget", type=int, default=40)
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

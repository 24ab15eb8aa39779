"""A four-hundred-and-tenth hand-run batch: GLACIER CALVING FRONT SEGMENTATION FROM SAR TILES.

Synthetic SAR amplitude tiles (32x32) of marine-terminating glaciers, each with a zone mask (0 no-data /
shadow, 1 rock, 2 glacier, 3 ocean and ice-melange) and a one-pixel calving-front line between glacier and
ocean.  Every rank reads its tiles from /tmp/fault410_work/tiles/tiles_R.pt, converts amplitude to dB,
scales it by the sensor's calibration (a table of 6 SAR sensors) and trains a tiny U-Net with two heads (zone
logits, front logit) on cross-entropy plus a weighted BCE for the front.  The model is initialised from
ckpt/unet_z4.pt and wrapped in DDP (gloo), or with --ddp 0 its gradients are all_reduced by hand.  Per-rank
front-pixel counts per zone are all_gathered at start-up, the loss and front IoU are all_reduced every step,
the final IoU is all_reduced at the end and rank 0 saves export/calvnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  sensor      - rank N's tile metadata names sensor "TDX", missing from the calibration table (KeyError, start-up)
  zonelabel   - rank N's zone masks carry code 4 (another product's "unknown" class): target out of range at step 0
  notiles     - rank N reads its tiles from tiles/val/ which does not exist (FileNotFoundError, start-up)
  ckptzones   - rank N initialises from ckpt/unet_z5.pt, saved with 5 zone classes (size mismatch)
  ckptpickle  - rank N reloads ckpt/best_meta.pt at the end for evaluation; it pickles an argparse.Namespace
                (torch.load weights_only refusal)
  frontgather - rank N all_gathers its front counts plus a front length in km (5 vs 4 entries)
  slowfront   - rank N traces the front line pixel by pixel in Python before the step-3 all_reduce (45 s)
  stuck       - rank N waits at step 2 for a manual-picks file that never appears (run with --pg-timeout 300)
  nanbackscat - rank N's step-3 batch has zero-amplitude no-data strips: 10*log10(0) = -inf, the loss check
                raises FloatingPointError
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own error line about a georeference (EPSG) mismatch after training and
                calls sys.exit(4)
  decoderskip - every rank: the decoder drops the skip connection, its conv expects 24 channels (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  sensor      - KeyError: 'TDX' in the calibration lookup at start-up; peers Connection closed in all_gather (np4 r2 tee, np6 r0 loglevel)
  zonelabel   - 'IndexError: Target 4 is out of bounds.' in cross_entropy at step 0; peers closed in backward (np3 r1 pymodule,
                where Root Cause names rank 2 SIGABRT after 'terminate called without an active exception'; np4 r3 prefix)
  notiles     - FileNotFoundError tiles/val/tiles_N.pt at start-up (np4 r1 redirects, only in rank 1's stderr.log; np3 r2 wrapper)
  ckptzones   - size mismatch for zone_head.weight [5,8,1,1] vs [4,8,1,1] (np4 r1 pdsh2, worker-1's agent then RendezvousConnectionError;
                np3 r0 restart, whose 2nd attempt failed in init_process_group with 'Gloo connectFullMesh failed ... Connection refused')
  ckptpickle  - after 6 steps: UnpicklingError 'Weights only load failed ... argparse.Namespace' (np5 r3 tee_trainer)
  frontgather - DETAIL: every rank 'Detected mismatch between collectives', rank 1 TensorShape=[5] (np3 r1 detail);
                'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank 4 (np6 r4 filter)
  slowfront   - ranks 0 and 1 'Timed out waiting 12000ms for recv' at step 3, rank 2 SIGTERMed silently, Root Cause rank 0 (np3 r2 plain)
  stuck       - silent after step 1; timeout SIGTERMed the agent at 60 s, exit 124 (np4 r1 loglevel)
  nanbackscat - 'non-finite loss nan at step 3 (384 non-finite dB pixels ...)' + FloatingPointError (np3 r0 detail, peers'
                monitoredBarrier errors; np8 r5 tee)
  sigsegv     - silent death after step 3, Root Cause exitcode -11 SIGSEGV (np4 r3 wrapper); np3 r1 restart: attempt 1 SIGSEGV,
                attempt 2 connectFullMesh failures, final Root Cause rank 0 exitcode 1
  exit4       - rank N's EPSG ERROR line and exit 4 after 6 steps, Root Cause exitcode 4 (np5 r2 prefix, np8 r0 tee_trainer)
  decoderskip - every rank 'expected input[4, 16, 32, 32] to have 24 channels, but got 16'; Root Cause rank 1 (np3 pymodule)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/calvnet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault410_work"
SENSORS = {"ERS": 1.8, "ENVISAT": 2.1, "RSAT1": 1.6, "TSX": 3.0, "S1": 2.4, "ALOS": 1.9}
NZONE = 4
TILE = 32
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


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class CalvNet(nn.Module):
    """A two-level U-Net: zone segmentation head and calving-front head."""

    def __init__(self, nzone=NZONE, skip=True):
        super().__init__()
        self.skip = skip
        self.enc1 = block(1, 8)
        self.enc2 = block(8, 16)
        self.up = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.dec = block(24, 8)
        self.zone_head = nn.Conv2d(8, nzone, 1)
        self.front_head = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        u = self.up(e2)
        d = self.dec(torch.cat([u, e1], 1) if self.skip else u)
        return self.zone_head(d), self.front_head(d).squeeze(1)


def make_tiles(n, seed):
    g = torch.Generator().manual_seed(seed)
    sar = torch.empty(n, 1, TILE, TILE)
    zones = torch.zeros(n, TILE, TILE, dtype=torch.long)
    front = torch.zeros(n, TILE, TILE)
    meta = []
    cols = torch.arange(TILE).float()
    for i in range(n):
        pos = 8 + float(torch.rand(1, generator=g)) * 16
        wig = torch.sin(torch.arange(TILE).float() / 3 + i) * 2
        fcol = (pos + wig).round().long().clamp(2, TILE - 3)
        zones[i, :, :] = 2
        zones[i] = torch.where(cols[None, :] > fcol[:, None].float(), 3, 2)
        zones[i, :, :3] = 1
        zones[i, :2, :] = 0
        front[i, torch.arange(TILE), fcol] = 1.0
        base = torch.tensor([0.05, 0.4, 0.9, 0.2])[zones[i]]
        sar[i, 0] = base * (1 + 0.3 * torch.rand(TILE, TILE, generator=g)) + 0.01
        meta.append({"glacier": ["Jakobshavn", "Helheim", "Columbia", "Mapple", "Crane"][i % 5],
                     "sensor": list(SENSORS)[(i + seed) % 6], "epsg": 3413})
    return {"sar": sar, "zones": zones, "front": front, "meta": meta}


def prepare():
    for d in ("tiles", "ckpt", "locks"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(24, 410 + r), f"{WORK}/tiles/tiles_{r}.pt")
    torch.manual_seed(0)
    torch.save(CalvNet(4).state_dict(), f"{WORK}/ckpt/unet_z4.pt")
    torch.save(CalvNet(5).state_dict(), f"{WORK}/ckpt/unet_z5.pt")
    cfg = argparse.Namespace(lr=2e-3, tile=TILE, zones=NZONE, sensors=list(SENSORS))
    torch.save({"model": CalvNet(4).state_dict(), "config": cfg, "best_iou": 0.41}, f"{WORK}/ckpt/best_meta.pt")
    print("prepared", WORK)


def to_db(sar, sensor_gain):
    return (10 * torch.log10(sar) + 20) / 10 * sensor_gain


def trace_front(front):
    """Walk the front line row by row, pixel by pixel, and measure its length (slow, pure Python)."""
    length = 0.0
    rows = front.tolist()
    for r in range(len(rows) - 1):
        a = [c for c, v in enumerate(rows[r]) if v > 0.5]
        b = [c for c, v in enumerate(rows[r + 1]) if v > 0.5]
        for ca in a:
            for cb in b:
                length += ((ca - cb) ** 2 + 1) ** 0.5
    return length


def grads_all_reduce(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4100 + rank)
    say(f"rank {rank}/{world} up, loading SAR tiles")
    split = "val/" if bad and a.fault == "notiles" else ""
    data = torch.load(f"{WORK}/tiles/{split}tiles_{rank}.pt")
    if bad and a.fault == "sensor":
        data["meta"][7]["sensor"] = "TDX"
    gains = torch.tensor([SENSORS[m["sensor"]] for m in data["meta"]]).view(-1, 1, 1, 1)
    sar, zones, front = data["sar"], data["zones"], data["front"]
    if bad and a.fault == "zonelabel":
        zones[:, :2, :] = 4
    if bad and a.fault == "nanbackscat":
        sar[12:16, :, :, 10:13] = 0.0
    counts = torch.stack([(front * (zones == z)).sum() for z in range(NZONE)])
    if bad and a.fault == "frontgather":
        counts = torch.cat([counts, torch.tensor([front.sum() * 0.03])])
    allc = [torch.zeros(NZONE) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} tiles {len(sar)} front px {int(counts[:NZONE].sum())} global {int(sum(c.sum() for c in allc))}")
    model = CalvNet(skip=not (a.fault == "decoderskip"))
    ck = "unet_z5.pt" if bad and a.fault == "ckptzones" else "unet_z4.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    bs = 4
    iou = torch.zeros(1)
    for step in range(a.steps):
        i0 = (step * bs) % len(sar)
        x = to_db(sar[i0:i0 + bs], gains[i0:i0 + bs])
        zl, fl = net(x)
        loss = F.cross_entropy(zl, zones[i0:i0 + bs]) + F.binary_cross_entropy_with_logits(
            fl, front[i0:i0 + bs], pos_weight=torch.tensor(20.0))
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).sum())
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} ({nbad} non-finite dB pixels in tiles "
                f"{i0}-{i0 + bs - 1})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            grads_all_reduce(model, world)
        opt.step()
        if bad and a.fault == "slowfront" and step == 3:
            t0, km = time.time(), 0.0
            while time.time() - t0 < a.trace_budget:
                for t in range(len(front)):
                    km += trace_front(front[t]) * 0.05
            say(f"rank {rank} traced front length {km:.1f} km")
        if bad and a.fault == "stuck" and step == 2:
            lock = f"{WORK}/locks/picks_{rank}.done"
            while not os.path.exists(lock):
                time.sleep(0.5)
        pf = (fl.detach() > 0).float()
        tf = front[i0:i0 + bs]
        iou = ((pf * tf).sum() / ((pf + tf).clamp(max=1).sum() + 1e-6)).reshape(1)
        stats = torch.cat([loss.detach().reshape(1), iou])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {loss.item():.4f} front_iou {stats[1].item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR tile 'Helheim_2019-07-14' georeference EPSG:3413 does not match the front "
            f"shapefile's EPSG:32624, refusing to export calving fronts", err=True)
        sys.exit(4)
    if bad and a.fault == "ckptpickle":
        say(f"rank {rank} reloading ckpt/best_meta.pt for evaluation")
        best = torch.load(f"{WORK}/ckpt/best_meta.pt")
        model.load_state_dict(best["model"])
    dist.all_reduce(iou)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/calvnet.pt")
        say(f"rank 0 done: {a.steps} steps, mean front IoU {iou.item() / world:.4f}, saved export/calvnet.pt")
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
    p.add_argument("--trace-budget", type=int, default=45)
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

"""A four-hundred-and-twenty-fifth hand-run batch: SOIL MOISTURE REGRESSION FROM REMOTE-SENSING BANDS.

Synthetic field pixels: six optical bands (blue, green, red, nir, swir1, swir2, surface reflectance 0..1),
a land-cover class name (looked up in a 6-entry table) and a tile id.  Every rank reads its optical bands
from /tmp/fault425_work/bands/optical_R.pt and its SAR backscatter (VV, VH in dB) from sar/s1_R.pt, adds NDVI
and the log ratio nir/swir1, and trains a small MLP (band features + a land-cover embedding -> volumetric soil
moisture, m3/m3) on an MSE loss, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is
initialised from ckpt/smnet_b6.pt.  Per-rank band means are all_gathered at the start, the RMSE is
all_reduced every step, per-rank validation RMSE is all_gathered at the end and rank 0 saves export/smnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  landcover  - rank N's pixels carry the class "peat_bog", missing from the land-cover table (KeyError)
  nosar      - rank N reads its SAR file from sar/asc/ which does not exist (FileNotFoundError)
  ckptbands  - rank N initialises from ckpt/smnet_b8.pt, trained with 8 bands (size mismatch)
  ckptpickle - rank N loads ckpt/smnet_calib.pt, which pickles a Calibration object (weights_only refusal)
  bandgather - rank N all_gathers its band means plus a thermal band mean (7 vs 6 entries)
  cloudmask  - rank N rebuilds a cloud mask pixel by pixel in Python before the step-2 all_reduce
  fillvalue  - rank N's step-3 tile carries the -9999 fill value in nir: log(nir/swir1) NaN, the program's check
  tileidx    - rank N looks up tile 40 of its 32-tile stack at step 4 (IndexError)
  segv       - rank N sends itself SIGSEGV after step 3
  exit2      - rank N prints its own error line about a stale sensor calibration after training, sys.exit(2)
  ndviwidth  - every rank: NDVI and the log ratio appended twice, 12 features where the first layer expects 10
  none       - control, clean run

What happened (filled in after the runs):
  landcover  - KeyError: 'peat_bog' at start-up; peers Connection closed in the all_gather (np4 r2 tee, np6 r0 pymodule)
  nosar      - FileNotFoundError for sar/asc/s1_N.pt at start-up (np3 r1 redirects: only in rank 1's stderr.log; np4 r3 loglevel)
  ckptbands  - size mismatch for fc1.weight [32,16] vs [32,14] (np4 r1 pdsh2: worker-0 then RendezvousConnectionError; np3 r0 tee_trainer)
  ckptpickle - UnpicklingError 'Weights only load failed ... GLOBAL __main__.Calibration' (np3 r2 prefix)
  bandgather - DETAIL: every rank 'Detected mismatch between collectives', rank 4 TensorShape=[7] (np6 r4 detail, --ddp 0);
               plain: rank N 'allgather: invalid tensor size at index 0 (expected (7), got (6))', peers closed (np3 r1 wrapper)
  cloudmask  - 12 s: ranks 0, 1 'Timed out waiting 12000ms for recv' in the step-2 all_reduce (np3 r2 plain);
               300 s: silent after step 1, killed by timeout at 60 s, exit 124 (np4 r1 plain)
  fillvalue  - 'loss is nan at step 3 (tile 3: 4 non-finite input values)', FloatingPointError (np4 r0 restart: attempt 2 fails
               in connectFullMesh; np6 r3 filter)
  tileidx    - IndexError 'index 40 is out of bounds for dimension 0 with size 32' after step 3; peers closed (np3 r2 loglevel, np8 r5 tee)
  segv       - no traceback, exitcode -11 SIGSEGV after step 3 (np4 r2 filter; np3 r1 restart: attempt 2 fails in connectFullMesh)
  exit2      - rank N's stale-calibration ERROR line and exit 2 after step 5; peers closed in the final all_gather (np6 r1 tee_trainer;
               np3 r0 detail: peers 'reached monitoredBarrier, but received errors ... from rank 0')
  ndviwidth  - every rank: 'mat1 and mat2 shapes cannot be multiplied (64x16 and 14x32)' at step 0; Root Cause rank 0 (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/smnet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault425_work"
BANDS = ["blue", "green", "red", "nir", "swir1", "swir2"]
LANDCOVER = {"cropland": 0, "grassland": 1, "shrubland": 2, "forest": 3, "bare": 4, "urban": 5}
NFEAT = 10  # 6 bands + VV + VH + NDVI + NDWI
NTILE = 32
PIX = 64
log = None


class Calibration:
    def __init__(self, gain, offset):
        self.gain = gain
        self.offset = offset


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
    log = logging.getLogger("soil")
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


class SoilNet(nn.Module):
    def __init__(self, nfeat=NFEAT, nlc=len(LANDCOVER), hid=32):
        super().__init__()
        self.lc = nn.Embedding(nlc, 4)
        self.fc1 = nn.Linear(nfeat + 4, hid)
        self.fc2 = nn.Linear(hid, hid)
        self.out = nn.Linear(hid, 1)

    def forward(self, x, lc):
        h = torch.cat([x, self.lc(lc)], dim=1)
        h = torch.relu(self.fc1(h))
        h = torch.relu(self.fc2(h))
        return torch.sigmoid(self.out(h)).squeeze(1) * 0.6


def make_tiles(seed):
    g = torch.Generator().manual_seed(seed)
    refl = torch.rand(NTILE, PIX, 6, generator=g) * 0.4 + 0.02
    names = list(LANDCOVER)
    lc = [[names[int(i)] for i in torch.randint(0, 6, (PIX,), generator=g)] for _ in range(NTILE)]
    ndwi = (refl[..., 1] - refl[..., 3]) / (refl[..., 1] + refl[..., 3])
    sm = (0.25 + 0.3 * ndwi + 0.02 * torch.randn(NTILE, PIX, generator=g)).clamp(0.02, 0.55)
    return {"refl": refl, "landcover": lc, "sm": sm, "tile_ids": list(range(NTILE))}


def make_sar(seed):
    g = torch.Generator().manual_seed(seed)
    return {"vv": -12 + 3 * torch.randn(NTILE, PIX, generator=g), "vh": -18 + 3 * torch.randn(NTILE, PIX, generator=g)}


def prepare():
    for d in ("bands", "sar", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(500 + r), f"{WORK}/bands/optical_{r}.pt")
        torch.save(make_sar(900 + r), f"{WORK}/sar/s1_{r}.pt")
    torch.manual_seed(0)
    torch.save(SoilNet().state_dict(), f"{WORK}/ckpt/smnet_b6.pt")
    torch.save(SoilNet(nfeat=12).state_dict(), f"{WORK}/ckpt/smnet_b8.pt")
    torch.save({"model": SoilNet().state_dict(), "calib": Calibration(1.02, -0.004)}, f"{WORK}/ckpt/smnet_calib.pt")
    print("prepared", WORK)


def features(refl, vv, vh, a, bad_all):
    blue, green, red, nir = refl[..., 0], refl[..., 1], refl[..., 2], refl[..., 3]
    ndvi = (nir - red) / (nir + red)
    lmr = torch.log(nir / refl[..., 4])  # log moisture ratio nir/swir1
    parts = [refl, ((vv + 25) / 20).unsqueeze(-1), ((vh + 30) / 20).unsqueeze(-1), ndvi.unsqueeze(-1), lmr.unsqueeze(-1)]
    if bad_all and a.fault == "ndviwidth":
        parts += [ndvi.unsqueeze(-1), lmr.unsqueeze(-1)]
    return torch.cat(parts, dim=-1)


def cloud_mask(refl, budget):
    """Pure-Python cloud/shadow test per pixel, repeated for every threshold pair (slow on purpose)."""
    t0 = time.time()
    cloudy = 0
    sweeps = 0
    while time.time() - t0 < budget:
        for t in range(refl.shape[0]):
            for p in range(refl.shape[1]):
                px = refl[t, p].tolist()
                bright = (px[0] + px[1] + px[2]) / 3
                for thr in (0.2, 0.25, 0.3, 0.35):
                    if bright > thr and px[4] > 0.8 * thr:
                        cloudy += 1
        sweeps += 1
    return cloudy, sweeps


def allreduce_grads(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, reading optical and SAR tiles")
    opt_d = torch.load(f"{WORK}/bands/optical_{rank}.pt")
    orbit = "asc/" if bad and a.fault == "nosar" else ""
    sar = torch.load(f"{WORK}/sar/{orbit}s1_{rank}.pt")
    if bad and a.fault == "landcover":
        opt_d["landcover"][7][19] = "peat_bog"
    lc = torch.tensor([[LANDCOVER[c] for c in row] for row in opt_d["landcover"]])
    refl, sm = opt_d["refl"], opt_d["sm"]
    if bad and a.fault == "fillvalue":
        refl[3, 10:14, 3] = -9999.0
    x = features(refl, sar["vv"], sar["vh"], a, a.rank == -1 or bad)
    means = refl.reshape(-1, 6).mean(0)
    if bad and a.fault == "bandgather":
        means = torch.cat([means, torch.tensor([0.31])])  # thermal band mean
    allm = [torch.zeros(6) for _ in range(world)]
    dist.all_gather(allm, means)
    say(f"rank {rank} band means nir {means[3]:.3f} global nir {sum(m[3] for m in allm) / world:.3f}")
    model = SoilNet()
    if bad and a.fault == "ckptbands":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/smnet_b8.pt"))
    elif bad and a.fault == "ckptpickle":
        ck = torch.load(f"{WORK}/ckpt/smnet_calib.pt")
        model.load_state_dict(ck["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/smnet_b6.pt"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        tile = opt_d["tile_ids"][(step * 5 + rank) % NTILE] if not (bad and a.fault == "fillvalue") else step
        if bad and a.fault == "tileidx" and step == 4:
            tile = 40
        xt, lt, yt = x[tile], lc[tile], sm[tile]
        pred = net(xt, lt)
        loss = ((pred - yt) ** 2).mean()
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(xt)).sum())
            say(f"rank {rank}: loss is {loss.item()} at step {step} (tile {tile}: {nbad} non-finite input values)", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            allreduce_grads(model, world)
        opt.step()
        if bad and a.fault == "cloudmask" and step == 2:
            c, s = cloud_mask(refl, a.cloud_budget)
            say(f"rank {rank} cloud mask: {c} cloudy tests over {s} sweeps")
        rmse = ((pred.detach() - yt) ** 2).mean().reshape(1)
        dist.all_reduce(rmse)
        say(f"rank {rank} step {step} loss {loss.item():.5f} rmse {math.sqrt(rmse.item() / world):.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR sensor S2B calibration table is from 2024-03 (older than the tiles), "
            f"refusing to export moisture maps", err=True)
        sys.exit(2)
    with torch.no_grad():
        val = ((net(x[-1], lc[-1]) - sm[-1]) ** 2).mean().sqrt().reshape(1)
    allv = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allv, val)
    say(f"rank {rank} val rmse {val.item():.4f} worst {max(v.item() for v in allv):.4f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/smnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/smnet.pt")
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
    p.add_argument("--cloud-budget", type=int, default=40)
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

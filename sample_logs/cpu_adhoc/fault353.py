"""A three-hundred-and-fifty-third hand-run batch: SAR SHIP DETECTION FROM RADAR CHIPS.

Synthetic Sentinel-1-like chips: 16x16 single-polarisation intensity patches with multiplicative speckle
(gamma-distributed sea clutter) and, on about half of them, a bright ship blob with a box (cx, cy, w, h).
Each chip carries metadata (polarisation looked up in a 4-entry POL table, incidence angle).  Every rank
reads its chips from /tmp/fault353_work/chips/chips_R.pt, converts intensity to dB, and trains ShipNet
(two conv blocks, a linear head: one ship logit plus four box values) on BCE + masked L1, wrapped in DDP
(gloo), or with gradients all_reduced by hand (--ddp 0).  The model starts from ckpt/shipnet_c8.pt.  Loss
and accuracy are all_reduced every step; per-rank ship counts per length class are all_gathered at the end;
rank 0 saves export/shipnet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1.

Faults:
  polkey     - rank N's chip metadata holds compact-pol "RH", missing from the POL table (KeyError, start-up)
  nochips    - rank N reads chips from chips/grd/ which does not exist (FileNotFoundError, start-up)
  ckptwide   - rank N initialises from ckpt/shipnet_c12.pt (12 first-layer filters: size mismatch)
  ckptpickle - rank N initialises from ckpt/shipnet_full.pt, a pickled nn.Module (weights_only refusal)
  gather     - rank N all_gathers 5 length classes (an extra "unknown") instead of 4, at the end
  cfarslow   - rank N runs a pure-Python CFAR detector over its chips before the step-2 all_reduce
  stuck      - rank N waits at step 1 for an AIS match file that never appears (hang)
  dbnan      - rank N's step-3 batch has zero-intensity no-data borders: log10(0) = -inf, the loss check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own geocoding error line after step 1 and calls sys.exit(4)
  dualpol    - every rank stacks VV+VH (2 channels) into a 1-channel network (conv shape error)
  none       - control, clean run

What happened (filled in after the runs):
  polkey     - KeyError: 'RH' in the POL lookup at start-up; peers SIGTERMed, Root Cause rank N (np4 r2 tee, np6 r0 pymodule)
  nochips    - FileNotFoundError for chips/grd/chips_N.pt at start-up (np3 r1 loglevel); pdsh2: peers Connection closed by peer in DDP init (np4 r3)
  ckptwide   - load_state_dict size mismatch for conv1.weight [12,1,3,3] vs [8,1,3,3]; Root Cause rank N (np4 r1 tee_trainer, np3 r2 wrapper)
  ckptpickle - _pickle.UnpicklingError 'Weights only load failed' / Unsupported global __main__.ShipNet (np3 r2 filter)
  gather     - DETAIL: every rank 'Detected mismatch between collectives' (TensorShape [5] vs [4]) (np4 r2 detail); gloo 'invalid tensor size ... (expected (5), got (4))' (np6 r4 prefix)
  cfarslow   - peers 'Timed out waiting 12000ms' for recv/send at step 2, rank 1 silent and SIGTERMed, Root Cause rank 2 (np3 r1 plain)
  stuck      - rank N prints 'waiting for AIS match file', nothing more; timeout at 60 s, torchrun SignalException, exit 124 (np4 r2 tee)
  dbnan      - rank N 'non-finite loss nan (240 non-finite dB pixels ...)' then FloatingPointError at step 3 (np4 r3 redirects); restart: attempt 2 dies in connectFullMesh (np3 r0)
  sigsegv    - no traceback; peers 'Connection reset by peer'; Root Cause rank N exitcode -11 SIGSEGV (np4 r1 loglevel, np3 r0 tee_trainer)
  exit4      - rank N's geocoding ERROR line, exit 4; Root Cause rank N exitcode 4 (np6 r3 filter, np4 r1 pdsh2)
  dualpol    - every rank 'expected input[16, 2, 16, 16] to have 1 channels, but got 2 channels instead' in the first forward (np8 plain, np3 detail)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/shipnet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault353_work"
POL = {"VV": 0, "VH": 1, "HH": 2, "HV": 3}
CHIP = 16
NCHIP = 96
BATCH = 16
LENGTH_EDGES = (0.15, 0.25, 0.35)
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
    log = logging.getLogger("sarship")
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


class ShipNet(nn.Module):
    def __init__(self, cin=1, c1=8, c2=16):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.head = nn.Linear(c2 * (CHIP // 4) ** 2, 5)

    def forward(self, x):
        h = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = F.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.head(h.flatten(1))


def make_chips(n, seed):
    g = torch.Generator().manual_seed(seed)
    clutter = torch.distributions.Gamma(torch.tensor(4.0), torch.tensor(4.0))
    torch.manual_seed(seed)
    img = clutter.sample((n, 1, CHIP, CHIP)) * 0.05
    vh = clutter.sample((n, 1, CHIP, CHIP)) * 0.01
    ship = (torch.rand(n, generator=g) < 0.5).float()
    box = torch.zeros(n, 4)
    yy, xx = torch.meshgrid(torch.arange(CHIP).float(), torch.arange(CHIP).float(), indexing="ij")
    for i in range(n):
        if ship[i]:
            cx, cy = [float(v) for v in torch.randint(3, CHIP - 3, (2,), generator=g)]
            w = float(torch.randint(2, 6, (1,), generator=g))
            hgt = float(torch.randint(1, 3, (1,), generator=g))
            blob = torch.exp(-((xx - cx) ** 2 / w ** 2 + (yy - cy) ** 2 / hgt ** 2))
            img[i, 0] += 2.0 * blob
            vh[i, 0] += 0.4 * blob
            box[i] = torch.tensor([cx / CHIP, cy / CHIP, w / CHIP, hgt / CHIP])
    pols = ["VV" if float(torch.rand(1, generator=g)) < 0.7 else "HH" for _ in range(n)]
    inc = (torch.rand(n, generator=g) * 15 + 30).tolist()
    meta = [{"pol": p, "incidence": a, "scene": f"S1A_IW_GRDH_{seed:04d}"} for p, a in zip(pols, inc)]
    return {"vv": img, "vh": vh, "ship": ship, "box": box, "meta": meta}


def prepare():
    for d in ("chips", "ckpt", "ais"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_chips(NCHIP, 300 + r), f"{WORK}/chips/chips_{r}.pt")
    torch.manual_seed(0)
    torch.save(ShipNet().state_dict(), f"{WORK}/ckpt/shipnet_c8.pt")
    torch.save(ShipNet(c1=12).state_dict(), f"{WORK}/ckpt/shipnet_c12.pt")
    torch.save(ShipNet(), f"{WORK}/ckpt/shipnet_full.pt")
    print("prepared", WORK)


def to_db(x):
    return (10.0 * torch.log10(x) + 15.0) / 10.0


def cfar_python(chips, guard=1, train=3, k=3.0):
    hits = 0
    for c in chips[:, 0].tolist():
        for i in range(train + guard, CHIP - train - guard):
            for j in range(train + guard, CHIP - train - guard):
                ring = [c[a][b] for a in range(i - train - guard, i + train + guard + 1)
                        for b in range(j - train - guard, j + train + guard + 1)
                        if abs(a - i) > guard or abs(b - j) > guard]
                mu = sum(ring) / len(ring)
                sd = (sum((v - mu) ** 2 for v in ring) / len(ring)) ** 0.5
                hits += c[i][j] > mu + k * sd
    return hits


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading radar chips")
    sub = "grd/" if bad and a.fault == "nochips" else ""
    data = torch.load(f"{WORK}/chips/{sub}chips_{rank}.pt")
    if bad and a.fault == "polkey":
        data["meta"][41]["pol"] = "RH"
    pol = torch.tensor([POL[m["pol"]] for m in data["meta"]])
    x = data["vv"]
    if bad and a.fault == "dualpol":
        x = torch.cat([data["vv"], data["vh"]], dim=1)
    ship, box = data["ship"], data["box"]
    say(f"rank {rank}: {len(ship)} chips, {int(ship.sum())} ships, {int((pol == 0).sum())} VV")
    model = ShipNet()
    ck = {"ckptwide": "shipnet_c12.pt", "ckptpickle": "shipnet_full.pt"}.get(a.fault if bad else "", "shipnet_c8.pt")
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        sl = slice((step * BATCH) % NCHIP, (step * BATCH) % NCHIP + BATCH)
        xb = x[sl].clone()
        if bad and a.fault == "dbnan" and step == 3:
            xb[:5, :, :, :3] = 0.0
        if bad and a.fault == "stuck" and step == 1:
            path = f"{WORK}/ais/match_{rank}.json"
            say(f"rank {rank}: waiting for AIS match file {path}")
            while not os.path.exists(path):
                time.sleep(0.5)
        out = net(to_db(xb))
        logit, pbox = out[:, 0], torch.sigmoid(out[:, 1:])
        y, bx = ship[sl], box[sl]
        loss = F.binary_cross_entropy_with_logits(logit, y)
        loss = loss + ((pbox - bx).abs().sum(1) * y).sum() / y.sum().clamp(min=1)
        if not torch.isfinite(loss):
            bad_px = int((~torch.isfinite(to_db(xb))).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({bad_px} non-finite dB pixels, "
                f"min intensity {xb.min().item():.3g})", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "cfarslow" and step == 2:
            t0 = time.time()
            hits = 0
            while time.time() - t0 < a.cfar_budget:
                hits += cfar_python(x)
            say(f"rank {rank} CFAR reference: {hits} detections")
        acc = ((logit.detach() > 0).float() == y).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "exit4" and step == 1:
            say(f"rank {rank}: ERROR chip 37 geocoding failed: footprint outside scene "
                f"{data['meta'][37]['scene']} (lat 91.2), refusing to continue", err=True)
            sys.exit(4)
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    lengths = box[ship > 0, 2]
    counts = torch.bincount(torch.bucketize(lengths, torch.tensor(LENGTH_EDGES)), minlength=4).float()
    if bad and a.fault == "gather":
        counts = torch.cat([counts, torch.tensor([float((ship > 0).sum() - lengths.numel())])])
    allc = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} ships by length class {counts.int().tolist()} global {torch.stack(allc).sum(0).int().tolist()}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/shipnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/shipnet.pt")
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
    p.add_argument("--cfar-budget", type=int, default=40)
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

"""A three-hundred-and-ninety-fourth hand-run batch: BONE AGE REGRESSION FROM HAND X-RAYS.

Synthetic left-hand radiographs (1x32x32, bright bone blobs whose size grows with age) with a metadata table
per scan: sex ("M"/"F", looked up in a two-entry table), age in months, and the id of the bone whose region
of interest (ROI) is cropped as an extra channel statistic (one of 20 TW3 bones).  Every rank reads its scans
from /tmp/fault394_work/scans/hands_R.pt, predicts log(age in months) with a small CNN (two convs, a global
average pool, the sex flag concatenated before a two-layer head) on an MSE loss, wrapped in DDP (gloo) or with
gradients all_reduced by hand (--ddp 0).  The model is initialised from ckpt/bagenet.pt.  The MAE in months is
all_reduced every step, a per-rank histogram of predicted ages (20 one-year bins) is all_gathered at the end,
and rank 0 saves export/bagenet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1.

Faults:
  sexcode    - rank N's metadata codes sex as "U" (unknown) for one scan: not in the sex table (KeyError, start-up)
  landmark   - rank N's scans at step 1 name bone id 21 in a 20-bone ROI table (IndexError in the ROI lookup)
  noscans    - rank N reads scans/holdout/hands_R.pt, which does not exist (FileNotFoundError, start-up)
  ckptwidth  - rank N initialises from ckpt/bagenet_w24.pt, saved with 24 conv2 channels (size mismatch)
  ckptpickle - rank N initialises from ckpt/bagenet_full.pt, which pickles a ScanConfig object (weights_only refusal)
  histgather - rank N all_gathers a 24-bin age histogram (half-year bins to 12 y) vs 20 bins (end of training)
  slowaug    - rank N runs an elastic deformation of its scans in pure Python before the step-2 all_reduce
  nanmonths  - rank N has a scan with age 0 months: log target -inf, loss inf at step 3, the program's own check
  segv       - rank N sends itself SIGSEGV after step 4
  exit4      - rank N prints its own error about a scan without pixel spacing and calls sys.exit(4)
  pooldim    - every rank: the head is fed the flattened 16x6x6 map instead of the pooled 16 features (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  sexcode    - KeyError: 'U' in the sex lookup at start-up, no collective yet; peers SIGTERMed (np4 r2 tee, np6 r0 loglevel)
  landmark   - IndexError 'index 21 is out of bounds for dimension 0 with size 20' at step 1; peers Connection closed (np3 r1 pymodule, np4 r3 prefix)
  noscans    - FileNotFoundError for scans/holdout/hands_N.pt at start-up (np3 r2 redirects: only in rank 2's stderr.log; np4 r1 wrapper)
  ckptwidth  - load_state_dict size mismatch c2.weight [24,8,3,3] vs [16,8,3,3] (np4 r1 pdsh2, worker-1's agent RendezvousConnectionError;
               np3 r0 restart: attempt 2 failed in Gloo connectFullMesh instead of repeating the mismatch)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.ScanConfig' (np5 r3 tee_trainer)
  histgather - DETAIL: 'Detected mismatch between collectives on ranks' on every rank, TensorShape [24] vs [20] (np3 r1 detail);
               'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (24), got (20))' on rank 4 (np6 r4 filter)
  slowaug    - 12 s: ranks 0,1 'Timed out waiting 12000ms for recv', Root Cause rank 0 (np3 r2 plain); 300 s: silent after step 1,
               killed by timeout at 60 s, exit 124 (np4 r1 tee)
  nanmonths  - the program's check: 'non-finite loss inf at step 3', FloatingPointError (np8 r5 plain; np3 r0 detail, peers monitoredBarrier errors)
  segv       - no traceback after step 4; Root Cause exitcode -11 (SIGSEGV) (np4 r3 loglevel, np3 r1 prefix)
  exit4      - rank 2's logged PixelSpacing ERROR and exit 4, Root Cause exitcode 4 (np5 r2 tee_trainer, --logfmt 1)
  pooldim    - every rank: 'mat1 and mat2 shapes cannot be multiplied (8x578 and 18x16)' in the first forward; Root Cause rank 1 (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/bagenet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault394_work"
SEX = {"M": 0, "F": 1}
NBONE = 20
NSCAN = 48
BATCH = 8
log = None


class ScanConfig:
    def __init__(self, size=32, pixel_spacing=0.15):
        self.size = size
        self.pixel_spacing = pixel_spacing


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("bage")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter(f"%(asctime)s bage[{rank}] %(levelname)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class BageNet(nn.Module):
    def __init__(self, width=16, flat=False):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3)
        self.c2 = nn.Conv2d(8, width, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width + 2, 16)
        self.out = nn.Linear(16, 1)
        self.flat = flat

    def forward(self, img, sex, roi):
        h = torch.max_pool2d(torch.relu(self.c1(img)), 2)
        h = torch.max_pool2d(torch.relu(self.c2(h)), 2)
        h = h.flatten(1) if self.flat else self.pool(h).flatten(1)
        h = torch.cat([h, sex[:, None], roi[:, None]], 1)
        return self.out(torch.relu(self.fc(h))).squeeze(1)


def make_scans(seed):
    g = torch.Generator().manual_seed(seed)
    ages = torch.randint(12, 216, (NSCAN,), generator=g).float()
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    imgs = []
    for a in ages:
        r = 2 + float(a) / 30.0
        img = torch.zeros(32, 32)
        for cx, cy in [(8, 10), (16, 8), (24, 10), (12, 22), (20, 22)]:
            img += torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))
        imgs.append(img + 0.05 * torch.randn(32, 32, generator=g))
    meta = [{"sex": "MF"[int(torch.randint(0, 2, (1,), generator=g))], "age_months": float(ages[i]),
             "bone": int(torch.randint(0, NBONE, (1,), generator=g)), "spacing": 0.15} for i in range(NSCAN)]
    return {"imgs": torch.stack(imgs)[:, None], "meta": meta}


def prepare():
    os.makedirs(f"{WORK}/scans", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_scans(200 + r), f"{WORK}/scans/hands_{r}.pt")
    torch.manual_seed(0)
    torch.save(BageNet().state_dict(), f"{WORK}/ckpt/bagenet.pt")
    torch.save(BageNet(24).state_dict(), f"{WORK}/ckpt/bagenet_w24.pt")
    torch.save({"model": BageNet().state_dict(), "config": ScanConfig()}, f"{WORK}/ckpt/bagenet_full.pt")
    print("prepared", WORK)


def roi_table():
    g = torch.Generator().manual_seed(7)
    return torch.randint(4, 28, (NBONE, 2), generator=g)


def roi_means(imgs, bones, table):
    out = []
    for i, b in enumerate(bones):
        cy, cx = table[b].tolist()
        out.append(imgs[i, 0, cy - 3:cy + 3, cx - 3:cx + 3].mean())
    return torch.stack(out)


def elastic(imgs, seconds):
    t0 = time.time()
    n = 0
    while time.time() - t0 < seconds:
        for i in range(imgs.shape[0]):
            rows = imgs[i, 0].tolist()
            for y in range(1, 31):
                for x in range(1, 31):
                    rows[y][x] = 0.25 * (rows[y - 1][x] + rows[y + 1][x] + rows[y][x - 1] + rows[y][x + 1])
            n += 1
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading hand radiographs")
    split = "holdout/" if bad and a.fault == "noscans" else ""
    data = torch.load(f"{WORK}/scans/{split}hands_{rank}.pt")
    imgs, meta = data["imgs"], data["meta"]
    if bad and a.fault == "sexcode":
        meta[31]["sex"] = "U"
    if bad and a.fault == "landmark":
        meta[BATCH + 3]["bone"] = 21
    if bad and a.fault == "nanmonths":
        meta[3 * BATCH + 2]["age_months"] = 0.0
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR scan hand_{rank}_0112.dcm has no PixelSpacing (0028,0030) tag, "
            f"cannot calibrate bone age; aborting", err=True)
        sys.exit(4)
    sex = torch.tensor([float(SEX[m["sex"]]) for m in meta])
    bones = [m["bone"] for m in meta]
    y = torch.log(torch.tensor([m["age_months"] for m in meta]))
    say(f"rank {rank} scans {len(meta)} girls {int(sex.sum())} median age {y.exp().median():.0f} months")
    width = 16
    model = BageNet(width, flat=(a.fault == "pooldim"))
    ck = {"ckptwidth": "bagenet_w24.pt", "ckptpickle": "bagenet_full.pt"}.get(a.fault) if bad else None
    state = torch.load(f"{WORK}/ckpt/{ck or 'bagenet.pt'}")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    table = roi_table()
    for step in range(a.steps):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % NSCAN
        roi = roi_means(imgs, [bones[i] for i in idx.tolist()], table)
        pred = net(imgs[idx], sex[idx], roi)
        loss = ((pred - y[idx]) ** 2).mean()
        if not torch.isfinite(loss):
            bad_i = [int(i) for i in idx if not torch.isfinite(y[i])]
            say(f"rank {rank}: ERROR non-finite loss {loss.item()} at step {step}; log-age target "
                f"non-finite for scans {bad_i}", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowaug" and step == 2:
            say(f"rank {rank} elastic deformation of {imgs.shape[0]} scans (python)")
            n = elastic(imgs, a.slow_s)
            say(f"rank {rank} elastic deformation done: {n} scans")
        mae = ((pred.detach().exp() - y[idx].exp()).abs().mean()).reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae_months {mae.item() / world:.2f}")
        if bad and a.fault == "segv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        years = net(imgs, sex, roi_means(imgs, bones, table)).exp() / 12.0
    nbins = 24 if bad and a.fault == "histgather" else 20
    hist = torch.histc(years, bins=nbins, min=0, max=20 if nbins == 20 else 12)
    hists = [torch.zeros(20) for _ in range(world)]
    dist.all_gather(hists, hist)
    say(f"rank {rank} predicted-age histogram gathered: {int(sum(h.sum() for h in hists))} scans")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/bagenet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/bagenet.pt")
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
    p.add_argument("--slow-s", type=float, default=30)
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

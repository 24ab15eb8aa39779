"""A three-hundred-and-eightieth hand-run batch: RETINAL VESSEL SEGMENTATION FROM FUNDUS PATCHES.

Synthetic fundus patches: every rank reads 64 RGB patches (32x32) from /tmp/fault380_work/patches/fundus_R.pt
and their vessel masks from masks/vessels_R.pt.  Each image is gain-corrected by its camera model (looked up in
a small camera table) and its green channel normalised by the mean inside the field-of-view (FOV) mask.  A tiny
U-Net (two encoder levels, one skip connection, a 1-channel head) is trained with BCE + soft Dice, wrapped in DDP
(gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is initialised from ckpt/unet_c8.pt.
A per-rank vessel-fraction histogram (16 bins) is all_gathered at the start, the loss and Dice are all_reduced
every step, the per-rank final Dice is all_gathered at the end, and rank 0 saves export/unet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  camera     - rank N's patches name camera "Optos-P200", missing from the camera gain table (KeyError, start-up)
  patchidx   - rank N's sampler index list holds index 64 for 64 patches at step 2 (IndexError, later step)
  nomask     - rank N reads its masks from masks_v2/ which does not exist (FileNotFoundError, start-up)
  ckptsize   - rank N initialises from ckpt/unet_c12.pt, saved with 12 base channels (size mismatch)
  ckptpickle - rank N initialises from ckpt/unet_meta.pt which pickles a ThresholdPolicy object (weights_only)
  gatherhist - rank N all_gathers a 17-bin vessel-fraction histogram (others 16)
  skeleton   - rank N skeletonises its masks in pure Python before the step-2 all_reduce (slow: timeout/hang)
  fovzero    - rank N's step-3 batch holds a patch wholly outside the FOV: green/0 -> inf, the program's check
  segv       - rank N sends itself SIGSEGV after step 1
  exit5      - rank N prints its own error line (grader agreement too low) and sys.exit(5) after the last step
  chanwidth  - every rank: 4-channel input (RGB + CLAHE green), the first conv expects 3 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  camera     - KeyError: 'Optos-P200' in normalise at start-up; peers Connection closed by peer (np4 r2 plain, np6 r0 tee)
  patchidx   - after steps 0-1, IndexError 'index 64 is out of bounds for dimension 0 with size 64' (np3 r1 tee_trainer, np8 r5 filter)
  nomask     - FileNotFoundError for masks_v2/vessels_N.pt at start-up (np4 r3 redirects: only in rank 3's stderr.log; np3 r0 pymodule)
  ckptsize   - load_state_dict size mismatch [12,3,3,3] vs [8,3,3,3] etc. (np4 r1 pdsh2; np3 r2 restart: attempt 2 died on
               rank 0's Gloo connectFullMesh 'Connection refused' instead, final Root Cause rank 0)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.ThresholdPolicy' (np5 r3 loglevel)
  gatherhist - DETAIL: every rank 'Detected mismatch between collectives', rank 1 TensorShape=[17] (np3 r1 detail, Root Cause rank 0);
               plain: rank 4 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (17), got (16))' (np6 r4)
  skeleton   - 12 s: ranks 0 and 1 'Timed out waiting 12000ms for recv operation', Root Cause rank 0 (np3 r2 prefix);
               300 s: output stops after step 1, killed at 60 s, exit 124 (np4 r1 wrapper; torchrun survived timeout, SIGKILLed by pid)
  fovzero    - 'step 3: 1024 non-finite pixels in the normalised batch' + FloatingPointError (np4 r0 detail: peers' monitoredBarrier
               errors naming rank 0; np6 r2 tee_trainer)
  segv       - no traceback after step 1, Root Cause exitcode -11 (SIGSEGV) (np4 r2 tee, np3 r1 loglevel)
  exit5      - after all 6 steps rank 4's 'ERROR: ... grader 0.41 below 0.60' and exit 5; peers closed in the final all_gather (np5 r4 pymodule)
  chanwidth  - every rank: 'expected input[8, 4, 32, 32] to have 3 channels, but got 4 channels instead'; Root Cause rank 0 (np3 prefix)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/unet.pt, exit 0 (np3 wrapper)
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

WORK = "/tmp/fault380_work"
CAMERAS = {"Canon-CR2": 1.00, "Topcon-TRC50": 0.92, "Zeiss-Visucam": 1.07, "Kowa-VX10": 0.96}
NPATCH = 64
P = 32
BATCH = 8
log = None


class ThresholdPolicy:
    def __init__(self, thr=0.5):
        self.thr = thr


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
    log = logging.getLogger("rves")
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


class TinyUNet(nn.Module):
    def __init__(self, c=8, cin=3):
        super().__init__()
        self.enc1 = block(cin, c)
        self.enc2 = block(c, 2 * c)
        self.dec1 = block(3 * c, c)
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        up = F.interpolate(e2, scale_factor=2, mode="nearest")
        return self.head(self.dec1(torch.cat([up, e1], 1)))


def make_patches(seed):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(P).float(), torch.arange(P).float(), indexing="ij")
    masks = torch.zeros(NPATCH, 1, P, P)
    for i in range(NPATCH):
        for _ in range(3):
            a, b = torch.rand(2, generator=g) * 2 - 1
            c = torch.rand(1, generator=g) * P
            d = (a * xx + b * yy - c * (a.abs() + b.abs()) / 2).abs() / (a * a + b * b).sqrt()
            masks[i, 0] = torch.maximum(masks[i, 0], (d < 1.3).float())
    img = torch.rand(NPATCH, 3, P, P, generator=g) * 0.2 + 0.4
    img[:, 1:2] -= 0.25 * masks
    fov = torch.ones(NPATCH, 1, P, P)
    fov[:, :, :3, :3] = 0
    cams = [list(CAMERAS)[int(i)] for i in torch.randint(0, 4, (NPATCH,), generator=g)]
    return {"img": img, "fov": fov, "camera": cams}, masks


def prepare():
    for d in ("patches", "masks", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        data, masks = make_patches(380 + r)
        torch.save(data, f"{WORK}/patches/fundus_{r}.pt")
        torch.save(masks, f"{WORK}/masks/vessels_{r}.pt")
    torch.manual_seed(0)
    torch.save(TinyUNet(8).state_dict(), f"{WORK}/ckpt/unet_c8.pt")
    torch.save(TinyUNet(12).state_dict(), f"{WORK}/ckpt/unet_c12.pt")
    torch.save({"state": TinyUNet(8).state_dict(), "policy": ThresholdPolicy(0.45)}, f"{WORK}/ckpt/unet_meta.pt")
    print("prepared", WORK)


def normalise(data, a, bad):
    img = data["img"].clone()
    cams = list(data["camera"])
    if bad and a.fault == "camera":
        cams[11] = "Optos-P200"
    gain = torch.tensor([CAMERAS[c] for c in cams]).view(-1, 1, 1, 1)
    img = img * gain
    fov = data["fov"]
    green_mean = (img[:, 1:2] * fov).sum((2, 3), keepdim=True) / fov.sum((2, 3), keepdim=True)
    img[:, 1:2] = img[:, 1:2] / green_mean
    if a.fault == "chanwidth":
        clahe = (img[:, 1:2] - img[:, 1:2].amin((2, 3), keepdim=True)).clamp(0, 2)
        img = torch.cat([img, clahe], 1)
    return img


def skeletonise(masks):
    n = 0
    for m in masks:
        grid = [[int(v) for v in row] for row in m[0].tolist()]
        changed = True
        while changed:
            changed = False
            for y in range(1, P - 1):
                for x in range(1, P - 1):
                    if grid[y][x] and sum(grid[y + dy][x + dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)) > 7:
                        grid[y][x] = 0
                        changed = True
        n += sum(map(sum, grid))
    return n


def dice(logits, mask):
    p = torch.sigmoid(logits)
    inter = (p * mask).sum()
    return (2 * inter + 1) / (p.sum() + mask.sum() + 1)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(380 + rank)
    say(f"rank {rank}/{world} up, loading fundus patches")
    data = torch.load(f"{WORK}/patches/fundus_{rank}.pt")
    mdir = "masks_v2" if bad and a.fault == "nomask" else "masks"
    masks = torch.load(f"{WORK}/{mdir}/vessels_{rank}.pt")
    img = normalise(data, a, bad)
    frac = masks.mean((1, 2, 3))
    hist = torch.histc(frac, bins=17 if bad and a.fault == "gatherhist" else 16, min=0, max=0.5)
    allh = [torch.zeros(16) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} patches {NPATCH} vessel fraction {frac.mean():.3f} global {sum(h.sum() for h in allh):.0f}")
    model = TinyUNet(8, 3)
    ck = {"ckptsize": "unet_c12.pt", "ckptpickle": "unet_meta.pt"}.get(a.fault, "unet_c8.pt") if bad else "unet_c8.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state["state"] if "state" in state else state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p_ in model.parameters():
            dist.broadcast(p_.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(rank)
    fin = torch.zeros(1)
    for step in range(a.steps):
        idx = torch.randint(0, NPATCH, (BATCH,), generator=g)
        if bad and a.fault == "patchidx" and step == 2:
            idx[-1] = NPATCH
        x, y = img[idx], masks[idx]
        if bad and a.fault == "fovzero" and step == 3:
            x = x.clone()
            x[2, 1] = x[2, 1] / 0.0
        nf = int((~torch.isfinite(x)).sum())
        if nf:
            say(f"rank {rank} step {step}: {nf} non-finite pixels in the normalised batch (FOV mean 0)", err=True)
            raise FloatingPointError(f"non-finite fundus intensities at step {step} on rank {rank}")
        out = net(x)
        loss = F.binary_cross_entropy_with_logits(out, y) + 1 - dice(out, y)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p_ in model.parameters():
                dist.all_reduce(p_.grad)
                p_.grad /= world
        opt.step()
        if bad and a.fault == "skeleton" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.skel_budget:
                n += skeletonise(masks)
            say(f"rank {rank} skeleton pixels: {n}")
        d = dice(out.detach(), y)
        stats = torch.stack([loss.detach(), d])
        dist.all_reduce(stats)
        fin = d.reshape(1)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} dice {stats[1].item() / world:.4f}")
        if bad and a.fault == "segv" and step == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"ERROR: rank {rank}: vessel-mask agreement with reference grader 0.41 below 0.60; "
            f"refusing to export a model trained on these patches", err=True)
        sys.exit(5)
    alld = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(alld, fin)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/unet.pt")
        say(f"rank 0 done: {a.steps} steps, per-rank dice {[round(float(t), 3) for t in alld]}, saved export/unet.pt")
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
    p.add_argument("--skel-budget", type=int, default=40)
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

"""A three-hundred-and-thirty-eighth hand-run batch: TINY NEURAL RADIANCE FIELD FITTING ON SYNTHETIC RAYS.

Synthetic scenes: a coloured sphere seen by a ring of pinhole cameras.  --prepare renders, per rank, 4096
rays (origin, direction, scene name, target RGB) into /tmp/fault338_work/rays/rays_R.pt and writes initial
weights ckpt/nerf_l4.pt (4 frequency bands), ckpt/nerf_l6.pt (6 bands) and ckpt/nerf_meta.pt (weights plus
a pickled CameraRig object).  Each rank looks up its scene's near/far bounds in a scene table, encodes 16
samples per ray with a sinusoidal positional encoding, runs a small MLP (RGB + density), volume-renders and
fits the RGB with an MSE loss, wrapped in DDP over gloo (--ddp 0: gradients all_reduced by hand).  Ray counts
are all_gathered at the start, the loss and PSNR are all_reduced every step, a per-rank depth histogram is
all_gathered at the end, and rank 0 saves export/nerf.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  scenekey   - rank N's rays name the scene "ficus", missing from the scene table (KeyError, start-up)
  pixidx     - rank N re-samples its pixel batch at step 1 with an off-by-one index (IndexError)
  norays     - rank N reads rays/val/rays_N.pt which does not exist (FileNotFoundError, start-up)
  ckptband   - rank N initialises from ckpt/nerf_l6.pt, saved with 6 frequency bands (size mismatch)
  ckptpickle - rank N initialises from ckpt/nerf_meta.pt; torch.load's weights_only refuses CameraRig
  histbins   - rank N all_gathers a 17-bin depth histogram at the end, the others 16 bins
  slowsample - rank N does hierarchical importance resampling in pure Python before the step-2 all_reduce
  lockwait   - rank N waits at step 1 for an occupancy grid file that nobody writes (hang)
  densinf    - rank N's density activation is exp(raw + 90) from step 3: inf/NaN loss, the program's check
  sigsegv    - rank N sends itself SIGSEGV after step 4
  exit4      - rank N finds a camera pose that is not orthonormal, prints its own error and sys.exit(4)
  encwidth   - every rank: the encoding also appends the raw view direction (30 wide, MLP expects 27)
  none       - control, clean run

What happened (filled in after the runs):
  scenekey   - KeyError: 'ficus' on the scene table at start-up; peers Connection closed by peer in the first all_gather (np4 r2 tee, np6 r0 loglevel)
  pixidx     - IndexError 'index 4096 is out of bounds for dimension 0 with size 4096' at step 1; peers Connection closed (np3 r1 prefix, np4 r3 pdsh2)
  norays     - FileNotFoundError rays/val/rays_N.pt at start-up; only in attempt_0/1/stderr.log for redirects (np4 r1 redirects, np3 r2 wrapper)
  ckptband   - load_state_dict size mismatch net.0.weight [32,39] vs [32,27] (np8 r5 tee_trainer); restart's attempt 1 timed out in all_gather (np3 r0)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.CameraRig'; peers SIGTERMed (np4 r2 pymodule)
  histbins   - 'allgather: invalid tensor size at index 0 (expected (17), got (16))' (np6 r4 filter); DETAIL 'Detected mismatch' [17] vs [16] (np3 r1)
  slowsample - after step 1 rank 0 'Timed out waiting 12000ms for recv', rank 2 '... send' in the step-2 all_reduce; Root Cause rank 0 (np3 r1 plain)
  lockwait   - 'rank 2 waiting for occupancy grid ...' then silence; timeout exit 124 at 60 s, torchrun SIGTERMed by hand later (np4 r2 wrapper)
  densinf    - NaN gradients reach every rank; all ranks' check 'non-finite loss nan' FloatingPointError at step 4 (np4 r3 detail, np3 r0 tee)
  sigsegv    - no traceback, 'exitcode: -11' Root Cause rank 2, peers Connection reset (np6 r2 tee_trainer); restart fails connectFullMesh (np4 r1)
  exit4      - 'rank 1: ERROR camera pose 3 is not orthonormal ...' and exit 4; Root Cause rank 1 exitcode 4 (np3 r1 pymodule)
  encwidth   - every rank 'mat1 and mat2 shapes cannot be multiplied (8192x30 and 27x32)' in the first forward; Root Cause rank 1 (np4 loglevel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/nerf.pt, exit 0 (np3 plain; a first try without the final barrier aborted)
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

WORK = "/tmp/fault338_work"
SCENES = {"lego": (2.0, 6.0), "chair": (2.0, 6.0), "drums": (1.5, 5.5), "hotdog": (2.5, 6.5)}
BANDS = 4
NSAMP = 16
BATCH = 512
log = None


class CameraRig:
    def __init__(self, n, radius):
        self.n = n
        self.radius = radius


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
    log = logging.getLogger("nerf")
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


def encode(p, bands, with_dir=None):
    out = [p]
    for k in range(bands):
        out += [torch.sin((2.0 ** k) * math.pi * p), torch.cos((2.0 ** k) * math.pi * p)]
    if with_dir is not None:
        out.append(with_dir)
    return torch.cat(out, -1)


class TinyNeRF(nn.Module):
    def __init__(self, bands=BANDS, width=32):
        super().__init__()
        self.inp = 3 + 6 * bands
        self.net = nn.Sequential(nn.Linear(self.inp, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.rgb = nn.Linear(width, 3)
        self.sigma = nn.Linear(width, 1)

    def forward(self, x):
        h = self.net(x)
        return torch.sigmoid(self.rgb(h)), self.sigma(h).squeeze(-1)


def render(model, o, d, near, far, a, bad, step):
    t = torch.linspace(near, far, NSAMP).expand(o.shape[0], NSAMP)
    pts = o[:, None, :] + d[:, None, :] * t[..., None]
    extra = d[:, None, :].expand_as(pts) if a.fault == "encwidth" else None
    rgb, raw = model(encode(pts, BANDS, extra))
    if bad and a.fault == "densinf" and step >= 3:
        sigma = torch.exp(raw + 90.0)
    else:
        sigma = nn.functional.softplus(raw)
    delta = torch.full_like(t, (far - near) / NSAMP)
    alpha = 1.0 - torch.exp(-sigma * delta)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha[:, :-1] + 1e-10], -1), -1)
    w = alpha * trans
    return (w[..., None] * rgb).sum(1), (w * t).sum(1)


def make_rays(n, seed, scene):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(n, generator=g) * 2 * math.pi
    o = torch.stack([4 * torch.cos(ang), 4 * torch.sin(ang), torch.rand(n, generator=g) - 0.5], -1)
    tgt = torch.randn(n, 3, generator=g) * 0.3
    d = tgt - o
    d = d / d.norm(dim=-1, keepdim=True)
    b = (o * d).sum(-1)
    disc = b * b - ((o * o).sum(-1) - 1.0)
    hit = disc > 0
    pt = o + d * (-b - disc.clamp(min=0).sqrt())[:, None]
    rgb = torch.where(hit[:, None], 0.5 + 0.5 * pt, torch.ones(n, 3))
    poses = torch.linalg.qr(torch.randn(8, 3, 3, generator=g)).Q
    return {"origins": o, "dirs": d, "rgb": rgb.clamp(0, 1), "scene": scene, "poses": poses}


def prepare():
    os.makedirs(f"{WORK}/rays", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_rays(4096, 300 + r, ["lego", "chair", "drums", "hotdog"][r % 4]),
                   f"{WORK}/rays/rays_{r}.pt")
    torch.manual_seed(0)
    torch.save(TinyNeRF(4).state_dict(), f"{WORK}/ckpt/nerf_l4.pt")
    torch.save(TinyNeRF(6).state_dict(), f"{WORK}/ckpt/nerf_l6.pt")
    torch.save({"model": TinyNeRF(4).state_dict(), "rig": CameraRig(8, 4.0)}, f"{WORK}/ckpt/nerf_meta.pt")
    print("prepared", WORK)


def importance_resample(w, t, budget):
    t0 = time.time()
    rounds = 0
    rows = w.tolist()
    ts = t.tolist()
    while time.time() - t0 < budget:
        for row, tr in zip(rows, ts):
            cdf, acc = [], 0.0
            for v in row:
                acc += v + 1e-5
                cdf.append(acc)
            fine = []
            for u in range(64):
                x = (u + 0.5) / 64 * acc
                j = next(i for i, c in enumerate(cdf) if c >= x)
                fine.append(tr[j])
        rounds += 1
    return rounds


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading rays")
    split = "val/" if bad and a.fault == "norays" else ""
    rays = torch.load(f"{WORK}/rays/{split}rays_{rank % 8}.pt")
    if bad and a.fault == "scenekey":
        rays["scene"] = "ficus"
    near, far = SCENES[rays["scene"]]
    poses = rays["poses"]
    if bad and a.fault == "exit4":
        poses[3, 0, 1] += 0.25
    err = (poses @ poses.transpose(1, 2) - torch.eye(3)).abs().amax(dim=(1, 2))
    if (err > 1e-3).any():
        i = int(err.argmax())
        say(f"rank {rank}: ERROR camera pose {i} is not orthonormal (|R R^T - I| = {err[i]:.3f}); "
            f"refusing to fit a radiance field to a broken rig", err=True)
        sys.exit(4)
    n = torch.tensor([rays["origins"].shape[0]], dtype=torch.float32)
    alln = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(alln, n)
    say(f"rank {rank} scene {rays['scene']} near {near} far {far} rays {int(n)} global {int(sum(alln))}")
    model = TinyNeRF()
    ck = {"ckptband": "nerf_l6.pt", "ckptpickle": "nerf_meta.pt"}.get(a.fault, "nerf_l4.pt") if bad else "nerf_l4.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=5e-3)
    o, d, rgb = rays["origins"], rays["dirs"], rays["rgb"]
    npix = o.shape[0]
    for step in range(a.steps):
        idx = torch.randint(0, npix, (BATCH,))
        if bad and a.fault == "pixidx" and step == 1:
            idx = torch.arange(npix - BATCH + 1, npix + 1)
        ob, db, cb = o[idx], d[idx], rgb[idx]
        col, depth = render(net, ob, db, near, far, a, bad, step)
        loss = ((col - cb) ** 2).mean()
        if not torch.isfinite(loss):
            bads = int((~torch.isfinite(col)).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({bads} non-finite colour values, "
                f"max depth {depth.max().item()})", err=True)
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowsample" and step == 2:
            with torch.no_grad():
                ts = torch.linspace(near, far, NSAMP).expand(64, NSAMP)
                r = importance_resample(torch.rand(64, NSAMP), ts, a.slow_budget)
            say(f"rank {rank} importance resampling: {r} rounds")
        if bad and a.fault == "lockwait" and step == 1:
            lock = f"{WORK}/occupancy/grid_{rank}.ready"
            say(f"rank {rank} waiting for occupancy grid {lock}")
            while not os.path.exists(lock):
                time.sleep(1.0)
        stats = torch.stack([loss.detach(), -10.0 * torch.log10(loss.detach())])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.5f} psnr {stats[1].item() / world:.2f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    nbins = 17 if bad and a.fault == "histbins" else 16
    with torch.no_grad():
        _, depth = render(model, o[:1024], d[:1024], near, far, a, False, 0)
    hist = torch.histc(depth, bins=nbins, min=0.0, max=far)
    allh = [torch.zeros(16) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} depth histogram gathered: {int(sum(h.sum() for h in allh))} rays")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/nerf.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/nerf.pt")
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
    p.add_argument("--slow-budget", type=int, default=40)
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

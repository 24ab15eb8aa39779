"""A four-hundred-and-fourth hand-run batch: MULTI-TASK SCENE SEGMENTATION AND DEPTH.

Synthetic street scenes: every rank reads its RGB crops (3x32x32), its semantic label maps (13 train ids,
remapped from dataset class names through a CLASSES table listed in data/meta_R.json) and its metric depth
maps from /tmp/fault404_work/data/.  A small shared conv encoder feeds two heads: a segmentation head
(cross entropy over 13 classes) and a depth head (scale-invariant log-depth loss).  The model is initialised
from ckpt/mtnet_c13.pt, wrapped in DDP (gloo) or, with --ddp 0, its gradients are all_reduced by hand.
Per-rank class pixel histograms are all_gathered at the start, the loss and mIoU proxy are all_reduced every
step, and rank 0 saves export/mtnet.pt at the end.  Options: --spawn N (torch.multiprocessing.spawn,
--port), --logfmt 1 (progress and errors through logging).

Faults:
  badclass   - rank N's label maps carry the void id 19 where the 13-class head expects < 13 (IndexError, step 0)
  unklabel   - rank N's meta lists the class name "tram", missing from the CLASSES table (KeyError, start-up)
  nodepth    - rank N reads depth from data/depth_lidar/ which does not exist (FileNotFoundError, start-up)
  ckptheads  - rank N initialises from ckpt/mtnet_c19.pt, saved with a 19-class head (size mismatch)
  ckptpickle - rank N loads ckpt/mtnet_cfg.pt, saved with a SceneConfig object (weights_only refusal)
  statgather - rank N all_gathers its class histogram plus a void bin (14 vs 13 entries)
  slowcrf    - rank N refines its step-3 predictions with a pure-Python dense CRF before the all_reduce
  stuck      - rank N waits at step 2 for a depth-cache lock file that never appears (run with --pg-timeout 300)
  nandepth   - rank N's depth maps contain zeros (invalid lidar); log(0) = -inf, the program's check at step 2
  segv       - rank N sends itself SIGSEGV after step 4
  exit5      - rank N prints its own error line about missing camera intrinsics and calls sys.exit(5)
  upsample   - every rank: the decoder forgets the last upsample, 16x16 logits vs 32x32 labels (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  badclass   - 'IndexError: Target 19 is out of bounds.' in cross_entropy at step 0; peers Connection closed by peer (np4 r2 tee, np6 r0 pymodule)
  unklabel   - KeyError: 'tram' building the class remap at start-up; peers closed in all_gather (np3 r1 loglevel, np8 r6 wrapper)
  nodepth    - FileNotFoundError for data/depth_lidar/depth_3.pt, only in rank 3's stderr.log; console Root Cause rank 3 (np4 r3 redirects)
  ckptheads  - load_state_dict size mismatch seg.weight [19,8,1,1] vs [13,8,1,1] (np3 r2 restart: attempt 2 ended in a 12 s
               all_gather send timeout on rank 2 instead; np4 r1 pdsh2: worker-1's agent then RendezvousConnectionError)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SceneConfig' (np3 r0 tee_trainer)
  statgather - DETAIL: 'Detected mismatch between collectives' on every rank, rank 1 TensorShape=[14] (np3 r1 detail);
               'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (14), got (13))' on rank 4 (np6 r4 filter)
  slowcrf    - ranks 0 and 1 'Timed out waiting 12000ms for recv operation' at step 3; rank 2 silent, Root Cause rank 1 (np3 r2 plain)
  stuck      - output stops after step 1, timeout 60 s, exit 124; the orphaned agent's SIGTERM lines follow (np4 r1 wrapper)
  nandepth   - the program's check: 16 non-finite log-depth values at step 2, FloatingPointError (np4 r1 prefix; np3 r0 detail,
               peers' monitoredBarrier errors name rank 0)
  segv       - no traceback after step 4; Root Cause exitcode -11 (SIGSEGV); peers Connection reset by peer (np4 r3 tee, np8 r5 loglevel)
  exit5      - the rank's own intrinsics ERROR line, exit 5, Root Cause exitcode 5 (np3 r2 tee_trainer logfmt, np5 r3 filter)
  upsample   - every rank: 'size mismatch (got input: [8, 13, 16, 16] , target: [8, 32, 32]'; Root Cause rank 0 (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/mtnet.pt, exit 0 (np3 plain)
"""
import argparse
import json
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

WORK = "/tmp/fault404_work"
CLASSES = {"road": 0, "sidewalk": 1, "building": 2, "wall": 3, "fence": 4, "pole": 5, "light": 6,
           "sign": 7, "vegetation": 8, "terrain": 9, "sky": 10, "person": 11, "car": 12}
NCLS = 13
N = 16
log = None


class SceneConfig:
    def __init__(self, ncls, depth_max):
        self.ncls = ncls
        self.depth_max = depth_max


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
    log = logging.getLogger("mtsg")
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


class MTNet(nn.Module):
    def __init__(self, ncls=NCLS, skip_up=False):
        super().__init__()
        self.enc1 = nn.Conv2d(3, 8, 3, padding=1)
        self.enc2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.dec = nn.Conv2d(16, 8, 3, padding=1)
        self.seg = nn.Conv2d(8, ncls, 1)
        self.depth = nn.Conv2d(8, 1, 1)
        self.skip_up = skip_up

    def forward(self, x):
        h = F.relu(self.enc1(x))
        h = F.relu(self.enc2(h))
        h = F.relu(self.dec(h))
        if not self.skip_up:
            h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        return self.seg(h), F.softplus(self.depth(h)).squeeze(1) + 0.1


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    names = list(CLASSES)
    for r in range(8):
        g = torch.Generator().manual_seed(400 + r)
        rgb = torch.rand(N, 3, 32, 32, generator=g)
        seg = torch.randint(0, NCLS, (N, 32, 32), generator=g)
        rows = torch.arange(32).float().view(1, 32, 1).expand(N, 32, 32)
        depth = 2.0 + rows * 0.8 + torch.rand(N, 32, 32, generator=g)
        torch.save(rgb, f"{WORK}/data/rgb_{r}.pt")
        torch.save(seg, f"{WORK}/data/seg_{r}.pt")
        torch.save(depth, f"{WORK}/data/depth_{r}.pt")
        with open(f"{WORK}/data/meta_{r}.json", "w") as f:
            json.dump({"city": f"city{r}", "classes": names, "intrinsics": [500.0, 500.0, 16.0, 16.0]}, f)
    torch.manual_seed(0)
    torch.save(MTNet(NCLS).state_dict(), f"{WORK}/ckpt/mtnet_c13.pt")
    torch.save(MTNet(19).state_dict(), f"{WORK}/ckpt/mtnet_c19.pt")
    torch.save({"model": MTNet(NCLS).state_dict(), "cfg": SceneConfig(NCLS, 80.0)}, f"{WORK}/ckpt/mtnet_cfg.pt")
    print("prepared", WORK)


def dense_crf(prob, rgb, iters):
    # a deliberately naive mean-field refinement in pure Python
    c, hh, ww = prob.shape
    p = prob.tolist()
    im = rgb.tolist()
    for _ in range(iters):
        for y in range(hh):
            for x in range(ww):
                for k in range(c):
                    acc = 0.0
                    for dy in (-1, 0, 1):
                        for dx in (-1, 0, 1):
                            yy, xx = min(max(y + dy, 0), hh - 1), min(max(x + dx, 0), ww - 1)
                            wgt = math.exp(-abs(im[0][y][x] - im[0][yy][xx]))
                            acc += wgt * p[k][yy][xx]
                    p[k][y][x] = 0.5 * p[k][y][x] + 0.5 * acc / 9.0
    return torch.tensor(p)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4040 + rank)
    say(f"rank {rank}/{world} up, loading scenes")
    with open(f"{WORK}/data/meta_{rank}.json") as f:
        meta = json.load(f)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR {meta['city']} scenes have no camera intrinsics for the depth branch "
            f"(calib/cam_{rank}.yaml empty), refusing to train metric depth", err=True)
        sys.exit(5)
    if bad and a.fault == "unklabel":
        meta["classes"] = meta["classes"][:6] + ["tram"] + meta["classes"][6:]
    remap = torch.tensor([CLASSES[n] for n in meta["classes"]])
    rgb = torch.load(f"{WORK}/data/rgb_{rank}.pt")
    seg = torch.load(f"{WORK}/data/seg_{rank}.pt")
    seg = remap[seg.clamp(max=len(remap) - 1)]
    dsub = "depth_lidar/" if bad and a.fault == "nodepth" else ""
    depth = torch.load(f"{WORK}/data/{dsub}depth_{rank}.pt")
    if bad and a.fault == "badclass":
        seg[3, :4, :] = 19
    hist = torch.bincount(seg.flatten().clamp(max=NCLS - 1), minlength=NCLS).float()
    if bad and a.fault == "statgather":
        hist = torch.cat([hist, torch.tensor([float((seg == 255).sum())])])
    allh = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allh, hist)
    glob = sum(allh)
    say(f"rank {rank} pixels {int(hist.sum())} global {int(glob.sum())} rarest class {int(glob.argmin())}")
    model = MTNet(skip_up=(bad and a.fault == "upsample"))
    if bad and a.fault == "ckptpickle":
        sd = torch.load(f"{WORK}/ckpt/mtnet_cfg.pt")["model"]
    else:
        ck = "mtnet_c19.pt" if bad and a.fault == "ckptheads" else "mtnet_c13.pt"
        sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(a.steps):
        idx = torch.arange(step * 4, step * 4 + 8) % N
        logits, pd = net(rgb[idx])
        ce = F.cross_entropy(logits, seg[idx])
        if bad and a.fault == "nandepth" and step == 2:
            depth[idx[1], 10:14, 10:14] = 0.0
        d = torch.log(pd) - torch.log(depth[idx])
        if not torch.isfinite(d).all():
            say(f"rank {rank}: log-depth residual has {int((~torch.isfinite(d)).sum())} non-finite values at step "
                f"{step} (min gt depth {depth[idx].min():.3f} m)", err=True)
            raise FloatingPointError(f"non-finite depth loss on rank {rank} at step {step}")
        silog = (d ** 2).mean() - 0.5 * d.mean() ** 2
        loss = ce + silog
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowcrf" and step == 3:
            t0 = time.time()
            prob = logits[0].detach().softmax(0)
            n = 0
            while time.time() - t0 < a.crf_budget:
                prob = dense_crf(prob, rgb[idx[0]], 1)
                n += 1
            say(f"rank {rank} dense CRF: {n} mean-field passes")
        if bad and a.fault == "stuck" and step == 2:
            lock = f"{WORK}/cache/depth_{rank}.ready"
            while not os.path.exists(lock):
                time.sleep(0.5)
        with torch.no_grad():
            pred = logits.argmax(1)
            acc = (pred == seg[idx]).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} pixacc {stats[1].item():.4f} "
            f"silog {silog.item():.4f}")
        if bad and a.fault == "segv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/mtnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/mtnet.pt")
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
    p.add_argument("--crf-budget", type=int, default=40)
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

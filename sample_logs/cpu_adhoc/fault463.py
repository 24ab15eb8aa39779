"""Batch 463 of hand-run faults: CROP LEAF BLIGHT DETECTION FROM FIELD PHOTOS.

Synthetic field photos: every rank reads its plot's leaf patches (3x32x32 RGB crops, a label 0 healthy,
1 early blight, 2 late blight, a cultivar name and a per-batch exposure value) from
/tmp/fault463_work/plots/plot_R.pt.  Patches are divided by the batch's exposure, the cultivar is looked up in
a 5-entry cultivar table and embedded, and a small CNN (two conv blocks, pooling, a linear head that takes the
cultivar embedding too) classifies the patch.  The model starts from ckpt/blightnet_init.pt, is wrapped in DDP
(gloo) or, with --ddp 0, its gradients are all_reduced by hand.  The loss and accuracy are all_reduced every
step, per-class lesion counts are all_gathered after training, and rank 0 saves export/blightnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  cultivar    - rank N's plot is planted with cultivar "Kennebec", missing from the cultivar table (KeyError, start-up)
  lesionlabel - rank N's annotator used class 3 ("septoria") for some patches: cross_entropy target out of range
                (IndexError, first step)
  notiles     - rank N reads its patches from plots/rescan/ which does not exist (FileNotFoundError, start-up)
  ckptsize    - rank N initialises from ckpt/blightnet_c4.pt, saved with a 4-class head (size mismatch)
  ckptpickle  - rank N initialises from ckpt/blightnet_meta.pt, which pickles a FieldMeta object beside the
                weights: torch.load (weights_only) refuses it (UnpicklingError)
  histgather  - rank N all_gathers its lesion counts per class plus an "unsure" count (4 vs 3 entries, at the end)
  slowaug     - rank N runs a pure-Python lesion-mask dilation for 25 s before the step-2 all_reduce
  stuckcache  - rank N waits at step 1 for a patch-cache lock file that nobody ever removes (a hang)
  nanexposure - rank N's batch 3 has exposure 0: patches inf/NaN, the program's loss check (FloatingPointError)
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own error line (colour calibration card missing) and calls sys.exit(4) after step 1
  patchsize   - every rank crops 40x40 patches, the head expects 32x32 features (shape error, first forward)
  none        - control, clean run

What happened (filled in after the runs):
  cultivar    - KeyError: 'Kennebec' at start-up, peers SIGTERMed by the agent (np4 r2 tee; np6 r0 loglevel)
  lesionlabel - IndexError 'Target 3 is out of bounds.' at step 0; peers Connection closed by peer (np3 r1 pymodule);
                np8 r5 filter: Root Cause names local_rank 4 SIGABRT (filtered out), rank 5 listed as SIGTERM
  notiles     - FileNotFoundError plots/rescan/plot_N.pt at start-up (np4 r3 wrapper; np3 r0 tee_trainer)
  ckptsize    - load_state_dict size mismatch head.weight [4,1028] vs [3,1028] on rank 1 (np4 pdsh2)
  ckptpickle  - UnpicklingError 'Weights only load failed ... __main__.FieldMeta', only in rank 2's stderr.log;
                the console shows just Root Cause rank 2 exit 1 (np3 r2 redirects)
  histgather  - DETAIL: every rank 'Detected mismatch between collectives', rank 4 TensorShape=[4] (np6 r4 detail);
                plain: rank 0 'allgather: invalid tensor size at index 0 (expected (4), got (3))' (np3 r0 plain)
  slowaug     - peers 'Timed out waiting 12000ms for recv/send', the slow rank 1 SIGTERMed silently (np3 r1 prefix)
  stuckcache  - 'waiting for patch cache lock', silence, timeout at 60 s, exit 124 (np4 r2 plain; np3 r0 tee)
  nanexposure - 'non-finite loss nan at step 3 (exposure 0.000, max pixel inf)', FloatingPointError (np6 r2 loglevel);
                np4 r3 restart: the restart fails at start-up in Gloo connectFullMesh, final Root Cause rank 0
  sigsegv     - exitcode -11 (SIGSEGV) after step 3, peers connection reset/closed (np4 r1 tee_trainer); np3 r2 restart:
                the restart fails in Gloo connectFullMesh, final Root Cause rank 0 exit 1
  exit4       - rank N's calibration ERROR line, Root Cause exitcode 4 (np3 r1 pymodule; np5 r3 wrapper)
  patchsize   - every rank 'mat1 and mat2 shapes cannot be multiplied (24x1604 and 1028x3)' (np3 detail, --ddp 0)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/blightnet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault463_work"
CULTIVARS = {"Russet Burbank": 0, "Yukon Gold": 1, "Shepody": 2, "Atlantic": 3, "Umatilla": 4}
CLASSES = ["healthy", "early_blight", "late_blight"]
PATCH = 32
BATCH = 24
log = None


class FieldMeta:
    def __init__(self, field, season):
        self.field = field
        self.season = season


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
    log = logging.getLogger("blight")
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


class BlightNet(nn.Module):
    def __init__(self, ncls=3, patch=PATCH):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.cult = nn.Embedding(len(CULTIVARS), 4)
        self.head = nn.Linear(16 * (patch // 4) ** 2 + 4, ncls)

    def forward(self, x, cv):
        h = F.max_pool2d(torch.relu(self.c1(x)), 2)
        h = F.max_pool2d(torch.relu(self.c2(h)), 2)
        h = torch.cat([h.flatten(1), self.cult(cv)], 1)
        return self.head(h)


def make_plot(rank, n=BATCH * 8, size=PATCH + 8):
    g = torch.Generator().manual_seed(500 + rank)
    y = torch.randint(0, 3, (n,), generator=g)
    img = torch.rand(n, 3, size, size, generator=g) * 0.5
    img[:, 1] += 0.3  # green leaves
    for k in range(n):
        if y[k]:
            cx, cy = (int(v) for v in torch.randint(8, size - 8, (2,), generator=g))
            img[k, 0, cy - 3:cy + 3, cx - 3:cx + 3] += 0.4 * int(y[k])  # brown lesion
    names = list(CULTIVARS)
    cult = [names[int(i)] for i in torch.randint(0, 5, (n,), generator=g)]
    expo = (0.8 + 0.4 * torch.rand(8, generator=g)).tolist()
    return {"img": img, "label": y, "cultivar": cult, "exposure": expo, "plot": f"P{rank:02d}"}


def prepare():
    os.makedirs(f"{WORK}/plots", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_plot(r), f"{WORK}/plots/plot_{r}.pt")
    torch.manual_seed(0)
    torch.save(BlightNet().state_dict(), f"{WORK}/ckpt/blightnet_init.pt")
    torch.save(BlightNet(ncls=4).state_dict(), f"{WORK}/ckpt/blightnet_c4.pt")
    torch.save({"model": BlightNet().state_dict(), "meta": FieldMeta("north-40", 2026)},
               f"{WORK}/ckpt/blightnet_meta.pt")
    print("prepared", WORK)


def dilate_masks(img, iters):
    # pure-Python 3x3 dilation of the lesion masks (red > green), deliberately slow
    area = 0
    for k in range(img.shape[0]):
        m = (img[k, 0] > img[k, 1]).tolist()
        n = len(m)
        for _ in range(iters):
            m = [[any(m[i + di][j + dj] for di in (-1, 0, 1) for dj in (-1, 0, 1)
                      if 0 <= i + di < n and 0 <= j + dj < n) for j in range(n)] for i in range(n)]
        area += sum(map(sum, m))
    return area


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading plot patches")
    sub = "rescan/" if bad and a.fault == "notiles" else ""
    plot = torch.load(f"{WORK}/plots/{sub}plot_{rank}.pt")
    if bad and a.fault == "cultivar":
        plot["cultivar"][37] = "Kennebec"
    if bad and a.fault == "lesionlabel":
        plot["label"][5] = 3
    if bad and a.fault == "nanexposure":
        plot["exposure"][3] = 0.0
    cv = torch.tensor([CULTIVARS[c] for c in plot["cultivar"]])
    crop = 40 if bad and a.fault == "patchsize" else PATCH
    off = (plot["img"].shape[-1] - crop) // 2
    img = plot["img"][:, :, off:off + crop, off:off + crop].contiguous()
    labels = plot["label"]
    say(f"rank {rank} plot {plot['plot']}: {len(labels)} patches, {int((labels > 0).sum())} with lesions")
    model = BlightNet()
    if bad and a.fault == "ckptsize":
        state = torch.load(f"{WORK}/ckpt/blightnet_c4.pt")
    elif bad and a.fault == "ckptpickle":
        state = torch.load(f"{WORK}/ckpt/blightnet_meta.pt")["model"]
    else:
        state = torch.load(f"{WORK}/ckpt/blightnet_init.pt")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(a.steps):
        sl = slice(step % 8 * BATCH, step % 8 * BATCH + BATCH)
        if bad and a.fault == "stuckcache" and step == 1:
            lock = f"{WORK}/cache/patches_{rank}.lock"
            say(f"rank {rank} waiting for patch cache lock {lock}")
            while True:  # nobody ever creates (or removes) the lock: poll forever
                if os.path.exists(lock) and not os.path.exists(lock):
                    break
                time.sleep(0.5)
        x = img[sl] / plot["exposure"][step % 8]
        logits = net(x, cv[sl])
        loss = F.cross_entropy(logits, labels[sl])
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"(exposure {plot['exposure'][step % 8]:.3f}, max pixel {x.abs().max().item()})", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowaug" and step == 2:
            t0 = time.time()
            area = 0
            while time.time() - t0 < a.slow_budget:
                area += dilate_masks(img[sl], 2)
            say(f"rank {rank} lesion mask dilation done: area {area}")
        acc = (logits.argmax(1) == labels[sl]).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "exit4" and step == 1:
            say(f"rank {rank}: ERROR colour calibration card not found in plot {plot['plot']} photos "
                f"(0 of {len(labels)} frames); lesion colours uncalibrated, aborting", err=True)
            sys.exit(4)
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    counts = torch.bincount(labels, minlength=3).float()
    if bad and a.fault == "histgather":
        counts = torch.cat([counts, torch.tensor([7.0])])
    allc = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} lesion counts {counts.tolist()} global {torch.stack(allc).sum(0).tolist()}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/blightnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/blightnet.pt")
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
    p.add_argument("--slow-budget", type=int, default=25)
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

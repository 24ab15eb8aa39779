"""A three-hundred-and-sixty-seventh hand-run batch: TUMOUR GRADING FROM HISTOLOGY PATCHES.

Synthetic H&E patches: every rank reads its slide's 3x32x32 uint8 patches and their grade labels
(benign, G1, G2, G3: a 4-entry grade table) from /tmp/fault367_work/slides/slide_R.pt, stain-normalises
each mini-batch by its per-channel mean and std, and trains a small CNN (two conv blocks, a linear head) with
cross-entropy, wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model is
initialised from ckpt/gradenet.pt.  Per-rank patch counts are all_gathered at start-up, the loss and accuracy
are all_reduced every step, per-grade prediction counts are all_gathered at the end, and rank 0 saves
export/gradenet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging).

Faults (--fault NAME --rank R, R = -1 for every rank):
  badgrade    - rank N's label sheet grades one patch "G4", missing from the grade table (KeyError, start-up)
  noslide     - rank N reads its slide from slides/scanner_b/, which does not exist (FileNotFoundError, start-up)
  ckptsize    - rank N initialises from ckpt/gradenet_c5.pt, saved with 5 grades (size mismatch, start-up)
  ckptpickle  - rank N loads ckpt/gradenet_meta.pt, which pickles a StainStats object (weights_only refusal)
  gradegather - rank N all_gathers 5 per-grade counts (an extra "ungradable" slot) at the end (4 expected)
  tiling      - rank N recomputes overlapping tile coordinates in Python before the step-2 all_reduce
  stainnan    - rank N's step-3 batch is blank (all-white) tiles: std 0, NaN inputs, the program's loss check
  patchidx    - rank N's sampler draws patch index 128 of 128 at step 2 (IndexError)
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit5       - rank N prints its own error line about a magnification mismatch and calls sys.exit(5) at step 1
  patchbug    - every rank: patches cropped 40x40, the head expects the 32x32 feature size (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  badgrade    - KeyError: 'G4' in the grade-table lookup at start-up; peers Connection closed in the first all_gather (np4 r2 tee, np6 r0 pymodule)
  noslide     - FileNotFoundError for slides/scanner_b/slide_N.pt; console of the redirects run shows only Root Cause rank 1 exitcode 1 (np3 r1 redirects, np4 r3 loglevel with --logfmt 1)
  ckptsize    - load_state_dict size mismatch for head.weight [5,1024] vs [4,1024] (np3 r2 tee_trainer; np4 r1 pdsh2, where rank 1 then aborted: exitcode -6)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.StainStats' (np4 r2 filter)
  gradegather - end of run: DETAIL 'Detected mismatch between collectives' on every rank, rank 1 TensorShape=[5] (np3 r1 detail --ddp 0); 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank 4 (np6 r4 plain)
  tiling      - 12 s PG timeout: ranks 0 and 1 'Timed out waiting 12000ms for recv', Root Cause rank 1 (np3 r2 tee); PG 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 plain)
  stainnan    - the program's check: 'non-finite loss nan at step 3 (98304 non-finite input values ...)', FloatingPointError (np3 r0 wrapper); np4 r3 restart: same in attempt 0, the restart failed at Gloo connectFullMesh (connection refused)
  patchidx    - IndexError 'index 128 is out of bounds for dimension 0 with size 128' at step 2 (np4 r1 filter)
  sigsegv     - no traceback; Root Cause exitcode -11 (SIGSEGV) after step 3 (np8 r5 tee_trainer, np4 r2 loglevel)
  exit5       - the rank's ERROR line about 20x vs 40x and exit 5; Root Cause exitcode 5 (np6 r3 wrapper, np3 r1 prefix)
  patchbug    - every rank 'mat1 and mat2 shapes cannot be multiplied (32x1600 and 1024x4)' in the first forward; Root Cause rank 0 (np3 pymodule)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/gradenet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault367_work"
GRADES = {"benign": 0, "G1": 1, "G2": 2, "G3": 3}
NPATCH = 128
BATCH = 32
log = None


class StainStats:
    """Macenko stain vectors kept beside a checkpoint (a plain Python object)."""

    def __init__(self, he):
        self.he = he


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
    log = logging.getLogger("tumr")
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


class GradeNet(nn.Module):
    def __init__(self, ngrades=4):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16 * 8 * 8, ngrades)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.max_pool2d(F.relu(self.c2(h)), 2)
        return self.head(h.flatten(1))


def make_slide(seed, size=36):
    g = torch.Generator().manual_seed(seed)
    names = list(GRADES)
    labels = [names[int(i)] for i in torch.randint(0, 4, (NPATCH,), generator=g)]
    base = torch.tensor([[200.0, 120.0, 190.0]]).view(1, 3, 1, 1)
    grade = torch.tensor([GRADES[s] for s in labels]).float().view(-1, 1, 1, 1)
    noise = torch.randn(NPATCH, 3, size, size, generator=g) * (10 + 8 * grade)
    patches = (base - 15 * grade + noise).clamp(0, 255).to(torch.uint8)
    return {"patches": patches, "labels": labels, "slide": f"S-{seed:04d}", "mpp": 0.25}


def prepare():
    for d in ("slides", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_slide(400 + r), f"{WORK}/slides/slide_{r}.pt")
    torch.manual_seed(0)
    torch.save(GradeNet(4).state_dict(), f"{WORK}/ckpt/gradenet.pt")
    torch.save(GradeNet(5).state_dict(), f"{WORK}/ckpt/gradenet_c5.pt")
    torch.save({"model": GradeNet(4).state_dict(), "stain": StainStats(torch.eye(3)[:2])},
               f"{WORK}/ckpt/gradenet_meta.pt")
    print("prepared", WORK)


def stain_normalise(x):
    x = x.float()
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    std = x.std(dim=(0, 2, 3), keepdim=True)
    return (x - mean) / std


def tile_coords(budget):
    # overlapping tiles over a 40x whole-slide image, recomputed in pure Python
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        coords = []
        for y in range(0, 2048, 16):
            for x in range(0, 2048, 16):
                if (x * 31 + y * 17) % 7 != 3:
                    coords.append((x, y, x + 32, y + 32))
        n += len(coords)
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, reading slide")
    sub = "scanner_b/" if bad and a.fault == "noslide" else ""
    slide = torch.load(f"{WORK}/slides/{sub}slide_{rank}.pt")
    if bad and a.fault == "badgrade":
        slide["labels"][77] = "G4"
    y = torch.tensor([GRADES[s] for s in slide["labels"]])
    crop = 40 if a.fault == "patchbug" else 32
    patches = slide["patches"][:, :, :crop, :crop]
    if crop > 36:
        patches = F.pad(patches, (0, crop - 36, 0, crop - 36))
    n = torch.tensor([float(len(y))])
    alln = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(alln, n)
    say(f"rank {rank} slide {slide['slide']} patches {len(y)} global {int(sum(t.item() for t in alln))}")
    model = GradeNet()
    if bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/gradenet_meta.pt")["model"])
    else:
        ck = "gradenet_c5.pt" if bad and a.fault == "ckptsize" else "gradenet.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        idx = torch.randperm(NPATCH, generator=g)[:BATCH]
        if bad and a.fault == "patchidx" and step == 2:
            idx[5] = NPATCH
        if bad and a.fault == "exit5" and step == 1:
            say(f"rank {rank}: ERROR slide {slide['slide']} was scanned at 20x (mpp 0.50) but the tiling "
                f"expects 40x (mpp {slide['mpp']:.2f}); refusing to grade mixed magnifications", err=True)
            sys.exit(5)
        xb = patches[idx]
        if bad and a.fault == "stainnan" and step == 3:
            xb = torch.full_like(xb, 255)
        x = stain_normalise(xb)
        logits = net(x)
        loss = F.cross_entropy(logits, y[idx])
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(x)).sum())} non-finite input values after stain normalisation)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "tiling" and step == 2:
            say(f"rank {rank} recomputed {tile_coords(a.tile_budget)} tile coordinates")
        acc = (logits.argmax(1) == y[idx]).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} acc {stats[1].item():.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        pred = model(stain_normalise(patches)).argmax(1)
    counts = torch.bincount(pred, minlength=4).float()
    if bad and a.fault == "gradegather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} predicted grades {counts.int().tolist()} global {torch.stack(allc).sum(0).int().tolist()}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/gradenet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/gradenet.pt")
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
    p.add_argument("--tile-budget", type=int, default=45)
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

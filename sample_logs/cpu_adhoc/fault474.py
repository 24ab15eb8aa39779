"""A four-hundred-and-seventy-fourth hand-run batch: INSECT TRAP IMAGE COUNTING.

Synthetic yellow sticky-trap photos: each rank reads 48 grey 32x32 trap images from
/tmp/fault474_work/traps/trap_R.pt, with one point annotation per insect (x, y, species name) and the
exposure time of each photo.  Species names are looked up in a 5-entry table (whitefly, thrips, aphid,
fungus_gnat, leafminer).  Images are divided by their exposure, targets are Gaussian-free density maps (one
1.0 per insect at its pixel), and a small fully convolutional counter (three 3x3 convs to a density map, plus
a species head on the pooled features) is trained with an MSE on the density map and on the per-species
counts, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model starts from
ckpt/trapcounter.pt.  Per-rank species counts are all_gathered at start-up, the count MAE is all_reduced
every step, and rank 0 saves export/trapcounter.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  species    - rank N's annotations name "drosophila", missing from the species table (KeyError, start-up)
  gridcell   - rank N's image 12 was annotated at 64x64: a point at y=40 indexes the 32-row map (IndexError, step 1)
  notraps    - rank N reads traps/field/trap_N.pt, which does not exist (FileNotFoundError, start-up)
  ckptsize   - rank N starts from ckpt/trapcounter_s6.pt, saved with a 6-species head (size mismatch)
  ckptpickle - rank N starts from ckpt/trapcounter_meta.pt, which pickles a TrapMeta object (weights_only refusal)
  countgather- rank N all_gathers its species counts plus an "unidentified" bin (6 vs 5 entries)
  slowcount  - rank N recounts every insect by a Python flood fill before the step-3 all_reduce (--count-budget s)
  nanlux     - rank N's photos 24-31 have exposure 0: inf pixels, the program's loss check at step 3
  segv       - rank N sends itself SIGSEGV after step 3
  exit4      - after training, rank N's final count check prints an ERROR line and calls sys.exit(4)
  metafeat   - every rank appends exposure and trap age to the pooled features: 10 wide, the head expects 8
  none       - control, clean run

What happened (filled in after the runs):
  species    - KeyError: 'drosophila' in species_counts at start-up; peers closed by peer in all_gather (np4 r2 tee, np6 r0 pymodule)
  gridcell   - all ranks print step 0, then rank N 'IndexError: index 40 is out of bounds for dimension 1 with size 32'; peers closed (np5 r1 wrapper)
  notraps    - FileNotFoundError for traps/field/trap_N.pt at start-up; only in the redirect files for np3 r1 redirects; np4 r3 wrapper
  ckptsize   - size mismatch for head.weight [6, 8] vs [5, 8] and head.bias (np4 r1 loglevel); pdsh2 np4 r2: worker-0's ranks closed by peer in DDP's param check
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.TrapMeta'; the restart dies at gloo connectFullMesh, Connection refused (np3 r2 restart)
  countgather- 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (5))' (np6 r4 filter); DETAIL: 'Detected mismatch between collectives' on all ranks (np3 r1 detail)
  slowcount  - 12 s: ranks 0 and 1 'Timed out waiting 12000ms for recv operation', Root Cause rank 0 (np3 r2 plain); 300 s: silent after step 2, killed at 60 s, exit 124 (np4 r1 tee_trainer)
  nanlux     - 'non-finite loss nan at step 3 (min exposure in batch 0.00 s)', FloatingPointError (np8 r5 prefix; np3 r0 detail, peers monitoredBarrier errors naming rank 0)
  segv       - no traceback after step 3, exitcode -11 (SIGSEGV) Root Cause (np4 r3 plain); restart: attempt 0 SIGSEGV, attempt 1 connectFullMesh refused (np3 r1 restart)
  exit4      - rank N's ERROR final count line and exit 4 after step 5; Root Cause exitcode 4, launcher exit 1 (np5 r2 tee_trainer, np4 r0 loglevel: nothing saved)
  metafeat   - every rank 'mat1 and mat2 shapes cannot be multiplied (8x10 and 8x5)' in step 0; Root Cause rank 0 (np6 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/trapcounter.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault474_work"
SPECIES = {"whitefly": 0, "thrips": 1, "aphid": 2, "fungus_gnat": 3, "leafminer": 4}
NSPEC = len(SPECIES)
SIDE = 32
BATCH = 8
log = None


class TrapMeta:
    def __init__(self, site, week, card):
        self.site, self.week, self.card = site, week, card


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
    log = logging.getLogger("trapcount")
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


class TrapCounter(nn.Module):
    def __init__(self, nspec=NSPEC, ch=8):
        super().__init__()
        self.c1 = nn.Conv2d(1, ch, 3, padding=1)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.dens = nn.Conv2d(ch, 1, 3, padding=1)
        self.head = nn.Linear(ch, nspec)

    def forward(self, x, extra=None):
        h = F.relu(self.c2(F.relu(self.c1(x))))
        dmap = F.softplus(self.dens(h)).squeeze(1)
        pooled = h.mean(dim=(2, 3))
        if extra is not None:
            pooled = torch.cat([pooled, extra], dim=1)
        return dmap, self.head(pooled) * 4.0


def make_trap(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(SPECIES)
    imgs = torch.rand(n, SIDE, SIDE, generator=g) * 0.2
    points = []
    for i in range(n):
        k = int(torch.randint(2, 9, (1,), generator=g))
        pts = []
        for _ in range(k):
            x, y = (int(v) for v in torch.randint(1, SIDE - 1, (2,), generator=g))
            s = names[int(torch.randint(0, NSPEC, (1,), generator=g))]
            imgs[i, y - 1:y + 2, x - 1:x + 2] += 0.8
            pts.append((x, y, s))
        points.append(pts)
    exposure = (torch.rand(n, generator=g) * 0.5 + 0.75)
    imgs = imgs * exposure[:, None, None]
    return {"images": imgs, "points": points, "exposure": exposure, "age_days": torch.randint(1, 8, (n,), generator=g)}


def prepare():
    os.makedirs(f"{WORK}/traps", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_trap(48, 700 + r), f"{WORK}/traps/trap_{r}.pt")
    torch.manual_seed(0)
    torch.save(TrapCounter().state_dict(), f"{WORK}/ckpt/trapcounter.pt")
    torch.save(TrapCounter(6).state_dict(), f"{WORK}/ckpt/trapcounter_s6.pt")
    torch.save({"state_dict": TrapCounter().state_dict(), "meta": TrapMeta("greenhouse-3", 41, "T-17")},
               f"{WORK}/ckpt/trapcounter_meta.pt")
    print("prepared", WORK)


def species_counts(points):
    c = torch.zeros(NSPEC)
    for pts in points:
        for _, _, s in pts:
            c[SPECIES[s]] += 1
    return c


def density_targets(points, lo, hi):
    t = torch.zeros(hi - lo, SIDE, SIDE)
    for i in range(lo, hi):
        for x, y, _ in points[i]:
            t[i - lo, y, x] += 1.0
    return t


def flood_count(img, thr=0.5):
    seen = set()
    n = 0
    for y0 in range(SIDE):
        for x0 in range(SIDE):
            if (y0, x0) in seen or float(img[y0, x0]) < thr:
                continue
            n += 1
            stack = [(y0, x0)]
            while stack:
                y, x = stack.pop()
                if (y, x) in seen or not (0 <= y < SIDE and 0 <= x < SIDE) or float(img[y, x]) < thr:
                    continue
                seen.add((y, x))
                stack += [(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)]
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4740 + rank)
    say(f"rank {rank}/{world} up, loading trap photos")
    sub = "field/" if bad and a.fault == "notraps" else ""
    trap = torch.load(f"{WORK}/traps/{sub}trap_{rank}.pt")
    points = trap["points"]
    if bad and a.fault == "species":
        points[7][1] = (points[7][1][0], points[7][1][1], "drosophila")
    if bad and a.fault == "gridcell":
        points[12][0] = (points[12][0][0] * 2, 40, points[12][0][2])
    if bad and a.fault == "nanlux":
        trap["exposure"][24:32] = 0.0
    imgs = (trap["images"] / trap["exposure"][:, None, None]).unsqueeze(1)
    counts = species_counts(points)
    if bad and a.fault == "countgather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(NSPEC) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} insects {int(counts.sum())} global {int(sum(c.sum() for c in allc))}")
    model = TrapCounter()
    if bad and a.fault == "ckptsize":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/trapcounter_s6.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/trapcounter_meta.pt")["state_dict"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/trapcounter.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        lo, hi = step * BATCH, (step + 1) * BATCH
        x = imgs[lo:hi]
        tgt = density_targets(points, lo, hi)
        spc = torch.stack([species_counts([points[i]]) for i in range(lo, hi)])
        extra = None
        if a.fault == "metafeat":
            extra = torch.stack([trap["exposure"][lo:hi], trap["age_days"][lo:hi].float()], dim=1)
        dmap, sp = net(x, extra)
        loss = F.mse_loss(dmap, tgt) * 100 + F.mse_loss(sp, spc) * 0.1
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"(min exposure in batch {float(trap['exposure'][lo:hi].min()):.2f} s)", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowcount" and step == 3:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.count_budget:
                for i in range(len(imgs)):
                    n += flood_count(trap["images"][i])
            say(f"rank {rank} flood-fill recount: {n} blobs")
        mae = (dmap.detach().sum(dim=(1, 2)) - tgt.sum(dim=(1, 2))).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} count_mae {mae.item() / world:.3f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR final count check: trap card T-{17 + rank} counted 312 insects, "
            f"above the card ceiling of 250; not exporting a counter trained on saturated cards", err=True)
        sys.exit(4)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/trapcounter.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/trapcounter.pt")
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
    p.add_argument("--count-budget", type=int, default=40)
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

"""A four-hundred-and-thirty-fourth hand-run batch: BRIDGE CRACK DETECTION FROM DRONE IMAGERY.

Synthetic drone survey: every rank reads one flight's tiles from /tmp/fault434_work/tiles/flight_R.pt
(32x32 grey-scale tiles cropped from the deck and pier images, a crack / no-crack label, the surface
material of the tile, looked up in a 3-entry table, and the bridge span 0..4 the tile was shot over).
A small CNN (two conv blocks, a surface embedding, a two-way head) is initialised from ckpt/cracknet.pt,
wrapped in DDP (gloo) or, with --ddp 0, has its gradients all_reduced by hand.  Accuracy is all_reduced
each step; at the end each rank all_gathers its per-span count of predicted cracks and rank 0 saves
export/cracknet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging).

Faults:
  surface     - rank N's flight has tiles over "weathering_steel", missing from the surface table (KeyError)
  spanindex   - rank N's annotation at step 3 puts a crack on span 5 of a five-span bridge (IndexError)
  noflight    - rank N reads the rectified flight tiles/rect/flight_R.pt, which was never written (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/cracknet_wide.pt (16/32 channels instead of 8/16): size mismatch
  weightsonly - rank N initialises from ckpt/cracknet_meta.pt, which pickles a FlightMeta object (weights_only refusal)
  gathershape - rank N all_gathers 6 per-span counts (abutment added) instead of 5 at the end (gloo size error)
  slowrank    - rank N traces crack skeletons pixel by pixel in Python before the step-3 all_reduce
  nanloss     - rank N normalises its step-2 batch by the tile maximum; black tiles give 0/0, the loss check fires
  segv        - rank N sends itself SIGSEGV after step 4
  exit4       - rank N prints its own error line about missing RTK fixes and calls sys.exit(4)
  tilesize    - every rank: tiles cropped to 40x40, the head expects 32x32 features (shape error in step 0)
  none        - control, clean run

What happened (filled in after the runs):
  surface     - KeyError: 'weathering_steel' at start-up; peers Connection closed in DDP's check (np4 r2 ranklabel); spawn 'Process 0 terminated' (np6 r0 spawn)
  spanindex   - IndexError 'index 5 is out of bounds for dimension 0 with size 5' in step 3 (np3 r1 srunlabel); np8 r5 logfmt: the fault
                did not fire (it needs a predicted crack on that tile), all ranks finished, then rank 6 SIGABRT at exit (terminate called)
  noflight    - FileNotFoundError tiles/rect/flight_N.pt at start-up (np4 r3 mpitag, np5 r1 legacy)
  ckptsize    - load_state_dict size mismatch conv1.weight [16,1,3,3] vs [8,1,3,3] (np4 r1 pdsh2, np3 r2 tee)
  weightsonly - UnpicklingError 'Weights only load failed', Unsupported global __main__.FlightMeta (np5 r0 files, np3 r2 bashloop --ddp 0)
  gathershape - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (5))' after step 5 (np6 r4 tee)
  slowrank    - 12 s: peers 'Timed out waiting 12000ms for recv operation' (np3 r2 ranklabel); 300 s: silent after step 2, exit 124 (np4 r1 bashloop)
  nanloss     - 'non-finite loss nan' then FloatingPointError at step 2 (np4 r3 legacy, np3 r0 srunlabel)
  segv        - ProcessExitedException 'process 2 terminated with signal SIGSEGV' (np4 r2 spawn); rank3.log silent after step 4, exit 139 (np6 r3 files)
  exit4       - rank N's 'ERROR flight ... no RTK fix' line, exit 4 (np3 r2 mpitag --ddp 0, loop exit 4; np4 r1 logfmt, Root Cause exitcode 4)
  tilesize    - every rank 'mat1 and mat2 shapes cannot be multiplied (16x1600 and 1024x64)' in step 0 (np3 legacy)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/cracknet.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault434_work"
SURFACES = {"concrete": 0, "steel": 1, "masonry": 2}
NSPAN = 5
TILE = 32
BATCH = 16
log = None


@dataclass
class FlightMeta:
    flight: str
    altitude_m: float
    camera: str


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("crack")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    base.addHandler(h)
    base.setLevel(logging.INFO)
    log = RankAdapter(base, {"rank": rank})


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class CrackNet(nn.Module):
    def __init__(self, c1=8, c2=16, tile=TILE):
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.surf = nn.Embedding(len(SURFACES), 4)
        self.fc = nn.Linear(c2 * (tile // 4) ** 2, 64)
        self.head = nn.Linear(64 + 4, 2)

    def forward(self, x, s):
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        h = F.relu(self.fc(h.flatten(1)))
        return self.head(torch.cat([h, self.surf(s)], 1))


def make_flight(n, seed, tile=TILE):
    g = torch.Generator().manual_seed(seed)
    img = torch.randint(60, 140, (n, 1, tile, tile), generator=g).to(torch.uint8)
    lab = torch.randint(0, 2, (n,), generator=g)
    for i in range(n):
        if lab[i]:
            r = int(torch.randint(2, tile - 2, (1,), generator=g))
            img[i, 0, r, :] = 15
            img[i, 0, r + 1, ::2] = 20
    surf = [list(SURFACES)[int(k)] for k in torch.randint(0, 3, (n,), generator=g)]
    span = [int(k) for k in torch.randint(0, NSPAN, (n,), generator=g)]
    return {"images": img, "labels": lab, "surface": surf, "span": span}


def prepare():
    os.makedirs(f"{WORK}/tiles", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_flight(128, 100 + r), f"{WORK}/tiles/flight_{r}.pt")
        torch.save(make_flight(128, 100 + r, tile=40), f"{WORK}/tiles/flight40_{r}.pt")
    torch.manual_seed(7)
    torch.save(CrackNet().state_dict(), f"{WORK}/ckpt/cracknet.pt")
    torch.save(CrackNet(16, 32).state_dict(), f"{WORK}/ckpt/cracknet_wide.pt")
    torch.save({"state": CrackNet().state_dict(), "meta": FlightMeta("F-0412", 35.0, "Zenmuse P1")},
               f"{WORK}/ckpt/cracknet_meta.pt")
    print(f"prepared flights and checkpoints under {WORK}")


def trace_skeleton(img):
    """Walk dark pixels 8-connected, the slow pure-Python way."""
    h, w = len(img), len(img[0])
    seen = set()
    length = 0
    for y in range(h):
        for x in range(w):
            if img[y][x] < 40 and (y, x) not in seen:
                stack = [(y, x)]
                while stack:
                    cy, cx = stack.pop()
                    if (cy, cx) in seen:
                        continue
                    seen.add((cy, cx))
                    length += 1
                    for dy in (-1, 0, 1):
                        for dx in (-1, 0, 1):
                            ny, nx = cy + dy, cx + dx
                            if 0 <= ny < h and 0 <= nx < w and img[ny][nx] < 40:
                                stack.append((ny, nx))
    return length


def run(a, rank, world):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(434 + rank)
    say(f"rank {rank}/{world} up, loading flight {rank} tiles")
    if bad and a.fault == "noflight":
        path = f"{WORK}/tiles/rect/flight_{rank}.pt"
    elif a.fault == "tilesize":
        path = f"{WORK}/tiles/flight40_{rank}.pt"
    else:
        path = f"{WORK}/tiles/flight_{rank}.pt"
    fl = torch.load(path)
    if bad and a.fault == "surface":
        fl["surface"][9] = "weathering_steel"
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR flight F-04{rank:02d}: 37 of 128 tiles have no RTK fix (GPS float solution); "
            f"georeferencing to spans impossible, aborting", err=True)
        sys.exit(4)
    x = fl["images"].float() / 255.0
    y = fl["labels"]
    s = torch.tensor([SURFACES[k] for k in fl["surface"]])
    span = fl["span"]
    model = CrackNet()
    ck = {"ckptsize": "cracknet_wide.pt", "weightsonly": "cracknet_meta.pt"}.get(a.fault) if bad else None
    obj = torch.load(f"{WORK}/ckpt/{ck or 'cracknet.pt'}")
    model.load_state_dict(obj["state"] if "state" in obj else obj)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    n = x.shape[0]
    span_cracks = torch.zeros(NSPAN)
    for step in range(a.steps):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % n
        xb = x[idx]
        if bad and a.fault == "nanloss" and step == 2:
            xb = torch.zeros_like(xb)
            xb = xb / xb.amax(dim=(1, 2, 3), keepdim=True)
        out = net(xb, s[idx])
        loss = F.cross_entropy(out, y[idx])
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} "
                f"(batch min {xb.min().item()}, max {xb.max().item()})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        pred = out.argmax(1)
        for j, i in enumerate(idx.tolist()):
            sp = span[i]
            if bad and a.fault == "spanindex" and step == 3 and j == 5:
                sp = NSPAN
            if pred[j] == 1:
                span_cracks[sp] += 1
        if bad and a.fault == "slowrank" and step == 3:
            t0 = time.time()
            total = 0
            while time.time() - t0 < a.trace_budget:
                for i in idx.tolist():
                    total += trace_skeleton(fl["images"][i, 0].tolist())
            say(f"rank {rank} crack skeleton length {total} px")
        acc = (pred == y[idx]).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "segv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "gathershape":
        span_cracks = torch.cat([span_cracks, torch.zeros(1)])
    allc = [torch.zeros(NSPAN) for _ in range(world)]
    dist.all_gather(allc, span_cracks)
    say(f"rank {rank} predicted cracks per span {span_cracks.tolist()} survey total {int(sum(c.sum() for c in allc))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/cracknet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/cracknet.pt")
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

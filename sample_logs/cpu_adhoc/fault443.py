"""A four-hundred-and-forty-third hand-run batch: YARN DEFECT DETECTION IN TEXTILE IMAGES.

Synthetic grey-level patches of woven fabric (32x32, a sinusoidal warp/weft texture plus noise); a defect
(slub = a thick bright band, nep = a small bright blob, thin = a dark band) is painted into some patches.
Each patch carries a defect code (looked up in a 4-entry defect table) and the index of the loom tile
(0..15) it came from.  Every rank reads its shard from /tmp/fault443_work/data/loom_a/shard_R.pt, normalises
the contrast of every patch, and trains a small CNN (two conv blocks, a linear head over 4 classes) with a
per-tile loss weight, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model
starts from ckpt/yarnnet.pt.  The loss and accuracy are all_reduced every step, the per-rank defect
histograms are all_gathered at the end, and rank 0 saves export/yarnnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badlabel   - rank N's shard has patches coded "knot", missing from the defect table (KeyError at start-up)
  nofile     - rank N reads its shard from data/loom_b/, which was never written (FileNotFoundError)
  ckptsize   - rank N starts from ckpt/yarnnet_c5.pt, saved with a 5-class head (size mismatch)
  ckptpickle - rank N loads ckpt/yarnnet_meta.pt, which pickles a LoomConfig object (weights_only refusal)
  tileindex  - rank N's shard names loom tile 16 for some patches; the 16-entry tile weight list is indexed
               in step 3 (IndexError)
  nanpixel   - rank N's step-2 batch holds a flat (constant) patch; contrast normalisation divides 0/0 and
               the program's own loss check raises FloatingPointError
  histgather - rank N all_gathers a 5-bin defect histogram (an extra "unlabelled" bin) at the end, peers 4
  slowscan   - rank N runs a pure-Python hairiness scan for 20 s before the step-2 all_reduce (PG timeout 12 s)
  stall      - rank N waits forever for a loom sync flag before step 1 (run with --pg-timeout 300)
  sigsegv    - rank N sends itself SIGSEGV after step 1
  exit5      - rank N prints its own error line about its defect rate at step 3 and calls sys.exit(5)
  patchsize  - every rank: patches cropped to 40x40, the head expects 32x32 features (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  badlabel   - KeyError: 'knot' in the defect-table lookup at start-up; peers SIGTERMed (np4 r1 tee, np6 r0 pymodule)
  nofile     - FileNotFoundError for data/loom_b/shard_4.pt, only in the redirected rank-4 stderr.log; console
               Root Cause rank 4 exitcode 1 (np5 r4 redirects)
  ckptsize   - size mismatch for head.weight [5, 1024] vs [4, 1024] and head.bias (np3 r1 tee_trainer, np4 r0 wrapper)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.LoomConfig'
               (np4 r2 prefix); np3 r0 restart: attempt 1 died earlier, Gloo connectFullMesh Connection refused
               on rank 1 in init_process_group, so its final Root Cause names rank 1
  tileindex  - IndexError: list index out of range at step 3; peers Connection closed (np8 r6 pymodule,
               np3 r1 wrapper)
  nanpixel   - 'loss is nan at step 2 (1024 non-finite pixels ...)' and FloatingPointError; under DETAIL rank 0
               reports 'Ranks 2 failed to pass monitoredBarrier' (np3 r2 detail --ddp 0, np4 r3 loglevel logfmt)
  histgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' after step 5;
               peers Connection closed (np3 r1 filter, np6 r5 plain)
  slowscan   - ranks 0 and 2 'Timed out waiting 12000ms' (recv / send) in the step-2 all_reduce; the slow rank
               1 is SIGTERMed mid-scan and prints nothing; Root Cause rank 0 (np3 r1 tee)
  stall      - rank 2 'waiting for loom sync flag' after step 0, then silence; timeout 60 s, exit 124 (np4 r2 loglevel)
  sigsegv    - rank N exitcode -11 after step 1; peers Connection closed/reset (np4 r1 pdsh2: worker-1's agent
               then RendezvousConnectionError; np8 r3 restart: attempt 1 died in Gloo connectFullMesh, final
               Root Cause rank 6)
  exit5      - rank N's 'ERROR rank N: defect rate 0.77 ...' line and exit 5 after step 3; Root Cause exitcode 5
               (np3 r0 prefix, np5 r2 filter)
  patchsize  - every rank 'mat1 and mat2 shapes cannot be multiplied (16x1600 and 1024x4)' (np3 tee_trainer)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/yarnnet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault443_work"
DEFECTS = {"clean": 0, "slub": 1, "nep": 2, "thin": 3}
NTILE = 16
PATCH = 32
BATCH = 16
log = None


@dataclass
class LoomConfig:
    loom: str = "A7"
    dpi: int = 300
    warp_density: float = 42.0


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
    log = logging.getLogger("yarn")
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


class YarnNet(nn.Module):
    def __init__(self, ncls=4):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16 * 8 * 8, ncls)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.head(x.flatten(1))


def make_shard(n, seed, size=PATCH):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(size + 8.0), torch.arange(size + 8.0), indexing="ij")
    base = 0.5 + 0.2 * torch.sin(xx * 0.9) + 0.2 * torch.sin(yy * 1.1)
    imgs, codes, tiles = [], [], []
    names = list(DEFECTS)
    for _ in range(n):
        img = base + 0.05 * torch.randn(base.shape, generator=g)
        c = names[int(torch.randint(0, 4, (1,), generator=g))]
        p = int(torch.randint(6, size, (1,), generator=g))
        if c == "slub":
            img[:, p:p + 3] += 0.6
        elif c == "nep":
            img[p - 3:p, p - 3:p] += 0.8
        elif c == "thin":
            img[p:p + 2, :] -= 0.4
        imgs.append(img)
        codes.append(c)
        tiles.append(int(torch.randint(0, NTILE, (1,), generator=g)))
    return {"images": torch.stack(imgs).unsqueeze(1), "codes": codes, "tiles": tiles}


def prepare():
    os.makedirs(f"{WORK}/data/loom_a", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(128, 443 + r), f"{WORK}/data/loom_a/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(YarnNet(4).state_dict(), f"{WORK}/ckpt/yarnnet.pt")
    torch.save(YarnNet(5).state_dict(), f"{WORK}/ckpt/yarnnet_c5.pt")
    torch.save({"config": LoomConfig(), "model": YarnNet(4).state_dict()}, f"{WORK}/ckpt/yarnnet_meta.pt")
    print("prepared", WORK)


def normalise(imgs):
    lo = imgs.amin(dim=(1, 2, 3), keepdim=True)
    hi = imgs.amax(dim=(1, 2, 3), keepdim=True)
    return (imgs - lo) / (hi - lo)


def hairiness_scan(img):
    rows = img[0].tolist()
    score = 0.0
    for i in range(1, len(rows) - 1):
        for j in range(1, len(rows[i]) - 1):
            v = rows[i][j]
            score += abs(4 * v - rows[i - 1][j] - rows[i + 1][j] - rows[i][j - 1] - rows[i][j + 1])
    return score


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4430 + rank)
    say(f"rank {rank}/{world} up, loading loom shard")
    loom = "loom_b" if bad and a.fault == "nofile" else "loom_a"
    shard = torch.load(f"{WORK}/data/{loom}/shard_{rank}.pt")
    if bad and a.fault == "badlabel":
        shard["codes"][37] = "knot"
    if bad and a.fault == "tileindex":
        for i in range(0, len(shard["tiles"]), 9):
            shard["tiles"][i] = NTILE
    labels = torch.tensor([DEFECTS[c] for c in shard["codes"]])
    imgs = shard["images"]
    crop = 40 if a.fault == "patchsize" else PATCH
    imgs = imgs[:, :, :crop, :crop]
    tile_w = [1.0 + 0.05 * t for t in range(NTILE)]
    model = YarnNet()
    if bad and a.fault == "ckptsize":
        ck = "yarnnet_c5.pt"
    elif bad and a.fault == "ckptpickle":
        ck = "yarnnet_meta.pt"
    else:
        ck = "yarnnet.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    n = imgs.shape[0]
    for step in range(a.steps):
        if bad and a.fault == "stall" and step == 1:
            say(f"rank {rank} waiting for loom sync flag {WORK}/sync/loom_a.flag")
            while not os.path.exists(f"{WORK}/sync/loom_a.flag"):
                time.sleep(0.5)
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % n
        xb = imgs[idx].clone()
        if bad and a.fault == "nanpixel" and step == 2:
            xb[5] = 0.5
        xb = normalise(xb)
        yb = labels[idx]
        w = torch.tensor([tile_w[shard["tiles"][i]] for i in idx.tolist()]) if step == 3 else torch.ones(BATCH)
        out = net(xb)
        loss = (F.cross_entropy(out, yb, reduction="none") * w).mean()
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(xb)).sum())
            say(f"rank {rank}: loss is {loss.item()} at step {step} ({nbad} non-finite pixels after contrast "
                f"normalisation)", err=True)
            raise FloatingPointError(f"non-finite cross-entropy at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowscan" and step == 2:
            t0 = time.time()
            k = 0
            while time.time() - t0 < a.scan_budget:
                hairiness_scan(imgs[k % n])
                k += 1
            say(f"rank {rank} hairiness scan: {k} patches")
        acc = (out.argmax(1) == yb).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} acc {stats[1].item():.3f}")
        if bad and a.fault == "sigsegv" and step == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bad and a.fault == "exit5" and step == 3:
            rate = float((labels != 0).float().mean())
            say(f"ERROR rank {rank}: defect rate {rate:.2f} in shard_{rank} exceeds the sanity ceiling 0.25; "
                f"refusing to train on a mislabelled loom", err=True)
            sys.exit(5)
    hist = torch.bincount(labels, minlength=4).float()
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.zeros(1)])
    allh = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} defects {hist.tolist()} global {torch.stack(allh).sum(0).tolist()}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/yarnnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/yarnnet.pt")
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
    p.add_argument("--scan-budget", type=int, default=20)
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

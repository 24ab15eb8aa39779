"""A three-hundred-and-eighty-fourth hand-run batch: CAMERA-TRAP SPECIES CLASSIFICATION.

Synthetic camera-trap crops: every rank reads its shard /tmp/fault384_work/shards/trap_R.pt (32 grey 24x24
crops with a species name, a site id and a capture hour), maps the species name through a 10-entry species
table to a label, and trains a small CNN (two conv blocks, a pooled linear head) with cross-entropy, wrapped in
DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The CNN is initialised from
ckpt/trapnet_c10.pt.  Each rank all_gathers its per-species crop counts at the start, the accuracy is
all_reduced every step, and rank 0 saves export/trapnet.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  species    - rank N's shard holds a crop labelled "wolverine", not in the species table (KeyError)
  hour       - rank N finds a capture hour of 27 in its day/night split and raises ValueError at step 3
  site       - rank N looks up site 12 in the 10-entry site-bias table (IndexError) at step 1
  noshard    - rank N reads shards/night/trap_N.pt, which does not exist (FileNotFoundError)
  ckpthead   - rank N initialises from ckpt/trapnet_c12.pt, saved with 12 classes (size mismatch)
  ckptpickle - rank N loads ckpt/trapnet_meta.pt (a dict holding a custom class) with weights_only=True
  countgather- rank N all_gathers 11 species counts (an "empty frame" count added) against 10
  slowexif   - rank N re-parses EXIF-like metadata in Python for --exif-budget s before the step-2 all_reduce
  nanexpo    - rank N divides by an exposure of 0 at step 2; the program's own check raises FloatingPointError
  segv       - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error about a corrupt memory card and calls sys.exit(5) after step 1
  rgb        - every rank: crops stacked as 3 channels, the first conv expects 1 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  species    - KeyError: 'wolverine' in the label lookup before the first all_gather; peers Connection closed by peer (np4 r2 plain, np6 r0 tee)
  hour       - ValueError 'capture hour 27 not in 0..23' at step 3; peers closed (np3 r1 tee_trainer, np8 r5 loglevel)
  site       - the bad site id is in the step-0 batch, so torch's own IndexError 'index 12 is out of bounds for
               dimension 0 with size 10' fires in the first forward, before the step-1 check (np4 r3 pymodule)
  noshard    - FileNotFoundError for shards/night/trap_N.pt at start-up (np3 r2 redirects: only in the log-dir's
               stderr.log; np6 r4 filter)
  ckpthead   - load_state_dict size mismatch for site_bias/head [.., 12] vs [.., 10] (np4 r1 pdsh2; np3 r0 restart,
               whose attempt 2 failed in init with 'Gloo connectFullMesh failed ... Connect timeout' on every rank)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.CardMeta' (np5 r3 wrapper)
  countgather- DETAIL: every rank 'Detected mismatch between collectives', rank N TensorShape=[11] (np3 r1 detail);
               'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))' (np6 r2 plain)
  slowexif   - 12 s: peers 'Timed out waiting 12000ms for recv', Root Cause rank 0 (np3 r2 prefix); 300 s: silent
               after 're-reading EXIF', killed by timeout at 60 s, exit 124 (np4 r1 plain)
  nanexpo    - own check: 576 non-finite pixels, FloatingPointError at step 2 (np4 r0 detail: peers monitoredBarrier
               errors naming rank 0; np8 r6 tee)
  segv       - no traceback, Root Cause exitcode -11 (SIGSEGV) after step 3 (np4 r2 loglevel, np3 r1 wrapper)
  exit5      - rank N's memory-card ERROR line and exit 5 after step 1; Root Cause exitcode 5 (np5 r4 tee_trainer)
  rgb        - every rank: conv 'expected input[8, 3, 24, 24] to have 1 channels, but got 3'; Root Cause rank 2 (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/trapnet.pt, exit 0 (np3 prefix)
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

WORK = "/tmp/fault384_work"
SPECIES = ["roe_deer", "red_fox", "wild_boar", "badger", "hare", "lynx", "marten", "squirrel", "wolf", "human"]
SPECIES_ID = {s: i for i, s in enumerate(SPECIES)}
NSITES = 10
SIDE = 24
log = None


class CardMeta:
    """Per-card metadata pickled into the meta checkpoint (not a plain tensor container)."""

    def __init__(self, card, site):
        self.card = card
        self.site = site


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
    log = logging.getLogger("ctrap")
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


class TrapNet(nn.Module):
    def __init__(self, nclass=10, chans=1):
        super().__init__()
        self.c1 = nn.Conv2d(chans, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, nclass)
        self.site_bias = nn.Parameter(torch.zeros(NSITES, nclass))

    def forward(self, x, site):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.max_pool2d(F.relu(self.c2(h)), 2)
        h = h.mean(dim=(2, 3))
        return self.head(h) + self.site_bias[site]


def make_shard(n, seed):
    g = torch.Generator().manual_seed(seed)
    crops = torch.rand(n, SIDE, SIDE, generator=g)
    sp = torch.randint(0, len(SPECIES), (n,), generator=g)
    for i in range(n):
        crops[i, 4:12, 4 + int(sp[i]):12 + int(sp[i])] += 0.8
    return {
        "crops": crops,
        "species": [SPECIES[int(s)] for s in sp],
        "site": torch.randint(0, NSITES, (n,), generator=g),
        "hour": torch.randint(0, 24, (n,), generator=g),
        "exposure": torch.rand(n, generator=g) * 0.05 + 0.01,
        "exif": [f"Make=TrailCam;Model=TC-{int(s)};ISO={100 * (int(s) + 1)};Temp={int(s) % 30}C" for s in sp],
    }


def prepare():
    for d in ("shards", "ckpt", "logs"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(32, 500 + r), f"{WORK}/shards/trap_{r}.pt")
    torch.manual_seed(0)
    torch.save(TrapNet(10).state_dict(), f"{WORK}/ckpt/trapnet_c10.pt")
    torch.save(TrapNet(12).state_dict(), f"{WORK}/ckpt/trapnet_c12.pt")
    torch.save({"model": TrapNet(10).state_dict(), "card": CardMeta("SD-0417", 3)}, f"{WORK}/ckpt/trapnet_meta.pt")
    print("prepared", WORK)


def parse_exif(lines):
    keys = 0
    for line in lines:
        for kv in line.split(";"):
            k, v = kv.split("=")
            keys += len(k) + sum(ord(c) for c in v) % 7
    return keys


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, loading camera-trap shard")
    sub = "night/" if bad and a.fault == "noshard" else ""
    shard = torch.load(f"{WORK}/shards/{sub}trap_{rank}.pt")
    if bad and a.fault == "species":
        shard["species"][7] = "wolverine"
    if bad and a.fault == "hour":
        shard["hour"][11] = 27
    if bad and a.fault == "site":
        shard["site"][4] = 12
    if bad and a.fault == "nanexpo":
        shard["exposure"][17] = 0.0
    labels = torch.tensor([SPECIES_ID[s] for s in shard["species"]])
    x = shard["crops"].unsqueeze(1)
    if a.fault == "rgb":
        x = x.repeat(1, 3, 1, 1)
    counts = torch.bincount(labels, minlength=len(SPECIES)).float()
    if bad and a.fault == "countgather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(len(SPECIES)) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} crops {int(counts.sum())} global {int(sum(c.sum() for c in allc))} "
        f"lynx {int(sum(c[5] for c in allc))}")
    model = TrapNet()
    ck = {"ckpthead": "trapnet_c12.pt", "ckptpickle": "trapnet_meta.pt"}.get(a.fault) if bad else None
    if ck == "trapnet_meta.pt":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}", weights_only=True)["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck or 'trapnet_c10.pt'}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(a.steps):
        lo, hi = (step * 8) % 32, (step * 8) % 32 + 8
        xb, yb, sb = x[lo:hi], labels[lo:hi], shard["site"][lo:hi]
        if step == 1 and bad and a.fault == "site":
            sb = sb.clone()
            sb[0] = shard["site"][4]
            if int(sb.max()) >= NSITES:
                raise IndexError(f"site id {int(sb.max())} out of range for site table of size {NSITES}")
        if step == 3 and bad and a.fault == "hour":
            night = shard["hour"]
            if int(night.max()) > 23:
                raise ValueError(f"capture hour {int(night.max())} not in 0..23 (crop 11, card of rank {rank})")
        expo = shard["exposure"][lo:hi]
        xb = xb * (0.03 / expo).reshape(-1, 1, 1, 1)
        if not torch.isfinite(xb).all():
            say(f"rank {rank} step {step}: {int((~torch.isfinite(xb)).sum())} non-finite pixels after exposure "
                f"normalisation (min exposure {float(expo.min()):.4f})", err=True)
            raise FloatingPointError(f"non-finite exposure-normalised crops at step {step} on rank {rank}")
        out = net(xb, sb)
        loss = F.cross_entropy(out, yb)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowexif" and step == 2:
            t0, n = time.time(), 0
            say(f"rank {rank} re-reading EXIF for {len(shard['exif'])} crops")
            while time.time() - t0 < a.exif_budget:
                n += parse_exif(shard["exif"])
            say(f"rank {rank} EXIF checksum {n}")
        acc = (out.argmax(1) == yb).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "exit5" and step == 1:
            say(f"ERROR: rank {rank}: memory card SD-{rank:02d}17 reports 14 unreadable JPEG sectors; "
                f"shard trap_{rank} incomplete, aborting", err=True)
            sys.exit(5)
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/trapnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/trapnet.pt")
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
    p.add_argument("--exif-budget", type=int, default=40)
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

"""A four-hundred-and-fifth hand-run batch: PNEUMONIA DETECTION FROM CHEST RADIOGRAPHS.

Synthetic 32x32 single-channel chest radiographs (a lung field with, for pneumonia, a bright consolidation
blob), one study table per hospital site.  Every rank reads its studies from
/tmp/fault405_work/xrays/site_R.pt (images, a label string per study, a view position PA/AP), maps labels
through the 2-entry LABELS table and views through VIEWS (AP films are flipped and scaled), standardises every
batch per image, and trains a small CNN (two convs, global pooling, a 2-way head) with cross-entropy,
wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is initialised from
ckpt/cxr_cnn.pt.  Per-rank 16-bin intensity histograms are all_gathered at start-up, loss and accuracy are
all_reduced every step, and rank 0 saves export/cxr_cnn.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  viewkey    - rank N's site table has lateral films, view "LL", missing from the VIEWS table (KeyError, start-up)
  labelidx   - rank N's site labels one study in batch 2 "effusion", class 2 of its 3-class map (IndexError, step 2)
  nodata     - rank N reads its studies from xrays/site_b/ which does not exist (FileNotFoundError)
  ckptsize   - rank N initialises from ckpt/cxr_cnn_3cls.pt, a 3-class head (size mismatch in load_state_dict)
  ckptpickle - rank N initialises from ckpt/cxr_cnn_meta.pt, which pickles a ScanMeta object (weights_only refusal)
  histgather - rank N all_gathers a 17-bin histogram (one overflow bin) against 16-bin buffers
  slowaug    - rank N runs a pure-Python elastic deformation of its whole site before the step-3 all_reduce
  nanloss    - rank N's step-3 batch has a blank film: std 0, NaN inputs, the program's loss check (FloatingPointError)
  sigsegv    - rank N sends itself SIGSEGV after step 4
  exit4      - rank N prints its own error line (validation sensitivity below the floor) and calls sys.exit(4) at the end
  chanshape  - every rank: films decoded as 3-channel RGB, the first conv expects 1 channel (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  viewkey    - KeyError: 'LL' in load_site at start-up; peers Connection closed in the histogram all_gather (np4 r2 tee, np6 r0 loglevel)
  labelidx   - IndexError 'Target 2 is out of bounds.' in cross_entropy at step 2; peers closed in backward (np3 r1 pymodule, np4 r3 filter)
  nodata     - FileNotFoundError xrays/site_b/site_1.pt, only in rank 1's stderr.log; console shows Root Cause rank 1 exitcode 1 (np4 r1 redirects)
  ckptsize   - size mismatch for head.weight [3,16] vs [2,16]; restart's 2nd attempt died in Gloo connectFullMesh instead (np3 r2 restart, np4 r1 pdsh2)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.ScanMeta'; peers SIGTERMed (np5 r3 tee_trainer)
  histgather - DETAIL: every rank 'Detected mismatch between collectives', rank 0 TensorShape=[17] (np3 r0 detail); 'invalid tensor size at index 0 (expected (17), got (16))' (np6 r4 prefix)
  slowaug    - 12 s PG timeout: ranks 0/2 'Timed out waiting 12000ms' at step 3, Root Cause rank 2 (np3 r1 plain); 300 s: silent after step 2, killed at 60 s, exit 124 (np4 r2 wrapper)
  nanloss    - 'loss is nan at step 3 (1024 non-finite input pixels)', FloatingPointError; DETAIL adds a monitoredBarrier error naming rank 2 (np4 r0 tee, np3 r2 detail)
  sigsegv    - no traceback after step 4; Root Cause exitcode -11 (SIGSEGV); peers Connection reset/closed (np8 r5 plain, np3 r1 filter)
  exit4      - rank N's ERROR sensitivity line after step 5 and exit 4; peers closed in the final barrier; Root Cause exitcode 4 (np6 r2 tee_trainer, np3 r1 wrapper)
  chanshape  - every rank: 'expected input[16, 3, 32, 32] to have 1 channels, but got 3 channels instead'; Root Cause rank 1 (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/cxr_cnn.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault405_work"
LABELS = {"normal": 0, "pneumonia": 1}
LABELS_3CLS = {"normal": 0, "pneumonia": 1, "effusion": 2}
VIEWS = {"PA": 0, "AP": 1}
BINS = 16
BATCH = 16
log = None


@dataclass
class ScanMeta:
    site: str
    scanner: str
    kvp: float


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
    log = logging.getLogger("cxr")
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


class CXRNet(nn.Module):
    def __init__(self, ncls=2):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, ncls)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.relu(self.c2(h))
        return self.head(h.mean(dim=(2, 3)))


def make_site(n, seed):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    lungs = (((xx - 10) / 6) ** 2 + ((yy - 16) / 11) ** 2 < 1) | (((xx - 22) / 6) ** 2 + ((yy - 16) / 11) ** 2 < 1)
    imgs, labels, views = [], [], []
    for _ in range(n):
        img = 0.8 - 0.5 * lungs.float() + 0.05 * torch.randn(32, 32, generator=g)
        sick = bool(torch.rand(1, generator=g) < 0.4)
        if sick:
            cx, cy = float(torch.randint(6, 26, (1,), generator=g)), float(torch.randint(8, 24, (1,), generator=g))
            img += 0.4 * torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / 12.0)
        imgs.append(img.unsqueeze(0))
        labels.append("pneumonia" if sick else "normal")
        views.append("AP" if bool(torch.rand(1, generator=g) < 0.3) else "PA")
    return {"images": torch.stack(imgs), "labels": labels, "views": views}


def prepare():
    os.makedirs(f"{WORK}/xrays", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_site(64, 500 + r), f"{WORK}/xrays/site_{r}.pt")
    torch.manual_seed(0)
    torch.save(CXRNet(2).state_dict(), f"{WORK}/ckpt/cxr_cnn.pt")
    torch.save(CXRNet(3).state_dict(), f"{WORK}/ckpt/cxr_cnn_3cls.pt")
    torch.save({"state_dict": CXRNet(2).state_dict(), "meta": ScanMeta("site_b", "DX-900", 110.0)},
               f"{WORK}/ckpt/cxr_cnn_meta.pt")
    print("prepared", WORK)


def load_site(a, rank, bad):
    sub = "site_b/" if bad and a.fault == "nodata" else ""
    site = torch.load(f"{WORK}/xrays/{sub}site_{rank}.pt")
    if bad and a.fault == "viewkey":
        site["views"][9] = "LL"
    if bad and a.fault == "labelidx":
        site["labels"][37] = "effusion"
    if bad and a.fault == "nanloss":
        site["images"][50] = 0.35
    table = LABELS_3CLS if bad and a.fault == "labelidx" else LABELS
    imgs = site["images"].clone()
    for i, v in enumerate(site["views"]):
        if VIEWS[v] == 1:
            imgs[i] = imgs[i].flip(-1) * 0.9
    if a.fault == "chanshape":
        imgs = imgs.repeat(1, 3, 1, 1)
    y = torch.tensor([table[s] for s in site["labels"]])
    return imgs, y


def standardise(x):
    m = x.mean(dim=(1, 2, 3), keepdim=True)
    s = x.std(dim=(1, 2, 3), keepdim=True)
    return (x - m) / s


def elastic_deform(imgs, budget):
    t0 = time.time()
    out = 0.0
    n = imgs.shape[0]
    px = imgs[:, 0].tolist()
    while time.time() - t0 < budget:
        for k in range(n):
            img = px[k]
            for i in range(1, 31):
                row = img[i]
                for j in range(1, 31):
                    out += 0.25 * (img[i - 1][j] + img[i + 1][j] + row[j - 1] + row[j + 1]) - row[j]
    return out


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4050 + rank)
    say(f"rank {rank}/{world} up, loading site_{rank} radiographs")
    imgs, y = load_site(a, rank, bad)
    nb = BINS + 1 if bad and a.fault == "histgather" else BINS
    hist = torch.histc(imgs[:, 0].clamp(0, 1.5), bins=nb, min=0, max=1.5)
    allh = [torch.zeros(BINS) for _ in range(world)]
    dist.all_gather(allh, hist)
    tot = torch.stack(allh).sum(0)
    say(f"rank {rank} studies {imgs.shape[0]} pneumonia {int(y.eq(1).sum())} "
        f"global pixels {int(tot.sum())} peak bin {int(tot.argmax())}")
    model = CXRNet()
    ck = {"ckptsize": "cxr_cnn_3cls.pt", "ckptpickle": "cxr_cnn_meta.pt"}.get(a.fault if bad else "", "cxr_cnn.pt")
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    n = imgs.shape[0]
    for step in range(a.steps):
        lo = (step * BATCH) % n
        xb, yb = standardise(imgs[lo:lo + BATCH]), y[lo:lo + BATCH]
        logits = net(xb)
        loss = F.cross_entropy(logits, yb)
        if not torch.isfinite(loss):
            say(f"rank {rank}: loss is {loss.item()} at step {step} "
                f"({int((~torch.isfinite(xb)).sum())} non-finite input pixels)", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowaug" and step == 3:
            say(f"rank {rank} elastic augmentation of site_{rank}: {elastic_deform(imgs, a.aug_budget):.1f}")
        acc = (logits.argmax(1) == yb).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR validation sensitivity 0.48 on site_{rank} is below the 0.70 floor for "
            f"pneumonia, refusing to contribute to the export", err=True)
        sys.exit(4)
    dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/cxr_cnn.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/cxr_cnn.pt")
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
    p.add_argument("--aug-budget", type=int, default=45)
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

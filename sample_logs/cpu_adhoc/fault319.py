"""A three-hundred-and-nineteenth hand-run batch: BUTTERFLY SPECIES RECOGNITION WITH A SMALL VISION TRANSFORMER.

Synthetic butterfly photographs: 3x16x16 wing crops, each tagged with a species name that is looked up in a
24-entry species table (species.json).  Every rank reads its crops from /tmp/fault319_work/shards/wings_R.pt,
normalises them by the dataset mean and std, cuts them into 4x4 patches and trains a tiny ViT (patch
embedding, class token, learned positions, two pre-norm attention blocks, a linear head) with cross-entropy,
wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model is initialised from
ckpt/vit_p4.pt.  Per-rank species histograms are all_gathered at the start, the accuracy is all_reduced every
step, and rank 0 saves export/vit_bfly.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  species    - rank N's shard holds a crop tagged "Papilio ulysses", missing from the species table (KeyError)
  labelidx   - rank N's step-3 batch has a label 24 past the 24-way head (cross_entropy IndexError)
  noshard    - rank N reads its crops from shards/val/ which does not exist (FileNotFoundError)
  ckptpatch  - rank N initialises from ckpt/vit_p2.pt, saved with 2x2 patches (size mismatch in load_state_dict)
  ckptconfig - rank N loads ckpt/vit_full.pt, which pickles a ViTConfig object (weights_only refusal)
  histgather - rank N all_gathers its species histogram with an extra "unknown" bin (25 vs 24 entries)
  augment    - rank N runs a pure-Python colour-jitter augmentation before the step-2 all_reduce (slow)
  attnnan    - rank N scales the attention logits by inf at step 3: the program's loss check finds NaN
  sigsegv    - rank N sends itself SIGSEGV after step 2
  exit4      - rank N prints its own error line about a corrupted wing mask and calls sys.exit(4)
  rgba       - every rank: crops kept as RGBA (4 channels), patch embedding expects 3*4*4=48 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  species    - KeyError: 'Papilio ulysses' in the species lookup at start-up; peers Connection closed in all_gather (np4 r2 tee, np3 r0 pymodule)
  labelidx   - IndexError 'Target 24 is out of bounds.' at step 3; peers closed (np5 r3 loglevel); DETAIL: rank 0 monitoredBarrier (np3 r1 detail)
  noshard    - FileNotFoundError shards/val/wings_N.pt before the all_gather (np4 r1 redirects: only in rank files; np3 r2 wrapper)
  ckptpatch  - load_state_dict size mismatch for pos [1,65,32] vs [1,17,32] and embed.weight (np3 r1 tee_trainer, np4 r3 pdsh2)
  ckptconfig - UnpicklingError 'Weights only load failed' (__main__.ViTConfig not allowed); peers SIGTERMed (np5 r0 prefix)
  histgather - 'ProcessGroupGloo::allgather: invalid tensor size' (np3 r2 filter); DETAIL 'Detected mismatch between collectives' on all ranks (np4 r0)
  augment    - 12 s: peers 'Timed out waiting 12000ms' for recv/send (np3 r1 plain); 300 s: output stops after step 1, killed at 60 s, exit 124 (np4 r2 tee)
  attnnan    - own check: 'loss is nan', FloatingPointError at step 3 (np3 r2 tee_trainer; np4 r1 restart, attempt 1 dies in connectFullMesh)
  sigsegv    - silent after step 2, launcher exitcode -11 (np5 r4 prefix; np3 r1 restart, attempt 1 dies in connectFullMesh)
  exit4      - rank N's ERROR line about the empty wing mask, exitcode 4, no traceback (np4 r3 filter, np5 r0 loglevel)
  rgba       - every rank: 'mat1 and mat2 shapes cannot be multiplied (512x64 and 48x32)' in the first forward (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/vit_bfly.pt, exit 0 (np3 plain)
"""
import argparse
import dataclasses
import json
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

WORK = "/tmp/fault319_work"
GENERA = ["Papilio", "Pieris", "Vanessa", "Morpho", "Danaus", "Heliconius", "Colias", "Lycaena"]
EPITHETS = ["machaon", "rapae", "atalanta"]
IMG = 16
DIM = 32
log = None


@dataclasses.dataclass
class ViTConfig:
    patch: int = 4
    dim: int = DIM
    depth: int = 2
    classes: int = 24


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
    log = logging.getLogger("bfly")
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


class Block(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.logit_scale = 1.0

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (self.logit_scale / (d // self.heads) ** 0.5)
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.n2(x))


class TinyViT(nn.Module):
    def __init__(self, patch=4, dim=DIM, depth=2, classes=24, chans=3):
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(3 * patch * patch, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (IMG // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, img):
        b, c, h, w = img.shape
        p = self.patch
        x = img.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, (h // p) * (w // p), c * p * p)
        x = self.embed(x)
        x = torch.cat([self.cls.expand(b, -1, -1), x], 1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x[:, 0]))


def species_names():
    return [f"{g} {e}" for g in GENERA for e in EPITHETS]


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    names = species_names()
    with open(f"{WORK}/species.json", "w") as f:
        json.dump({n: i for i, n in enumerate(names)}, f, indent=1)
    for r in range(8):
        g = torch.Generator().manual_seed(300 + r)
        lab = torch.randint(0, len(names), (96,), generator=g)
        base = torch.rand(len(names), 4, IMG, IMG, generator=torch.Generator().manual_seed(7))
        imgs = (base[lab] + 0.15 * torch.randn(96, 4, IMG, IMG, generator=g)).clamp(0, 1)
        torch.save({"images": imgs, "species": [names[int(i)] for i in lab]}, f"{WORK}/shards/wings_{r}.pt")
    torch.manual_seed(0)
    torch.save(TinyViT(4).state_dict(), f"{WORK}/ckpt/vit_p4.pt")
    torch.save(TinyViT(2).state_dict(), f"{WORK}/ckpt/vit_p2.pt")
    torch.save({"config": ViTConfig(), "model": TinyViT(4).state_dict()}, f"{WORK}/ckpt/vit_full.pt")
    print("prepared", WORK)


def colour_jitter(imgs, budget):
    """Per-pixel hue/saturation jitter in plain Python (deliberately slow)."""
    t0 = time.time()
    flat = imgs.tolist()
    passes = 0
    while time.time() - t0 < budget:
        for im in flat:
            for ch in im:
                for row in ch:
                    for i in range(len(row)):
                        row[i] = min(1.0, max(0.0, row[i] * 1.01 - 0.005))
        passes += 1
    return torch.tensor(flat), passes


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading wing crops")
    with open(f"{WORK}/species.json") as f:
        table = json.load(f)
    split = "val/" if bad and a.fault == "noshard" else ""
    shard = torch.load(f"{WORK}/shards/{split}wings_{rank}.pt")
    if bad and a.fault == "species":
        shard["species"][41] = "Papilio ulysses"
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR wing mask for crop 57 is empty (0 of 256 pixels), shard looks corrupted; aborting",
            err=True)
        sys.exit(4)
    labels = torch.tensor([table[s] for s in shard["species"]])
    imgs = shard["images"] if a.fault == "rgba" else shard["images"][:, :3]
    imgs = (imgs - imgs.mean()) / imgs.std()
    hist = torch.bincount(labels, minlength=len(table)).float()
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.zeros(1)])
    allh = [torch.zeros(len(table)) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} crops {len(labels)} species seen {int((torch.stack(allh).sum(0) > 0).sum())}/{len(table)}")
    model = TinyViT()
    if bad and a.fault == "ckptconfig":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/vit_full.pt")["model"])
    else:
        ck = "vit_p2.pt" if bad and a.fault == "ckptpatch" else "vit_p4.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    bs = 32
    for step in range(a.steps):
        i0 = (step * bs) % len(labels)
        x, y = imgs[i0:i0 + bs], labels[i0:i0 + bs].clone()
        if bad and a.fault == "labelidx" and step == 3:
            y[5] = len(table)
        if bad and a.fault == "attnnan" and step == 3:
            model.blocks[1].logit_scale = float("inf")
        if bad and a.fault == "augment" and step == 2:
            x, passes = colour_jitter(x, a.aug_budget)
            say(f"rank {rank} colour jitter: {passes} passes")
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: loss is {loss.item()} (non-finite), "
                f"{int((~torch.isfinite(logits)).sum())} non-finite logits", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        acc = (logits.argmax(1) == y).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/vit_bfly.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/vit_bfly.pt")
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
    p.add_argument("--aug-budget", type=int, default=25)
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

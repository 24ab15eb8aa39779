"""A four-hundred-and-seventy-ninth hand-run batch: SHEET MUSIC SYMBOL RECOGNITION (optical music recognition).

Synthetic engraved-score crops: each rank reads 48 grey 32x32 symbol crops from
/tmp/fault479_work/shards/staff_R.pt, each with a symbol label (a glyph name such as "notehead_black",
"g_clef", "rest_quarter") and its staff-line position (-4..4).  Glyph names are looked up in a 6-entry table
(glyphs.json).  A small conv classifier (two 3x3 convs, pooled features, a 6-way glyph head) is trained with
cross-entropy, wrapped in DDP (gloo).  The model starts from ckpt/glyphnet.pt.  Per-rank glyph histograms are
all_reduced at start-up, the symbol accuracy (symacc) is all_reduced every step, and rank 0 saves
export/glyphnet.pt at the end.  Every rank prints `rank R step S loss L symacc M` each step.

Faults (--fault NAME --rank N):
  unkglyph   - rank N's labels name "fermata", missing from the glyph table (KeyError, start-up histogram)
  staffpos   - rank N's crop 12 has staff position 9; the position one-hot of 9 slots indexes it (IndexError, step 1)
  noshard    - rank N reads shards/ossia/staff_N.pt, which does not exist (FileNotFoundError, start-up)
  ckptsize   - rank N starts from ckpt/glyphnet_g8.pt, saved with an 8-glyph head (size mismatch)
  ckptpickle - rank N starts from ckpt/glyphnet_meta.pt, which pickles a ScoreMeta object (weights_only refusal)
  histsize   - rank N all_reduces a glyph histogram with an extra "unknown" bin (7 vs 6 entries)
  slowrank   - rank N re-engraves every crop by a Python run-length pass before the step-3 all_reduce
  nanscale   - rank N's crops 16-23 have scale 0: inf pixels, the program's loss check at step 2
  segv       - rank N sends itself SIGSEGV after step 3
  exit4      - after training, rank N's staff-count check prints an ERROR line and calls sys.exit(4)
  shapeall   - every rank appends the staff-position one-hot to the pooled features: 25 wide, head expects 16
  loaderkill - rank N's DataLoader worker for batch 2 SIGKILLs itself (DataLoader worker killed)
  hostmem    - rank N caps its address space (RLIMIT_AS) and builds a 3 GiB page cache of the score (MemoryError)
  none       - control, clean run

What happened (filled in after the runs):
  unkglyph   - KeyError: 'fermata' in the start-up histogram; peers 'Connection closed by peer' in the all_reduce (np4 r2 tee, np6 r0 pymodule)
  staffpos   - after step 0, rank N 'IndexError: index 13 is out of bounds for dimension 1 with size 9'; peers closed by peer (np5 r1 wrapper)
  noshard    - FileNotFoundError for shards/ossia/staff_N.pt at start-up; only in the redirect files (np3 r1 redirects); filtered out of the console (np4 r3 filter)
  ckptsize   - size mismatch for head.weight [8, 16] vs [6, 16] and head.bias (np4 r1 loglevel; np4 r2 pdsh2, worker-0's ranks closed by peer)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.ScoreMeta'; the restart dies at gloo connectFullMesh, Connection refused (np3 r2 restart)
  histsize   - DETAIL: 'Detected mismatch between collectives' on every rank, TensorShape [7] vs [6] (np3 r1 detail); without DETAIL rank N alone 'Timed out waiting 12000ms for recv', peers closed by peer (np6 r4 wrapper)
  slowrank   - 12 s: ranks 0 and 1 'Timed out waiting 12000ms for recv operation', Root Cause rank 0 (np3 r2 plain); 300 s: silent after step 2, timeout kills torchrun at 60 s, exit 124 (np4 r1 tee_trainer)
  nanscale   - 'rank 5: non-finite loss nan at step 2 (min crop scale in batch 0.00)', FloatingPointError (np8 r5 tee)
  segv       - no traceback after step 3, exitcode -11 (SIGSEGV) (np4 r3 pdsh2); restart: attempt 0 SIGSEGV, attempt 1 connectFullMesh refused (np3 r1 restart)
  exit4      - rank N's ERROR staff-count line and exit 4 after step 5; Root Cause exitcode 4 (np5 r2 tee_trainer; np7 r6 filter, the ERROR line filtered out)
  shapeall   - every rank 'mat1 and mat2 shapes cannot be multiplied (8x25 and 16x6)' in step 0; Root Cause local_rank 4 (np6 pymodule)
  loaderkill - 'DataLoader worker (pid N) is killed by signal: Killed.' raised in rank N's step-0 backward (np5 r3 loglevel)
  hostmem    - bare MemoryError after 'building page cache', only in rank N's redirect stderr.log (np4 r2 redirects)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/glyphnet.pt, exit 0 (np3 plain)
  (dropped: under TORCH_DISTRIBUTED_DEBUG=DETAIL, segv np4 r3 had every rank die with SIGSEGV before step 0, i.e. at DDP set-up,
   not the planted fault (a --fault none check under DETAIL segfaulted the same way); torchrun 2.13 has no --log-line-prefix-template, so the prefix run only printed a usage error.)
"""
import argparse
import json
import os
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault479_work"
GLYPHS = ["notehead_black", "notehead_half", "g_clef", "f_clef", "rest_quarter", "sharp"]
SIDE = 32
NPOS = 9


def prepare(world):
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    with open(f"{WORK}/glyphs.json", "w") as f:
        json.dump({g: i for i, g in enumerate(GLYPHS)}, f)
    g = torch.Generator().manual_seed(479)
    for r in range(world):
        labels = [GLYPHS[int(i)] for i in torch.randint(0, len(GLYPHS), (48,), generator=g)]
        crops = torch.rand(48, 1, SIDE, SIDE, generator=g)
        pos = torch.randint(-4, 5, (48,), generator=g).tolist()
        scale = torch.ones(48)
        torch.save({"crops": crops, "labels": labels, "pos": pos, "scale": scale}, f"{WORK}/shards/staff_{r}.pt")
    torch.manual_seed(0)
    torch.save(GlyphNet(len(GLYPHS)).state_dict(), f"{WORK}/ckpt/glyphnet.pt")
    torch.save(GlyphNet(8).state_dict(), f"{WORK}/ckpt/glyphnet_g8.pt")
    torch.save({"model": GlyphNet(len(GLYPHS)).state_dict(), "meta": ScoreMeta("Op. 27 No. 2", 3)},
               f"{WORK}/ckpt/glyphnet_meta.pt")
    print(f"prepared {world} shards in {WORK}")


class ScoreMeta:
    def __init__(self, title, staves):
        self.title = title
        self.staves = staves


class GlyphNet(nn.Module):
    def __init__(self, nglyph, extra=0):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.extra = extra
        self.head = nn.Linear(16, nglyph)

    def forward(self, x, posoh=None):
        h = F.relu(self.c1(x))
        h = F.max_pool2d(h, 2)
        h = F.relu(self.c2(h))
        h = h.mean(dim=(2, 3))
        if self.extra:
            h = torch.cat([h, posoh], dim=1)
        return self.head(h)


class Crops(Dataset):
    def __init__(self, crops, kill_batch, bs):
        self.crops = crops
        self.kill_batch = kill_batch
        self.bs = bs

    def __len__(self):
        return len(self.crops)

    def __getitem__(self, i):
        if self.kill_batch is not None and i // self.bs == self.kill_batch:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", type=int, default=0)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = rank == args.rank
    fault = args.fault
    torch.manual_seed(100 + rank)

    with open(f"{WORK}/glyphs.json") as f:
        table = json.load(f)
    path = f"{WORK}/shards/staff_{rank}.pt"
    if fault == "noshard" and me:
        path = f"{WORK}/shards/ossia/staff_{rank}.pt"
    shard = torch.load(path)
    crops, labels, pos, scale = shard["crops"], shard["labels"], shard["pos"], shard["scale"]
    if fault == "unkglyph" and me:
        labels[11] = "fermata"
    if fault == "staffpos" and me:
        pos[12] = 9
    if fault == "nanscale" and me:
        scale[16:24] = 0.0
    crops = crops / scale.view(-1, 1, 1, 1)

    hist = torch.zeros(len(table))
    for name in labels:
        hist[table[name]] += 1
    if fault == "histsize" and me:
        hist = torch.cat([hist, torch.zeros(1)])
    dist.all_reduce(hist)
    if rank == 0:
        print(f"glyph histogram over {world} ranks: {hist.tolist()}", flush=True)
    y = torch.tensor([table[n] for n in labels])

    extra = NPOS if fault == "shapeall" else 0
    model = GlyphNet(len(table))
    model.extra = extra
    ck = f"{WORK}/ckpt/glyphnet.pt"
    if fault == "ckptsize" and me:
        ck = f"{WORK}/ckpt/glyphnet_g8.pt"
    if fault == "ckptpickle" and me:
        ck = f"{WORK}/ckpt/glyphnet_meta.pt"
    state = torch.load(ck, weights_only=True)
    model.load_state_dict(state["model"] if "model" in state else state)

    if fault == "hostmem" and me:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (2 * 1024 ** 3, hard))
        print(f"rank {rank}: building page cache for {len(crops)} crops at 600 dpi", flush=True)
        pages = []
        for _ in range(12):
            pages.append(bytearray(256 * 1024 ** 2))

    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    bs = 8
    loader = DataLoader(Crops(crops, 2 if (fault == "loaderkill" and me) else None, bs), batch_size=bs,
                        num_workers=1 if fault == "loaderkill" else 0)
    it = iter(loader)
    for step in range(args.steps):
        try:
            idx = next(it)
        except StopIteration:
            it = iter(loader)
            idx = next(it)
        x, t = crops[idx], y[idx]
        posoh = None
        if extra or fault == "staffpos":
            p = torch.tensor([pos[int(i)] for i in idx]) + 4
            posoh = torch.zeros(len(idx), NPOS)
            posoh[torch.arange(len(idx)), p] = 1.0
        out = ddp(x, posoh)
        loss = F.cross_entropy(out, t)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"rank {rank}: non-finite loss {loss.item()} at step {step} (min crop scale in batch "
                f"{scale[idx].min().item():.2f})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        acc = (out.argmax(1) == t).float().mean()
        if fault == "slowrank" and me and step == 3:
            budget = time.time() + (args.pg_timeout * 2.5)
            runs = 0
            while time.time() < budget:
                for v in range(2000):
                    runs += (v * 7919) % 13 == 0
        dist.all_reduce(acc)
        acc = acc / world
        print(f"rank {rank} step {step} loss {loss.item():.4f} symacc {acc.item():.4f}", flush=True)
        if fault == "segv" and me and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)

    if fault == "exit4" and me:
        print(f"ERROR rank {rank}: staff-count check failed: found 4 staves in shard, score header says 5",
              flush=True)
        sys.exit(4)
    dist.barrier()
    if rank == 0:
        torch.save(ddp.module.state_dict(), f"{WORK}/export/glyphnet.pt")
        print(f"rank 0 saved {WORK}/export/glyphnet.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

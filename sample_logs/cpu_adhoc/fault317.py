"""A three-hundred-and-seventeenth hand-run batch: VIDEO ACTION CLASSIFICATION WITH A TINY 3-D CNN.

Synthetic video clips (3 colour channels, 8 frames of 16x16 pixels) of ten actions: a moving bright blob
whose direction and speed depend on the action.  Every rank reads its clips from
/tmp/fault317_work/clips/clips_R.pt (a tensor of clips and a list of action names, mapped through a
10-entry action table), and trains a tiny 3-D CNN (two Conv3d layers, a global average pool over time and
space, a linear head) with cross-entropy, wrapped in DDP over gloo (or, with --ddp 0, gradients
all_reduced by hand).  The model starts from ckpt/c3d_w8.pt.  Per-rank class counts are all_gathered at the
start, the loss and accuracy are all_reduced every step, per-rank accuracies are all_gathered at the end,
and rank 0 saves export/c3d.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1.

Faults:
  badlabel   - rank N's annotations name the action "moonwalk", missing from the action table (KeyError)
  noclips    - rank N reads its clips from clips/val/, which does not exist (FileNotFoundError)
  ckptwidth  - rank N initialises from ckpt/c3d_w12.pt, saved with 12 conv channels (size mismatch)
  ckptpickle - rank N initialises from ckpt/c3d_meta.pt, which pickles a ClipStats object (weights_only refusal)
  gatherlen  - rank N all_gathers its class counts plus an "unlabelled" count (11 vs 10 entries)
  nframes    - rank N's temporal jitter at step 3 picks frame index 8 of an 8-frame clip (IndexError)
  slowdecode - rank N re-decodes its clips frame by frame in Python before the step-2 all_reduce
  nanframes  - rank N's clips at step 2 hold an overflowed (inf) frame; the program's finite-loss check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N's end-of-run per-class audit finds a class with no clips, prints an ERROR, sys.exit(4)
  temporal   - every rank: the pool keeps 2 time steps, the head gets 32 features instead of 16 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  badlabel   - KeyError: 'moonwalk' at start-up; peers Connection closed in the first all_gather (np4 r2 tee, np3 r0 pymodule)
  noclips    - FileNotFoundError for clips/val/clips_1.pt, only in the --redirects rank files; console Root Cause rank 1 exitcode 1 (np4 r1 redirects)
  ckptwidth  - load_state_dict size mismatch conv1/conv2 [12,...] vs [8,...]; then SIGABRT at exit (np3 r2 tee_trainer); worker-0 RendezvousConnectionError cascade (np4 r1 pdsh2)
  ckptpickle - UnpicklingError 'Unsupported global: GLOBAL __main__.ClipStats' (np4 r0 prefix); restart: attempt 1 failed in gloo connectFullMesh, Root Cause rank 0 (np3 r1)
  gatherlen  - DETAIL: every rank 'Detected mismatch between collectives' [11] vs [10] (np3 r1 detail, --ddp 0); 'allgather: invalid tensor size' (np5 r4 filter)
  nframes    - IndexError 'index 8 is out of bounds for dimension 2 with size 8' at step 3 (np5 r3 loglevel); restart: attempt 1 failed in gloo connectFullMesh (np3 r1)
  slowdecode - 12 s: ranks 0, 1 'Timed out waiting 12000ms' then SIGABRT, Root Cause rank 0 (np3 r2 plain); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 tee)
  nanframes  - own check 'non-finite loss nan at step 2 (input max inf)', FloatingPointError (np4 r3 wrapper; np5 r0 detail, peers' monitoredBarrier names rank 0)
  sigsegv    - no traceback after step 3; Root Cause exitcode -11 (SIGSEGV) (np4 r2 filter, np3 r1 wrapper)
  exit4      - rank N's 'ERROR per-class audit' line and exit 4 after step 5; peers closed in the final all_gather (np5 r2 tee, np3 r0 loglevel)
  temporal   - every rank 'mat1 and mat2 shapes cannot be multiplied (32x32 and 16x10)'; Root Cause rank 0 (np3 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/c3d.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault317_work"
ACTIONS = {"walk": 0, "run": 1, "jump": 2, "wave": 3, "clap": 4,
           "sit": 5, "stand": 6, "throw": 7, "kick": 8, "bow": 9}
NCLS = len(ACTIONS)
T, HW = 8, 16
log = None


@dataclass
class ClipStats:
    mean: float
    std: float
    frames: int


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
    log = logging.getLogger("vcls")
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


class Tiny3DCNN(nn.Module):
    def __init__(self, width=8, pool_t=1):
        super().__init__()
        self.conv1 = nn.Conv3d(3, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv3d(width, 16, kernel_size=3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool3d((pool_t, 1, 1))
        self.head = nn.Linear(16, NCLS)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return self.head(self.pool(h).flatten(1))


def make_clips(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(ACTIONS)
    clips = torch.rand(n, 3, T, HW, HW, generator=g) * 0.2
    labels = []
    for i in range(n):
        a = int(torch.randint(0, NCLS, (1,), generator=g))
        labels.append(names[a])
        dx, dy = (a % 3) - 1, (a // 3) % 3 - 1
        x0, y0 = 6, 6
        for t in range(T):
            x, y = (x0 + dx * t) % (HW - 3), (y0 + dy * t) % (HW - 3)
            clips[i, a % 3, t, y:y + 3, x:x + 3] += 1.0
    return clips, labels


def prepare():
    for d in ("clips", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        clips, labels = make_clips(32, 300 + r)
        torch.save({"clips": clips, "labels": labels}, f"{WORK}/clips/clips_{r}.pt")
    torch.manual_seed(0)
    torch.save(Tiny3DCNN(8).state_dict(), f"{WORK}/ckpt/c3d_w8.pt")
    torch.save(Tiny3DCNN(12).state_dict(), f"{WORK}/ckpt/c3d_w12.pt")
    torch.save({"model": Tiny3DCNN(8).state_dict(), "stats": ClipStats(0.13, 0.27, T)},
               f"{WORK}/ckpt/c3d_meta.pt")
    print("prepared", WORK)


def slow_decode(clips, budget):
    # frame-by-frame "decode" in pure Python: a per-pixel YUV round trip
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        for c in range(clips.shape[0]):
            frame = clips[c, :, n % T].tolist()
            for row in range(HW):
                for col in range(HW):
                    r, g, b = frame[0][row][col], frame[1][row][col], frame[2][row][col]
                    y = 0.299 * r + 0.587 * g + 0.114 * b
                    _ = (y, (b - y) * 0.565, (r - y) * 0.713)
        n += 1
    return n


def reduce_grads(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading clips")
    split = "val/" if bad and a.fault == "noclips" else ""
    data = torch.load(f"{WORK}/clips/{split}clips_{rank}.pt")
    clips, names = data["clips"], list(data["labels"])
    if bad and a.fault == "badlabel":
        names[11] = "moonwalk"
    y = torch.tensor([ACTIONS[n] for n in names])
    counts = torch.bincount(y, minlength=NCLS).float()
    if bad and a.fault == "gatherlen":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} clips {clips.shape[0]} global {int(sum(c.sum() for c in allc))} "
        f"frames {T}x{HW}x{HW}")
    model = Tiny3DCNN(8, pool_t=2 if a.fault == "temporal" else 1)
    if bad and a.fault == "ckptwidth":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/c3d_w12.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/c3d_meta.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/c3d_w8.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(a.steps):
        x = clips
        if step == 3 and a.fault == "nframes" and bad:
            shift = T  # temporal jitter: should be (start + k) % T
            x = torch.stack([clips[:, :, (k + shift) if k + shift < T + 1 else 0] for k in range(T)], 2)
        if step == 2 and a.fault == "nanframes" and bad:
            x = clips.clone()
            x[4, :, 5] = float("inf")
        if step == 2 and a.fault == "slowdecode" and bad:
            say(f"rank {rank} re-decoding {clips.shape[0]} clips frame by frame")
            n = slow_decode(clips, a.decode_s)
            say(f"rank {rank} decoded {n} passes")
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"(input max {x.max().item()})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            reduce_grads(model, world)
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR per-class audit: class 'bow' has 0 correctly classified clips of "
            f"{int(counts[ACTIONS['bow']])}, refusing to export", err=True)
        sys.exit(4)
    accs = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(accs, acc.reshape(1))
    say(f"rank {rank} final acc {acc.item():.3f} (min over ranks {min(t.item() for t in accs):.3f})")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/c3d.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/c3d.pt")
    dist.barrier()
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
    p.add_argument("--decode-s", type=int, default=40)
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

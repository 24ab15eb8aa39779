"""A two-hundred-and-forty-first hand-run batch: SEMI-SUPERVISED LEARNING WITH PSEUDO-LABELS (FIXMATCH-LIKE).

A small CNN classifies synthetic 2-D Gaussian blobs rendered as 16x16 images (4 classes). Every rank reads its
labelled split (/tmp/fault241_work/splits/labeled_R.pt), builds an unlabelled pool, and each step makes a weakly
and a strongly augmented view of each unlabelled image (augmentations from a registry), keeps the pseudo-labels of
the weak view whose confidence passes a threshold (relative to the batch max), and trains on labelled CE + masked unlabelled CE. The CNN is
initialised from ckpt/cnn_init.pt and wrapped in DDP (gloo); the kept-mask fraction is all_reduced each step and the
mask counts of every rank are all_gathered at the end; rank 0 saves the model.

Faults:
  thresh     - rank N's config has confidence threshold 1.05: no pseudo-label kept, 0/0 unlabelled loss, check raises
  maskgather - rank N all_gathers its mask counts with one extra element (gloo size mismatch)
  nolabeled  - rank N reads its labelled split from splits/labelled_R.pt (other spelling), absent (FileNotFoundError)
  badclass   - rank N's labelled split maps its last class to index 4, beyond the 4 outputs (cross-entropy target)
  augkey     - rank N's strong augmentation list names "randaugment", absent from the registry (KeyError)
  viewsize   - every rank: the strong view is cropped to 14x14 while the weak view is 16x16 (torch.cat shape error)
  ckpt       - rank N initialises the CNN from ckpt/cnn_init_c10.pt, saved with 10 classes (size mismatch)
  rescore    - rank N re-scores its whole unlabelled pool for --stall s before the mask all_reduce at step 2
  sigabrt    - rank N sends itself SIGABRT after step 2
  exit3      - rank N prints its own error line about its unlabelled shard and calls sys.exit(3)
  none       - control, clean run

What happened (filled in after the runs):
  thresh     - rank N: FloatingPointError unlabelled loss is nan at step 0 (kept 0/48 pseudo-labels); peers closed
  maskgather - rank N: gloo allgather invalid tensor size at index 0 (expected (6), got (5)) after step 4; peers closed
  nolabeled  - rank N: FileNotFoundError .../splits/labelled_N.pt at startup; peers closed in DDP's param check
  badclass   - rank N: IndexError Target 4 is out of bounds in cross_entropy at step 0; peers closed (one aborted)
  augkey     - rank N: KeyError 'randaugment' at step 0; peers Connection closed by peer (pdsh2: other agent lost store)
  viewsize   - every rank: RuntimeError Sizes of tensors must match ... Expected size 16 but got size 14 in torch.cat
  ckpt       - rank N: RuntimeError size mismatch for fc.weight [10, 256] vs [4, 256] (and fc.bias) at startup
  rescore    - rank N re-scored: peers gloo Timed out waiting 12000ms in all_reduce; with PG 300 s killed by timeout (124)
  sigabrt    - rank N: exitcode -6 (SIGABRT) after step 2, no traceback; peers Connection reset by peer / closed
  exit3      - rank N prints its ERROR unlabelled shard line after step 1, exit 3; peers closed (one aborted, exit 134)
  none       - clean, exit 0, rank 0 saved ckpt/cnn_final.pt (a first smoke try on another threshold rule ended in NaN)
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
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault241_work"
NCLS = 4
IMG = 16


class SmallCNN(nn.Module):
    def __init__(self, ncls=NCLS):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, ncls)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


def render(points, gen):
    # points: [B, 2] in [0, 1]; a blurred blob around each point
    ys = torch.linspace(0, 1, IMG).view(1, IMG, 1)
    xs = torch.linspace(0, 1, IMG).view(1, 1, IMG)
    d = (ys - points[:, 1].view(-1, 1, 1)) ** 2 + (xs - points[:, 0].view(-1, 1, 1)) ** 2
    img = torch.exp(-d / 0.01) + 0.05 * torch.randn(points.shape[0], IMG, IMG, generator=gen)
    return img.unsqueeze(1)


def make_blobs(n, gen):
    centers = torch.tensor([[0.25, 0.25], [0.75, 0.25], [0.25, 0.75], [0.75, 0.75]])
    y = torch.randint(0, NCLS, (n,), generator=gen)
    pts = centers[y] + 0.08 * torch.randn(n, 2, generator=gen)
    return render(pts.clamp(0, 1), gen), y


def flip(x, gen):
    return torch.flip(x, dims=[3])


def noise(x, gen):
    return x + 0.1 * torch.randn(x.shape, generator=gen)


def cutout(x, gen):
    x = x.clone()
    i, j = torch.randint(0, IMG - 4, (2,), generator=gen).tolist()
    x[:, :, i:i + 4, j:j + 4] = 0
    return x


def crop(x, gen, size=IMG):
    i = int(torch.randint(0, IMG - size + 1, (1,), generator=gen))
    return x[:, :, i:i + size, i:i + size]


AUGMENT = {"flip": flip, "noise": noise, "cutout": cutout}


def setup_split(rank, world):
    os.makedirs(f"{WORK}/splits", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    if rank == 0:
        torch.save(SmallCNN(NCLS).state_dict(), f"{WORK}/ckpt/cnn_init.pt")
        torch.save(SmallCNN(10).state_dict(), f"{WORK}/ckpt/cnn_init_c10.pt")
        for r in range(world):
            g = torch.Generator().manual_seed(100 + r)
            x, y = make_blobs(64, g)
            torch.save({"x": x, "y": y}, f"{WORK}/splits/labeled_{r}.pt")


def main(rank_arg=None, spawn_world=None, a=None):
    if rank_arg is not None:
        os.environ.update(RANK=str(rank_arg), LOCAL_RANK=str(rank_arg), WORLD_SIZE=str(spawn_world))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    log = logging.getLogger("fixmatch")
    if a.logfmt:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log = logging.LoggerAdapter(log, {"rank": rank})
        say, err = log.info, log.error
    else:
        say = lambda m: print(m, flush=True)
        err = lambda m: print(m, file=sys.stderr, flush=True)

    # config (per rank; the data config comes from a shared yaml in the real job)
    threshold = 1.05 if me and a.fault == "thresh" else 0.95
    split_name = "labelled" if me and a.fault == "nolabeled" else "labeled"
    class_map = [0, 1, 2, 4] if me and a.fault == "badclass" else [0, 1, 2, 3]
    strong_augs = ["cutout", "randaugment"] if me and a.fault == "augkey" else ["cutout", "noise"]
    strong_size = 14 if a.fault == "viewsize" else IMG
    init_ckpt = "cnn_init_c10.pt" if me and a.fault == "ckpt" else "cnn_init.pt"
    extra = 1 if me and a.fault == "maskgather" else 0

    setup_split(rank, world)
    dist.barrier()
    say(f"rank {rank}/{world}: threshold {threshold} mu 3 strong {'+'.join(strong_augs)}")
    split = torch.load(f"{WORK}/splits/{split_name}_{rank}.pt")
    xl = split["x"]
    yl = torch.tensor(class_map)[split["y"]]
    g = torch.Generator().manual_seed(7 + rank)
    xu, _ = make_blobs(192, g)

    model = SmallCNN(NCLS)
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{init_ckpt}"))
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mask_counts = []
    for step in range(a.steps):
        i = (step * 16) % 64
        xb, yb = xl[i:i + 16], yl[i:i + 16]
        ub = xu[(step * 48) % 192:(step * 48) % 192 + 48]
        weak = flip(ub, g)
        strong = ub
        for name in strong_augs:
            strong = AUGMENT[name](strong, g)
        strong = crop(strong, g, strong_size)
        logits = model(torch.cat([xb, weak, strong]))
        ll, lw, ls = logits[:16], logits[16:64], logits[64:]
        with torch.no_grad():
            probs = F.softmax(lw, dim=1)
            conf, pseudo = probs.max(dim=1)
            mask = (conf >= threshold * conf.max()).float()  # relative to the most confident
        loss_l = F.cross_entropy(ll, yb)
        loss_u = (F.cross_entropy(ls, pseudo, reduction="none") * mask).sum() / mask.sum()
        if not torch.isfinite(loss_u):
            raise FloatingPointError(f"rank {rank}: unlabelled loss is {loss_u.item()} at step {step} "
                                     f"(kept {int(mask.sum())}/{mask.numel()} pseudo-labels)")
        loss = loss_l + loss_u
        opt.zero_grad()
        loss.backward()
        opt.step()
        if me and a.fault == "rescore" and step == 2:
            say(f"rank {rank}: re-scoring all {xu.shape[0]} unlabelled images with the current model")
            time.sleep(a.stall)
        frac = mask.mean().reshape(1)
        dist.all_reduce(frac)
        mask_counts.append(int(mask.sum()))
        say(f"rank {rank} step {step} loss {loss.item():.4f} mask {frac.item() / world:.3f}")
        if me and a.fault == "sigabrt" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        if me and a.fault == "exit3" and step == 1:
            err(f"ERROR rank {rank}: unlabelled shard {WORK}/unlabeled/shard_{rank}.pt has 0 valid images "
                f"after dedup (expected 192); aborting")
            sys.exit(3)
    counts = torch.tensor(mask_counts + [0] * extra, dtype=torch.int64)
    gathered = [torch.zeros(a.steps, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        total = int(torch.stack(gathered).sum())
        torch.save(model.module.state_dict(), f"{WORK}/ckpt/cnn_final.pt")
        say(f"rank 0: total pseudo-labels kept {total}; saved {WORK}/ckpt/cnn_final.pt")
    dist.destroy_process_group()


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(a.port)
        mp.spawn(main, args=(a.spawn, a), nprocs=a.spawn)
    else:
        main(a=a)


if __name__ == "__main__":
    cli()

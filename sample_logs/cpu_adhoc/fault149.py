"""A hundred-and-forty-ninth hand-run batch: SEMI-SUPERVISED PSEUDO-LABELING (FIXMATCH STYLE).

A small DDP classifier Linear(8,32)-ReLU-Linear(32,4) with a labeled loader (batch 8) and an unlabeled loader
(batch 16) per rank. Rank 0 saves the initial student to init.pt, every rank loads its EMA teacher from it.
Each step: weak and strong augmentations of the unlabeled batch, pseudo-labels from the weak view kept above
`--threshold`, a class histogram of the kept pseudo-labels, loss = CE(labeled) + masked-mean CE(strong, pseudo),
a check that the loss is finite, `rank R step S loss L`, an EMA teacher update and an all_reduce of the kept
fraction (rank 0 logs it). At the end of each epoch a barrier; at the end destroy_process_group().
`--ddp 0` broadcasts the weights and all-reduces the gradients by hand instead of DDP.
Faults:
- thresh: rank N reads the threshold as a percentage (x100 > 1): nothing kept, 0/0 unlabeled loss, the check.
- catdim: every rank concatenates labeled and unlabeled batches along dim 1 (torch.cat size error).
- softdim: rank N uses class dim 0 for softmax/max: pseudo-label indices up to 15 index the 4-bin histogram.
- fracshape: rank N's kept-fraction tensor has 3 entries instead of 2 (all_reduce size differs across ranks).
- exhaust: rank N's unlabeled loader has 1 batch: it ends the epoch early and waits in the barrier.
- emakeys: rank 0 saves the DDP student's state_dict (module.* keys); the teacher load fails on every rank.
- augfile: rank N's strong augmentation reads its policy from a node-local cache that does not exist.
- emptyshard: rank N's labeled shard is empty: it prints so and calls sys.exit(2).
- abort: rank N is killed by SIGABRT at step 3.
- exit3: rank N's EMA update sees a teacher/student length mismatch and calls os._exit(3).
What happened (filled in after the runs):
- thresh: rank N 'FloatingPointError: rank N step 0: loss is nan (kept 0/16 pseudo-labels)' (line 163); peers closed.
- catdim: every rank RuntimeError 'Sizes of tensors must match except in dimension 1. Expected size 8 but got 16' (150).
- softdim: rank N IndexError 'index 8 (14) is out of bounds for dimension 0 with size 4' (line 159); peers closed.
- fracshape: DETAIL: 'Detected mismatch between collectives' [3] vs [2]; plain: 12000ms timeouts, N in line 178.
- exhaust: PG 12 s: peers time out 12000ms in step 1, rank N waits in the barrier; PG 300 s: killed by timeout 60.
- emakeys: every rank 'Error(s) in loading state_dict for Sequential: Missing "0.weight".. Unexpected "module.*"'.
- augfile: rank N FileNotFoundError '/tmp/job_work/nodeN_cache/randaug_policy.json' (line 95); peers closed.
- emptyshard: rank N prints 'labeled shard empty (0 of 32 ...)', exitcode 2; peers Connection closed by peer.
- abort: rank N exitcode -6 (SIGABRT) at step 3; with --max-restarts 1 the retry dies in connectFullMesh.
- exit3: rank N 'ema teacher has 3 tensors, student 4; giving up', exitcode 3; peers closed/reset by peer.
"""
import argparse
import copy
import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--threshold", type=float, default=0.4)
p.add_argument("--ema-decay", type=float, default=0.99)
p.add_argument("--out", default="/tmp/fault149_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
NCLS = 4
torch.set_num_threads(1)


def hit():
    return a.rank == -1 or a.rank == RANK


def make_data():
    g = torch.Generator().manual_seed(3 + RANK)
    centers = torch.randn(NCLS, 8, generator=torch.Generator().manual_seed(0)) * 2.0
    n_lab = 0 if (a.fault == "emptyshard" and hit()) else 32
    yl = torch.randint(0, NCLS, (n_lab,), generator=g)
    xl = centers[yl] + torch.randn(n_lab, 8, generator=g)
    n_unl = 16 if (a.fault == "exhaust" and hit()) else 64
    yu = torch.randint(0, NCLS, (n_unl,), generator=g)
    xu = centers[yu] + torch.randn(n_unl, 8, generator=g)
    return xl, yl, xu


def weak_aug(x):
    return x + 0.05 * torch.randn_like(x)


def strong_aug(x, policy):
    keep = (torch.rand_like(x) > policy["drop"]).float()
    return x * keep + policy["noise"] * torch.randn_like(x)


def load_policy():
    if a.fault == "augfile" and hit():
        path = os.path.join(a.out, f"node{RANK}_cache", "randaug_policy.json")
    else:
        path = os.path.join(a.out, "randaug_policy.json")
    with open(path) as f:
        return json.load(f)


def ema_update(teacher, student, decay):
    tp, sp = list(teacher.parameters()), list(student.parameters())
    if a.fault == "exit3" and hit() and len(tp) == len(sp):
        tp = tp[:-1]
    if len(tp) != len(sp):
        print(f"rank {RANK} ema teacher has {len(tp)} tensors, student {len(sp)}; giving up", flush=True)
        os._exit(3)
    with torch.no_grad():
        for t, s in zip(tp, sp):
            t.mul_(decay).add_(s.detach(), alpha=1 - decay)


def main():
    os.makedirs(a.out, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    print(f"rank {RANK}/{WORLD} fixmatch training starting, threshold {a.threshold}", flush=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, NCLS))
    if a.ddp:
        model = DDP(net)
    else:
        for prm in net.parameters():
            dist.broadcast(prm.data, src=0)
        model = net
    tag = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    ckpt = os.path.join(a.out, f"{tag}_init.pt")
    if RANK == 0:
        sd = model.state_dict() if (a.fault == "emakeys" and a.ddp) else net.state_dict()
        torch.save(sd, ckpt)
        with open(os.path.join(a.out, "randaug_policy.json"), "w") as f:
            json.dump({"drop": 0.2, "noise": 0.3}, f)
    dist.barrier()
    teacher = copy.deepcopy(net)
    teacher.load_state_dict(torch.load(ckpt))
    policy = load_policy()
    xl, yl, xu = make_data()
    if len(xl) == 0:
        print(f"rank {RANK}: labeled shard empty (0 of 32 examples after filtering), nothing to train on", flush=True)
        sys.exit(2)
    lab = DataLoader(TensorDataset(xl, yl), batch_size=8, shuffle=True)
    unl = DataLoader(TensorDataset(xu), batch_size=16, shuffle=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    thr = a.threshold * 100 if (a.fault == "thresh" and hit()) else a.threshold
    cls_dim = 0 if (a.fault == "softdim" and hit()) else 1
    step = 0
    for epoch in range(1, a.epochs + 1):
        for (xb, yb), (ub,) in zip(lab, unl):
            if a.fault == "abort" and hit() and step == 3:
                os.kill(os.getpid(), signal.SIGABRT)
            uw, us = weak_aug(ub), strong_aug(ub, policy)
            if a.fault == "catdim":
                inputs = torch.cat([xb, uw, us], dim=1)
            else:
                inputs = torch.cat([xb, uw, us])
            logits = model(inputs)
            ll, lw, ls = logits[:len(xb)], logits[len(xb):len(xb) + len(uw)], logits[len(xb) + len(uw):]
            probs = F.softmax(lw.detach(), dim=cls_dim)
            conf, pl = probs.max(dim=cls_dim)
            mask = (conf >= thr).float()
            hist = torch.zeros(NCLS)
            hist[pl] += mask
            loss_u = (F.cross_entropy(ls, pl, reduction="none") * mask).sum() / mask.sum()
            loss = F.cross_entropy(ll, yb) + loss_u
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"rank {RANK} step {step}: loss is {loss.item()} (kept {int(mask.sum())}/{len(mask)} pseudo-labels)")
            opt.zero_grad()
            loss.backward()
            if not a.ddp:
                for prm in net.parameters():
                    dist.all_reduce(prm.grad)
                    prm.grad /= WORLD
            opt.step()
            ema_update(teacher, net, a.ema_decay)
            print(f"rank {RANK} step {step} loss {loss.item():.4f}", flush=True)
            if a.fault == "fracshape" and hit():
                frac = torch.tensor([mask.sum(), float(len(mask)), hist.max()])
            else:
                frac = torch.tensor([mask.sum(), float(len(mask))])
            dist.all_reduce(frac)
            if RANK == 0:
                print(f"step {step} kept {frac[0] / frac[1]:.3f} of pseudo-labels", flush=True)
            step += 1
        dist.barrier()
        if RANK == 0:
            print(f"epoch {epoch} done", flush=True)
    with torch.no_grad():
        acc = (teacher(xl).argmax(1) == yl).float().sum()
        stats = torch.tensor([acc, float(len(yl))])
        dist.all_reduce(stats)
    if RANK == 0:
        print(f"teacher labeled accuracy {stats[0] / stats[1]:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

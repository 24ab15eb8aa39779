"""A hundred-and-forty-sixth hand-run batch: WEIGHT AVERAGING AND WEIGHTED SAMPLING (SWA, EMA, CLASS BALANCING).

A small DDP classifier Linear(6,16)-BatchNorm1d-ReLU-Linear(16,3) over an imbalanced 3-class shard per rank.
Each rank builds its own WeightedRandomSampler from its class counts (DistributedSampler takes no weights),
trains `--epochs` epochs of 3 steps printing `rank R step S loss L`, keeps an EMA copy updated every step and,
from epoch 2, an AveragedModel (SWA) with SWALR. At the end: barrier, update_bn over the local shard, an
all_reduce of the SWA parameter vector (averaged over ranks), rank 0 saves swa.pt, every rank reloads it
into a fresh model and evaluates, barrier, destroy_process_group(). `--ddp 0` broadcasts the weights and
all-reduces the gradients by hand instead of DDP.
Faults:
- zerocls: rank N's shard has no class-2 sample: normalised class weights become nan/0 (sampler error).
- bndict: the BN-update loader yields dict batches on every rank (update_bn passes a dict to the model).
- avgbuf: rank N builds AveragedModel with use_buffers=True: its SWA sync vector has another length.
- emastr: the EMA decay is read from the config as a string on every rank (EMA update fails).
- swalr: rank N's SWA learning rate is scaled by n/0 -> inf; the program's check refuses it at epoch 2.
- leave: rank N leaves the SWA phase after epoch 1 and waits in the pre-BN barrier; the others wait.
- ckptkeys: rank 0 saves swa.state_dict() (keys 'module.*' + 'n_averaged'); reloading fails on every rank.
- abort: rank N is killed by SIGABRT in epoch 2.
- nsamp0: rank N's sampler num_samples is budget // WORLD with a stale budget of 2: 0 samples.
- oom: rank N sizes its EMA history buffer from a wrong count: one huge allocation fails at once.
What happened (filled in after the runs):
- zerocls: rank N 'class counts [.., .., 0.0] weights [0.0, 0.0, nan]', RuntimeError invalid multinomial distribution.
- bndict: every rank TypeError 'linear(): argument 'input' (position 1) must be Tensor, not dict' in update_bn.
- avgbuf: DETAIL: 'Detected mismatch between collectives' [228] vs [195]; plain: gloo EnforceNotMet size, SIGABRT.
- emastr: every rank TypeError 'mul_(): argument 'other' (position 1) must be Tensor, not str' in ema_update.
- swalr: rank N ValueError 'SWA learning rate must be positive and finite, got inf' (line 126); peers closed.
- leave: PG 12 s: rank N (barrier) and a peer (backward) time out 12000ms; PG 300 s: killed by timeout 60.
- ckptkeys: every rank RuntimeError loading state_dict: Missing '0.weight'..., Unexpected 'n_averaged', 'module.*'.
- abort: rank N exitcode -6 (SIGABRT) at epoch 2; with --max-restarts 1 the retry dies in connectFullMesh.
- nsamp0: rank N ValueError 'num_samples should be a positive integer value, but got num_samples=0' (line 86).
- oom: rank N RuntimeError DefaultCPUAllocator can't allocate 3350074490880 bytes (line 115); peers closed.
"""
import argparse
import copy
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, SWALR, update_bn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--swa-start", type=int, default=2)
p.add_argument("--swa-lr", type=float, default=0.02)
p.add_argument("--ema-decay", default="0.99")
p.add_argument("--out", default="/tmp/fault146_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)


def hit():
    return a.rank == -1 or a.rank == RANK


def make_shard():
    g = torch.Generator().manual_seed(7 + RANK)
    y = torch.multinomial(torch.tensor([0.6, 0.3, 0.1]), 96, replacement=True, generator=g)
    if a.fault == "zerocls" and hit():
        y[y == 2] = 1
    x = torch.randn(96, 6, generator=g) + y.float().unsqueeze(1) * 0.5
    return x, y


def make_sampler(y):
    counts = torch.bincount(y, minlength=3).float()
    class_w = 1.0 / counts
    class_w = class_w / class_w.sum()
    print(f"rank {RANK} class counts {counts.tolist()} weights {[round(w, 4) for w in class_w.tolist()]}", flush=True)
    budget = 2 if (a.fault == "nsamp0" and hit()) else 144
    num_samples = budget // WORLD if budget < 96 else 48
    g = torch.Generator().manual_seed(11 + RANK)
    return WeightedRandomSampler(class_w[y], num_samples=num_samples, replacement=True, generator=g)


def ema_update(ema, net, decay):
    with torch.no_grad():
        for e, q in zip(ema.parameters(), net.parameters()):
            e.mul_(decay).add_(q.detach(), alpha=1 - decay)


def main():
    os.makedirs(a.out, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    print(f"rank {RANK}/{WORLD} swa training starting", flush=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    if a.ddp:
        model = DDP(net)
    else:
        for prm in net.parameters():
            dist.broadcast(prm.data, src=0)
        model = net
    x, y = make_shard()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, sampler=make_sampler(y))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ema = copy.deepcopy(net)
    decay = a.ema_decay if a.fault == "emastr" else float(a.ema_decay)
    swa = AveragedModel(net, use_buffers=(a.fault == "avgbuf" and hit()))
    sched = None
    if a.fault == "oom" and hit():
        hist = torch.empty(sum(q.numel() for q in net.parameters()) << 32, dtype=torch.float32)
        print(f"rank {RANK} ema history {hist.numel()}", flush=True)
    step = 0
    for epoch in range(1, a.epochs + 1):
        if a.fault == "leave" and hit() and epoch == a.swa_start + 1:
            print(f"rank {RANK} swa phase done after epoch {epoch - 1}", flush=True)
            break
        if epoch == a.swa_start:
            scale = torch.tensor(float(len(y))) / (0.0 if (a.fault == "swalr" and hit()) else len(y))
            swa_lr = a.swa_lr * (scale.item() if a.fault == "swalr" and hit() else 1.0)
            if not math.isfinite(swa_lr) or swa_lr <= 0:
                raise ValueError(f"rank {RANK}: SWA learning rate must be positive and finite, got {swa_lr}")
            sched = SWALR(opt, swa_lr=swa_lr, anneal_epochs=1)
        if a.fault == "abort" and hit() and epoch == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            if not a.ddp:
                for prm in net.parameters():
                    dist.all_reduce(prm.grad)
                    prm.grad /= WORLD
            opt.step()
            ema_update(ema, net, decay)
            print(f"rank {RANK} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
        if epoch >= a.swa_start:
            swa.update_parameters(net)
            sched.step()
            print(f"rank {RANK} epoch {epoch} swa n_averaged {int(swa.n_averaged)}", flush=True)
    dist.barrier()
    if a.fault == "bndict":
        bn_loader = [{"x": x[i:i + 16], "y": y[i:i + 16]} for i in range(0, 96, 16)]
    else:
        bn_loader = DataLoader(TensorDataset(x), batch_size=16)
    update_bn(bn_loader, swa)
    tensors = list(swa.module.parameters()) + (list(swa.module.buffers()) if a.fault == "avgbuf" and hit() else [])
    vec = torch.cat([t.detach().float().flatten() for t in tensors])
    dist.all_reduce(vec)
    vec /= WORLD
    print(f"rank {RANK} swa vector {vec.numel()} norm {vec.norm().item():.4f}", flush=True)
    ck = os.path.join(a.out, "swa.pt")
    if RANK == 0:
        torch.save(swa.state_dict() if a.fault == "ckptkeys" else swa.module.state_dict(), ck)
    dist.barrier()
    fresh = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    fresh.load_state_dict(torch.load(ck, map_location="cpu"))
    fresh.eval()
    with torch.no_grad():
        acc = (fresh(x).argmax(1) == y).float().mean()
        ema.eval()
        ema_acc = (ema(x).argmax(1) == y).float().mean()
    stats = torch.stack([acc, ema_acc])
    dist.all_reduce(stats)
    if RANK == 0:
        print(f"swa acc {stats[0].item() / WORLD:.3f} ema acc {stats[1].item() / WORLD:.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main()

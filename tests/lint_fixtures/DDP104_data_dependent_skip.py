"""DDP104 fixture: break/continue on per-rank data in loops that run collectives."""
import math
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train(net, loader, optimizer, max_steps, budget_s):
    model = DDP(net)
    start = time.time()
    for step, batch in enumerate(loader):
        if step >= max_steps:
            # ok: DDP104
            break
        if batch is None:
            # ruleid: DDP104
            continue
        loss = model(batch).sum()
        if torch.isnan(loss):
            # ruleid: DDP104
            continue
        if not math.isfinite(loss.item()):
            # ruleid: DDP104
            continue
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            # ruleid: DDP104
            break
        if time.time() - start > budget_s:
            # ruleid: DDP104
            break
        if step % 100 == 0:
            # ok: DDP104
            continue


def agreed_before_skipping(net, loader):
    for batch in loader:
        loss = net(batch).sum()
        bad = torch.isnan(loss).float()
        dist.all_reduce(bad)
        if bad.item() > 0:
            # ok: DDP104
            continue
        dist.all_reduce(loss)


def no_collective_in_the_loop(net, loader):
    for batch in loader:
        loss = net(batch)
        if torch.isnan(loss):
            # ok: DDP104
            continue
        print(loss)


def modes_are_the_same_on_every_rank(model, modes, has_compiler):
    for mode in modes:
        if mode != "eager" and not has_compiler():
            # ok: DDP104
            continue
        dist.barrier()
        model(mode)

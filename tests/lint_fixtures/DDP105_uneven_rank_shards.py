"""DDP105 fixture: hand-made per-rank shards iterated by loops with collectives."""
import numpy as np
import torch
import torch.distributed as dist


def strided_shard(samples, rank, world_size, model):
    # ruleid: DDP105
    shard = samples[rank::world_size]
    for x in shard:
        loss = model(x)
        dist.all_reduce(loss)


def array_split_through_a_loader(samples, model):
    rank, world = dist.get_rank(), dist.get_world_size()
    # ruleid: DDP105
    mine = np.array_split(samples, world)[rank]
    loader = torch.utils.data.DataLoader(mine, batch_size=4)
    for batch in loader:
        dist.all_reduce(model(batch))


def truncated_to_a_multiple_first(samples, rank, world_size, model):
    samples = samples[: len(samples) // world_size * world_size]
    # ok: DDP105
    shard = samples[rank::world_size]
    for x in shard:
        dist.all_reduce(model(x))


def inside_join(samples, rank, world_size, ddp_model):
    # ok: DDP105
    shard = samples[rank::world_size]
    with ddp_model.join():
        for x in shard:
            dist.all_reduce(ddp_model(x))


def loop_without_collectives(samples, rank, world_size):
    # ok: DDP105
    shard = samples[rank::world_size]
    for x in shard:
        print(x)


def round_robin_skip(samples, rank, world_size, model):
    for i, x in enumerate(samples):
        # ruleid: DDP105
        if i % world_size != rank:
            continue
        dist.all_reduce(model(x))


def round_robin_then_one_reduce(samples, rank, world_size, model):
    total = torch.zeros(1)
    for i, x in enumerate(samples):
        # ok: DDP105
        if i % world_size != rank:
            continue
        total += model(x)
    dist.all_reduce(total)

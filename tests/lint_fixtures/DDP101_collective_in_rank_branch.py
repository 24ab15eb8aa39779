"""DDP101 fixture: collectives that only some ranks reach.

`# ruleid: DDP101` marks the line before an expected finding, `# ok: DDP101` a near miss.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed import all_reduce, barrier as sync


def log_metric(metric):
    dist.all_reduce(metric)      # every rank that calls this helper runs the collective
    return metric


def rank_zero_eval(metric, rank):
    if rank == 0:
        # ruleid: DDP101
        dist.all_reduce(metric)
        print(metric)


def imported_name(metric):
    if dist.get_rank() == 0:
        # ruleid: DDP101
        all_reduce(metric)


def helper_variable(rank):
    is_main = rank == 0
    if is_main:
        # ruleid: DDP101
        sync()


def through_local_helper(metric, local_rank):
    if local_rank == 0:
        # ruleid: DDP101
        log_metric(metric)


def early_return(metric, rank):
    if rank != 0:
        return
    # ruleid: DDP101
    dist.broadcast(metric, src=0)


def rank_from_environment(metric):
    if int(os.environ["RANK"]) == 0:
        # ruleid: DDP101
        dist.all_gather([metric], metric)


def different_collectives(metric, rank):
    if rank == 0:
        # ruleid: DDP101
        dist.broadcast(metric, src=0)
    else:
        # ruleid: DDP101
        dist.reduce_scatter(metric, [metric])


def same_collective_both_branches(metric, rank):
    if rank == 0:
        # ok: DDP101
        dist.broadcast(metric, src=0)
    else:
        # ok: DDP101
        dist.broadcast(metric, src=0)


def collective_outside_the_branch(metric, rank):
    # ok: DDP101
    dist.all_reduce(metric)
    if rank == 0:
        print(metric.item())


def sentinel_test_is_the_same_on_every_rank(args):
    if args.local_rank != -1:
        # ok: DDP101
        dist.barrier()


def paired_barriers(args):
    if args.local_rank not in [-1, 0]:
        # ok: DDP101
        torch.distributed.barrier()      # the other ranks wait while rank 0 downloads
    download_once()
    if args.local_rank == 0:
        # ok: DDP101
        torch.distributed.barrier()


def explicit_subgroup(metric, rank, group):
    if rank < 4:
        # ok: DDP101
        dist.all_reduce(metric, group=group)


def adapter_rank_is_not_a_process_rank(metric, lora_rank):
    if lora_rank > 0:
        # ok: DDP101
        dist.all_reduce(metric)


def silenced(rank):
    if rank == 0:
        dist.barrier()  # triage: ignore[DDP101]


def download_once():
    pass


def round_robin_is_not_a_rank_branch(items, rank, world_size, model):
    for i, item in enumerate(items):
        # ruleid: DDP105
        if i % world_size != rank:      # every rank gets items: uneven counts are DDP105's case
            continue
        # ok: DDP101
        dist.broadcast(model(item), src=rank)


def every_role_creates_the_group(rank, trainer_ranks):
    if rank == 0:
        # ok: DDP101
        dist.new_group(trainer_ranks)
    elif rank == 1:
        # ok: DDP101
        dist.new_group(trainer_ranks)
    elif rank in trainer_ranks:
        # ok: DDP101
        dist.new_group(trainer_ranks)
    else:
        raise RuntimeError(f"unknown rank {rank}")


def one_role_forgets_the_group(rank, trainer_ranks):
    if rank == 0:
        # ruleid: DDP101
        dist.new_group(trainer_ranks)
    elif rank in trainer_ranks:
        # ruleid: DDP101
        dist.new_group(trainer_ranks)

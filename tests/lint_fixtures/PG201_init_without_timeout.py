"""PG201 fixture: init_process_group without timeout=."""
import datetime

import torch.distributed as dist
from torch.distributed import init_process_group


def setup(options, group_maker):
    # ruleid: PG201
    dist.init_process_group(backend="nccl")
    # ruleid: PG201
    init_process_group("gloo")
    # ok: PG201
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=30))
    # ok: PG201
    dist.init_process_group("gloo", "env://", datetime.timedelta(seconds=60))
    # ok: PG201
    dist.init_process_group(**options)
    # ok: PG201
    group_maker.init_process_group()

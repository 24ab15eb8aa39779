"""DDP103 fixture: a DDP/FSDP-wrapped model called on only some ranks."""
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate(model, batch):
    with torch.no_grad():
        return model(batch)


def train(net, sharded_net, batch, rank):
    model = DDP(net)
    fsdp_model = FSDP(sharded_net)
    quiet = DDP(net, broadcast_buffers=False)
    if rank == 0:
        model.eval()
        # ruleid: DDP103
        val = model(batch)
        # ruleid: DDP103
        evaluate(model, batch)
        # ok: DDP103
        model.module(batch)
        # ruleid: DDP103
        fsdp_model(batch)
        # ok: DDP103
        quiet(batch)
    # ok: DDP103
    out = model(batch)
    return val, out


def wrapped_by_a_project_helper(net, batch, ctx, ddp_wrap, ddp_setup):
    run = ddp_setup(ctx)
    policy = ddp_wrap(net, ctx)
    if ctx.is_main:
        # ruleid: DDP103
        policy(batch)
        # ok: DDP103
        run(batch)


def unwrap(module):
    return module.module if hasattr(module, "module") else module


def helper_gets_the_unwrapped_model(net, batch, rank):
    model = DDP(net)
    if rank == 0:
        # ok: DDP103
        evaluate(unwrap(model), batch)
        # ok: DDP103
        evaluate(model.module, batch)
        # ruleid: DDP103
        evaluate(model=model, batch=batch)

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

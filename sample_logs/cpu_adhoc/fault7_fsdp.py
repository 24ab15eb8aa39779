"""fault7.py's FSDP case (kept in its own file so that fault7.py's line numbers stay those of the earlier runs)."""
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def wrap(net, rank, fault_rank):
    if rank == fault_rank:
        net.fc.bias.requires_grad_(False)  # this rank's config freezes the bias before wrapping
    return FSDP(net, device_id=torch.device("cpu"), use_orig_params=False)

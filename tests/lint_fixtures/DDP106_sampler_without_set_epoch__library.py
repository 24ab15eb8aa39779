"""DDP106 near miss: a loader factory; the epoch loop (and set_epoch) live in another file."""
import torch
from torch.utils.data import DataLoader


def create_loader(dataset, batch_size):
    # ok: DDP106
    sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


def fast_collate(batch):
    out = []
    for i in range(len(batch)):
        for item in batch[i]:
            out.append(item)
    return out

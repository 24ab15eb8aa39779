"""DDP106 fixture: a shuffling DistributedSampler and no set_epoch anywhere in the file."""
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def train(ds, epochs):
    # ruleid: DDP106
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, drop_last=True)
    # ok: DDP106
    eval_sampler = DistributedSampler(ds, shuffle=False)
    for epoch in range(epochs):
        for batch in loader:
            print(epoch, batch)
    return eval_sampler

"""DDP106 fixture (near miss): the epoch loop calls set_epoch."""
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def train(ds, epochs):
    # ok: DDP106
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, drop_last=True)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            print(epoch, batch)

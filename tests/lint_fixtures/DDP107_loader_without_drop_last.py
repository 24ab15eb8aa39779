"""DDP107 fixture: training loaders over a DistributedSampler that keep the short last batch,
in a file whose model uses BatchNorm."""
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def model():
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))


def loaders(ds, epochs):
    sampler = DistributedSampler(ds)
    # ruleid: DDP107
    train = DataLoader(ds, batch_size=32, sampler=sampler)
    # ruleid: DDP107
    train_inline = DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds), drop_last=False)
    # ok: DDP107
    dropped = DataLoader(ds, batch_size=32, sampler=sampler, drop_last=True)
    # ok: DDP107
    evaluation = DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds, shuffle=False))
    # ok: DDP107
    single_process = DataLoader(ds, batch_size=32, shuffle=True)
    # ok: DDP107
    val_loader = DataLoader(ds, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
    return train, train_inline, dropped, evaluation, single_process, val_loader

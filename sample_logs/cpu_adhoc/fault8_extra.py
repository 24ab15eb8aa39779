"""Faults added to fault8.py in its third version; each returns the step's batch (fault8.py line 80)."""
import json, os, time
import torch
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault8_work"


class ShardOnSlowMount(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(30)  # this rank's shard sits on a mount that stopped answering
        return torch.randn(8)


def batch(rank: int, step: int, a) -> torch.Tensor:
    hit = rank == a.rank and step == 3
    os.makedirs(WORK, exist_ok=True)
    if hit and a.fault == "loader_timeout":
        loader = DataLoader(ShardOnSlowMount(), batch_size=16, num_workers=1, timeout=5)
        return next(iter(loader))
    if hit and a.fault == "json_config":
        path = f"{WORK}/lr_schedule_rank{rank}.json"
        with open(path, "w") as f:
            f.write('{"warmup": 100, "decay": [0.1, 0.01')  # a copy cut short by a full quota
        with open(path) as f:
            sched = json.load(f)
    if hit and a.fault == "save_full":
        torch.save({"step": step, "w": torch.randn(256, 256)}, "/dev/full")  # the checkpoint volume is full
    return torch.randn(16, 8)

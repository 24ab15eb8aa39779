"""More faults that are not triage inject scenarios (second hand-run batch)."""
import argparse, datetime, os, time
import torch, torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
a = p.parse_args()
rank = int(os.environ["RANK"])


class Shard(Dataset):
    def __init__(self, bad: bool):
        self.bad = bad
    def __len__(self):
        return 64
    def __getitem__(self, i):
        if self.bad and i >= 40:
            raise ValueError(f"sample {i}: expected 8 features, got 7")
        return torch.randn(8)


if a.fault == "dataset_init_missing" and rank == a.rank:
    open(f"/tmp/job/data/train_{rank:03d}.idx").read()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
width = 6 if (a.fault == "ddp_model_mismatch" and rank == a.rank) else 4
model = nn.parallel.DistributedDataParallel(nn.Linear(8, width))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Shard(a.fault == "loader_valueerror" and rank == a.rank), batch_size=16,
                    num_workers=2 if a.fault == "loader_valueerror" else 0)
step = 0
for epoch in range(3):
    for x in loader:
        step += 1
        hit = rank == a.rank and step == 3
        if hit and a.fault == "abort":
            os.abort()
        if hit and a.fault == "sleep_hang":
            time.sleep(3600)
        if step == 2 and a.fault == "all_attr":
            model.module.proj(x)
        if hit and a.fault == "ckpt_save":
            torch.save(model.module.state_dict(), "/dev/null/run1/step3.pt")
        if hit and a.fault == "assert_after_save":
            assert step < 3, "eval metric dict is empty"
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step >= a.steps:
            break
        if a.fault == "sigint_agent":
            time.sleep(1)
    if step >= a.steps:
        break
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)

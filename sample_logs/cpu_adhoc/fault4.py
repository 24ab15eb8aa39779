"""Fourth batch of hand-run faults: a rank's exception in the first attempt only, so that
torchrun --max-restarts 1 restarts the workers and the second attempt finishes."""
import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, default=1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
for step in range(3):
    t = torch.ones(4)
    dist.all_reduce(t)
    print(f"[rank {rank}] attempt {attempt} step {step} loss {t.sum().item():.1f}", flush=True)
    if attempt == 0 and rank == args.rank and step == 1:
        batch = {"input_ids": t}
        print(batch["labels"])
dist.destroy_process_group()
print(f"[rank {rank}] training finished", flush=True)

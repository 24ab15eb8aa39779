# Fourth batch, run in /tmp/judge9 before fault4.py existed: the same fault with the rank fixed at 1.
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
for step in range(3):
    t = torch.ones(4)
    dist.all_reduce(t)
    print(f"[rank {rank}] attempt {attempt} step {step} loss {t.sum().item():.1f}", flush=True)
    if attempt == 0 and rank == 1 and step == 1:
        batch = {"input_ids": t}
        print(batch["labels"])
dist.destroy_process_group()
print(f"[rank {rank}] training finished", flush=True)

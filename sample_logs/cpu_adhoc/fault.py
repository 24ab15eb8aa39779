"""Faults not among the project's inject scenarios, to test how the diagnosis generalises."""
import argparse, ctypes, datetime, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
a = p.parse_args()

if a.fault == "import_missing":
    import apex_fused_kernels  # noqa
rank = int(os.environ["RANK"])
if a.fault == "exit_before_init" and rank == a.rank:
    raise SystemExit("config error: --batch-size must divide the world size")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
world = dist.get_world_size()
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if a.fault == "ckpt_missing":
    model.module.load_state_dict(torch.load("/tmp/judge/no_such_run/last.pt"))
n_batches = a.steps - 3 if (a.fault == "uneven_data" and rank == a.rank) else a.steps
for step in range(1, n_batches + 1):
    x = torch.randn(16, 8)
    hit = rank == a.rank and step == 3
    if hit and a.fault == "zerodiv":
        scale = 1 / (len(x) - 16)
    if hit and a.fault == "assert":
        assert x.shape[0] == 32, f"expected a batch of 32, got {x.shape[0]}"
    if hit and a.fault == "matmul":
        x = x @ torch.randn(5, 8)
    if hit and a.fault == "file_missing":
        open(f"/tmp/judge/shards/shard_{rank:05d}.jsonl").read()
    if hit and a.fault == "os_exit":
        os._exit(1)
    if hit and a.fault == "sigterm_self":
        os.kill(os.getpid(), signal.SIGTERM)
    if hit and a.fault == "recursion":
        def f(n): return f(n + 1)
        f(0)
    if hit and a.fault == "memory":
        big = torch.empty(1 << 44, dtype=torch.uint8)
    if hit and a.fault == "sleep_hang":
        time.sleep(3600)
    if hit and a.fault == "nan_check":
        loss = torch.tensor(float("nan"))
        if not torch.isfinite(loss):
            raise RuntimeError(f"Loss is NaN at step {step}, stopping training")
    if hit and a.fault == "index":
        labels = [0, 1, 2]
        y = labels[len(labels) + rank]
    if hit and a.fault == "type":
        x = x + "1"
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)

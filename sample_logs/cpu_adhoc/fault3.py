"""A third hand-run batch of faults that are not triage inject scenarios."""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
a = p.parse_args()


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, a.steps + 1):
        hit = rank == a.rank and step == 3
        if a.fault == "restart_once" and hit and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            raise RuntimeError("transient: dataset shard server returned 503")
        if hit and a.fault == "valueerror":
            raise ValueError(f"invalid learning-rate schedule: warmup_steps ({step}) > total_steps (2)")
        if hit and a.fault == "zerodiv":
            print(1 / 0)
        if step == 3 and a.fault == "monitored_barrier":
            if rank == a.rank:
                time.sleep(60)
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))
        if step == 3 and a.fault == "pickle":
            obj = (lambda x: x) if rank == a.rank else {"ok": True}
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_PORT"] = str(29700 + os.getpid() % 200)
        mp.spawn(main, args=(a.spawn,), nprocs=a.spawn)
    else:
        main()

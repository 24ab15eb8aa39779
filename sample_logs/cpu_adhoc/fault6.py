"""A sixth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault5.py)."""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()


class Net(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        if a.fault == "model_init" and rank == a.rank:
            raise ValueError(f"hidden_size 8 is not divisible by num_heads 3")

    def forward(self, x):
        return self.fc(x)


def evaluate(model, rank):
    if a.fault == "eval_only" and rank == a.rank:
        scores = {"acc": 0.5}
        return scores["acc"] / len([])  # an empty validation shard
    return 0.0


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    # the faulty rank reads a stale host name from its config (mp.spawn and torchrun alike)
    if a.fault == "bad_host" and rank == a.rank:
        os.environ["MASTER_ADDR"] = "trainer-master-0.cluster.internal"  # a stale host name
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout), rank=rank, world_size=world)
    net = Net(rank)
    if a.fault == "bcast_src":
        w = torch.zeros(4)
        if rank == a.rank:
            cfg = {"seed": 1}
            w = torch.full((4,), float(cfg["init_scale"]))  # the key the broadcaster needs is absent
        dist.broadcast(w, src=a.rank)
    if a.fault == "new_group":
        ranks = list(range(world)) if rank != a.rank else list(range(world - 1))
        sub = dist.new_group(ranks)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, a.steps + 1):
        hit = rank == a.rank and step == 3
        if hit and a.fault == "extra_barrier":
            dist.barrier()  # a logging helper's barrier that only this rank reaches
        if step == 3 and a.fault == "gather_len":
            t = torch.ones(4) * rank
            n = world - 1 if rank == a.rank else world
            out = [torch.zeros(4) for _ in range(n)]
            dist.all_gather(out, t)
        if hit and a.fault in ("hang_stop", "node_hang"):
            print(f"rank {rank}: waiting for the data service", flush=True)
            while True:
                time.sleep(1)
        if hit and a.fault == "node_fault":
            raise RuntimeError("shard /data/train-00003.bin has 0 samples")
        if hit and a.fault == "restarts2":
            if attempt == 0:
                raise KeyError("input_ids")
        if step == 3 and a.fault == "restarts2" and attempt >= 1 and rank == (a.rank + 1) % world:
            raise FileNotFoundError(f"[Errno 2] No such file or directory: '/tmp/fault6_cache/rank{rank}.idx'")
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step == a.steps - 1:
            acc = evaluate(model, rank) if rank == a.rank else None
            dist.barrier()  # the others wait for the evaluating rank
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_PORT"] = str(29900 + os.getpid() % 90)
        mp.spawn(main, args=(a.spawn,), nprocs=a.spawn)
    else:
        main()

"""A forty-third hand-run batch: RENDEZVOUS and ELASTIC membership. A small DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, a few steps, `attempt A rank R step S loss L` progress lines) whose
failures come from forming or re-forming the group. Most faults are the launcher's (late, missing or mismatched
nodes, static rendezvous with a wrong node rank, an endpoint nobody listens on): those runs use --fault none and the
fault is in the command (see fault43_nodes.py). The script's own faults (--rank N: the rank at fault):
  none            trains --steps steps and prints `attempt A rank R done`
  pre_init_raise  rank N raises before init_process_group (its run config names a shard index that is not there:
                  ValueError), so the others wait in the rendezvous until the agent stops them
  tcp_port        --init tcp: init_process_group(init_method="tcp://127.0.0.1:P") with rank N using P+1 (a port
                  nobody listens on; a stale value in its launch config)
  tcp_world       --init tcp: rank N passes world_size+1 to init_process_group
  file_dir        --init file: init_method="file:///tmp/fault43_store/pg" with rank N given a path under a folder
                  that does not exist (its own copy of the config points at another scratch folder)
  slow_step       every rank sleeps --sleep s per step (lets a node leave in the middle of training)
  leave_once      attempt 0 only: rank N raises RuntimeError at step 3 (a worker that leaves); the restart finishes
Env-only runs (plain `python fault43.py` without torchrun) read RANK/WORLD_SIZE and init_method env://.
"""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--init", choices=["env", "tcp", "file"], default="env")
p.add_argument("--tcp-port", type=int, default=24390)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def say(rank: int, msg: str) -> None:
    print(f"attempt {ATTEMPT} rank {rank} {msg}", flush=True)


def init(rank: int, world: int) -> None:
    bad = rank == a.rank
    if a.fault == "pre_init_raise" and bad:
        idx = "/tmp/job/data/shards.idx"
        raise ValueError(f"run config: shard index {idx} lists 0 shards for rank {rank}, expected {world}")
    if a.init == "env":
        dist.init_process_group("gloo", timeout=TIMEOUT)
    elif a.init == "tcp":
        port = a.tcp_port + 1 if (a.fault == "tcp_port" and bad) else a.tcp_port
        ws = world + 1 if (a.fault == "tcp_world" and bad) else world
        say(rank, f"init_method tcp://127.0.0.1:{port} world_size {ws}")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                                timeout=TIMEOUT)
    else:
        path = "/tmp/fault43_scratch/run7/pg" if (a.fault == "file_dir" and bad) else "/tmp/fault43_store/pg"
        say(rank, f"init_method file://{path}")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world, timeout=TIMEOUT)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    init(rank, world)
    say(rank, f"world {dist.get_world_size()} building model (max restarts {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')})")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, a.steps + 1):
        if a.fault == "leave_once" and ATTEMPT == 0 and rank == a.rank and step == 3:
            raise RuntimeError(f"rank {rank}: node health check failed (ECC errors on this host), leaving the job")
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(rank, f"step {step} loss {loss.item():.4f}")
        time.sleep(a.sleep)
    dist.barrier()
    say(rank, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

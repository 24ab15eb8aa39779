"""A twenty-fourth hand-run batch: launch, rendezvous and elastic failures (master port in use, a node that never
joins or joins another run id, the c10d store's node dying, a worker that exits 0 early, two processes claiming one
rank, a file:// init_method one rank cannot open, signals to the agent from outside, a worker SIGKILLed from outside,
argparse and launcher usage mistakes). Most faults come from the command line or from fault24_ctl.py /
fault24_nodes.py around torchrun; this script is an ordinary small DDP loop with a few rank-local faults.

Run: --fault NAME --rank N (the faulty rank). Under mpirun, RANK/WORLD_SIZE/LOCAL_RANK come from OMPI_COMM_WORLD_*.
Each rank writes its pid to /tmp/fault24/pid_rank<R> so that fault24_ctl.py can signal one worker from outside.
The script does NOT accept --local-rank: the legacy launcher without --use-env is rejected (a launch mistake)."""
import argparse, datetime, logging, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--step-sleep", type=float, default=0.3)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--logfmt", choices=["print", "bracket"], default="print")
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16
RUNDIR = "/tmp/fault24"
log = logging.getLogger("train")


def say(rank: int, msg: str) -> None:
    if a.logfmt == "print":
        print(f"rank {rank} {msg}", flush=True)
    else:
        log.info(msg)
        sys.stdout.flush()


def init(rank: int, world: int, hit: bool) -> None:
    f = a.fault
    if f == "dup_rank" and hit:  # a stale RANK from a per-host env file: this process claims its neighbour's rank
        claimed = (rank + 1) % world
        say(rank, f"init_process_group as rank {claimed} (from /etc/job.env)")
        dist.init_process_group("gloo", rank=claimed, world_size=world, timeout=TIMEOUT)
    elif f == "file_init_bad":  # a shared rendezvous file; this rank's copy of the config names an unwritable path
        path = "/sys/fault24_rdzv" if hit else f"{RUNDIR}/rdzv_{os.environ.get('MASTER_PORT', 'x')}"
        say(rank, f"init_method file://{path}")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world, timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)


@record
def main() -> None:
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    if a.logfmt == "bracket":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [Rank {rank}] %(levelname)s %(message)s")
    os.makedirs(RUNDIR, exist_ok=True)
    with open(f"{RUNDIR}/pid_rank{rank}", "w") as fh:
        fh.write(str(os.getpid()))
    init(rank, world, hit)
    say(rank, f"world {world} building model")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, a.steps + 1):
        if hit and a.fault == "early_exit0" and step == 3:  # the data iterator ran dry here; main returns normally
            say(rank, f"no more samples in shard {rank} at step {step}; finishing")
            return
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        time.sleep(a.step_sleep)
        say(rank, f"step {step} loss {loss.item():.4f}")
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    main()

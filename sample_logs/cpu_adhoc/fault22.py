"""A twenty-second hand-run batch: ordinary training faults on one rank (6-8 ranks), run under the launcher and
log-format forms under which rank attribution is hardest: plain torchrun, --tee 3 / --role, --local-ranks-filter,
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, a srun --label emulation and a pdsh-style host prefix around one torchrun per
"node" (fault22_nodes.py), Open MPI's mpirun --tag-output, the script's own logging format with a rank field
(--logfmt bracket|kv) and --redirects 3 --log-dir.

Run: --fault NAME --rank N (the faulty rank). Under mpirun, RANK/WORLD_SIZE/LOCAL_RANK come from OMPI_COMM_WORLD_*."""
import argparse, datetime, logging, math, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--logfmt", choices=["print", "bracket", "kv"], default="print")
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16
CKDIR = "/tmp/fault22_ckpt"
log = logging.getLogger("train")


def setup_logging(rank: int) -> None:
    if a.logfmt == "bracket":  # a plain basicConfig with the rank baked into the format
        fmt = f"%(asctime)s [Rank {rank}] %(levelname)s %(message)s"
    else:  # DeepSpeed/Megatron-like: [time] [LEVEL] [file:line:func] [rank=N] msg
        fmt = f"[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] [rank={rank}] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stdout)


def say(rank: int, msg: str) -> None:
    if a.logfmt == "print":
        print(f"rank {rank} {msg}", flush=True)
    else:
        log.info(msg)
        sys.stdout.flush()


class Shard(torch.utils.data.Dataset):
    """16 * steps synthetic samples; the faulty rank's shard goes wrong from step 3's batch on for some faults."""

    def __init__(self, rank: int, hit: bool, n: int):
        self.rank, self.hit, self.n = rank, hit, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        x, y = torch.randn(8, generator=g), int(torch.randint(0, 4, (1,), generator=g))
        late = self.hit and i >= 2 * BATCH  # step 3's batch and after
        if late and a.fault == "loader_worker" and i == 2 * BATCH + 5:
            raise ValueError(f"bad sample {i} in shard part-0000{self.rank}.jsonl: label -1 outside [0, 4)")
        if late and a.fault == "batch_key":  # the second shard file was written with another schema
            return {"x": x, "labels": y}
        if late and a.fault == "matmul_shape":  # the second shard file has 12 features per sample
            return {"x": torch.randn(12, generator=g), "y": y}
        if late and a.fault == "nan_raise" and i == 2 * BATCH + 3:
            x = x.clone()
            x[2] = float("nan")
        return {"x": x, "y": y}


def fault_at_step(rank: int, step: int, model, opt) -> None:
    f = a.fault
    if f == "load_missing" and step == 3:  # resume the per-rank EMA copy saved at step 2; this rank's file is gone
        if os.path.exists(f"{CKDIR}/ema_rank{rank}.pt"):
            os.remove(f"{CKDIR}/ema_rank{rank}.pt")  # node-local scratch cleaned by another job
        say(rank, f"loading EMA weights from {CKDIR}/ema_rank{rank}.pt")
        model.module.load_state_dict(torch.load(f"{CKDIR}/ema_rank{rank}.pt"))
    elif f == "huge_alloc" and step == 3:  # a prefetch buffer sized from a config value read in bytes, not MB
        say(rank, "allocating prefetch buffer")
        buf = bytearray(16 * 1024 ** 4)
        buf[0] = 1
    elif f == "segv_self" and step == 3:  # stands in for a native extension's crash
        os.kill(os.getpid(), signal.SIGSEGV)
    elif f == "sigkill_self" and step == 3:  # stands in for a watchdog / OOM kill of this one process
        os.kill(os.getpid(), signal.SIGKILL)
    elif f == "stall" and step == 3:  # waits on a shared-storage lock past the process-group timeout
        time.sleep(3 * a.pg_timeout)
    elif f == "assert_cfg" and step == 3:  # the schedule config is re-read at step 3; this rank's copy is stale
        cfg = {"warmup_steps": 2000, "total_steps": 1500}
        assert cfg["warmup_steps"] < cfg["total_steps"], (
            f"warmup_steps ({cfg['warmup_steps']}) must be smaller than total_steps ({cfg['total_steps']})")
    elif f == "import_opt" and step == 3:  # switch to the fused optimizer from an optional package
        say(rank, "switching to fused optimizer")
        from apex.optimizers import FusedAdam  # noqa: F401


@record
def main() -> None:
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    if a.logfmt != "print":
        setup_logging(rank)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    say(rank, f"world {world} building model")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    whiten = torch.eye(8)
    workers = 2 if a.fault == "loader_worker" else 0
    loader = torch.utils.data.DataLoader(Shard(rank, hit, BATCH * a.steps), batch_size=BATCH, num_workers=workers)
    os.makedirs(CKDIR, exist_ok=True)
    step = 0
    try:
        for step, batch in enumerate(loader, start=1):
            if hit:
                fault_at_step(rank, step, model, opt)
            x = batch["x"] @ whiten  # feature whitening (identity here)
            y = batch["y"]
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss is {loss.item()} at step {step}, stopping")
            loss.backward()
            opt.step()
            if step == 2:
                if a.fault == "load_missing":
                    torch.save(model.module.state_dict(), f"{CKDIR}/ema_rank{rank}.pt")
                if a.fault == "save_barrier" and hit:  # the 'main' rank saves; the barrier slipped inside the if
                    torch.save(model.module.state_dict(), f"{CKDIR}/step2.pt")
                    say(rank, f"saved {CKDIR}/step2.pt")
                    dist.barrier()
            if step == 3 and a.fault == "skip_allreduce":  # eval metric sync; this rank has no eval shard
                metric = torch.tensor([loss.item()])
                if not hit:
                    dist.all_reduce(metric)
            say(rank, f"step {step} loss {loss.item():.4f}")
    except Exception:
        if a.logfmt != "print":
            log.exception(f"training failed at step {step}")
        raise
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    main()

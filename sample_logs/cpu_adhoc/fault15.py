"""A fifteenth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault14.py)."""
import argparse, contextlib, dataclasses, datetime, os, queue, shutil, signal, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class StepTimer:
    """Times the step and reports it to the metrics sink on exit."""

    def __init__(self, rank, sink):
        self.rank, self.sink = rank, sink

    def __enter__(self):
        self.t0 = time.time()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.sink["step_s"].append(time.time() - self.t0)  # this rank's sink has no step_s series
        return False


def make_planner(hit: bool):
    from torch.distributed.checkpoint import DefaultSavePlanner

    class ShardFilterPlanner(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            if hit:
                raise ValueError("ShardFilterPlanner: no shard rule for key 'head.bias' on this rank")
            return plan

    return ShardFilterPlanner()


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 2
    batch: int = 16


def fault_at_step3(rank: int, world: int, model, hit: bool, state: dict) -> None:
    if a.fault == "frozen_config":
        cfg = EvalConfig()
        if hit:
            say(rank, "halving eval batch for this rank's smaller memory")
            cfg.batch = cfg.batch // 2  # the config is frozen
        state["cfg"] = cfg
    if a.fault == "bf16_numpy" and hit:
        say(rank, "exporting bf16 head weights for the dashboard")
        w = model.module.head.weight.detach().to(torch.bfloat16)
        state["w"] = w.numpy()
    if a.fault == "dcp_planner":
        from torch.distributed import checkpoint as dcp
        path = "/tmp/fault15_dcp"
        say(rank, f"saving distributed checkpoint to {path}")
        dcp.save({"model": model.module.state_dict()}, checkpoint_id=path, planner=make_planner(hit))
    if a.fault == "env_missing":
        say(rank, "opening eval shards")
        root = os.environ["DATA_ROOT"]
        state["eval_root"] = os.path.join(root, f"eval{rank}")
    if a.fault == "queue_empty" and hit:
        q = queue.Queue()

        def prefetch():
            time.sleep(5)  # this rank's prefetcher is slower than the consumer's patience
            q.put(torch.randn(16, 8))

        threading.Thread(target=prefetch, daemon=True).start()
        say(rank, "waiting for prefetched eval batch")
        state["eval_x"] = q.get(timeout=2)
    if a.fault == "recursion_low" and hit:
        sys.setrecursionlimit(30)  # set for a flat config walk, too low for anything else
        say(rank, "recursion limit lowered to 30; saving step-2 weights")
        torch.save(model.module.state_dict(), f"/tmp/fault15_weights_rank{rank}.pt")
    if a.fault == "detail_dtype":
        t = torch.ones(64, dtype=torch.float64 if hit else torch.float32)
        say(rank, "all-reducing eval counters")
        dist.all_reduce(t)
    if a.fault == "item_multi" and hit:
        say(rank, "logging grad norm")
        norms = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
        state["gn"] = norms.item()  # meant norms.norm().item()
    if a.fault == "sigterm_swallow":
        if rank == (a.rank + 1) % world:
            signal.signal(signal.SIGTERM, lambda s, f: say(rank, "SIGTERM received, finishing upload first"))
            say(rank, "uploading step-2 checkpoint (slow)")
            time.sleep(60)
        if hit:
            say(rank, "validating loss scale")
            raise RuntimeError("loss scale fell below 1e-8 on this rank; refusing to continue")


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    if a.fault == "env_missing":
        os.environ["DATA_ROOT"] = "/tmp/fault15_data"  # the cluster profile sets it ...
        if hit:
            del os.environ["DATA_ROOT"]  # ... except on this rank's node profile
    if a.fault == "dcp_planner" and rank == 0:
        shutil.rmtree("/tmp/fault15_dcp", ignore_errors=True)
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
    if a.fault == "meta_late" and hit:
        with torch.device("meta"):  # deferred init on this rank; to_empty comes after wrapping
            net = Net()
        say(rank, "model built on meta device")
    else:
        net = Net()
    model = nn.parallel.DistributedDataParallel(net)
    if a.fault == "meta_late" and hit:
        model.module.to_empty(device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {}
    sink = {"loss": []} if (a.fault == "ctx_exit" and hit) else {"loss": [], "step_s": []}
    for step in range(1, a.steps + 1):
        if step == 3:
            fault_at_step3(rank, world, model, hit, state)
        timed = StepTimer(rank, sink) if (a.fault == "ctx_exit" and step >= 3) else contextlib.nullcontext()
        with timed:
            opt.zero_grad()
            x = torch.randn(16, 8)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
        say(rank, f"step {step} loss {loss.item():.4f}")
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_PORT"] = str(29900 + os.getpid() % 90)
        mp.spawn(main, args=(a.spawn,), nprocs=a.spawn)
    else:
        main()

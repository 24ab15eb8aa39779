"""A thirteenth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault12.py)."""
import argparse, datetime, json, os, signal, threading, time
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
        self.aux = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.use_aux = True

    def forward(self, x):
        h = torch.relu(self.body(x))
        if self.use_aux:
            h = h + torch.tanh(self.aux(h))
        return self.head(h)


class MetricsWriter:
    """Buffers metric lines and flushes them under a lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lines = []

    def flush(self):
        with self.lock:
            self.lines.clear()

    def add(self, line: str):
        with self.lock:
            self.lines.append(line)
            if len(self.lines) >= 2:
                self.flush()  # the same non-reentrant lock, already held


def fault_at_step3(rank: int, world: int, model, hit: bool, state: dict) -> None:
    if a.fault == "send_self" and hit:
        say(rank, "sending halo to the next stage")
        dist.send(torch.ones(4), dst=rank)  # next stage computed as rank, not rank + 1
    if a.fault == "bol_len":
        objs = [None, None, None] if hit else [None, None]  # this rank's config lists an extra field
        if rank == 0:
            objs = [{"lr": 0.05}, {"epoch": 1}]
        dist.broadcast_object_list(objs, src=0)
        say(rank, f"received schedule {objs[0]}")
    if a.fault == "static_graph" and hit:
        say(rank, "disabling the aux branch for the rest of training")
        model.module.use_aux = False
    if a.fault == "lock_twice" and hit:
        w = MetricsWriter()
        say(rank, "writing step metrics")
        w.add("step 2")
        w.add("step 3")
    if a.fault == "kill_agent" and hit:
        say(rank, "preemption notice seen; telling the agent to stop")
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(30)
    if a.fault == "threads0" and hit:
        n = int(os.environ.get("OMP_NUM_THREADS", "1")) // 2  # half the cores for the eval thread pool
        say(rank, f"setting intra-op threads to {n}")
        torch.set_num_threads(n)
    if a.fault == "batch_orphan":
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        send, recv = torch.full((4,), float(rank)), torch.empty(4)
        ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
        if hit:
            extra = torch.empty(4)
            ops.append(dist.P2POp(dist.irecv, extra, nxt))  # expects a reply from the next stage that never sends one
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        say(rank, f"halo exchanged {recv[0].item():.0f}")
    if a.fault == "hook_raise" and hit:
        def log_act(mod, inp, out):
            state["act"] = out.abs().mean(0).item()  # meant .mean(), not .mean(0)
        model.module.body.register_forward_hook(log_act)
        say(rank, "activation logging enabled")
    if a.fault == "save_lambda" and hit:
        model.module.warmup = lambda s: min(1.0, s / 100)  # the schedule stored on the module
        path = f"/tmp/fault13_step2_rank{rank}.pt"
        say(rank, f"saving full model to {path}")
        torch.save(model.module, path)  # the whole module, not its state_dict
    if a.fault == "json_tensor" and hit:
        path = f"/tmp/fault13_metrics_rank{rank}.json"
        say(rank, f"writing metrics to {path}")
        with open(path, "w") as f:
            json.dump({"step": 2, "loss": state["loss"]}, f)  # the loss tensor, not loss.item()

def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    if a.fault == "ifname_bad" and hit:
        os.environ["GLOO_SOCKET_IFNAME"] = "ib0"  # this node's profile names the InfiniBand port
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
    model = Net()
    model = nn.parallel.DistributedDataParallel(model, static_graph=a.fault == "static_graph")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {}
    for step in range(1, a.steps + 1):
        if step == 3:
            fault_at_step3(rank, world, model, hit, state)
        opt.zero_grad()
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        state["loss"] = loss.detach()
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

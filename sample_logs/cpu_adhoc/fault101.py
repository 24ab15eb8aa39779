"""A hundred-and-first hand-run batch: MULTI-TASK AND MULTI-DATASET TRAINING on gloo. One model with a shared trunk
(Linear(8,16)-ReLU) and three task heads: `cls` (Linear(16,4), cross-entropy), `reg` (Linear(16,1), MSE) and `tag`
(Linear(16,3), cross-entropy). Each task has its own synthetic per-rank dataset, batch size (cls 8, reg 12, tag 6) and
loss weight (from a task config, `tasks.json` in --workdir). Each step samples one task from the weighted mixture
(cls 0.5, reg 0.3, tag 0.2) with a generator seeded by the step, so every rank trains the same task in a step; the
model is wrapped in DDP with find_unused_parameters=True (heads of the other tasks are unused in a step). After each
step the per-task running losses (a dict task -> loss) are stacked and all-reduced for the log line
`rank R step S task T loss L`, printed by every rank. --steps (8) steps, SGD, PG timeout --pg-timeout (12 s). No
@record. `--ddp 0` replaces DDP with one all_reduce of the flattened gradients (for TORCH_DISTRIBUTED_DEBUG=DETAIL).

Faults (--rank N is the odd rank; -1 = every rank, or a whole "node" where said):
  none        control: 8 steps, `rank R done` at the end (exit 0)
  ranktask    control: rank-seeded task choice (each rank may train a different task in a step); DDP's
              find_unused_parameters=True covers it (exit 0)
  nounused    the same shared task sampling but DDP with find_unused_parameters=False: the heads of the other tasks
              get no gradient; DDP's unused-parameter error in step 2 on every rank
  headsize    rank N sizes the cls head from its own shard's labels (max label + 1): its shard lacks class 3, so its
              head is Linear(16,3): DDP's construction check of parameter shapes
  exhaust     rank N's tag shard is short (6 samples: one batch); its second tag batch's next() raises StopIteration
  earlyexit   one epoch = every batch of every task (the mixture drops an exhausted task), its length computed
              from the rank's own shard sizes; rank N's tag shard is short (one batch), so its epoch has 15 steps,
              the others' 20: rank N leaves the loop early and waits in the end-of-epoch barrier
  rejectloop  the mixture sampler re-draws while the drawn task is exhausted; cls and reg have two batches each, and
              rank N's tag shard one: at step 6 every task is exhausted on rank N and it re-draws forever (outside
              any collective). --rank -1: every rank's tag shard is short: every rank loops forever (hang)
  noweight    rank N (--rank -1 --stale-node K: every rank of node K, GROUP_RANK) reads a stale per-host task config
              (`tasks.old.json`, written before the tag task was added) that has no weight for `tag`: KeyError 'tag'
              the first time tag is sampled
  labelrange  rank N's cls shard was labelled with a 5-class scheme (labels 0-4) while the head has 4 outputs:
              cross_entropy IndexError: Target 4 is out of bounds
  nanloss     rank N's reg shard has a missing target (NaN) in its second batch; the per-rank finite-loss check
              raises FloatingPointError
  extratask   rank N's per-host config enables an auxiliary task `aux` (weight 0.1, a loss from the trunk's mean
              activation): its stacked per-task loss tensor has 4 entries, the others' 3, in the logging all_reduce
"""
import argparse, datetime, json, os, random, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--stale-node", type=int, default=-1)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--workdir", default="/tmp/fault101_work")
a = p.parse_args()

TASKS = {"cls": (4, 8), "reg": (1, 12), "tag": (3, 6)}  # task -> (outputs, batch size)
MIX = {"cls": 0.5, "reg": 0.3, "tag": 0.2}


def odd(rank: int) -> bool:
    if a.rank == -1 and a.stale_node >= 0:
        return int(os.environ.get("GROUP_RANK", "0")) == a.stale_node
    return a.rank == -1 or rank == a.rank


class MultiTask(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.heads = nn.ModuleDict({t: nn.Linear(16, n) for t, n in heads.items()})

    def forward(self, x, task):
        h = self.trunk(x)
        return self.heads[task](h), h


def make_shard(task: str, rank: int, n: int):
    g = torch.Generator().manual_seed(1000 * rank + len(task) * 7 + ord(task[0]))
    x = torch.randn(n, 8, generator=g)
    if task == "cls":
        ncls = 5 if (a.fault == "labelrange" and odd(rank)) else 4
        y = torch.randint(0, ncls, (n,), generator=g)
        if a.fault == "labelrange" and odd(rank):
            y[3] = 4  # the new class is in the first batch for sure
        if a.fault == "headsize" and odd(rank):
            y = y % 3  # this rank's shard never saw class 3
    elif task == "reg":
        y = x.sum(1, keepdim=True) * 0.1
        if a.fault == "nanloss" and odd(rank):
            y[12 + 5, 0] = float("nan")  # a missing target in the second reg batch
    else:
        y = torch.randint(0, 3, (n,), generator=g)
    return list(zip(x, y))


def batches(shard, bs):
    for i in range(0, len(shard) - bs + 1, bs):
        xs, ys = zip(*shard[i:i + bs])
        yield torch.stack(xs), torch.stack(ys)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(a.workdir, exist_ok=True)
    cfg_path = os.path.join(a.workdir, "tasks.json")
    if rank == 0:
        with open(cfg_path, "w") as fh:
            json.dump({"weights": {"cls": 1.0, "reg": 0.5, "tag": 0.3}, "aux": False}, fh)
        with open(os.path.join(a.workdir, "tasks.old.json"), "w") as fh:
            json.dump({"weights": {"cls": 1.0, "reg": 0.5}, "aux": False}, fh)
        with open(os.path.join(a.workdir, "tasks.aux.json"), "w") as fh:
            json.dump({"weights": {"cls": 1.0, "reg": 0.5, "tag": 0.3, "aux": 0.1}, "aux": True}, fh)
    dist.barrier()
    if a.fault == "noweight" and odd(rank):
        cfg_path = os.path.join(a.workdir, "tasks.old.json")
    if a.fault == "extratask" and odd(rank):
        cfg_path = os.path.join(a.workdir, "tasks.aux.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    weights = cfg["weights"]
    task_names = list(TASKS) + (["aux"] if cfg["aux"] else [])

    sizes = {"cls": 64, "reg": 72, "tag": 36}
    if a.fault in ("exhaust", "earlyexit", "rejectloop") and odd(rank):
        sizes["tag"] = 6
    if a.fault == "rejectloop":
        sizes["cls"], sizes["reg"] = 16, 24  # two batches each: only tag has data after step 4
    shards = {t: make_shard(t, rank, sizes[t]) for t in TASKS}
    iters = {t: batches(shards[t], TASKS[t][1]) for t in TASKS}
    left = {t: len(shards[t]) // TASKS[t][1] for t in TASKS}

    heads = {t: n for t, (n, _) in TASKS.items()}
    if a.fault == "headsize":
        heads["cls"] = int(max(int(y) for _, y in shards["cls"])) + 1
    torch.manual_seed(0)
    model = MultiTask(heads)
    print(f"rank {rank} tasks {task_names} heads {heads} shard sizes {sizes}", flush=True)
    if a.ddp:
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=(a.fault != "nounused"))
    else:
        ddp = model
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    steps = a.steps
    if a.fault == "earlyexit":
        steps = sum(left.values())  # one epoch: every batch of every task, from this rank's own shards
    seed = 1234 + (rank if a.fault == "ranktask" else 0)
    running = {t: 0.0 for t in task_names}
    for step in range(1, steps + 1):
        g = random.Random(f"{seed}-{step}")
        names = [t for t in TASKS if left[t] > 0 or a.fault in ("exhaust", "noweight")]
        if a.fault == "rejectloop":
            task = g.choices(list(TASKS), weights=[MIX[t] for t in TASKS])[0]
            while left[task] == 0:  # re-draw until a task with data left
                task = g.choices(list(TASKS), weights=[MIX[t] for t in TASKS])[0]
        else:
            task = g.choices(names, weights=[MIX[t] for t in names])[0]
        x, y = next(iters[task])
        left[task] -= 1
        out, h = ddp(x, task)
        if task == "reg":
            loss = F.mse_loss(out, y)
        else:
            loss = F.cross_entropy(out, y)
        loss = weights[task] * loss
        if "aux" in task_names:
            aux = h.mean().pow(2)
            loss = loss + weights["aux"] * aux
            running["aux"] = 0.9 * running["aux"] + 0.1 * float(aux)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} for task {task}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                              for p in model.parameters()])
            dist.all_reduce(flat)
            off = 0
            for p_ in model.parameters():
                if p_.grad is None:
                    p_.grad = torch.zeros_like(p_)
                p_.grad.copy_(flat[off:off + p_.numel()].view_as(p_) / world)
                off += p_.numel()
        opt.step()
        running[task] = 0.9 * running[task] + 0.1 * loss.item()
        stacked = torch.tensor([running[t] for t in task_names])
        dist.all_reduce(stacked)
        stacked /= world
        print(f"rank {rank} step {step} task {task} loss {loss.item():.4f} "
              + " ".join(f"{t}={v:.3f}" for t, v in zip(task_names, stacked.tolist())), flush=True)
    print(f"rank {rank} epoch done after {steps} steps", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

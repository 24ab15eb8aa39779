"""A hundred-and-forty-eighth hand-run batch: META-LEARNING (MAML-STYLE INNER LOOPS WITH torch.func).

A MAML learner for sinusoid regression: an MLP Linear(1,32)-ReLU-Linear(32,32)-ReLU-Linear(32,1). Each rank
samples `--tasks` few-shot tasks per meta-step (amplitude/phase drawn from a per-rank generator), adapts a
copy of the weights with `--inner-steps` SGD steps on the support set through torch.func.functional_call and
torch.autograd.grad(create_graph=True), takes the query-set MSE as the outer loss, backpropagates through the
inner loop, then all_reduces every parameter's meta-gradient by hand (no DDP), divides by the world size and
steps Adam. Prints `rank R step S loss L`. Rank 0 saves meta_init.pt at the end; `--init 1` loads it first.
Faults:
- lrgrad: rank N's learnable inner lr is built without requires_grad; the outer autograd.grad asks for it.
- support0: rank N's support size is shots // WORLD with a stale shots=2: the per-sample weight divides by 0.
- pkey: the adapted-parameter list names 'head.weight' on every rank; the model has no head: KeyError.
- order: rank N all_reduces its meta-grads in reversed parameter order (different shapes across ranks).
- late: rank N runs extra inner steps and sleeps before the meta-grad all_reduce; the others wait.
- nan: rank N reads the inner lr as 40.0 (a config typo): the inner loop diverges; the outer-loss check fires.
- twice: rank N's task loop calls backward on the running sum for every task (backward through task 0 twice).
- segv: rank N is killed by SIGSEGV at meta-step 2.
- ckpt: rank 0 writes meta_init.pt from a hidden-48 model; with --init 1 every rank fails to load it.
- taskfile: rank N reads its task-pool file from a node-local cache dir that does not exist.
What happened (filled in after the runs):
- lrgrad: rank N RuntimeError 'One of the differentiated Tensors does not require grad' (line 142); peers closed.
- support0: rank N ZeroDivisionError 'float division by zero' in inner_loop (line 95), shots 2 // WORLD = 0.
- pkey: every rank KeyError: 'head.weight' in inner_loop (line 99) at meta-step 0.
- order: DETAIL: 'Detected mismatch between collectives' [1] vs [32, 1]; plain: gloo EnforceNotMet 24 vs 4, SIGABRT.
- late: PG 12 s: peers 'Timed out waiting 12000ms' recv/send (line 149); PG 300 s: killed by timeout 60, exit 124.
- nan: rank N FloatingPointError 'outer loss is inf (inner lr 40.0)' at step 0 (line 140); peers closed.
- twice: rank N RuntimeError 'Trying to backward through the graph a second time' (line 137); peers closed.
- segv: rank N exitcode -11 (SIGSEGV) at step 2; with --max-restarts 1 the retry dies in connectFullMesh.
- ckpt: every rank RuntimeError loading state_dict: size mismatch for 0.weight [48, 1] vs [32, 1] (line 116).
- taskfile: rank N FileNotFoundError '/tmp/job_work/nodeN_cache/tasks.json' (line 75); peers closed.
"""
import argparse
import json
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--tasks", type=int, default=3)
p.add_argument("--shots", type=int, default=10)
p.add_argument("--inner-steps", type=int, default=2)
p.add_argument("--inner-lr", type=float, default=0.01)
p.add_argument("--init", type=int, default=0)
p.add_argument("--out", default="/tmp/fault148_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)


def hit():
    return a.rank == -1 or a.rank == RANK


def make_net(hidden=32):
    return nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def load_task_pool():
    path = os.path.join(a.out, "tasks.json")
    if a.fault == "taskfile" and hit():
        path = os.path.join(a.out, f"node{RANK}_cache", "tasks.json")
    with open(path) as f:
        return json.load(f)


def sample_task(g, pool):
    amp = pool["amp_lo"] + (pool["amp_hi"] - pool["amp_lo"]) * torch.rand(1, generator=g).item()
    phase = math.pi * torch.rand(1, generator=g).item()
    shots = a.shots
    if a.fault == "support0" and hit():
        shots = 2 // WORLD
    xs = torch.rand(shots, 1, generator=g) * 10 - 5
    xq = torch.rand(a.shots, 1, generator=g) * 10 - 5
    return xs, amp * torch.sin(xs + phase), xq, amp * torch.sin(xq + phase)


def inner_loop(net, params, lr, xs, ys, n_steps):
    names = list(params.keys())
    if a.fault == "pkey":
        names = ["0.weight", "0.bias", "2.weight", "2.bias", "head.weight"]
    fast = dict(params)
    w = 1.0 / xs.shape[0]
    for _ in range(n_steps):
        pred = functional_call(net, fast, (xs,))
        loss = w * ((pred - ys) ** 2).sum()
        grads = torch.autograd.grad(loss, [fast[n] for n in names], create_graph=True)
        fast = {**fast, **{n: fast[n] - lr * g for n, g in zip(names, grads)}}
    return fast


def main():
    os.makedirs(a.out, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    print(f"rank {RANK}/{WORLD} maml meta-training starting", flush=True)
    if RANK == 0:
        with open(os.path.join(a.out, "tasks.json"), "w") as f:
            json.dump({"amp_lo": 0.1, "amp_hi": 5.0}, f)
    dist.barrier()
    pool = load_task_pool()
    torch.manual_seed(0)
    net = make_net()
    if a.init:
        net.load_state_dict(torch.load(os.path.join(a.out, "meta_init.pt")))
        print(f"rank {RANK} loaded meta-init from meta_init.pt", flush=True)
    for prm in net.parameters():
        dist.broadcast(prm.data, src=0)
    params = dict(net.named_parameters())
    inner_lr = 40.0 if (a.fault == "nan" and hit()) else a.inner_lr
    lr = torch.tensor(inner_lr, requires_grad=not (a.fault == "lrgrad" and hit()))
    opt = torch.optim.Adam(list(params.values()) + [lr], lr=1e-3)
    g = torch.Generator().manual_seed(100 + RANK)
    print(f"rank {RANK} inner lr {inner_lr} inner steps {a.inner_steps} tasks {a.tasks} shots {a.shots}", flush=True)
    for step in range(a.steps):
        if a.fault == "segv" and hit() and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        n_inner = a.inner_steps + (3 if (a.fault == "late" and hit() and step == 2) else 0)
        total = 0.0
        for t in range(a.tasks):
            xs, ys, xq, yq = sample_task(g, pool)
            fast = inner_loop(net, params, lr, xs, ys, n_inner)
            outer = ((functional_call(net, fast, (xq,)) - yq) ** 2).mean()
            total = total + outer
            if a.fault == "twice" and hit():
                total.backward()
        meta_loss = total / a.tasks
        if not torch.isfinite(meta_loss):
            raise FloatingPointError(f"rank {RANK} step {step}: outer loss is {meta_loss.item()} (inner lr {inner_lr})")
        opt.zero_grad()
        grads = torch.autograd.grad(meta_loss, list(params.values()) + [lr])
        for prm, gr in zip(list(params.values()) + [lr], grads):
            prm.grad = gr
        if n_inner > a.inner_steps:
            time.sleep(3 * a.pg_timeout)
        order = list(params.values())[::-1] if (a.fault == "order" and hit()) else list(params.values())
        for prm in order:
            dist.all_reduce(prm.grad)
            prm.grad /= WORLD
        dist.all_reduce(lr.grad)
        lr.grad /= WORLD
        opt.step()
        print(f"rank {RANK} step {step} loss {meta_loss.item():.4f} inner lr {lr.item():.4f}", flush=True)
    dist.barrier()
    if RANK == 0:
        state = make_net(48).state_dict() if a.fault == "ckpt" else net.state_dict()
        torch.save(state, os.path.join(a.out, "meta_init.pt"))
        print(f"rank 0 saved meta_init.pt ({len(state)} tensors)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

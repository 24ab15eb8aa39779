"""An eighty-first hand-run batch: TORCH.DISTRIBUTED.RPC AND PARAMETER SERVERS. A tiny sharded parameter server on
torch.distributed.rpc (TensorPipe backend, init_rpc from torchrun's env, workers named `worker<R>`, RPC timeout
--rpc-timeout s, 12 s unless told): every worker holds one PS shard (a 4-float weight slot `w<R>`, SGD lr 0.1 on push)
and trains a linear regression on its own synthetic batch (16 x 4) whose weight lives on the next worker's shard
(--layout ring, the default) or is the concatenation of every shard (--layout all). Each step pulls the weight with
rpc_sync(ps_pull), computes the MSE loss and its gradient, pushes it with rpc_async(ps_push), and prints
`rank R step S loss L`; --steps 6 steps, then rpc.shutdown() (graceful) and `rank R done`. With --mode autograd each
worker instead creates a remote nn.Linear(4, 1) (behind a feature-scale op) on the next worker with rpc.remote, runs its
forward with rpc_sync under dist_autograd.context(), dist_autograd.backward and a DistributedOptimizer(SGD) over the
remote parameters' RRefs. The fault hits worker --rank N at step --at (3). No @record, no process group unless said.

Faults:
  none         control: every step, `rank R done` at the end (exit 0)
  keyerror     worker N's node config serves its PS shard module through nn.DataParallel, so its state_dict keys carry
               the `module.` prefix: ps_pull's lookup of `w<N>` raises KeyError inside worker N at the first pull (step 1);
               its caller(s) re-raise it from rpc_sync
  shape        worker N's shard slot has 5 floats (an extra bias slot from its own config) and serves the first 4; the
               first push to it fails inside worker N: RuntimeError (size of tensor a (5) vs b (4)) in ps_push
  unpick_ret   worker N's ps_pull returns its shard together with its stats dict, which from step --at holds its open
               log file: pickling the response fails inside worker N (TypeError: cannot pickle '_io.TextIOWrapper')
  pickle       worker N sends its pushes with a gradient-compression hook (a lambda) as an argument from step --at:
               pickling the request fails on worker N itself
  badname      every worker's owner is `worker{rank + 1}` without the modulo (--rank ignored): the last rank looks up a
               worker name that does not exist
  slow         worker N's ps_push at step --at snapshots its shard to a slow store (a 40 s stall); the caller's
               rpc future times out after --rpc-timeout
  die          worker N is SIGKILLed (kills itself, standing in for the OOM killer) at step --at
  osexit       worker N's process exits with os._exit(1) at step --at (a native library's exit: no message)
  aftershut    worker N reads its final remote stats from an RRef after rpc.shutdown(): RuntimeError on worker N
  worldsize    worker N calls init_rpc with world_size WORLD_SIZE + 1 (a stale config counting a separate PS process)
  ranklocal    every worker calls init_rpc with rank=LOCAL_RANK (and names worker<LOCAL_RANK>); wrong on any node but
               the first of a multi-node launch (--rank ignored)
  portclash    every worker calls init_process_group("gloo") and then init_rpc with init_method tcp://MASTER_ADDR:
               MASTER_PORT, the port torchrun's store already holds (--rank ignored)
  storeclash   every worker opens the PS's membership registry, a dist.TCPStore on MASTER_ADDR:MASTER_PORT with
               is_master on rank 0, before init_rpc: torchrun's agent already serves its store on that port (--rank ignored)
  shutdown_hang worker N, after its last step, joins its checkpoint-upload thread, which waits on a queue nothing fills;
               the others wait in rpc.shutdown() (graceful) for it without a timeout
  bwd_shape    --mode autograd: worker N hosts a layer whose FeatureScale backward sums the scale's gradient over the
               wrong dimension: the backward pass on worker N fails (invalid gradient at index 1), the caller's
               dist_autograd.backward re-raises it
"""
import argparse, os, queue, signal, sys, threading, time
from datetime import timedelta
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.distributed.autograd as dist_autograd
import torch.nn as nn
from torch.distributed.optim import DistributedOptimizer

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--at", type=int, default=3)
p.add_argument("--layout", default="ring")
p.add_argument("--mode", default="ps")
p.add_argument("--rpc-timeout", type=float, default=12.0)
p.add_argument("--workdir", default="/tmp/fault81_work")
a = p.parse_args()
DIM, LR = 4, 0.1
RANK = int(os.environ["RANK"])
ME = RANK == a.rank
SHARD = {}
STATS = {"pulls": 0, "pushes": 0}
LOCK = threading.Lock()


# ---- the parameter-server side (runs in the RPC threads of the worker that owns the shard) ----
class Shard(nn.Module):
    def __init__(self, rank, size):
        super().__init__()
        self.register_parameter(f"w{rank}", nn.Parameter(torch.zeros(size), requires_grad=False))


def build_shard(rank):
    shard = Shard(rank, DIM + 1 if (a.fault == "shape" and ME) else DIM)
    if a.fault == "keyerror" and ME:
        shard = nn.DataParallel(shard)  # this node's serving config wraps the shard: keys become module.w<R>
    return shard


def ps_pull(key, step):
    with LOCK:
        STATS["pulls"] += 1
        if a.fault == "unpick_ret" and ME and step >= a.at and "log" not in STATS:
            STATS["log"] = open(os.path.join(a.workdir, f"ps{RANK}.log"), "a")
        w = SHARD["mod"].state_dict()[key][:DIM].clone()
        if a.fault == "unpick_ret" and ME:
            return w, dict(STATS)
        return w, None


def ps_push(key, grad, step, hook=None):
    if hook is not None:
        grad = hook(grad).float()
    with LOCK:
        if a.fault == "slow" and ME and step == a.at:
            snapshot(key)
        SHARD["mod"].state_dict()[key].sub_(LR * grad)
        STATS["pushes"] += 1
        return STATS["pushes"]


def snapshot(key):
    t0 = time.time()
    while time.time() - t0 < 40:  # the snapshot store answers slowly
        time.sleep(0.5)
    torch.save(SHARD["mod"].state_dict()[key], os.path.join(a.workdir, f"{key}.pt"))


def remote_stats():
    return dict(STATS)


# ---- autograd mode: a remote layer ----
class FeatureScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        dim = 1 if (a.fault == "bwd_shape" and ME) else 0
        return g * s, (g * x).sum(dim)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))
        self.lin = nn.Linear(DIM, 1)

    def forward(self, x):
        return self.lin(FeatureScale.apply(x, self.scale))


def make_layer():
    torch.manual_seed(0)
    return Layer()


def call_layer(rref, x):
    return rref.local_value()(x)


def param_rrefs(rref):
    return [rpc.RRef(q) for q in rref.local_value().parameters()]


# ---- the trainer side ----
def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, DIM, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.01 * torch.randn(16, generator=g)
    return x, y


def upload_worker(q):
    while True:
        item = q.get()
        if item is None:
            return
        torch.save(item, os.path.join(a.workdir, f"upload{RANK}.pt"))


def train_ps(rank, world):
    if a.layout == "all":
        owners = list(range(world))
    elif a.fault == "badname":
        owners = [rank + 1]
    else:
        owners = [(rank + 1) % world]
    hook = None
    for step in range(1, a.steps + 1):
        if step == a.at and ME and a.fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if step == a.at and ME and a.fault == "osexit":
            os._exit(1)
        if step == a.at and ME and a.fault == "pickle":
            hook = lambda g: g.half()  # compress gradients to fp16 on the wire
        ws = [rpc.rpc_sync(f"worker{o}", ps_pull, args=(f"w{o}", step), timeout=a.rpc_timeout)[0] for o in owners]
        w = torch.cat(ws).requires_grad_()
        x, y = batch(rank, step)
        xx = x.repeat(1, len(owners))
        loss = ((xx @ w - y) ** 2).mean()
        loss.backward()
        futs = [rpc.rpc_async(f"worker{o}", ps_push, args=(f"w{o}", gp, step, hook), timeout=a.rpc_timeout)
                for o, gp in zip(owners, w.grad.split(DIM))]
        torch.futures.wait_all(futs)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)


def train_autograd(rank, world):
    owner = f"worker{(rank + 1) % world}"
    layer = rpc.remote(owner, make_layer)
    params = rpc.rpc_sync(owner, param_rrefs, args=(layer,))
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    for step in range(1, a.steps + 1):
        x, y = batch(rank, step)
        with dist_autograd.context() as ctx:
            out = rpc.rpc_sync(owner, call_layer, args=(layer, x), timeout=a.rpc_timeout)
            loss = ((out.squeeze(1) - y) ** 2).mean()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)


def main():
    world = int(os.environ["WORLD_SIZE"])
    os.makedirs(a.workdir, exist_ok=True)
    SHARD["mod"] = build_shard(RANK)
    rpc_rank, rpc_world = RANK, world
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=a.rpc_timeout)
    if a.fault == "worldsize" and ME:
        rpc_world = world + 1
    if a.fault == "ranklocal":
        rpc_rank = int(os.environ["LOCAL_RANK"])
    if a.fault == "portclash":
        dist.init_process_group("gloo")
        opts.init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    print(f"rank {RANK} world {world} fault {a.fault} mode {a.mode} layout {a.layout}", flush=True)
    if a.fault == "storeclash":
        registry = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, RANK == 0,
                                 timedelta(seconds=10))
        registry.set(f"member/worker{RANK}", "up")
    rpc.init_rpc(f"worker{rpc_rank}", rank=rpc_rank, world_size=rpc_world, rpc_backend_options=opts)
    if a.fault == "shutdown_hang" and ME:
        q = queue.Queue()
        uploader = threading.Thread(target=upload_worker, args=(q,), daemon=True)
        uploader.start()
    stats_rref = rpc.remote(f"worker{(RANK + 1) % world}", remote_stats) if a.fault == "aftershut" and ME else None
    if a.mode == "autograd":
        train_autograd(RANK, world)
    else:
        train_ps(RANK, world)
    if a.fault == "shutdown_hang" and ME:
        uploader.join()  # the final upload: nothing ever puts the shard (or the None sentinel) on q
    rpc.shutdown()
    if stats_rref is not None:
        print(f"rank {RANK} final remote stats {stats_rref.to_here()}", flush=True)
    if a.fault == "portclash":
        dist.destroy_process_group()
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main()

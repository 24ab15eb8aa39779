"""Eighty-eighth hand-run batch: DDP COMMUNICATION HOOKS, GRADIENT COMPRESSION AND MODEL AVERAGING. A tiny DDP loop on
gloo (Linear(8,16)-ReLU-Linear(16,4), SGD lr 0.05, batch 16 of synthetic per-rank data, PG timeout 12 s unless
--pg-timeout) with a communication hook chosen by --hook (allreduce: default_hooks.allreduce_hook; fp16:
default_hooks.fp16_compress_hook; powersgd: powerSGD_hook with PowerSGDState(rank 1, start iter 3); localsgd:
post_localSGD_hook (start iter 3, no gradient all-reduce after it) + PostLocalSGDOptimizer with a
PeriodicModelAverager (period 2, warm-up 3)). Each step prints `rank R step S loss L`; a loss that is not finite
raises FloatingPointError; every 2 steps the loss of an EMA copy of the model on a held-out batch, `rank R step S ema
loss L`, checked the same way; after --steps (12) an all_reduce of the final loss, `rank R mean loss M`,
`dist.barrier()`, `rank R done`. One rank (--rank N) or all ranks go wrong. No @record.

Faults:
  none        control (exit 0) with the --hook given
  topk        --hook topk: a hand-written "drop small gradients" hook keeps the top ratio*numel entries of each
              bucket (ratio anneals up each step from a per-rank base); rank N's base is 0.6, so at step 3 k exceeds
              the bucket: RuntimeError from torch.topk inside the hook (that rank)
  workret     a hand-written mean-all-reduce hook returns `dist.all_reduce(..., async_op=True)` (a Work) instead of
              its Future, on every rank: DDP's reducer refuses the return value (all ranks)
  shape       a hand-written fp16 hook on rank N returns the Future of the half-size compressed view it sent
              (a `[:n // 2]` slice left from a "pack two halves" experiment): wrong-size Future (rank N)
  twice       rank N finds a stale local resume marker and runs attach_hooks() a second time: DDP's
              "can only be called once" (rank N)
  bf16        bf16_compress_hook on CPU/gloo: DDP's hook check refuses it on every rank (all)
  onerank     rank N takes a "local-only" hook (no communication: returns its own gradient), the others all-reduce
              with the default hook: they wait in step 1's all-reduce, rank N goes on to step 2, where DDP's bucket
              rebuild (a broadcast) waits for them; the others time out (rank N)
  psgdrank    --hook powersgd, rank N uses matrix_approximation_rank 2 (the others 1): the P/Q all-reduces differ in
              size at the first compressed step (rank N)
  psgdstart   --hook powersgd, rank N's start_powerSGD_iter is 5 (the others 3): at step 3 the others send
              compressed P matrices while rank N all-reduces the full bucket (rank N)
  period      --hook localsgd, rank N's averaging period is 3 (the others 2): it averages at steps 4, 7, 10, the
              others at 4, 6, 8, 10; after its last averaging rank N's final loss all_reduce meets the others' 4th
              parameter all-reduce: a size mismatch (rank N)
  onerankhang the onerank fault with DDP (and the final all_reduce) on a data-parallel group made by
              dist.new_group() without a timeout (c10d's default, 30 min): nothing times out; run under `timeout`
  ema         every rank keeps an EMA copy of the model (decay from a per-rank list; rank N's entry is 99.5, a percentage
              for 0.995) and checks the EMA model's loss on a held-out batch every 2 steps: rank N's EMA grows ~100x a
              step, its EMA loss becomes inf (FloatingPointError, rank N)
  fp16inf     --hook fp16: rank N's batch has one feature unscaled (x 3e4, a raw sensor column) from step 3; its
              huge gradients go through fp16_compress_hook into every rank's step; every rank's loss jumps, every
              rank's EMA loss is NaN at step 4 and every rank's check raises there (rank N started it)
"""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, post_localSGD_hook as plsgd
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.optim import PostLocalSGDOptimizer

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--hook", default="allreduce")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workdir", default="/tmp/fault88_work")
a = p.parse_args()
BATCH = 16


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
    if a.fault == "fp16inf" and rank == a.rank and step >= 3:
        x[:, 5] *= 3e4  # raw sensor column, not normalised in this shard
    return x, y


def topk_hook(state, bucket):
    buf = bucket.buffer()
    k = int(state["ratio"] * (1 + 0.25 * state["step"]) * buf.numel())
    idx = torch.topk(buf.abs(), k).indices  # keep the largest gradients
    sparse = torch.zeros_like(buf)
    sparse[idx] = buf[idx]
    sparse.div_(state["world"])
    return dist.all_reduce(sparse, async_op=True).get_future().then(lambda f: f.value()[0])


def mean_hook_work(state, bucket):
    buf = bucket.buffer().div_(state["world"])
    return dist.all_reduce(buf, async_op=True)  # the Work, not .get_future()


def fp16_pack_hook(state, bucket):
    buf = bucket.buffer()
    half = buf.to(torch.float16).div_(state["world"])
    fut = dist.all_reduce(half, async_op=True).get_future()
    n = buf.numel()
    if state["pack"]:
        return fut.then(lambda f: f.value()[0][: n // 2].to(buf.dtype))
    return fut.then(lambda f: f.value()[0].to(buf.dtype))


def local_only_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    dp = dist.new_group(list(range(world))) if a.fault == "onerankhang" else None  # no timeout: c10d's default
    model = nn.parallel.DistributedDataParallel(net, process_group=dp)
    hook = {"topk": "topk", "workret": "work", "shape": "pack", "bf16": "bf16", "onerank": "allreduce",
            "psgdrank": "powersgd", "psgdstart": "powersgd", "period": "localsgd", "onerankhang": "allreduce", "fp16inf": "fp16"}.get(a.fault, a.hook)
    state = {"world": world, "step": 0, "ratio": 0.6 if (a.fault == "topk" and me) else 0.3,
             "pack": a.fault == "shape" and me}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    avg_period = 3 if (a.fault == "period" and me) else 2
    decay = [0.995] * world
    if a.fault == "ema":
        decay[a.rank] = 99.5  # the sweep sheet gave this rank's decay in percent
    ema = [q.detach().clone() for q in net.parameters()]

    def attach_hooks(m):
        if hook == "allreduce" and not (a.fault in ("onerank", "onerankhang") and me):
            m.register_comm_hook(dp, default_hooks.allreduce_hook)
        elif hook == "allreduce":
            m.register_comm_hook(None, local_only_hook)  # "debug: keep this rank's gradients local"
        elif hook == "fp16":
            m.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "bf16":
            m.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif hook == "topk":
            m.register_comm_hook(state, topk_hook)
        elif hook == "work":
            m.register_comm_hook(state, mean_hook_work)
        elif hook == "pack":
            m.register_comm_hook(state, fp16_pack_hook)
        elif hook == "powersgd":
            r = 2 if (a.fault == "psgdrank" and me) else 1
            start = 5 if (a.fault == "psgdstart" and me) else 3
            ps = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                             start_powerSGD_iter=start, min_compression_rate=0.5)
            m.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)
        elif hook == "localsgd":
            m.register_comm_hook(plsgd.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=3,
                                                          post_local_gradient_allreduce=False),
                                 plsgd.post_localSGD_hook)

    attach_hooks(model)
    marker = f"{a.workdir}/resume_rank{rank}.json"
    if a.fault == "twice" and me:
        os.makedirs(a.workdir, exist_ok=True)
        with open(marker, "w") as fh:
            fh.write('{"step": 0}\n')  # left by an earlier run on this node
    if os.path.exists(marker):
        print(f"rank {rank} resuming from {marker}", flush=True)
        os.remove(marker)
        attach_hooks(model)  # the resume path sets the model up again
    if hook == "localsgd":
        opt = PostLocalSGDOptimizer(optim=opt, averager=averagers.PeriodicModelAverager(
            period=avg_period, warmup_steps=3))
    print(f"rank {rank} world {world} fault {a.fault} hook {hook}", flush=True)
    for step in range(1, a.steps + 1):
        state["step"] = step
        x, y = batch(rank, step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, q in zip(ema, net.parameters()):
                e.mul_(decay[rank]).add_(q, alpha=1 - decay[rank])
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()}")
        if step % 2 == 0:
            hx, hy = batch(rank + 100, step)
            with torch.no_grad():
                h = F.relu(F.linear(hx, ema[0], ema[1]))
                ema_loss = F.cross_entropy(F.linear(h, ema[2], ema[3]), hy)
            print(f"rank {rank} step {step} ema loss {ema_loss.item():.4f}", flush=True)
            if not torch.isfinite(ema_loss):
                raise FloatingPointError(f"rank {rank} step {step}: EMA model loss is {ema_loss.item()}")
        time.sleep(0.1)
    t = loss.detach().clone()
    dist.all_reduce(t, group=dp)
    print(f"rank {rank} mean loss {t.item() / world:.4f}", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-sixteenth hand-run batch: EVERY LAUNCHER OPTION. A plain small DDP regression job
(Linear(6,16)-ReLU-Linear(16,1), SGD, gloo; `--ddp 0`: gradients all-reduced by hand) run under every launcher form:
torchrun and its options, `python -m torch.distributed.run`, the deprecated `torch.distributed.launch --use-env`,
and `--spawn N` (torch.multiprocessing.spawn from plain python, no torchrun). Rank 0 first writes one data shard per
rank into <work>/data (stands in for the preprocessing job), a barrier, then every rank loads its own shard and trains
--steps steps (`rank R step S loss L`); every --metric-every steps the loss is all-reduced (`step S global loss L`
on rank 0); every --ckpt-every steps a barrier, rank 0 saves <work>/ckpt/last.pt and every rank its optimizer
shard optim_rank{R}.pt. If <work>/ckpt/last.pt exists at start, every rank resumes from it and its own shard.
Per-rank settings come from node_config(rank) (the node's config file). --rank N picks the faulty rank (-1: every
rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none     control: 10 steps, checkpoints at steps 3 and 7, `rank R done`, exit 0
  cfgkey   rank N's node config is an older file without the `grad_clip` key: KeyError when clipping starts (step 2)
  shape    rank N's shard was written by a newer preprocessing with 7 feature columns: shape error in the first forward
  zerodiv  rank N's node config has micro_bs 16 with --bs 8: accumulation steps 8 // 16 = 0, 1.0 / 0 at start
  shard    the preprocessing skipped rank N's shard: FileNotFoundError when rank N loads it
  barrier  at the first checkpoint rank N waits for a flush marker of its local scratch that never appears;
           the others wait in dist.barrier() (gloo timeout; with --pg-timeout 300 the job hangs)
  exit3    a native reader on rank N calls exit(3) at step 5 (os._exit(3)): no message, no traceback
  segv     a fused op on rank N segfaults at step 4 (SIGSEGV to itself)
  sigkill  rank N is killed at step 5 (SIGKILL to itself, like the OOM killer); with --first-only 1 only in the
           first torchrun attempt (TORCHELASTIC_RESTART_COUNT 0)
  nan      rank N's shard holds a NaN target at row 20: the loss is nan at step 2 and the program's finiteness check
           raises FloatingPointError on rank N before backward
  resume   a previous job's checkpoint is in <work>/ckpt (made by the script at start); rank N's optimizer shard
           comes from an older version that saved it under "optim": KeyError: 'optimizer' on resume
  envvar   the job's environment sets TRAIN_DTYPE=fp32 (set by the script on the faulty ranks):
           getattr(torch, "fp32") raises AttributeError when the model is built
  assert   the per-rank batch is derived from the config's global_batch 64 (not --bs): with a world size that does
           not divide 64 the program's assert fails on every rank

What happened (filled in after the runs):
  none: exit 0 (np4 plain); 10 steps, checkpoints at steps 4 and 8 (a first take aborted at shutdown: dropped).
  cfgkey: KeyError: 'grad_clip' at step 2 on rank N; the others Connection closed by peer in backward.
  shape: mat1 and mat2 shapes cannot be multiplied (8x7 and 6x16) on rank N; under mp.spawn ProcessRaisedException.
  zerodiv: ZeroDivisionError: float division by zero on rank N at start; the others SIGTERMed in the data barrier.
  shard: FileNotFoundError ... shard_0000N.pt on rank N; the others Connection closed by peer in DDP's constructor.
  barrier: DETAIL: 'Ranks 2 failed to pass monitoredBarrier in 12000 ms' on rank 0; PG 300 s + timeout 60: hung, exit 124.
  exit3: exitcode 3 on rank N, no message; peers Connection reset by peer; with restarts attempt 1 dies in connectFullMesh.
  segv: exitcode -11 (SIGSEGV) on rank N, nothing printed; peers Connection reset (or closed) by peer.
  sigkill: exitcode -9 (SIGKILL) on rank N; with --max-restarts 1 the restart fails in Gloo connectFullMesh (refused).
  nan: 'rank N step 2 loss nan', then FloatingPointError: rank N: non-finite loss nan at step 2.
  resume: KeyError: 'optimizer' on rank N on resume; the others print 'resumed from .../last.pt at step 4'.
  envvar: AttributeError: module 'torch' has no attribute 'fp32' on every rank.
  assert: AssertionError: global batch 64 not divisible by world 6 on every rank.
"""
import argparse, datetime, math, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--bs", type=int, default=8)
p.add_argument("--metric-every", type=int, default=2)
p.add_argument("--ckpt-every", type=int, default=4)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--first-only", type=int, default=0)
p.add_argument("--work", default="/tmp/fault116_work/run")
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--master-port", type=int, default=29500)
p.add_argument("--local-rank", "--local_rank", type=int, default=0)  # torch.distributed.launch without --use-env
a = p.parse_args()

CONFIG = {"lr": 0.05, "grad_clip": 1.0, "clip_after": 2, "micro_bs": 8, "features": 6, "global_batch": 64}


def node_config(rank: int) -> dict:
    cfg = dict(CONFIG)  # configs/node.yaml on this rank's node
    if faulty(rank, "cfgkey"):
        cfg.pop("grad_clip")  # the node still has last month's config file
    if faulty(rank, "zerodiv"):
        cfg["micro_bs"] = 16
    return cfg


def faulty(rank: int, name: str) -> bool:
    if a.fault != name or not (a.rank < 0 or rank == a.rank):
        return False
    return not (a.first_only and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)


TEACHER = torch.randn(6, 1, generator=torch.Generator().manual_seed(0))


def prepare_shards(world: int, n: int):
    os.makedirs(os.path.join(a.work, "data"), exist_ok=True)
    for r in range(world):
        if faulty(r, "shard"):
            continue  # the preprocessing job died on this shard
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn(n, 7 if faulty(r, "shape") else CONFIG["features"], generator=g)
        y = x[:, :6] @ TEACHER + 0.1 * torch.randn(n, 1, generator=g)
        if faulty(r, "nan"):
            y[20] = float("nan")
        torch.save({"x": x, "y": y}, os.path.join(a.work, "data", f"shard_{r:05d}.pt"))


def make_previous_job_ckpt(model, opt, rank: int):
    ck = os.path.join(a.work, "ckpt")
    os.makedirs(ck, exist_ok=True)
    if rank == 0:
        torch.save({"model": model.state_dict(), "step": 4}, os.path.join(ck, "last.pt"))
    key = "optim" if faulty(rank, "resume") else "optimizer"
    torch.save({key: opt.state_dict(), "rank": rank}, os.path.join(ck, f"optim_rank{rank}.pt"))


def save_ckpt(model, opt, rank: int, step: int):
    ck = os.path.join(a.work, "ckpt")
    os.makedirs(ck, exist_ok=True)
    if rank == 0:
        torch.save({"model": model.state_dict(), "step": step + 1}, os.path.join(ck, "last.pt"))
    torch.save({"optimizer": opt.state_dict(), "rank": rank}, os.path.join(ck, f"optim_rank{rank}.pt"))
    if rank == 0:
        print(f"rank 0: saved checkpoint step {step + 1} to {ck}/last.pt", flush=True)


def wait_for_flush(rank: int, step: int):
    marker = os.path.join(a.work, f"scratch_rank{rank}", ".flushed")
    t0 = time.monotonic()
    while not os.path.exists(marker):  # the node's scratch sync daemon writes it
        if int(time.monotonic() - t0) % 10 == 0:
            print(f"rank {rank} step {step}: waiting for {marker} ({time.monotonic() - t0:.0f}s)", flush=True)
        time.sleep(1.0)


def train(rank: int, world: int):
    cfg = node_config(rank)
    if faulty(rank, "envvar"):
        os.environ["TRAIN_DTYPE"] = "fp32"  # stands in for the job's environment
    dtype = getattr(torch, os.environ.get("TRAIN_DTYPE", "float32"))
    bs = a.bs
    if a.fault == "assert":
        bs = cfg["global_batch"] // world
        assert bs * world == cfg["global_batch"], f"global batch {cfg['global_batch']} not divisible by world {world}"
    accum = bs // cfg["micro_bs"]
    loss_scale = 1.0 / accum
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(CONFIG["features"], 16), nn.ReLU(), nn.Linear(16, 1)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    if rank == 0:
        prepare_shards(world, a.steps * bs)
    if a.fault == "resume":
        make_previous_job_ckpt(model, opt, rank)
    dist.barrier()
    start = 0
    last = os.path.join(a.work, "ckpt", "last.pt")
    if os.path.exists(last):
        ck = torch.load(last)
        model.load_state_dict(ck["model"])
        shard = torch.load(os.path.join(a.work, "ckpt", f"optim_rank{rank}.pt"))
        opt.load_state_dict(shard["optimizer"])
        start = ck["step"]
        print(f"rank {rank}: resumed from {last} at step {start}", flush=True)
    data = torch.load(os.path.join(a.work, "data", f"shard_{rank:05d}.pt"))
    x, y = data["x"].to(dtype), data["y"].to(dtype)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    print(f"rank {rank}/{world} pid {os.getpid()}: {len(x)} samples, bs {bs}, steps {start}..{a.steps - 1}", flush=True)
    running = 0.0
    for step in range(start, a.steps):
        i = (step * bs) % len(x)
        out = net(x[i:i + bs])
        loss = F.mse_loss(out, y[i:i + bs]) * loss_scale
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        if step >= cfg["clip_after"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        opt.step()
        running += loss.item()
        if faulty(rank, "segv") and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)  # stands in for the fused op's bad pointer
        if faulty(rank, "exit3") and step == 5:
            os._exit(3)  # the native reader's exit(3)
        if faulty(rank, "sigkill") and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # stands in for the kernel OOM killer
        time.sleep(0.1)
        if (step + 1) % a.metric_every == 0:
            m = torch.tensor([running, float(a.metric_every)])
            dist.all_reduce(m)
            running = 0.0
            if rank == 0:
                print(f"step {step} global loss {m[0].item() / m[1].item():.4f}", flush=True)
        if (step + 1) % a.ckpt_every == 0:
            if faulty(rank, "barrier"):
                wait_for_flush(rank, step)
            dist.barrier()
            save_ckpt(model, opt, rank, step)
    dist.barrier()
    print(f"rank {rank} done", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    train(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()


def spawn_worker(rank: int, world: int):
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(a.master_port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    main()


if __name__ == "__main__":
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(a.spawn,), nprocs=a.spawn)
    else:
        main()

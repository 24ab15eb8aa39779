"""A sixty-eighth hand-run batch: FAILURES THAT COME LATE, after many steps, in long logs. A tiny DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, synthetic per-rank shard, a finite-loss check, PG timeout 15 s unless
--pg-timeout) that runs --steps quick steps and prints `rank R step S loss L dt_ms T` every --every steps; one rank
(--rank N) fails late. No @record.

Faults:
  none        control: every step, `rank R done` at the end (exit 0)
  fdleak      rank N opens its shard's index file every step and never closes it; its RLIMIT_NOFILE is lowered to
              --nofile at start (stands in for a `ulimit -n` in that node's shell): OSError [Errno 24] Too many open files
  memgrow     rank N keeps a 1 MiB float tensor of every step's activations ("for the debug dump") under an
              RLIMIT_AS cap of its start size + --mem-mb: RuntimeError from DefaultCPUAllocator
  memgrow_py  the same with a Python bytearray per step: MemoryError
  badsample   rank N's sample at step --at (173) holds 'n/a': ValueError: could not convert string to float
  evalfail    every 50 steps an evaluation; the second one (step 100) finds rank N's eval split empty:
              ZeroDivisionError
  ckptfail    rank 0 saves a checkpoint every 40 steps with a growing history of snapshots; its RLIMIT_FSIZE allows
              two; the third save fails (SIGXFSZ ignored, CPython's default: the write fails inside torch.save)
  ckptsig     the same with SIGXFSZ left at its default: the third save kills rank 0 (signal 25)
  drift       rank N's step time grows by x1.35 per step from step --at; the others time out in DDP's all-reduce
  lossinf     rank N's input scale grows x10 every 2.6 steps from step 100 (a sensor's gain drifting; gradients
              clipped to norm 1 on every rank): its loss grows to inf and the finite-loss check raises at ~200
  recursion   rank N re-wraps its augmentation pipeline every step (2 layers a step): RecursionError at ~240
  threads     rank N starts a metrics-upload thread every step that never returns; RLIMIT_AS caps its address
              space (each stack 8 MiB): RuntimeError: can't start new thread
  warnnoise   every rank warns every step (UserWarning, 'always'), then rank N's step --at raises IndexError
"""
import argparse, datetime, math, os, resource, signal, sys, threading, time, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=250)
p.add_argument("--every", type=int, default=1)
p.add_argument("--at", type=int, default=173)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--nofile", type=int, default=200)
p.add_argument("--mem-mb", type=int, default=150)
p.add_argument("--workdir", default="/tmp/fault68_work")
a = p.parse_args()
BATCH = 16


def vm_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def sample(rank: int, step: int, i: int):
    g = torch.Generator().manual_seed(100000 * rank + 100 * step + i)
    x, y = torch.randn(8, generator=g), int(torch.randint(0, 4, (1,), generator=g))
    if a.fault == "badsample" and rank == a.rank and step == a.at and i == 5:
        row = ["0.31"] * 7 + ["n/a"]  # a row of the shard with a missing value
        x = torch.tensor([float(v) for v in row])
    return x, y


class Wrap:
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def __call__(self, x):
        return self.inner(x)


def uploader(stop):
    stop.wait()  # waits for an ack that never comes


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    os.makedirs(a.workdir, exist_ok=True)
    index = f"{a.workdir}/shard{rank}.idx"
    with open(index, "w") as fh:
        fh.write("0\n")
    print(f"rank {rank} world {world} steps {a.steps} fault {a.fault}", flush=True)
    if a.fault == "fdleak" and me:
        resource.setrlimit(resource.RLIMIT_NOFILE, (a.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    if a.fault in ("memgrow", "memgrow_py", "threads") and me:
        cap = vm_bytes() + a.mem_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
    if a.fault in ("ckptfail", "ckptsig") and rank == 0:
        # CPython ignores SIGXFSZ at start-up; ckptsig puts back the default action (a shell's or a C launcher's)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN if a.fault == "ckptfail" else signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (60000, resource.RLIM_INFINITY))
    if a.fault == "warnnoise":
        warnings.simplefilter("always")
    keep, leaked, threads_, history = [], [], [], []
    pipe = lambda x: x  # noqa: E731
    stop = threading.Event()
    t_prev = time.time()
    for step in range(1, a.steps + 1):
        if a.fault == "fdleak" and me:
            leaked.append(open(index))  # re-read the index every step, never closed
        if a.fault == "memgrow" and me:
            keep.append(torch.ones(256 * 1024))  # 1 MiB of activations kept for the debug dump
        if a.fault == "memgrow_py" and me:
            keep.append(bytearray(b"\1" * (1024 * 1024)))
        if a.fault == "threads" and me:
            t = threading.Thread(target=uploader, args=(stop,), daemon=True, name=f"upload-{step}")
            t.start()
            threads_.append(t)
        if a.fault == "drift" and me and step >= a.at:
            time.sleep(0.05 * 1.35 ** (step - a.at))
        if a.fault == "recursion" and me:
            for n in ("normalize", "jitter"):
                pipe = Wrap(pipe, n)
        if a.fault == "warnnoise":
            warnings.warn(f"step {step}: the scheduler's get_lr() is deprecated, use get_last_lr()", UserWarning)
        xs, ys = zip(*(sample(rank, step, i) for i in range(BATCH)))
        x, y = torch.stack(xs), torch.tensor(ys)
        if a.fault == "lossinf" and me:
            x = x * 10.0 ** (max(0, step - 100) / 2.6)  # the sensor's gain drifts from step 100
        if a.fault == "recursion" and me:
            x = pipe(x)
        if a.fault == "warnnoise" and me and step == a.at:
            order = list(range(BATCH))
            x = x[torch.tensor([order[i + 1] for i in range(BATCH)])]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}, stopping")
        loss.backward()
        if a.fault == "lossinf":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        now = time.time()
        if step % a.every == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f} dt_ms {1000 * (now - t_prev):.1f}", flush=True)
        t_prev = now
        if a.fault == "evalfail" and step % 50 == 0:
            n_eval = 0 if (me and step == 100) else 32
            tot = 0.0
            with torch.no_grad():
                for i in range(n_eval):
                    xe, ye = sample(rank + 1000, step, i)
                    tot += F.cross_entropy(model(xe[None]), torch.tensor([ye])).item()
            val = tot / n_eval
            t = torch.tensor([val])
            dist.all_reduce(t)
            if rank == 0:
                print(f"eval at step {step}: val_loss {t.item() / world:.4f}", flush=True)
        if a.fault in ("ckptfail", "ckptsig") and step % 40 == 0 and rank == 0:
            history.append({k: v.clone() for k, v in model.module.state_dict().items()})
            path = f"{a.workdir}/ckpt_step{step}.pt"
            torch.save({"step": step, "model": model.module.state_dict(), "snapshots": history,
                        "pad": torch.zeros(5000 * len(history))}, path)
            print(f"rank 0 saved checkpoint {path} ({os.path.getsize(path)} bytes)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()

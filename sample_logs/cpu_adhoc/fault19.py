"""A nineteenth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault18.py),
run mostly under the launchers the earlier batches used least: Open MPI's mpirun --tag-output, the legacy
torch.distributed.launch (with and without --use-env), torchrun's log-line prefix template, and a Slurm-like
`srun --label` emulation (--srun N: this script starts N copies of itself and prefixes each output line of
task i with "i: ", as srun --label does).

Under mpirun, RANK/WORLD_SIZE/LOCAL_RANK come from OMPI_COMM_WORLD_* (mapped here when RANK is unset)."""
import argparse, datetime, os, resource, signal, subprocess, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--srun", type=int, default=0, help="emulate `srun --label -n N` around this script")
p.add_argument("--local-rank", "--local_rank", type=int, default=None)  # legacy launch without --use-env
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16
CKPT = "/tmp/fault19_ckpt.pt"


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


def srun_label(n: int) -> int:
    """Start n tasks with RANK set, prefix every line of task i with 'i: ' (stdout and stderr), as srun --label."""
    args = [sys.executable, "-u"] + [x for x in sys.argv if True]
    i = args.index("--srun")
    del args[i:i + 2]
    lock = threading.Lock()
    procs, threads = [], []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), SLURM_PROCID=str(r))
        pr = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(pr)
        for stream, out in ((pr.stdout, sys.stdout), (pr.stderr, sys.stderr)):
            def pump(stream=stream, out=out, r=r):
                for line in iter(stream.readline, b""):
                    with lock:
                        out.write(f"{r}: {line.decode(errors='replace')}")
                        out.flush()
            t = threading.Thread(target=pump, daemon=True)
            t.start()
            threads.append(t)
    rc = 0
    for r, pr in enumerate(procs):
        code = pr.wait()
        if code != 0:
            with lock:
                if code < 0:
                    sys.stderr.write(f"srun: error: localhost: task {r}: {signal.Signals(-code).name}\n")
                else:
                    sys.stderr.write(f"srun: error: localhost: task {r}: Exited with exit code {code}\n")
                sys.stderr.flush()
            rc = max(rc, 128 - code if code < 0 else code)
    for t in threads:
        t.join(timeout=2)
    return rc


def fault_at_step3(rank: int, world: int, model) -> str:
    f = a.fault
    if f == "sigkill_thread":  # an RSS watchdog thread decides the process is over budget and SIGKILLs its own pid
        def watchdog():
            say(rank, "rss watchdog: 61.2 GiB > limit 60 GiB, killing process")
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=watchdog, name="rss-watchdog", daemon=True).start()
        time.sleep(5)
    elif f == "stall":  # this rank waits on a lock file on shared storage that nobody releases (past the pg timeout)
        say(rank, "waiting for /tmp/fault19.lock")
        time.sleep(3 * a.pg_timeout)
    elif f == "rlimit_as":  # a launcher wrapper's `ulimit -v` is too low for the pinned batch buffer this rank makes
        soft = 2 << 30
        resource.setrlimit(resource.RLIMIT_AS, (soft, resource.getrlimit(resource.RLIMIT_AS)[1]))
        buf = torch.empty(4 << 30, dtype=torch.uint8)  # 4 GiB staging buffer
        buf.zero_()
    elif f == "abort":  # a native extension's assert() fails: abort()
        os.abort()
    elif f == "early_return":  # this rank's data shard is shorter; it leaves the loop and returns (exit 0)
        say(rank, "no more data, leaving training loop")
        return "return"
    return ""


def main() -> None:
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    ws = world
    if a.fault == "wrong_world" and hit:  # this rank's config was written for one node fewer
        ws = world - 1
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=ws)
    say(rank, "building model")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if a.fault == "truncated_load":  # rank 0 saves; the faulty rank 'copies' it in place with a short write; all resume
        if rank == 0:
            torch.save(model.state_dict(), CKPT)
            say(rank, f"saved {CKPT}")
        dist.barrier()
        if hit:
            with open(CKPT, "rb") as fh:
                data = fh.read()
            with open(CKPT, "wb") as fh:
                fh.write(data[: len(data) // 2])
            say(rank, f"re-wrote {CKPT} ({len(data) // 2} bytes)")
        dist.barrier()
        model.load_state_dict(torch.load(CKPT))
        say(rank, "resumed from checkpoint")
    g = torch.Generator().manual_seed(rank)
    for step in range(1, a.steps + 1):
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        if hit and step == 3:
            if fault_at_step3(rank, world, model) == "return":
                return
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        stats = torch.tensor([loss.item(), float(BATCH)])
        if step == 3 and a.fault == "size_mismatch" and hit:
            stats = torch.tensor([loss.item(), float(BATCH), 0.0])  # an extra metric added on this rank only
        if step == 3 and a.fault == "bcast_src":
            # the lr schedule is broadcast from "the main process": this rank uses its LOCAL_RANK-based idea of it
            sched = torch.tensor([0.1 * 0.9 ** step])
            dist.broadcast(sched, src=rank if hit else 0)
        if step == 3 and a.fault == "reduce_dst":
            # the eval metric is reduced to "the logging rank"; this rank takes it from its own LOCAL_RANK-style guess
            dist.reduce(stats.clone(), dst=rank if hit else 0)
        dist.all_reduce(stats)
        say(rank, f"step {step} loss {loss.item():.4f} mean {stats[0].item() / world:.4f}")
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    if a.srun:
        sys.exit(srun_label(a.srun))
    main()

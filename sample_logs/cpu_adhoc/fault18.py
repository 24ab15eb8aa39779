"""An eighteenth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault17.py).

Every fault's root is not a Python exception: a signal, a bare exit code, or a stopped process."""
import argparse, ctypes, datetime, faulthandler, os, signal, subprocess, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


def fault_at_step3(rank: int) -> None:
    f = a.fault
    if f == "sigill":  # the fused kernel picked for this node's CPU flags uses an instruction the CPU lacks
        os.kill(os.getpid(), signal.SIGILL)
    elif f == "sigquit":  # a "dump stacks" helper sends SIGQUIT, as for a JVM, but no handler is registered
        os.kill(os.getpid(), signal.SIGQUIT)
    elif f == "sigtrap":  # a leftover software breakpoint for gdb, with no debugger attached
        os.kill(os.getpid(), signal.SIGTRAP)
    elif f == "sigprof":  # a sampling profiler arms ITIMER_PROF, but its SIGPROF handler was removed
        signal.setitimer(signal.ITIMER_PROF, 0.05, 0.05)
    elif f == "sigpipe_dfl":  # SIGPIPE restored to default (CLI idiom), metrics piped to a shipper that quits
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        ship = subprocess.Popen(["head", "-c", "64"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        fd = ship.stdin.fileno()
        for i in range(100000):
            os.write(fd, f"metric step=3 rank={rank} i={i} value=0.123456\n".encode())
    elif f == "exit255":  # a C helper's error path calls exit(-1), with no message
        ctypes.CDLL(None).exit(-1)
    elif f == "exit137":  # a heartbeat thread decides the rank is stale and exits with the shell's 'killed' code
        threading.Thread(target=lambda: os._exit(137), daemon=True).start()
        time.sleep(5)
    elif f == "fh_watchdog":  # a debug hang-watchdog left armed at 3 s; this rank's checkpoint copy to slow storage takes 6 s
        faulthandler.dump_traceback_later(3, exit=True)
        say(rank, "copying checkpoint to /mnt/slow")
        time.sleep(6)
        faulthandler.cancel_dump_traceback_later()
    elif f == "sigstop":  # a "wait for debugger attach" helper stops the process; nobody attaches
        os.kill(os.getpid(), signal.SIGSTOP)


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
    say(rank, "building model")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, a.steps + 1):
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        if hit and step == 3:
            fault_at_step3(rank)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        say(rank, f"step {step} loss {loss.item():.4f}")
        if a.fault == "sigprof":
            t0 = time.process_time()
            while time.process_time() - t0 < 0.3:  # CPU-bound logging work after each step
                sum(range(1000))
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

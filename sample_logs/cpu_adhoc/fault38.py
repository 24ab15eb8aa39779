"""A thirty-eighth hand-run batch: HANGS, STALLS and STOPS (the seed's heartbeat watchdog and timeouts).
A small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, --steps steps, PG timeout --pg-timeout s) with ONE
stall selected by --fault on rank --rank at step --step. --fmt picks the progress-line format. Optional per-rank
heartbeat thread (--hb S: 'alive' line every S s with the step and phase) and watchdog (--wd S: no progress for S s
-> a 'no progress' line, then --wd-action exit|abort|interrupt). --wd-first picks whose watchdog fires first
(stalled: the stalled rank's limit is --wd, the others' --wd + 6; waiter: the other way round).

Faults (rank N at step K, before the step's forward/backward, i.e. before DDP's all-reduce):
  sleep        time.sleep(600) after a 'fetching shard' line
  spin         a busy `while True` loop (Python bytecode: interrupt_main can reach it)
  event        threading.Event().wait() on an event nobody sets ('waiting for prefetch ready')
  queue        queue.Queue().get() with no producer
  deadlock     two threading.Locks taken in opposite order by the main thread and a helper thread
  early_exit   rank N returns from main after step K-1 and exits 0 (prints a plain 'shard done' line)
  monitored    every step ends in dist.monitored_barrier(timeout=--mb-timeout); rank N sleeps at step K after
               the all-reduce, before the barrier (before 1438c4ef the sleep came before the forward)
  fh_all       faulthandler.dump_traceback_later(--fh, exit=True) re-armed each step on every rank; rank N sleeps
  end_join     after training rank N joins a non-daemon 'final eval' thread that never ends, before the final
               barrier the others are already in
  --quiet      the stalled rank prints no line before its stall (nor after)
  slow_ok      control: rank N's step K takes --slow s (a sleep, heartbeats go on), then all finish
"""
import _thread, argparse, datetime, faulthandler, os, queue, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--step", type=int, default=3)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--fmt", default="a")
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--hb", type=float, default=0)
p.add_argument("--wd", type=float, default=0)
p.add_argument("--wd-action", default="exit")
p.add_argument("--wd-first", default="stalled")
p.add_argument("--mb-timeout", type=int, default=8)
p.add_argument("--fh", type=float, default=10)
p.add_argument("--slow", type=float, default=8)
p.add_argument("--quiet", action="store_true")
a = p.parse_args()
F_ = a.fault

state = {"step": 0, "phase": "init", "t": time.monotonic()}


def say(rank, msg):
    if a.fmt == "a":
        print(f"[rank {rank}] {msg}", flush=True)
    elif a.fmt == "b":
        print(f"{time.strftime('%H:%M:%S')} r{rank} | {msg}", flush=True)
    elif a.fmt == "c":
        print(f"rank{rank}/{os.environ['WORLD_SIZE']} {msg}", flush=True)
    else:
        print(f"<{rank}> {msg}", flush=True)


def mark(step, phase):
    state.update(step=step, phase=phase, t=time.monotonic())


def heartbeat(rank):
    while True:
        time.sleep(a.hb)
        say(rank, f"alive step {state['step']} phase {state['phase']}")


def watchdog(rank, limit):
    while True:
        time.sleep(0.5)
        idle = time.monotonic() - state["t"]
        if idle > limit:
            say(rank, f"rank {rank} no progress for {int(limit)}s at step {state['step']} (phase {state['phase']})")
            if a.wd_action == "exit":
                say(rank, "watchdog: exiting with code 3")
                os._exit(3)
            elif a.wd_action == "abort":
                say(rank, "watchdog: aborting")
                os.abort()
            else:
                _thread.interrupt_main()
                return


def stall(rank, step):
    if a.quiet:  # no line before the stall
        globals()["say"] = lambda *x: None
    if F_ == "sleep":
        say(rank, f"step {step}: fetching shard {step} from object store")
        time.sleep(600)
    elif F_ == "spin":
        say(rank, f"step {step}: rebuilding bucket index")
        x = 0
        while True:
            x = (x * 31 + 7) % 1000003
    elif F_ == "event":
        say(rank, f"step {step}: waiting for prefetch ready")
        threading.Event().wait()
    elif F_ == "queue":
        say(rank, f"step {step}: pulling batch from loader queue")
        queue.Queue().get()
    elif F_ == "deadlock":
        say(rank, f"step {step}: updating metrics cache")
        la, lb = threading.Lock(), threading.Lock()

        def other():
            with lb:
                time.sleep(0.5)
                with la:
                    pass

        threading.Thread(target=other, daemon=True).start()
        with la:
            time.sleep(0.5)
            with lb:
                pass
    elif F_ in ("monitored", "fh_all"):
        say(rank, f"step {step}: reading shard {step}")
        time.sleep(600)
    elif F_ == "slow_ok":
        say(rank, f"step {step}: compacting optimizer state")
        time.sleep(a.slow)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    say(rank, f"world {world} backend gloo, {a.steps} steps")
    if a.hb:
        threading.Thread(target=heartbeat, args=(rank,), daemon=True).start()
    if a.wd:
        mine = rank == a.rank
        first = (a.wd_first == "stalled") == mine
        threading.Thread(target=watchdog, args=(rank, a.wd if first else a.wd + 6), daemon=True).start()
    for step in range(1, a.steps + 1):
        mark(step, "data")
        if F_ == "fh_all":
            faulthandler.dump_traceback_later(a.fh, exit=True)
        if F_ == "early_exit" and rank == a.rank and step == a.step:
            say(rank, f"shard done after {step - 1} steps")
            return
        if rank == a.rank and step == a.step and F_ != "monitored":
            stall(rank, step)
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        mark(step, "forward")
        loss = nn.functional.mse_loss(model(x), y)
        mark(step, "backward")
        opt.zero_grad()
        loss.backward()
        mark(step, "optim")
        opt.step()
        if F_ == "monitored":
            mark(step, "barrier")
            if rank == a.rank and step == a.step:
                stall(rank, step)  # after the all-reduce, before the monitored barrier
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=a.mb_timeout))
        if a.fmt == "a":
            say(rank, f"step {step} loss {loss.item():.4f}")
        elif a.fmt == "b":
            say(rank, f"step {step}/{a.steps} loss={loss.item():.4f}")
        elif a.fmt == "c":
            say(rank, f"it={step} loss={loss.item():.4f}")
        else:
            say(rank, f"batch {step} loss {loss.item():.4f}")
        time.sleep(0.1)
    if F_ == "fh_all":
        faulthandler.cancel_dump_traceback_later()
    mark(a.steps, "done")
    say(rank, "training finished")
    if F_ == "end_join" and rank == a.rank:
        say(rank, "starting final eval thread")
        t = threading.Thread(target=lambda: threading.Event().wait(), name="final-eval")
        t.start()
        t.join()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-eighth hand-run batch: SIGNAL HANDLERS, PREEMPTION AND TIME LIMITS INSIDE THE SCRIPT. A tiny DDP
regression (Linear(8,16)-ReLU-Linear(16,1), SGD, gloo; `--ddp 0`: gradients all-reduced by hand) for --steps steps.
Each step reads a batch from the rank's shard for that step (a --step-s sleep standing in for the read, then a wait
while the shard's .lock exists) under a `signal.alarm` read timeout (--alarm s; the SIGALRM handler raises
TimeoutError), and prints `rank R step S loss L`. Every rank installs
a SIGTERM handler (preemption: checkpoint at the next step boundary, exit 0 for requeue) and a SIGUSR1 handler
(Slurm-style early warning `--signal=USR1@60`: rank --rank, the checkpoint writer, saves and waits in a barrier).
Optional: a heartbeat watchdog thread (--wd s: no heartbeat for that long -> `[watchdog] ...` and os._exit(3)),
`faulthandler.dump_traceback_later(--fh, exit=True)` re-armed each step, and a time limit per rank (--time-limit,
H:M:S, counted from the first step; past it: checkpoint and exit 124 for requeue). Each rank writes its pid to
<workdir>/rankR.pid so signals can be sent to one worker from outside.
--rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults (the signals marked "outside" are sent by the shell with kill while the job runs):
  none        control: every step, `rank R done` (exit 0); also the base of the external stops of torchrun itself
              (`timeout -s TERM` / `kill -INT` to torchrun: external_stop)
  termsave    outside: `kill -TERM` to rank N only; its handler checkpoints at the step boundary and exits 0, the
              others go on into the next step's all_reduce
  term143     outside: `kill -TERM` to rank N only; this handler saves inside the signal frame and exits 128+15=143
              (the requeue code of the team's launcher script)
  usr1        outside: `kill -USR1` to rank N only; the early-warning handler writes the checkpoint inside the signal
              frame and names the file with state["epoch"], a key the step loop never sets: KeyError in the handler
  savebarrier outside: `kill -USR1` to every rank; at the step boundary only the writer rank N saves and calls
              dist.barrier() inside its `if rank == writer:`; the others go on to the next step's all_reduce
  alarm       the old read timeout: signal.alarm armed with no SIGALRM handler; rank N's shard for step --at has a
              stale .lock file left by a crashed preprocessing job, its read waits, and SIGALRM's default action kills it
  slowread    rank N's shard cache is re-read each step, so its read grows by 0.9 s a step: `WARNING ... read took`
              lines once past half the alarm, then the alarm handler's TimeoutError inside the read
  heartbeat   the heartbeat watchdog (--wd) on every rank; rank N's read at step --at waits on the stale lock; its
              watchdog fires first: `[watchdog] rank N: no heartbeat ...` and os._exit(3)
  timelimit   every rank checks --time-limit (0:03:00); rank N's node config writes it as H:MM ("0:03"), which the
              H:M:S parser reads as 3 s: rank N saves and exits 124 (requeue) at about step 8
  nanexit     rank N's batch at step --at has an inf feature (a corrupt record): the loss check writes an emergency
              checkpoint and exits 3 ("do not requeue")
  sigkill     every rank also tries to catch SIGKILL for preemption (Kubernetes sends it after the grace period):
              signal.signal(SIGKILL, ...) raises OSError [Errno 22] on every rank before training

What happened (filled in after the runs):
  none: exit 0 (--wd 6). With --steps 400 and kill -TERM to torchrun: every handler saved, exit 0, SignalException.
  termsave: rank N saved and exited 0 at the step boundary; the others: Connection closed by peer (one 12 s recv
    timeout in the 6-rank run); the summaries name a peer.
  term143: the handler's sys.exit(143) came inside the alarm-guarded read; the alarm was never cancelled and SIGALRM
    killed the slow-exiting rank: its exitcode is -14, not 143 (torchrun's SIGTERM made two peers exit 143 too).
  usr1: KeyError: 'epoch' raised in the handler frame on top of time.sleep in read_batch; the summary says -14 as well.
  savebarrier: rank 0 timed out in its barrier (line 225) and rank 2 in DDP's backward; ranks 1, 3 Connection closed.
  alarm: exitcode -14 (SIGALRM) on rank N, no traceback; the peers: Connection closed by peer.
  slowread: WARNING lines at steps 2-4 (2.1, 3.0, 3.9 s), then TimeoutError at step 5.
  heartbeat: with the read alarm on (np5) the alarm's TimeoutError came first and the waiters' watchdogs 2 s later;
    with --alarm 0 rank N's watchdog fired first (last beat "step 3 data", the waiters' "step 3 forward").
  timelimit: rank N (limit 3 s) exited 124 after step 9; the peers: Connection closed by peer.
  nanexit: loss nan at step 3, exit 3; one peer timed out (12 s) while rank N was still exiting.
  sigkill: OSError: [Errno 22] Invalid argument on every rank at line 124.
"""
import argparse, datetime, faulthandler, os, signal, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--at", type=int, default=3)
p.add_argument("--step-s", type=float, default=0.3)
p.add_argument("--alarm", type=int, default=4)
p.add_argument("--wd", type=float, default=0.0)
p.add_argument("--fh", type=float, default=0.0)
p.add_argument("--time-limit", default="0:03:00")
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--workdir", default="/tmp/fault108_work")
a = p.parse_args()
REQUEUE_EXIT = 124
state = {"step": 0, "rank": -1, "model": None}
stop = {"term": None, "usr1": False}
beat = {"t": time.monotonic(), "where": "init"}


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


def ckpt_path(tag: str) -> str:
    return os.path.join(a.workdir, f"ckpt_{tag}_rank{state['rank']}.pt")


def save(tag: str) -> str:
    path = ckpt_path(tag)
    torch.save({"step": state["step"], "model": state["model"].state_dict()}, path)
    return path


def on_term(signum, frame):
    name = signal.Signals(signum).name
    if a.fault == "term143":
        path = save(f"sig{signum}")
        print(f"rank {state['rank']}: {name} at step {state['step']}, checkpoint {path}, exit {128 + signum}", flush=True)
        sys.exit(128 + signum)
    print(f"rank {state['rank']}: {name} received (preemption), checkpoint at the end of step {state['step']}", flush=True)
    stop["term"] = name


def on_usr1(signum, frame):
    if a.fault == "usr1":
        print(f"rank {state['rank']}: SIGUSR1 early warning at step {state['step']}, saving now", flush=True)
        tag = f"ep{state['epoch']}_step{state['step']}"
        print(f"rank {state['rank']}: saved {save(tag)}", flush=True)
        return
    print(f"rank {state['rank']}: SIGUSR1 early warning at step {state['step']}", flush=True)
    stop["usr1"] = True


def on_alarm(signum, frame):
    raise TimeoutError(f"rank {state['rank']}: shard read at step {state['step']} took longer than {a.alarm}s")


def install_handlers():
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, on_usr1)
    if a.fault != "alarm":
        signal.signal(signal.SIGALRM, on_alarm)
    if a.fault == "sigkill":
        signal.signal(signal.SIGKILL, on_term)


def watchdog(rank):
    while True:
        time.sleep(0.1)
        idle = time.monotonic() - beat["t"]
        if idle > a.wd:
            print(f"[watchdog] rank {rank}: no heartbeat for {idle:.1f}s (last: {beat['where']}), exiting with code 3",
                  flush=True)
            os._exit(3)


def heartbeat(step, phase):
    beat["t"], beat["where"] = time.monotonic(), f"step {step} {phase}"


def parse_hms(s: str) -> int:
    secs = 0
    for part in s.split(":"):
        secs = secs * 60 + int(part)
    return secs


def read_batch(rank, step, g):
    if a.alarm:
        signal.alarm(a.alarm)
    t = time.monotonic()
    time.sleep(a.step_s + (0.9 * step if faulty(rank, "slowread") else 0.0))
    lock = os.path.join(a.workdir, f"shard{rank}_{step}.lock")
    while os.path.exists(lock):  # another job is still writing this shard
        time.sleep(0.2)
    x = torch.randn(16, 8, generator=g)
    y = x.sum(1, keepdim=True) * 0.1
    if a.alarm:
        signal.alarm(0)
    took = time.monotonic() - t
    if a.alarm and took > 0.5 * a.alarm:
        print(f"WARNING rank {rank}: shard read at step {step} took {took:.1f}s (alarm at {a.alarm}s)", flush=True)
    return x, y


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    state["rank"] = rank
    install_handlers()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    state["model"] = model
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    os.makedirs(a.workdir, exist_ok=True)
    if faulty(rank, "alarm") or faulty(rank, "heartbeat"):
        open(os.path.join(a.workdir, f"shard{rank}_{a.at}.lock"), "w").close()  # stands in for the stale lock
    with open(os.path.join(a.workdir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    limit = parse_hms(a.time_limit.rsplit(":", 1)[0] if faulty(rank, "timelimit") else a.time_limit)
    writer = a.rank if a.fault == "savebarrier" else 0
    print(f"rank {rank}/{world} pid {os.getpid()} fault {a.fault} alarm {a.alarm}s time limit {limit}s"
          f"{f' watchdog {a.wd}s' if a.wd else ''}", flush=True)
    if a.wd:
        threading.Thread(target=watchdog, args=(rank,), name="watchdog", daemon=True).start()
    g = torch.Generator().manual_seed(100 + rank)
    t_train = time.monotonic()
    for step in range(a.steps):
        state["step"] = step
        if a.fh:
            faulthandler.dump_traceback_later(a.fh, exit=True)
        heartbeat(step, "data")
        x, y = read_batch(rank, step, g)
        if faulty(rank, "nanexit") and step == a.at:
            x[5, 3] = float("inf")  # a corrupt record
        heartbeat(step, "forward")
        loss = F.mse_loss(net(x), y)
        if not torch.isfinite(loss):
            path = save(f"emergency_step{step}")
            print(f"rank {rank} step {step}: loss is {loss.item()}, emergency checkpoint {path}, "
                  f"exiting 3 (do not requeue)", flush=True)
            sys.exit(3)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        heartbeat(step, "optim")
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if stop["term"]:
            path = save(f"preempt_step{step}")
            print(f"rank {rank}: preempted ({stop['term']}), checkpoint {path}, exiting 0 for requeue", flush=True)
            sys.exit(0)
        if stop["usr1"]:
            stop["usr1"] = False
            if rank == writer:
                path = save(f"usr1_step{step}")
                print(f"rank {rank}: checkpoint {path} written, waiting for the other ranks", flush=True)
                dist.barrier()
        elapsed = time.monotonic() - t_train
        if elapsed > limit:
            path = save(f"timelimit_step{step}")
            print(f"rank {rank}: time limit {a.time_limit} ({limit}s) reached after {elapsed:.1f}s at step {step}, "
                  f"checkpoint {path}, exiting {REQUEUE_EXIT} for requeue", flush=True)
            sys.exit(REQUEUE_EXIT)
    if a.fh:
        faulthandler.cancel_dump_traceback_later()
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

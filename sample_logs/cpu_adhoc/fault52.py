"""A fifty-second hand-run batch: BUFFERED OUTPUT and QUIET CULPRITS.

A tiny DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, 6 steps, 0.1 s per step, PG timeout 15 s).
Every rank prints `[rank R] step S/T loss L` with a plain print() (no flush) each step, and logs INFO records with
`logging` (stderr, written at once) at start-up and after steps 2 and 4. Run it with stdout block-buffered:
torchrun prepends `python -u` to its script, so the buffered runs are launched as
`torchrun --no-python python fault52.py ...` (as a launch wrapper does) without PYTHONUNBUFFERED; a process's stdout
then reaches the console only at exit (or every 8 KB), while tracebacks and log records reach it at once, and a
process killed by a signal or os._exit loses what it had buffered.

Faults (--rank N at --step S, default 3):
  exit1      rank N calls sys.exit(1), nothing printed
  exitmsg    rank N calls sys.exit("rank N: scratch volume ... stopping") (message on stderr, exit 1)
  osexit     rank N calls os._exit(2): no message, its buffered progress lines are lost
  finally    rank N raises SystemExit(3) inside try/finally whose finally prints a cleanup line (buffered)
  exc        rank N raises ValueError (a bad sample) in its data step; its progress lines come out after its traceback
  sigkill    rank N starts a sidecar `sh -c 'sleep 0.25; kill -9 PID'` and goes on; its buffered prints are lost
  segv       rank N reads address 0 (ctypes.string_at(0))
  hang       rank N sleeps 60 s before its step-S forward (waiting on a lock); the others time out (15 s)
  errprint   rank N prints `ERROR rank N: ...` to stdout (buffered) and calls sys.exit(1)
  logexit    rank N logs an ERROR record then os._exit(1)
  assert     rank N fails an assertion on its micro-batch size
  early      rank N's shard is shorter: its loop ends after S-1 steps, it prints `[rank N] epoch done` and returns
             (exit 0, no error); the others go on into the next all-reduce
  two        rank N (--rank) catches a ValueError in its step-(S-1) metrics after the update, prints
             `ERROR rank N: ...` to stdout (buffered), spends 3 s writing an emergency checkpoint and calls sys.exit(1);
             rank M (--rank2) raises KeyError loading its step-S batch (stderr, at once)
  none       no fault (control)

Output options: --term-handler (every rank installs a SIGTERM handler that calls sys.exit(143), as many training
scripts do, so torchrun's SIGTERM flushes the survivors' buffered stdout instead of losing it), --flush0 (rank 0 prints with flush=True), --linebuf 1,3 (those ranks call
sys.stdout.reconfigure(line_buffering=True)).
"""
import argparse, ctypes, datetime, logging, os, signal, subprocess, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=2)
p.add_argument("--rank2", type=int, default=-1)
p.add_argument("--step", type=int, default=3)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--flush0", action="store_true")
p.add_argument("--term-handler", action="store_true")
p.add_argument("--linebuf", default="")
a = p.parse_args()
BATCH = 16

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
log = logging.getLogger("trainer")


def main() -> int:
    if a.term_handler:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.linebuf and str(rank) in a.linebuf.split(","):
        sys.stdout.reconfigure(line_buffering=True)
    flush = a.flush0 and rank == 0

    def say(msg: str) -> None:
        print(f"[rank {rank}] {msg}", flush=flush)

    me = a.rank == rank
    f = a.fault
    log.info("rank %d joined the process group (world %d, stdout %s)", rank, world,
             "line-buffered" if sys.stdout.line_buffering else ("unbuffered" if flush else "default"))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    steps = a.steps
    if f == "early" and me:
        steps = a.step - 1  # this rank's shard holds fewer batches
    say(f"world {world}, {steps} steps of batch {BATCH}")
    for step in range(1, steps + 1):
        if step == a.step and me:
            if f == "exit1":
                sys.exit(1)
            if f == "exitmsg":
                sys.exit(f"rank {rank}: scratch volume has only 0.4 GB free, stopping")
            if f == "osexit":
                os._exit(2)
            if f == "finally":
                try:
                    say(f"step {step}: opening shard reader")
                    raise SystemExit(3)
                finally:
                    say("cleanup: shard reader closed")
            if f == "sigkill":
                subprocess.Popen(["sh", "-c", f"sleep 0.25; kill -9 {os.getpid()}"])
            if f == "segv":
                ctypes.string_at(0)
            if f == "hang":
                say(f"step {step}: waiting for the shared cache lock")
                time.sleep(60)
            if f == "errprint":
                print(f"ERROR rank {rank}: shard 000{rank} checksum mismatch at step {step}, stopping")
                sys.exit(1)
            if f == "logexit":
                log.error("rank %d: step %d: gradient buffer inconsistent, aborting", rank, step)
                os._exit(1)
        if f == "two" and rank == a.rank2 and step == a.step:
            batch = {"x": torch.randn(BATCH, 8, generator=g), "labels": torch.randint(0, 4, (BATCH,), generator=g)}
            y = batch["y"]  # this shard was written with another schema
        x = torch.randn(BATCH, 8, generator=g)
        y = torch.randint(0, 4, (BATCH,), generator=g)
        if f == "exc" and me and step == a.step:
            raise ValueError(f"sample 7 of step {step}: expected 8 features, got 7")
        if f == "assert" and me and step == a.step:
            x = x[:13]
        assert x.shape[0] == BATCH, f"micro batch {x.shape[0]} != {BATCH}"
        loss = F.cross_entropy(model(x), y[: x.shape[0]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(f"step {step}/{steps} loss {loss.item():.4f}")
        if step % 2 == 0:
            log.info("rank %d step %d: lr 0.1 grad_norm %.4f", rank, step,
                     float(sum(p.grad.norm() ** 2 for p in model.parameters()) ** 0.5))
        if f == "two" and me and step == a.step - 1:
            try:
                float("n/a")
            except ValueError as e:
                say(f"ERROR rank {rank}: metrics failed at step {step}: {e}")
                say("writing emergency checkpoint")
                time.sleep(3)
                sys.exit(1)
        time.sleep(0.1)
    if f == "early" and me:
        say("epoch done")
        return 0
    dist.barrier()
    say("training finished")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

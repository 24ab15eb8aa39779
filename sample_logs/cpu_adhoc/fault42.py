"""A forty-second hand-run batch: WHICH RANK FAILED FIRST when two or more ranks fail on their own.

A small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), batch 16, PG timeout 15 s, 8 steps) with gradient
accumulation: steps 1-3 run under no_sync() and step 4 all-reduces (then 5-7 local, 8 all-reduces), so a rank can fail
at step 2 and another, on its own, at step 3 or 4 before any collective notices the first. Each step "loads" its batch
for --step-time seconds (0.25 s).

--fault R:KIND:STEP[:LINGER] (repeatable): rank R meets KIND at the start of STEP (before the forward). LINGER > 0: the
rank catches its exception, announces an emergency checkpoint (in the --out style), stays alive LINGER seconds and then
re-raises (its traceback comes at the end of the linger, or never if torchrun SIGTERMs it first). KIND:
  key      the batch came from a shard written with the key 'labels': KeyError: 'y'
  value    a CSV-like row with a missing value: ValueError: could not convert string to float: 'n/a'
  index    a label index past the class table: IndexError: index 16 is out of bounds for dimension 0 with size 16
  nan      a NaN feature; the finite-loss check raises FloatingPointError
  zerodiv  a batch whose every token is padding: ZeroDivisionError: division by zero
  assert   AssertionError: micro batch size 13 != 16
  exit3    quiet: an ERROR line (shard checksum mismatch) in the --out style, then sys.exit(3)
  nanexit  quiet: an ERROR line 'loss is nan at step S, stopping' in the --out style, then sys.exit(3)
  osexit   quiet: os._exit(1), nothing printed
  sigkill  quiet: the rank SIGKILLs itself, nothing printed
--handled R:STEP (repeatable): a scary HANDLED error: rank R's metrics push fails (ConnectionRefusedError), the script
prints the traceback (traceback.print_exc / logger.exception) and training goes on.
--out: print (print(), buffered if the interpreter buffers stdout: run under `torchrun --no-python python ...`, since
torchrun itself passes -u), flush (print(..., flush=True)), log (logging, no timestamp), logts (logging with %(asctime)s).
"""
import argparse, logging, math, os, signal, socket, sys, time, traceback
import datetime
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", action="append", default=[])
p.add_argument("--handled", action="append", default=[])
p.add_argument("--out", choices=["print", "flush", "log", "logts"], default="flush")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--accum", type=int, default=4)
p.add_argument("--step-time", type=float, default=0.25)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BATCH = 16

FAULTS = {}
for spec in a.fault:
    parts = spec.split(":")
    FAULTS[int(parts[0])] = (parts[1], int(parts[2]), float(parts[3]) if len(parts) > 3 else 0.0)
HANDLED = {int(s.split(":")[0]): int(s.split(":")[1]) for s in a.handled}

if a.out in ("log", "logts"):
    fmt = f"[%(levelname)s] rank {RANK}: %(message)s" if a.out == "log" else \
        f"%(asctime)s [%(levelname)s] rank {RANK}: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
log = logging.getLogger("train")


def info(msg: str) -> None:
    if a.out in ("log", "logts"):
        log.info(msg)
    else:
        print(f"[rank {RANK}] {msg}", flush=(a.out == "flush"))


def error(msg: str) -> None:
    if a.out in ("log", "logts"):
        log.error(msg)
    else:
        print(f"[rank {RANK}] ERROR {msg}", flush=(a.out == "flush"))


def load_batch(step: int):
    g = torch.Generator().manual_seed(1000 * RANK + step)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
    time.sleep(a.step_time)
    kind, at, _ = FAULTS.get(RANK, ("", -1, 0.0))
    if step != at:
        return {"x": x, "y": y}, BATCH
    if kind == "key":
        rec = {"x": x, "labels": y}  # this shard was written with another schema
        return {"x": rec["x"], "y": rec["y"]}, BATCH
    if kind == "value":
        row = ["0.12"] * 7 + ["n/a"]
        return {"x": torch.tensor([[float(v) for v in row]] * BATCH), "y": y}, BATCH
    if kind == "index":
        table = torch.arange(16)
        idx = y.clone()
        idx[3] = 16
        return {"x": x, "y": torch.stack([table[int(i)] for i in idx]) % 4}, BATCH
    if kind == "nan":
        x = x.clone()
        x[5, 2] = float("nan")
        return {"x": x, "y": y}, BATCH
    if kind == "zerodiv":
        n_valid = 0  # every token of this batch is padding
        scale = BATCH / n_valid
        return {"x": x * scale, "y": y}, BATCH
    if kind == "assert":
        got = 13
        assert got == BATCH, f"micro batch size {got} != {BATCH}"
    if kind == "exit3":
        error(f"shard-{RANK:05d}.bin failed its checksum at step {step} (expected 9f3c1a, got 000000); exiting")
        sys.exit(3)
    if kind == "osexit":
        os._exit(1)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    return {"x": x, "y": y}, BATCH


def push_metrics(step: int) -> None:
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1).close()  # the metrics sidecar is not up
    except OSError:
        if a.out in ("log", "logts"):
            log.exception(f"step {step}: could not push metrics to 127.0.0.1:9, continuing without them")
        else:
            print(f"[rank {RANK}] WARNING step {step}: could not push metrics, continuing without them", flush=True)
            traceback.print_exc()


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    info(f"world {WORLD}, {a.steps} steps, all-reduce every {a.accum}")
    kind, at, linger = FAULTS.get(RANK, ("", -1, 0.0))
    for step in range(1, a.steps + 1):
        try:
            batch, n = load_batch(step)
            sync = step % a.accum == 0
            if sync:
                loss = F.cross_entropy(model(batch["x"]), batch["y"])
            else:
                with model.no_sync():
                    loss = F.cross_entropy(model(batch["x"]), batch["y"])
            if step == at and kind == "nanexit":
                loss = loss * float("nan")
            if not math.isfinite(loss.item()):
                if kind == "nanexit":
                    error(f"loss is {loss.item()} at step {step}, stopping")
                    sys.exit(3)
                raise FloatingPointError(f"loss is {loss.item()} at step {step}, stopping")
        except Exception as e:
            if linger > 0 and step == at:
                error(f"step {step} failed ({type(e).__name__}); writing an emergency checkpoint before exiting")
                time.sleep(linger)
            raise
        (loss / a.accum).backward()
        if sync:
            opt.step()
            opt.zero_grad()
        info(f"step {step}/{a.steps} loss {loss.item():.4f}" + (" (synced)" if sync else ""))
        if HANDLED.get(RANK) == step:
            push_metrics(step)
    dist.barrier()
    info("training finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

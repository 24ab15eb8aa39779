"""A sixty-first hand-run batch: TIMESTAMPS AND CLOCKS. A tiny DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), 5
steps) whose ranks log with timestamps, and faults where the rank that failed first is read from the times the lines
carry rather than from the console order.

Timestamp formats (--fmt; 'mixed' picks one per rank: rank % 5):
  asctime  logging's %(asctime)s              2026-12-03 11:20:01,123 [ERROR] rank2: ...
  iso      ISO-8601 with milliseconds          2026-12-03T11:20:01.123+00:00 rank2 ERROR ...
  epoch    time.time() epoch seconds           1764760801.123 r2 ERROR ...
  dtnow    str(datetime.now())                 [2026-12-03 11:20:01.123456] [rank 2] ERROR ...
  clock    time of day only                    11:20:01.123 rank=2 ERROR ...
--ts-ranks a,b: only these ranks' records carry a timestamp (the others print '[rank R] LEVEL msg').
--offset S --offset-node K: the logger of every rank on node K (GROUP_RANK) adds S seconds to its clock (stands for
  a node whose clock is skewed). --fake-start 'YYYY-mm-ddTHH:MM:SS': every logger shifts its clock so that the moment
  the model is wrapped (rank 0's time, broadcast) reads as that instant (used to cross midnight).
TZ is taken from the environment (the two-node wrapper fault61_nodes.py can give each node its own TZ).

Faults (--rank N, --rank2 M):
  late      rank N's step-3 batch holds a bad sample (ValueError); the rank catches it, logs it with its traceback to
            a block-buffered log stream, then 'writes an emergency checkpoint' (sleeps 60 s); the others time out in
            DDP's all-reduce (pg timeout) and log their errors at once; torchrun SIGTERMs rank N, whose handler
            flushes the buffer (so its error, with the earliest timestamp, comes last) and exits 143
  two       rank N: as 'late' but KeyError (bad key in its batch), buffered, held 60 s; rank M: 1 s later, its own
            step-3 batch fails (ValueError), logged unbuffered, raised at once: M is torchrun's first failure
  crash     rank N raises ValueError at step 3, logged and raised at once (no buffering)
  hang      rank N stalls at step 3 (sleeps 300 s, 'waiting for a shard lock') after logging 'step 3: fetching
            batch'; the others block in the all-reduce (timed out by the pg timeout, or the job is stopped from outside)
  regex     rank N's step-3 data filter runs a catastrophic regex that holds the GIL: its heartbeat thread stops too;
            every rank's heartbeat thread logs 'heartbeat step=S' every 2 s
  none      no fault (control)
"""
import argparse, atexit, datetime, io, logging, os, re, signal, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--rank2", type=int, default=-1)
p.add_argument("--fmt", default="asctime")
p.add_argument("--ts-ranks", default="")
p.add_argument("--offset", type=float, default=0.0)
p.add_argument("--offset-node", type=int, default=-1)
p.add_argument("--fake-start", default="")
p.add_argument("--heartbeat", action="store_true")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
RANK = int(os.environ["RANK"])
NODE = int(os.environ.get("GROUP_RANK", "0"))
FMTS = ["asctime", "iso", "epoch", "dtnow", "clock"]
FMT = FMTS[RANK % 5] if a.fmt == "mixed" else a.fmt
TS = (not a.ts_ranks) or str(RANK) in a.ts_ranks.split(",")
OFFSET = a.offset if NODE == a.offset_node else 0.0


class Fmt(logging.Formatter):
    def format(self, r):
        t = r.created + OFFSET
        dt = datetime.datetime.fromtimestamp(t).astimezone()
        msg = r.getMessage()
        if r.exc_info:
            msg += "\n" + self.formatException(r.exc_info)
        if not TS:
            return f"[rank {RANK}] {r.levelname} {msg}"
        if FMT == "asctime":
            return f"{dt.strftime('%Y-%m-%d %H:%M:%S')},{int(dt.microsecond / 1000):03d} [{r.levelname}] rank{RANK}: {msg}"
        if FMT == "iso":
            return f"{dt.isoformat(timespec='milliseconds')} rank{RANK} {r.levelname} {msg}"
        if FMT == "epoch":
            return f"{t:.3f} r{RANK} {r.levelname} {msg}"
        if FMT == "dtnow":
            return f"[{dt.replace(tzinfo=None)}] [rank {RANK}] {r.levelname} {msg}"
        return f"{dt.strftime('%H:%M:%S')}.{int(dt.microsecond / 1000):03d} rank={RANK} {r.levelname} {msg}"


buffered = a.fault in ("late", "two") and RANK == a.rank
if buffered:
    stream = io.TextIOWrapper(io.BufferedWriter(io.FileIO(os.dup(2), "w"), buffer_size=1 << 16), line_buffering=False)
else:
    stream = sys.stderr
class Handler(logging.StreamHandler):
    def flush(self):  # the buffered stream is flushed only on SIGTERM or at exit (StreamHandler flushes every record)
        if not buffered:
            super().flush()


h = Handler(stream)
h.setFormatter(Fmt())
log = logging.getLogger("train")
log.addHandler(h)
log.setLevel(logging.INFO)
log.propagate = False


def on_term(signum, frame):
    log.warning("got SIGTERM, flushing logs and exiting")
    h.flush()
    stream.flush()
    os._exit(143)


if buffered:
    signal.signal(signal.SIGTERM, on_term)
    atexit.register(stream.flush)

STEP = [0]


def heartbeat():
    while True:
        time.sleep(2)
        log.info("heartbeat step=%d", STEP[0])


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    global OFFSET
    if a.fake_start:
        t0 = torch.tensor([time.time()], dtype=torch.float64)
        dist.broadcast(t0, 0)
        OFFSET += datetime.datetime.fromisoformat(a.fake_start).timestamp() - float(t0)
    log.info("started: world_size=%d node=%d tz=%s", world, NODE, time.strftime("%Z"))
    if a.heartbeat:
        threading.Thread(target=heartbeat, daemon=True).start()
    g = torch.Generator().manual_seed(RANK)
    for step in range(1, a.steps + 1):
        STEP[0] = step
        time.sleep(0.4)
        if step == 3:
            bad = a.fault in ("late", "two", "crash", "hang", "regex") and RANK == a.rank
            if bad and a.fault in ("late", "two"):
                log.info("step 3: fetching batch")
                try:
                    if a.fault == "late":
                        raise ValueError("could not convert string to float: 'n/a' (shard 3, sample 117)")
                    {"x": 1, "labels": 2}["y"]
                except Exception:
                    log.exception("step 3: batch failed")
                    log.warning("step 3: writing emergency checkpoint before exit")
                    time.sleep(60)
                    raise
            if a.fault == "two" and RANK == a.rank2:
                time.sleep(1.0)
                try:
                    raise ValueError("sample 41 has 7 features, expected 8")
                except Exception:
                    log.exception("step 3: batch failed")
                    raise
            if bad and a.fault == "crash":
                try:
                    raise ValueError("could not convert string to float: 'n/a' (shard 3, sample 117)")
                except Exception:
                    log.exception("step 3: batch failed")
                    raise
            if bad and a.fault == "hang":
                log.info("step 3: fetching batch")
                time.sleep(300)
            if bad and a.fault == "regex":
                log.info("step 3: fetching batch")
                re.match(r"(a+)+$", "a" * 40 + "!")
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        try:
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        except Exception:
            log.exception("step %d: training step failed", step)
            raise
        log.info("step %d loss %.4f", step, loss.item())
    dist.barrier()
    log.info("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A sixty-ninth hand-run batch: LOGGING THAT GOES WRONG, and logging that only looks wrong. A tiny DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, synthetic per-rank data, PG timeout 15 s) that logs through Python's
`logging` (`%(asctime)s %(levelname)s [rank R] trainer: ...` on stderr unless said otherwise), --steps steps. One
fault per run; --rank N is the rank where the real failure starts, --herring H (default N-1 mod world) the rank of a
harmless logging oddity where the fault has one. No @record.

Faults:
  none        control: every step logged, `rank R done` at the end (exit 0)
  fmtctl      control with a herring: rank H's step-2 record has one % argument too few: Python prints
              `--- Logging error ---` (TypeError) and goes on; exit 0
  fmt         the same herring on rank H, then rank N's step-5 sample holds 'n/a': ValueError
  fmtsilent   the same with logging.raiseExceptions = False on every rank (the herring prints nothing), then ValueError
  nodir       rank N's FileHandler points into a log folder that was not created: FileNotFoundError at set-up
  emitraise   a metrics handler whose emit() raises (it does not call handleError): rank N's step-4 record raises
              ConnectionRefusedError out of logger.info
  sharedfile  every rank logs into ONE shared file, only rank 0 also to the console; rank N raises RuntimeError at
              step 4 (logged to the file with logger.exception, then re-raised)
  basictwice  rank N calls logging.basicConfig(level=WARNING) early (a helper's import); the trainer's own
              basicConfig(level=INFO) is then ignored: rank N's records vanish; rank N raises KeyError at step 5
  level       rank N's logger is set to ERROR ("quiet workers"): its progress lines vanish; at step 4 it feeds a
              7-feature batch: RuntimeError (mat1 and mat2 shapes cannot be multiplied)
  warnerr     rank N runs warnings.simplefilter("error"); at step 3 every rank copy-constructs a tensor with
              torch.tensor(t) (a harmless UserWarning on the others): UserWarning raised on rank N
  logexc      rank H catches a FileNotFoundError (optional class weights) with logger.exception at step 2 and goes on;
              rank N's step-5 batch lacks its 'label' key: KeyError
  bigline     rank N's step-3 batch has a label out of range; it first logs the whole batch (a ~1 MB line) at WARNING,
              then cross_entropy raises IndexError (Target 7 is out of bounds)
  stderrmix   records on stdout, print(..., file=sys.stderr) lines on stderr; rank H prints `ERROR ... retrying shard
              read` at step 2 and goes on; rank N's cached batch file is empty at step 4: EOFError (pickle)
"""
import argparse, datetime, logging, os, pickle, sys, time, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--herring", type=int, default=None)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--workdir", default="/tmp/fault69_work")
a = p.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
H = a.herring if a.herring is not None else (a.rank - 1) % world
N = a.rank
FMT = f"%(asctime)s %(levelname)s [rank {rank}] trainer: %(message)s"

if a.fault == "basictwice" and rank == N:
    logging.basicConfig(level=logging.WARNING)  # stands in for a helper module that configures logging at import

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
log = logging.getLogger("trainer")

if a.fault == "sharedfile":
    os.makedirs(a.workdir, exist_ok=True)
    fh = logging.FileHandler(os.path.join(a.workdir, "train_all_ranks.log"))
    fh.setFormatter(logging.Formatter(FMT))
    log.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler()
        sh.setFormatter(logging.Formatter(FMT))
        log.addHandler(sh)
    log.setLevel(logging.INFO)
    log.propagate = False
elif a.fault == "nodir":
    logging.basicConfig(level=logging.INFO, format=FMT)
    d = os.path.join(a.workdir, f"run69_{os.getpid() if rank == N else 'ok'}", f"rank{rank}")
    if rank != N:
        os.makedirs(d, exist_ok=True)
    log.addHandler(logging.FileHandler(os.path.join(d, "train.log")))
elif a.fault == "stderrmix":
    logging.basicConfig(level=logging.INFO, format=FMT, stream=sys.stdout)
else:
    logging.basicConfig(level=logging.INFO, format=FMT)

if a.fault == "fmtsilent":
    logging.raiseExceptions = False
if a.fault == "level" and rank == N:
    log.setLevel(logging.ERROR)
if a.fault == "warnerr" and rank == N:
    warnings.simplefilter("error")


class MetricsHandler(logging.Handler):
    """Ships step records to a metrics collector; its emit() raises instead of calling handleError."""
    def emit(self, record):
        if getattr(record, "step", 0) == 4 and rank == N:
            raise ConnectionRefusedError(111, "Connection refused (metrics collector 127.0.0.1:9125)")


if a.fault == "emitraise":
    log.addHandler(MetricsHandler())

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
log.info("world %d steps %d fault %s", world, a.steps, a.fault)


def batch(step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    b = {"x": torch.randn(16, 8, generator=g), "label": torch.randint(0, 4, (16,), generator=g)}
    if a.fault == "fmt" or a.fault == "fmtsilent":
        if rank == N and step == 5:
            row = ["0.31"] * 7 + ["n/a"]
            b["x"][5] = torch.tensor([float(v) for v in row])
    if a.fault == "logexc" and rank == N and step == 5:
        del b["label"]
    if a.fault == "level" and rank == N and step == 4:
        b["x"] = b["x"][:, :7]
    if a.fault == "bigline" and rank == N and step == 3:
        b["label"][9] = 7
        b["x"] = torch.randn(16384, 8, generator=g)[:16]
        dump = torch.randn(131072, generator=g).tolist()
        log.warning("label out of range in batch at step %d; batch dump: %s", step, ", ".join(f"{v:.4f}" for v in dump))
    if a.fault == "stderrmix" and rank == N and step == 4:
        path = os.path.join(a.workdir, f"cache_rank{rank}_step{step}.pkl")
        open(path, "wb").close()
        with open(path, "rb") as fh:
            b = pickle.load(fh)
    return b


for step in range(1, a.steps + 1):
    t0 = time.time()
    if a.fault in ("fmt", "fmtctl", "fmtsilent") and rank == H and step == 2:
        log.info("step %d loss %.4f lr %.3f", step, 1.0)  # one argument too few
    if a.fault == "logexc" and rank == H and step == 2:
        try:
            open(os.path.join(a.workdir, "class_weights_missing.pt"), "rb")
        except FileNotFoundError:
            log.exception("could not load class weights; using uniform weights")
    if a.fault == "stderrmix" and rank == H and step == 2:
        print(f"ERROR rank {rank}: shard 2 read failed (timeout), retrying shard read (1/3)", file=sys.stderr, flush=True)
    if a.fault == "warnerr" and step == 3:
        lr_t = torch.tensor(0.05)
        lr_t = torch.tensor(lr_t)  # copy-construct: UserWarning
    if a.fault == "sharedfile" and rank == N and step == 4:
        try:
            raise RuntimeError(f"gradient buffer of rank {rank} was resized during the step (expected 196 elements, got 180)")
        except RuntimeError:
            log.exception("step %d failed", step)
            raise
    if a.fault == "basictwice" and rank == N and step == 5:
        cfg = {"lr": 0.05, "warmup": 2}
        _ = cfg["schedule"]
    b = batch(step)
    out = ddp(b["x"])
    loss = F.cross_entropy(out, b["label"])
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)
    log.info("step %d loss %.4f dt_ms %.1f", step, loss.item(), 1000 * (time.time() - t0), extra={"step": step})
    if a.fault == "stderrmix" and step % 3 == 0:
        print(f"rank {rank}: step {step} data wait {3 + rank} ms", file=sys.stderr, flush=True)

dist.barrier()
log.info("rank %d done", rank)
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()

"""A fifty-eighth hand-run batch: HOW SCRIPTS LABEL THEIR RANKS (and don't). A tiny DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, 5 steps) whose per-rank progress output is labelled one of the many
ways real scripts do it (--style), with ONE plain fault on one rank (--fault, --rank) at step 3.

Styles (rank 3 of 8, step 4):
  angle     <3> step 4 loss 0.41           trainer   [trainer 3] step 4 loss 0.41
  frac      (3/8) step 4 loss 0.41         rbar      R3 | step 4 loss 0.41
  gpu       gpu3: step 4 loss 0.41         worker    worker-3 step 4 loss 0.41
  slash     [3/8] step 4 loss 0.41         pad       rank03 step 4 loss 0.41
  RANK      [RANK:3] step 4 loss 0.41      proc      proc 3: step 4 loss 0.41
  bare      3: step 4 loss 0.41            host      [host-a:3] step 4 loss 0.41
  pidmap    logging with %(process)d only; each rank logs one 'pid P -> rank R' line at start
  pid       logging with %(process)d only; the rank is never printed
  file      rank 0 logs to the console (and rank0.log); ranks > 0 log only to rank{R}.log (FileHandler)
  json      structlog-like JSON lines {"rank": 3, "step": 4, "loss": 0.41} on stdout
  tqdm      a tqdm bar per rank, desc=f"rank {rank}" (stderr, not a tty: one line per refresh)

Faults (on --rank N at step 3; errors are reported in the rank's own style where the script reports them):
  exc      ValueError from the sample parser (uncaught)
  shape    rank N's batch has 7 features: the Linear raises RuntimeError (mat1 and mat2 shapes ...)
  nan      rank N's loss is NaN; the script raises FloatingPointError
  osexit   os._exit(3) after an 'out of scratch space' style line, no traceback
  segv     ctypes.string_at(0): SIGSEGV, nothing printed by the rank
  sigkill  a sidecar process (`kill -9 <pid>`) SIGKILLs rank N
  hang     rank N sleeps 3 x pg-timeout before its all-reduce; the others time out in gloo
  logerr   rank N logs an ERROR record in its own style and exits 1 (sys.exit(1), no traceback)
  none     control: every rank finishes
"""
import argparse, ctypes, datetime, json, logging, math, os, subprocess, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--style", required=True)
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
BATCH = 16

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])

LABELS = {
    "angle": "<{r}>", "trainer": "[trainer {r}]", "frac": "({r}/{w})", "rbar": "R{r} |", "gpu": "gpu{r}:",
    "worker": "worker-{r}", "slash": "[{r}/{w}]", "pad": "rank{r:02d}", "RANK": "[RANK:{r}]", "proc": "proc {r}:",
    "bare": "{r}:", "host": "[host-a:{r}]",
}
log = logging.getLogger("train")
bar = None


def setup_output() -> None:
    s = a.style
    if s in ("pidmap", "pid"):
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
        if s == "pidmap":
            log.info("pid %d -> rank %d (world %d)", os.getpid(), RANK, WORLD)
    elif s == "file":
        fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        log.setLevel(logging.INFO)
        fh = logging.FileHandler(f"rank{RANK}.log", mode="w")
        fh.setFormatter(fmt)
        log.addHandler(fh)
        if RANK == 0:
            sh = logging.StreamHandler(sys.stdout)
            sh.setFormatter(fmt)
            log.addHandler(sh)
        log.propagate = False


def say(msg: str, step=None, loss=None, level="info") -> None:
    s = a.style
    if s in LABELS:
        lab = LABELS[s].format(r=RANK, w=WORLD)
        out = sys.stderr if level == "error" else sys.stdout
        print(f"{lab} {'ERROR ' if level == 'error' else ''}{msg}", file=out, flush=True)
    elif s in ("pidmap", "pid", "file"):
        getattr(log, level)(msg)
    elif s == "json":
        rec = {"rank": RANK, "level": level}
        if step is not None:
            rec.update(step=step, loss=round(loss, 4))
        else:
            rec["event"] = msg
        print(json.dumps(rec), flush=True)
    elif s == "tqdm":
        if bar is not None:
            bar.write(f"rank {RANK}: {msg}", file=sys.stderr)
        else:
            print(f"rank {RANK}: {msg}", file=sys.stderr, flush=True)
    else:
        raise SystemExit(f"unknown style {s}")


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * RANK + step)
    feats = 8
    if a.fault == "shape" and RANK == a.rank and step == 3:
        feats = 7  # a shard written before the feature list grew
    x, y = torch.randn(BATCH, feats, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
    if a.fault == "exc" and RANK == a.rank and step == 3:
        raise ValueError(f"sample 37 of shard {RANK}: could not parse label 'n/a'")
    if a.fault == "nan" and RANK == a.rank and step == 3:
        x[3, 5] = float("nan")
    return x, y


def main() -> None:
    global bar
    setup_output()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    say(f"world {WORLD} backend gloo, {a.steps} steps")
    steps = range(1, a.steps + 1)
    if a.style == "tqdm":
        from tqdm import tqdm
        bar = tqdm(total=a.steps, desc=f"rank {RANK}", position=RANK, mininterval=0, ascii=True)
    for step in steps:
        time.sleep(0.05)
        if RANK == a.rank and step == 3:
            f = a.fault
            if f == "osexit":
                say("no space left on scratch for the step-3 activations dump, giving up", level="error")
                os._exit(3)
            if f == "segv":
                ctypes.string_at(0)
            if f == "sigkill":
                subprocess.Popen(["kill", "-9", str(os.getpid())])
                time.sleep(10)
            if f == "hang":
                time.sleep(3 * a.pg_timeout)
            if f == "logerr":
                say(f"step {step}: gradient buffer checksum mismatch, aborting", level="error")
                sys.exit(1)
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}")
        loss.backward()
        opt.step()
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update(1)
        else:
            say(f"step {step} loss {loss.item():.4f}", step=step, loss=loss.item())
    if bar is not None:
        bar.close()
    dist.barrier()
    dist.destroy_process_group()
    say("done")


if __name__ == "__main__":
    main()

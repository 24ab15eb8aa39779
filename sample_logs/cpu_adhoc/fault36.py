"""A thirty-sixth hand-run batch: HOW THE ERROR IS PRINTED. A small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4),
batches of {"x", "y"} dicts, MSE, SGD, --steps steps, process-group timeout --pg-timeout s) with ONE ordinary fault on
rank --rank at step --step, where what varies is the renderer that prints the error and the progress (--render).

Faults (--fault): key (the batch holds 'labels', not 'y': KeyError), shape (a 7-feature batch: mat1/mat2 RuntimeError),
zerodiv (a per-rank mean over 0 valid samples in Python ints), fnf (the rank's shard file is missing), assert (a batch
size check), nan (loss set to NaN and raised as FloatingPointError), stall (sleeps 30 s before the step's all-reduce:
the others time out), segv (ctypes.string_at(0)), none (no fault).

Renderers (--render): plain, rich (rich.traceback.install()), rich_locals (show_locals=True), richlog (RichHandler
progress + rich tracebacks), logexc (logging; main's caller does logger.exception('step failed'); sys.exit(1)),
logfmt_every (a Formatter prefixing rank and time to EVERY line, traceback too), logfmt_first (prefix on the first
line only), json (one JSON record per line, the traceback in 'exc_info'), loguru (logger.exception), loguru_catch
(@logger.catch, backtrace and diagnose on), color (ANSI colours on every record and the traceback), fh
(faulthandler.enable()), fh_later (faulthandler.dump_traceback_later(20, exit=True) before the step), hook (a
sys.excepthook printing one summary line), hydra (Hydra-style 'Error executing job with overrides'), ctrl_log (an
optional eval hook fails, caught and logged with logger.exception; the run finishes), ctrl_rich (a handled
exception rendered by rich's Console.print_exception as a warning; the run finishes).
"""
import argparse, ctypes, datetime, faulthandler, json, logging, math, os, sys, time, traceback
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="key")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--step", type=int, default=3)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--render", default="plain")
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
RANK = int(os.environ.get("RANK", "0"))
BATCH = 16
R = a.render

log = logging.getLogger("train")
console = None
if R in ("rich", "rich_locals", "richlog", "ctrl_rich"):
    import rich.traceback
    from rich.console import Console
    console = Console(stderr=True)
    if R != "ctrl_rich":
        rich.traceback.install(show_locals=(R == "rich_locals"))
    if R == "richlog":
        from rich.logging import RichHandler
        logging.basicConfig(level=logging.INFO, format=f"[rank{RANK}] %(message)s", datefmt="[%X]",
                            handlers=[RichHandler(rich_tracebacks=True)])
elif R in ("logexc", "ctrl_log", "logfmt_first"):
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [rank{RANK}] %(name)s: %(message)s")
elif R == "logfmt_every":
    class EveryLine(logging.Formatter):
        def format(self, record):
            s = super().format(record)
            head = f"{self.formatTime(record)} {record.levelname:<7} [rank {RANK}] "
            return "\n".join(head + line for line in s.splitlines())
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(EveryLine("%(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[h])
elif R == "color":
    COL = {"DEBUG": "\033[36m", "INFO": "\033[32m", "WARNING": "\033[33m", "ERROR": "\033[31m", "CRITICAL": "\033[1;31m"}
    class Colored(logging.Formatter):
        def format(self, record):
            s = super().format(record)
            return f"{COL.get(record.levelname, '')}{s}\033[0m"
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(Colored(f"%(asctime)s \033[1m%(levelname)-8s\033[22m rank{RANK} %(name)s | %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[h])
elif R == "json":
    class Json(logging.Formatter):
        def format(self, record):
            d = {"ts": datetime.datetime.fromtimestamp(record.created).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "rank": RANK, "logger": record.name, "msg": record.getMessage()}
            if record.exc_info:
                d["exc_info"] = self.formatException(record.exc_info)
            return json.dumps(d)
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(Json())
    logging.basicConfig(level=logging.INFO, handlers=[h])
elif R in ("loguru", "loguru_catch"):
    from loguru import logger as log
    log.remove()
    log.add(sys.stderr, backtrace=True, diagnose=True, colorize=False,
            format="{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <8} | rank" + str(RANK) + " | {name}:{function}:{line} - {message}")
elif R == "fh":
    faulthandler.enable()
elif R == "hook":
    def hook(tp, val, tb):
        fr = traceback.extract_tb(tb)[-1]
        sys.stderr.write(f"[rank {RANK}] FATAL {val!r} at {os.path.basename(fr.filename)}:{fr.lineno}\n")
        sys.stderr.flush()
    sys.excepthook = hook

USES_LOG = R in ("richlog", "logexc", "ctrl_log", "logfmt_first", "logfmt_every", "color", "json", "loguru", "loguru_catch")


def say(msg: str) -> None:
    if USES_LOG:
        log.info(msg)
    elif console is not None:
        console.log(f"[rank {RANK}] {msg}")
    else:
        print(f"[rank {RANK}] {msg}", flush=True)


def batch_for(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, 8, generator=g)
    b = {"x": x, "y": x[:, :4] * 0.5 + 0.1}
    if a.fault == "key" and rank == a.rank and step == a.step:
        b = {"x": x, "labels": b["y"]}
    if a.fault == "shape" and rank == a.rank and step == a.step:
        b["x"] = torch.randn(BATCH, 7, generator=g)
    if a.fault == "assert" and rank == a.rank and step == a.step:
        b = {"x": x[:BATCH - 5], "y": b["y"][:BATCH - 5]}
    return b


def load_shard(rank: int, step: int) -> None:
    if a.fault == "fnf" and rank == a.rank and step == a.step:
        path = os.path.join(os.getcwd(), "data", f"train-{rank:05d}-of-{int(os.environ['WORLD_SIZE']):05d}.bin")
        with open(path, "rb") as f:
            f.read(16)


def valid_mean(values, mask) -> float:
    total = sum(v for v, m in zip(values, mask) if m)
    n_valid = sum(1 for m in mask if m)
    return total / n_valid


def train_step(model, opt, rank: int, step: int) -> float:
    load_shard(rank, step)
    b = batch_for(rank, step)
    assert b["x"].shape[0] == BATCH, f"batch size {b['x'].shape[0]} != {BATCH} on rank {rank}"
    out = model(b["x"])
    loss = F.mse_loss(out, b["y"])
    if a.fault == "zerodiv" and rank == a.rank and step == a.step:
        acc = valid_mean([1.0] * BATCH, [0] * BATCH)
    if a.fault == "nan" and rank == a.rank and step == a.step:
        loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}")
    if a.fault == "stall" and rank == a.rank and step == a.step:
        if R == "fh_later":
            faulthandler.dump_traceback_later(20, exit=True)
        say(f"step {step}: syncing shard cache before all-reduce")
        time.sleep(30)
    if a.fault == "segv" and rank == a.rank and step == a.step:
        ctypes.string_at(0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def optional_eval(rank: int, step: int) -> None:
    """An optional eval hook (controls): it fails on rank --rank at --step and is caught."""
    if rank == a.rank and step == a.step:
        metrics = {"loss": 0.1}
        return metrics["bleu"]


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    say(f"world {world}, {a.steps} steps")
    for step in range(1, a.steps + 1):
        loss = train_step(model, opt, rank, step)
        say(f"step {step}/{a.steps} loss {loss:.4f}")
        if R in ("ctrl_log", "ctrl_rich"):
            try:
                optional_eval(rank, step)
            except Exception:
                if R == "ctrl_log":
                    log.exception(f"optional eval hook failed at step {step}; continuing without it")
                else:
                    console.print(f"[bold yellow]WARNING[/] [rank {rank}] optional eval hook failed at step {step}; continuing")
                    console.print_exception()
        time.sleep(0.05)
    dist.barrier()
    say("training finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    if R in ("logexc", "logfmt_every", "logfmt_first", "color", "json", "loguru"):
        try:
            main()
        except Exception:
            log.exception("step failed")
            sys.exit(1)
    elif R == "loguru_catch":
        log.catch(main)()
    elif R == "hydra":
        try:
            main()
        except Exception as e:
            sys.stderr.write("Error executing job with overrides: ['lr=0.1', 'trainer.steps=%d']\n" % a.steps)
            tb = traceback.format_exception(e)
            sys.stderr.write(tb[0] + "".join(tb[2:]))
            sys.stderr.write("\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")
            sys.stderr.flush()
            sys.exit(1)
    else:
        main()

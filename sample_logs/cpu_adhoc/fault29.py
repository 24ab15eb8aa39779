"""A twenty-ninth hand-run batch: the script HANDLES (or mishandles) the failure itself, amid noisy output.

A small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), a DataLoader over a synthetic per-rank shard of
{"x", "y"} dicts, 6 steps of 16, a short sleep per step) whose output is noisy as real jobs are: Python logging on
every rank with a timestamped format (--log-format), a tqdm bar on every rank or rank 0 only (--bar), a repeated
UserWarning on every rank at start, and a metrics line per step (--metrics json | text).

The fault hits rank --rank at step 3 (--kind: key = the batch has 'label' instead of 'y' -> KeyError: 'y';
value = a CSV-like field 'n/a' -> ValueError; shape = the batch has 7 features -> RuntimeError mat1 and mat2 shapes),
and the script handles it as --fault says:
  logexc_exit       logger.exception("training failed"), then sys.exit(1)
  logerr_exit       logger.error(f"step failed: {e}") (message only, no traceback), then sys.exit(2)
  logerr_osexit     logger.error(f"step failed: {e}"), then os._exit(1)
  wrap_from         raise RuntimeError(f"rank {rank}: batch {i} failed") from e  (explicit chain)
  except_fails      the except block reports to a tracker that was never set up: AttributeError (implicit chain)
  except_barrier    the except block calls dist.barrier() "to sync before abort"; the others are in DDP's
                    all-reduce; the barrier times out (implicit chain)
  printexc_continue traceback.print_exc(), then continue with the next step (one collective fewer than the others)
  printexc_break    traceback.print_exc(), then break out of the loop; the rank finishes and returns (exit 0)
  finally_destroy   the exception propagates through try/finally: dist.destroy_process_group()
  finally_barrier   the exception propagates through try/finally: dist.barrier()
  emergency_ckpt    an on_exception hook saves an emergency checkpoint with torch.save to --ckpt-dir, then re-raises
                    (with the default --ckpt-dir the directory does not exist and the save itself fails)
  sigterm_handler   every rank installs a SIGTERM handler ("received SIGTERM, saving checkpoint") and an atexit hook;
                    the fault propagates uncaught
  nan_raise         rank's step-3 batch holds a NaN; the loss check logs an error and raises FloatingPointError
  nan_warn_shape    rank's step-2 batch holds a NaN; the loss check only warns ("skipping nothing") and training goes on
                    (every rank's loss is NaN after the all-reduce); at step 5 the rank's batch has 7 features
  memerr_retry      rank's step-3 prefetch buffer raises MemoryError; caught, retried with half the batch, which then
                    fails: ValueError Expected input batch_size (8) to match target batch_size (16)

v2 adds --end-barrier: every rank waits in dist.barrier() after the loop (so a rank that skipped or left the loop
waits there, alive, instead of exiting). Without it the script runs exactly as v1.
"""
import argparse, atexit, datetime, json, logging, math, os, signal, sys, time, traceback, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--kind", choices=["key", "value", "shape"], default="key")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--log-format", choices=["rankdash", "norank", "pipe", "rich"], default="rankdash")
p.add_argument("--bar", choices=["all", "rank0"], default="all")
p.add_argument("--metrics", choices=["json", "text"], default="json")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--ckpt-dir", default="/mnt/ckpt/emergency")
p.add_argument("--end-barrier", action="store_true", help="(v2) every rank waits in dist.barrier() after the loop")
a = p.parse_args()
BATCH = 16
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def setup_logging() -> logging.Logger:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    if a.log_format == "rich":
        from rich.console import Console
        from rich.logging import RichHandler
        h = RichHandler(console=Console(force_terminal=True, stderr=True))
        h.setFormatter(logging.Formatter(f"[rank {RANK}] %(message)s"))
    else:
        fmt = {"rankdash": f"%(asctime)s - %(name)s - %(levelname)s - [rank {RANK}] %(message)s",
               "norank": "%(asctime)s %(levelname)s %(name)s: %(message)s",
               "pipe": f"%(asctime)s | Rank {RANK} | %(levelname)s | %(message)s"}[a.log_format]
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(fmt))
    root.addHandler(h)
    return logging.getLogger("trainer")


log = setup_logging()


class Shard(torch.utils.data.Dataset):
    def __init__(self, rank: int):
        self.rank = rank

    def __len__(self):
        return BATCH * a.steps

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        x, y = torch.randn(8, generator=g), int(torch.randint(0, 4, (1,), generator=g))
        return {"x": x, "y": y}


def inject(step: int, batch: dict) -> dict:
    """The fault this rank meets at this step (the batch it gets instead)."""
    if RANK != a.rank:
        return batch
    f = a.fault
    if f == "nan_warn_shape":
        if step == 2:
            x = batch["x"].clone(); x[3, 5] = float("nan")
            return {"x": x, "y": batch["y"]}
        if step == 5:
            return {"x": batch["x"][:, :7], "y": batch["y"]}
        return batch
    if step != 3 or f == "memerr_retry":
        return batch
    if f == "nan_raise":
        x = batch["x"].clone(); x[3, 5] = float("nan")
        return {"x": x, "y": batch["y"]}
    if a.kind == "key":
        return {"x": batch["x"], "label": batch["y"]}  # this shard file was written with another schema
    if a.kind == "value":
        row = ["0.12"] * 7 + ["n/a"]  # a CSV-like row with a missing value
        x = batch["x"].clone(); x[2] = torch.tensor([float(v) for v in row])
        return {"x": x, "y": batch["y"]}
    return {"x": batch["x"][:, :7], "y": batch["y"]}


def train_step(model, opt, step: int, batch: dict) -> float:
    batch = inject(step, batch)
    x, y = batch["x"], batch["y"]
    if a.fault == "memerr_retry" and RANK == a.rank and step == 3:
        try:
            prefetch = bytearray(1 << 46)  # pinned prefetch buffer for the next shard  # noqa: F841
        except MemoryError:
            log.warning("MemoryError allocating the prefetch buffer at step 3; retrying with batch size %d",
                        BATCH // 2)
            x = x[: BATCH // 2]
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if not math.isfinite(loss.item()):
        if a.fault == "nan_warn_shape":
            log.warning("non-finite loss %s at step %d; continuing (loss scaler will recover)", loss.item(), step)
        else:
            log.error("non-finite loss %s at step %d", loss.item(), step)
            raise FloatingPointError(f"loss is {loss.item()} at step {step}")
    loss.backward()
    opt.step()
    return loss.item()


class Tracker:
    pass


def on_exception(model, step: int, e: BaseException) -> None:
    """A framework-like hook: save an emergency checkpoint on the failing rank, then re-raise."""
    path = os.path.join(a.ckpt_dir, f"emergency_rank{RANK}_step{step}.pt")
    log.error("exception at step %d (%s); saving emergency checkpoint to %s", step, type(e).__name__, path)
    torch.save({"model": model.module.state_dict(), "step": step}, path)
    log.error("emergency checkpoint saved to %s", path)


def main() -> int:
    if a.fault == "sigterm_handler":
        def on_term(signum, frame):
            log.warning("received SIGTERM, saving checkpoint before exit")
            sys.exit(128 + signum)
        signal.signal(signal.SIGTERM, on_term)
        atexit.register(lambda: log.info("atexit: flushing metrics writer"))
    warnings.simplefilter("always", UserWarning)
    for _ in range(2):
        warnings.warn("gradient_accumulation_steps not set; defaulting to 1", UserWarning)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    log.info("world %d rank %d started; %d steps of %d", WORLD, RANK, a.steps, BATCH)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Shard(RANK), batch_size=BATCH)
    it = loader
    if a.bar == "all" or RANK == 0:
        from tqdm import tqdm
        it = tqdm(loader, desc=f"rank {RANK} train", total=len(loader), mininterval=0)
    tracker = None
    try:
        for step, batch in enumerate(it, start=1):
            if a.fault in ("finally_destroy", "finally_barrier", "sigterm_handler", "nan_raise", "nan_warn_shape",
                           "memerr_retry"):
                loss = train_step(model, opt, step, batch)  # the fault propagates
            else:
                try:
                    loss = train_step(model, opt, step, batch)
                except Exception as e:
                    f = a.fault
                    if f == "logexc_exit":
                        log.exception("training failed")
                        sys.exit(1)
                    if f == "logerr_exit":
                        log.error(f"step failed: {e}")
                        sys.exit(2)
                    if f == "logerr_osexit":
                        log.error(f"step failed: {e}")
                        logging.shutdown()
                        os._exit(1)
                    if f == "wrap_from":
                        raise RuntimeError(f"rank {RANK}: batch {step} failed") from e
                    if f == "except_fails":
                        tracker.log({"event": "step_failed", "step": step, "error": repr(e)})
                        raise
                    if f == "except_barrier":
                        log.warning("step %d failed; syncing ranks before abort", step)
                        dist.barrier()
                        raise
                    if f == "printexc_continue":
                        traceback.print_exc()
                        continue
                    if f == "printexc_break":
                        traceback.print_exc()
                        break
                    if f == "emergency_ckpt":
                        on_exception(model, step, e)
                        raise
                    raise
            if a.metrics == "json":
                print(json.dumps({"step": step, "loss": round(loss, 4), "rank": RANK}), flush=True)
            else:
                print(f"step {step} | loss {loss:.4f}", flush=True)
            time.sleep(0.2)
    finally:
        if a.fault == "finally_destroy":
            log.info("cleaning up process group")
            dist.destroy_process_group()
        if a.fault == "finally_barrier":
            log.info("waiting for all ranks before exit")
            dist.barrier()
    if a.end_barrier:
        log.info("waiting for all ranks at the end of training")
        dist.barrier()
    log.info("training finished")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

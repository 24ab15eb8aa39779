"""A sixty-seventh hand-run batch: CHAINED AND GROUPED EXCEPTIONS on one rank. A tiny DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, batch 8, 5 steps, a 0.1 s sleep per step, PG timeout 15 s, no @record);
every rank prints `rank R step S loss L`. At step --step (default 3) rank --rank fails with an exception that carries
others (or, for `every`, every rank does).

Faults (--fault):
  from       the batch lookup raises KeyError: 'labels'; the step wraps it: raise RuntimeError("step 3 failed") from err
  during     a ValueError from the sample parser; the except block's error report itself fails (TypeError from a
             format with a None), so "During handling of the above exception, another exception occurred"
  fromnone   a KeyError from the batch lookup, re-raised as raise RuntimeError(...) from None (the cause suppressed)
  group      a prefetch of the step's shards runs in an asyncio.TaskGroup; one task raises FileNotFoundError
             (the ExceptionGroup box, one sub-exception)
  group2     the same with two failing tasks: FileNotFoundError and a ValueError 10 ms later (the TaskGroup cancels
             the second task when the first fails: one sub-exception in the log)
  groupmany  two failing tasks that fail before their first await: both collected (two sub-exceptions)
  exceptstar the step raises ExceptionGroup("batch validation", [ValueError, IndexError]); an `except* IndexError`
             handler re-raises as RuntimeError, the ValueError part propagates
  note       ValueError with add_note() notes (the rank, shard, sample and a hint)
  multiline  a custom DataValidationError whose message spans several lines (a table of bad fields)
  deep       a chain three deep: json.JSONDecodeError (a sample record) -> DatasetError -> TrainerError
  finally    an IndexError in the step; the finally block's cleanup (os.remove of the step's spill file, already gone)
             raises FileNotFoundError while the IndexError is in flight
  exitstack  a ZeroDivisionError (a normaliser with zero count) inside `with ExitStack()`; the stack's metrics
             flush callback raises RuntimeError on exit
  kbint      a KeyError; the except block waits to retry, and a SIGINT (sent to this rank's own pid, standing in for a
             Ctrl-C on that process) arrives: KeyboardInterrupt during the handling of the KeyError
  every      every rank: KeyError: 'labels' -> RuntimeError("step 3 failed") from err
  caught     control: rank --rank's step raises the `from` chain; the loop catches it, logs it with
             logging.exception (the whole chain printed) and skips the batch; training goes on, exit 0
  none       control: no fault, exit 0
"""
import argparse, asyncio, contextlib, datetime, json, logging, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--step", type=int, default=3)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
log = logging.getLogger("trainer")


class DataValidationError(Exception):
    pass


class DatasetError(Exception):
    pass


class TrainerError(Exception):
    pass


def lookup(batch: dict, key: str):
    return batch[key]


def parse_sample(text: str) -> float:
    return float(text)


def decode_record(raw: str) -> dict:
    return json.loads(raw)


async def fetch_shard(i: int, bad: set, eager: bool = False):
    if not eager:
        await asyncio.sleep(0.01 * (i + 1))
    if i in bad:
        if i % 2 == 1:
            raise FileNotFoundError(2, "No such file or directory", f"/data/shards/train-{i:05d}.bin")
        raise ValueError(f"shard {i}: header says 4096 records, index says 4095")
    return i


async def prefetch(shards, bad, eager=False):
    async with asyncio.TaskGroup() as tg:
        for i in shards:
            tg.create_task(fetch_shard(i, bad, eager))


def fail(kind: str, rank: int, step: int) -> None:
    batch = {"inputs": torch.randn(8, 8), "targets": torch.zeros(8, dtype=torch.long)}
    if kind in ("from", "every", "caught"):
        try:
            lookup(batch, "labels")
        except KeyError as err:
            raise RuntimeError(f"step {step} failed") from err
    if kind == "during":
        try:
            parse_sample("0.5e")
        except ValueError:
            shard = None  # the shard id was never set on this code path
            log.error("bad sample in shard %05d" % shard)
            raise
    if kind == "fromnone":
        try:
            lookup(batch, "labels")
        except KeyError:
            raise RuntimeError(f"step {step}: the batch has no labels (keys: inputs, targets)") from None
    if kind in ("group", "group2"):
        bad = {4 * rank + 1} if kind == "group" else {4 * rank + 1, 4 * rank + 2}
        asyncio.run(prefetch(range(4 * rank, 4 * rank + 4), bad))
    if kind == "groupmany":  # both bad shards fail before their first await: the TaskGroup collects both
        asyncio.run(prefetch(range(4 * rank, 4 * rank + 4), {4 * rank + 1, 4 * rank + 2}, eager=True))
    if kind == "exceptstar":
        try:
            raise ExceptionGroup("batch validation", [ValueError("sample 3: 7 features, expected 8"),
                                                      IndexError("label 9 out of range for 4 classes")])
        except* IndexError as eg:
            raise RuntimeError(f"step {step}: labels out of range") from eg.exceptions[0]
    if kind == "note":
        e = ValueError("could not convert string to float: 'n/a'")
        e.add_note(f"while reading rank {rank} shard {rank:05d}, sample {8 * step + 3}")
        e.add_note("hint: run tools/validate_shards.py on the shard folder")
        raise e
    if kind == "multiline":
        raise DataValidationError(
            f"batch {step} on rank {rank} failed validation:\n"
            "  field      expected    got\n"
            "  inputs     float32     float32\n"
            "  targets    int64       float64\n"
            "  mask       present     missing\n"
            "fix the preprocessing step or pass --skip-invalid")
    if kind == "deep":
        try:
            try:
                decode_record('{"tokens": [1, 2, 3], "label": 1')
            except json.JSONDecodeError as err:
                raise DatasetError(f"record {8 * step + 5} of shard train-{rank:05d}.jsonl is corrupt") from err
        except DatasetError as err:
            raise TrainerError(f"training step {step} aborted on rank {rank}") from err
    if kind == "finally":
        spill = f"/tmp/fault67_spill_rank{rank}_step{step}.pt"
        try:
            idx = torch.tensor([0, 1, 9])
            _ = batch["inputs"][idx[2].item()]
        finally:
            os.remove(spill)
    if kind == "exitstack":
        def flush_metrics():
            raise RuntimeError("metrics writer: flush failed, writer already closed")
        with contextlib.ExitStack() as stack:
            stack.callback(flush_metrics)
            count = 0
            _ = 1 / count
    if kind == "kbint":
        try:
            lookup(batch, "labels")
        except KeyError:
            print(f"rank {rank} step {step}: batch lookup failed, retrying in 5 s", flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            raise


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [%(levelname)s] [rank{rank}] %(name)s: %(message)s")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1, a.steps + 1):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        hit = step == a.step and (a.fault == "every" or (a.fault != "none" and rank == a.rank))
        if hit:
            if a.fault == "caught":
                try:
                    fail(a.fault, rank, step)
                except RuntimeError:
                    log.exception("step %d: skipping the batch", step)
                    x, y = torch.zeros(8, 8), torch.zeros(8, dtype=torch.long)
            else:
                fail(a.fault, rank, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.1)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

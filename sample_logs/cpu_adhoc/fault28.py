"""A twenty-eighth hand-run batch: RESTARTS. Faults that torchrun --max-restarts K restarts the workers after, on
4-8 ranks; what each attempt does is decided from TORCHELASTIC_RESTART_COUNT (printed in every progress line as
`attempt A rank R step S loss L`). The loop is the twenty-second batch's (Linear(8,16)-ReLU-Linear(16,4) under DDP,
a DataLoader over a synthetic shard of {"x", "y"} dicts, a finite-loss check; main under @record), with a per-rank
checkpoint saved at step 2 and, in a restarted attempt, resumed from it for the resume faults.

Faults (--rank N: the rank at fault in attempt 0; --rank2 M: the rank at fault in later attempts):
  recur_key       every attempt: rank N's step-3 batch comes from a shard written with the key 'labels' (KeyError: 'y')
  recur_segv      every attempt: rank N SIGSEGVs itself at step 3 (stands in for a native extension's crash)
  rotate_key      the bad shard is shard N; shards are reassigned each attempt (shard = (rank + attempt) % world), so
                  the rank that reads it (KeyError: 'y') is (N - attempt) % world
  once_key        attempt 0 only: rank N's KeyError: 'y'; the restart finishes
  once_sigkill    attempt 0 only: rank N SIGKILLs itself at step 3; the restart finishes
  diff_nan        attempt 0: rank N KeyError: 'y'; later attempts: rank M's step-3 batch holds a NaN feature and the
                  loss check raises FloatingPointError
  hang_after_exc  attempt 0: rank N raises ValueError (a bad sample); later attempts: rank M sleeps 45 s at step 3
                  (waiting on a shared-storage lock) and the others time out in DDP's all-reduce
  resume_size     every rank saves its EMA copy at step 2 (rank N's from a hidden=32 model); attempt 0: rank N then
                  raises KeyError at step 3; later attempts resume from the copies: rank N's load_state_dict fails
                  (size mismatch)
  resume_missing  attempt 0: every rank saves at step 2, rank N's file is then removed (scratch cleaned) and rank N
                  is SIGKILLed at step 3; later attempts resume: rank N's torch.load raises FileNotFoundError
  resume_trunc    attempt 0: every rank saves at step 3, rank N writes half its file and is SIGKILLed (killed
                  mid-write); later attempts resume: rank N's torch.load fails on the cut zip archive
  kill_then_exc   attempt 0: rank N SIGKILLs (--crash kill) or SIGSEGVs (--crash segv) itself at step 3; later attempts:
                  rank M's step-3 batch has a field 'n/a' (ValueError: could not convert string to float: 'n/a')
  startup_import  every attempt, before init_process_group: rank N (the metrics rank) imports wandb, not installed
  startup_env     every attempt, before init_process_group: the rank reads its loader worker count from
                  LOADER_WORKERS_PER_RANK (comma list, one per local rank); the entry for rank N is 'auto'
"""
import argparse, datetime, io, math, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--rank2", type=int, default=-1)
p.add_argument("--crash", choices=["kill", "segv"], default="kill")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--ckdir", default="/tmp/fault28_ckpt")
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def say(rank: int, msg: str) -> None:
    print(f"attempt {ATTEMPT} rank {rank} {msg}", flush=True)


def bad_here(rank: int, world: int) -> str:
    """Which fault this rank meets in this attempt ('' for none)."""
    f, n, m = a.fault, a.rank, a.rank2
    if f in ("recur_key", "recur_segv"):
        return f if rank == n else ""
    if f == "rotate_key":
        return "key" if (rank + ATTEMPT) % world == n else ""
    if f in ("once_key", "once_sigkill"):
        return f if ATTEMPT == 0 and rank == n else ""
    if f in ("diff_nan", "hang_after_exc", "kill_then_exc"):
        if ATTEMPT == 0:
            return "first" if rank == n else ""
        return "later" if rank == m else ""
    if f in ("resume_size", "resume_missing", "resume_trunc"):
        return "first" if ATTEMPT == 0 and rank == n else ""
    return ""


class Shard(torch.utils.data.Dataset):
    def __init__(self, rank: int, shard: int, bad: str, n: int):
        self.rank, self.shard, self.bad, self.n = rank, shard, bad, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * self.shard + i)
        x, y = torch.randn(8, generator=g), int(torch.randint(0, 4, (1,), generator=g))
        late = bool(self.bad) and i >= 2 * BATCH  # step 3's batch
        f = a.fault
        if late and (f in ("recur_key", "rotate_key", "once_key")
                     or (f in ("diff_nan", "resume_size") and self.bad == "first")):
            return {"x": x, "labels": y}  # this shard file was written with another schema
        if late and f == "diff_nan" and self.bad == "later" and i == 2 * BATCH + 3:
            x = x.clone()
            x[5] = float("nan")
        if late and f == "hang_after_exc" and self.bad == "first" and i == 2 * BATCH + 7:
            raise ValueError(f"sample {i} of shard {self.shard}: expected 8 features, got 7")
        if late and f == "kill_then_exc" and self.bad == "later" and i == 2 * BATCH + 2:
            row = ["0.12"] * 7 + ["n/a"]  # a CSV-like row with a missing value
            x = torch.tensor([float(v) for v in row])
        return {"x": x, "y": y}


def ckpt_path(rank: int) -> str:
    return f"{a.ckdir}/rank{rank}.pt"


def save_cut(obj, path: str) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 2])
        fh.flush()
        os.fsync(fh.fileno())
    os.kill(os.getpid(), signal.SIGKILL)  # stands in for the OOM killer hitting the process mid-write


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if a.fault == "startup_import" and rank == a.rank:
        import wandb  # noqa: F401  # the metrics rank reports to the tracker
    workers = 0
    if a.fault == "startup_env":
        workers = int(os.environ.get("LOADER_WORKERS_PER_RANK", "0").split(",")[local_rank])
    dist.init_process_group("gloo", timeout=TIMEOUT)
    bad = bad_here(rank, world)
    shard = (rank + ATTEMPT) % world if a.fault == "rotate_key" else rank
    say(rank, f"world {world} shard {shard} building model (max restarts {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')})")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    resume = a.fault.startswith("resume_") and ATTEMPT > 0
    if resume:
        say(rank, f"resuming from {ckpt_path(rank)}")
        state = torch.load(ckpt_path(rank))
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        say(rank, f"resumed at step {state['step']}")
    loader = torch.utils.data.DataLoader(Shard(rank, shard, bad, BATCH * a.steps), batch_size=BATCH,
                                         num_workers=workers)
    os.makedirs(a.ckdir, exist_ok=True)
    for step, batch in enumerate(loader, start=1):
        if bad in ("recur_segv",) and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if step == 3 and bad in ("once_sigkill",):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 3 and a.fault == "resume_missing" and bad == "first":
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 3 and a.fault == "kill_then_exc" and bad == "first":
            os.kill(os.getpid(), signal.SIGKILL if a.crash == "kill" else signal.SIGSEGV)
        if step == 3 and a.fault == "hang_after_exc" and bad == "later":
            say(rank, "waiting for the shared-storage lock before writing shard stats")
            time.sleep(3 * a.pg_timeout)
        x, y = batch["x"], batch["y"]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}, stopping")
        loss.backward()
        opt.step()
        if a.fault.startswith("resume_") and ATTEMPT == 0:
            if step == 2 and a.fault in ("resume_size", "resume_missing"):
                sd = model.module.state_dict()
                if a.fault == "resume_size" and bad:  # this rank's copy came from the wide-head experiment
                    sd = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).state_dict()
                torch.save({"model": sd, "opt": opt.state_dict(), "step": step}, ckpt_path(rank))
                say(rank, f"saved {ckpt_path(rank)}")
                if a.fault == "resume_missing" and bad:
                    os.remove(ckpt_path(rank))  # node-local scratch cleaned by another job
            if step == 3 and a.fault == "resume_trunc":
                obj = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
                if bad:
                    save_cut(obj, ckpt_path(rank))
                torch.save(obj, ckpt_path(rank))
                say(rank, f"saved {ckpt_path(rank)}")
        say(rank, f"step {step} loss {loss.item():.4f}")
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    main()

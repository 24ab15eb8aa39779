"""fault633.py - batch 633: a tiny "cassowary seed dispersal" regression job (gloo, CPU only).

Each rank reads its shard of synthetic fruit records (/tmp/fault633_work/shard<R>.pt), maps every
record's plant species through a JSON lookup table (species.json -> seed weight), and fits a Linear
model predicting seed dispersal distance (km). Gradients are all-reduced by hand (no DDP), 6 steps,
every rank prints `rank R step S loss L dispersal_km M`, rank 0 saves an export at the end.
`--prepare` writes the shards, the lookup table and the start checkpoint.

Faults (--fault NAME --rank N; "all" faults plant on every rank):
  none            control run
  dl_then_size    rank N's DataLoader worker raises at step 2; rank N+1 sleeps 1 s, all_reduces another size
  stall_raise     rank N sleeps past the pg timeout at step 2; rank N-1 raises ValueError 4 s later
  warn_ckpt       every rank warns each step (deprecation, DataLoader UserWarning, gloo env notice);
                  rank N fails loading a checkpoint (size mismatch) at step 4
  retry_keyerr    rank N's shard read fails once (logged with traceback, retried, works);
                  rank N+1 then hits a KeyError in the lookup table at step 3
  chained         rank N's data error re-raised as RuntimeError(...) from err inside a helper (step 2)
  finally_save    rank N raises at step 3; its `finally` saves to /dev/full and fails too
  same_early      every rank raises the same ValueError at step 4, rank N at step 3
  skip_coll       rank N logs an unrelated ERROR line at step 1, goes on, then skips the step-3 all_reduce
  restart         attempt 0: rank N KeyError at step 2; attempt 1: rank N missing shard at start
  sigkill_workers rank N SIGKILLs itself at step 3 while its 2 DataLoader workers are alive
  lazy_import     rank N lazily imports a missing module at step 3
  nan_detect      rank N's loss becomes NaN at step 3: it raises FloatingPointError, the others print nan
  sys_exit        rank N logs an ERROR line, then sys.exit("...") at step 2

Runs (one line per log):
  cassowary_chained_np3_r1_files: rank 1 RuntimeError from ValueError at step 2; ranks 0,2 connection closed
  cassowary_sys_exit_np3_r2_mpitag: rank 2 ERROR line then sys.exit message at step 2; ranks 0,1 connection closed
  cassowary_nan_detect_np4_r3_logfmt: rank 3 FloatingPointError at step 3; 0,2 connection closed, 1 gloo timeout
  cassowary_finally_save_np3_r2_spawn: rank 2 ZeroDivisionError, finally save to /dev/full fails too; spawn SIGTERMs
  cassowary_none_np3_rnone_bashloop: control, 6 steps on all ranks, export saved, exit 0
  cassowary_sigkill_workers_np4_r3_pdsh2: rank 3 SIGKILL with 2 workers alive; agent root cause -9; no worker errors
  cassowary_same_early_np3_r1_legacy: rank 1 ValueError at step 3; others lose peer before their own step-4 raise
  cassowary_restart_np3_r1_tee: attempt 0 rank 1 KeyError, attempt 1 rank 1 missing shard; agent names rank 0
  cassowary_lazy_import_np3_r2_ranklabel: rank 2 ModuleNotFoundError at step 3; ranks 0,1 connection closed
  cassowary_retry_keyerr_np3_r0_srunlabel: rank 0 read error logged+retried; rank 1 KeyError at step 3
  cassowary_stall_raise_np3_r1_bashloop: rank 1 stalls, rank 0 ValueError 4 s later; rank 2 gloo 12 s timeout
  cassowary_dl_then_size_np3_r0_ranklabel: rank 0 DataLoader worker IndexError; rank 1 size-7 all_reduce conn closed
  (slot 13)
  (slot 14)
  (slot 15)
  (slot 16)
  (slot 17)
  (slot 18)
  (slot 19)
  (slot 20)
  (slot 21)
  (slot 22)
"""
import argparse
import datetime
import json
import logging
import os
import signal
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault633_work"
SPECIES = ["quandong", "blue_fig", "davidson_plum", "cassowary_plum", "black_walnut", "lilly_pilly"]
A = None
LOG = None


def out(rank, msg, level="INFO"):
    if A.logfmt:
        LOG.log(getattr(logging, level), msg)
    elif level in ("ERROR", "WARNING"):
        print(f"{level} rank {rank}: {msg}", file=sys.stderr, flush=True)
    else:
        print(msg, flush=True)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(633)
    for r in range(world):
        n = 48
        feats = torch.rand(n, 4, generator=g)
        sp = [SPECIES[i % len(SPECIES)] for i in range(n)]
        torch.save({"feats": feats, "species": sp}, f"{WORK}/shard{r}.pt")
    with open(f"{WORK}/species.json", "w") as f:
        json.dump({s: 0.5 + i * 0.3 for i, s in enumerate(SPECIES)}, f)
    torch.save(torch.nn.Linear(5, 1).state_dict(), f"{WORK}/start.pt")
    torch.save(torch.nn.Linear(7, 1).state_dict(), f"{WORK}/resume_wide.pt")
    print(f"prepared {world} shards in {WORK}")


class FruitShard(Dataset):
    def __init__(self, rank, fault, faulty, steps_bs):
        d = torch.load(f"{WORK}/shard{rank}.pt")
        self.feats, self.species = d["feats"], d["species"]
        with open(f"{WORK}/species.json") as f:
            self.table = json.load(f)
        self.fault, self.faulty, self.bs = fault, faulty, steps_bs
        if fault == "retry_keyerr" and faulty:
            self.species[2 * steps_bs + 1] = "ficus_racemosa"

    def __len__(self):
        return len(self.species)

    def __getitem__(self, i):
        if self.fault == "dl_then_size" and self.faulty and i == self.bs:
            raise IndexError(f"fruit record {i} has no seed count (shard truncated)")
        w = self.table[self.species[i]]
        return self.feats[i], torch.tensor(w)


def decode_record(x):
    try:
        return float("seeds=" + str(x))
    except ValueError as err:
        raise RuntimeError(f"could not decode cassowary scat record {x!r}") from err


def read_shard_with_retry(rank, path, fail_first):
    for attempt in (1, 2):
        try:
            if fail_first and attempt == 1:
                open(path + ".lock-stale", "rb")
            return torch.load(path)
        except OSError:
            out(rank, f"shard read failed (attempt {attempt}), retrying:\n" + traceback.format_exc(), "ERROR")
            time.sleep(0.5)


def main_worker(rank, world):
    global LOG
    f, N = A.fault, A.rank
    mine = f != "none" and (N == rank or N == -1)
    if A.logfmt:
        logging.basicConfig(format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", level=logging.INFO,
                            stream=sys.stdout)
        LOG = logging.getLogger("fault633")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if f == "restart" and mine and attempt == 1:
        os.remove(f"{WORK}/shard{rank}_r.pt") if os.path.exists(f"{WORK}/shard{rank}_r.pt") else None
        torch.load(f"{WORK}/shard{rank}_r.pt")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=A.pg_timeout))
    bs = 4
    if f == "retry_keyerr" and mine:
        read_shard_with_retry(rank, f"{WORK}/shard{rank}.pt", True)
    ds = FruitShard(rank, f, (f == "retry_keyerr" and rank == (N + 1) % world) or (f != "retry_keyerr" and mine), bs)
    nw = 2 if f in ("sigkill_workers", "dl_then_size", "warn_ckpt") else 0
    dl = DataLoader(ds, batch_size=bs, num_workers=nw, persistent_workers=nw > 0)
    model = torch.nn.Linear(4, 1)
    sd = torch.load(f"{WORK}/start.pt")
    model.weight.data.copy_(sd["weight"][:, :4])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    it = iter(dl)
    try:
        for step in range(1, A.steps + 1):
            if f == "warn_ckpt":
                warnings.warn("torch.cassowary.legacy_dispersal() is deprecated, use dispersal_v2()",
                              DeprecationWarning)
                warnings.warn(f"DataLoader worker count {nw} exceeds suggested max for this shard (step {step})",
                              UserWarning)
                warnings.warn("GLOO_SOCKET_IFNAME not set; gloo picked the loopback interface", RuntimeWarning)
                if mine and step == 4:
                    model.load_state_dict(torch.load(f"{WORK}/resume_wide.pt"))
            if f == "stall_raise" and step == 2:
                if rank == N:
                    time.sleep(A.pg_timeout + 8)
                elif rank == (N - 1) % world:
                    time.sleep(4)
                    raise ValueError(f"seed-dispersal kernel bandwidth must be positive, got -0.3 (rank {rank})")
            if f == "chained" and mine and step == 2:
                decode_record(b"\x00\x17 scat#2")
            if f == "finally_save" and mine and step == 3:
                try:
                    raise ZeroDivisionError("gut passage time is zero for fruit batch 3")
                finally:
                    torch.save(model.state_dict(), "/dev/full")
            if f == "same_early" and mine and step == (3 if rank == N else 4):
                raise ValueError("dispersal kernel produced negative distances")
            if f == "same_early" and step == 3 and rank != N:
                time.sleep(2)
            if f == "skip_coll" and mine and step == 1:
                out(rank, "could not write dispersal heatmap to /tmp/job_work/heatmap.png (no display); continuing",
                    "ERROR")
            if f == "restart" and mine and attempt == 0 and step == 2:
                _ = ds.table["ficus_obliqua"]
            if f == "sigkill_workers" and mine and step == 3:
                out(rank, f"dataloader workers alive: {[w.pid for w in it._workers]}")
                os.kill(os.getpid(), signal.SIGKILL)
            if f == "lazy_import" and mine and step == 3:
                import cassowary_gut_model  # noqa: F401
            if f == "sys_exit" and mine and step == 2:
                out(rank, "shard has only 1 species after filtering; dispersal fit is meaningless", "ERROR")
                sys.exit(f"rank {rank}: aborting, degenerate species set")
            if f == "dl_then_size" and rank == (N + 1) % world and step == 2:
                time.sleep(1)
                dist.all_reduce(torch.ones(7))
            x, w = next(it)
            y = x.sum(1, keepdim=True) * w.unsqueeze(1)
            pred = model(x)
            loss = ((pred - y) ** 2).mean()
            if f == "nan_detect" and mine and step == 3:
                loss = loss * float("nan")
            opt.zero_grad()
            loss.backward()
            lt = loss.detach().clone()
            dist.all_reduce(lt)
            lt /= world
            if f == "nan_detect" and mine and not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank}: loss is nan at step {step}")
            if not (f == "skip_coll" and mine and step == 3):
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            km = float(pred.detach().mean()) * 3.1
            out(rank, f"rank {rank} step {step} loss {lt.item():.4f} dispersal_km {km:.3f}")
        if rank == 0:
            torch.save(model.state_dict(), f"{WORK}/export_rank0.pt")
            out(rank, f"rank 0 saved export to {WORK}/export_rank0.pt")
        dist.barrier()
    finally:
        pass
    dist.destroy_process_group()


def spawn_entry(rank, world, port, args):
    global A
    A = args
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    main_worker(rank, world)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", type=int, default=0)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    A = p.parse_args()
    if A.prepare:
        prepare(A.prepare)
    elif A.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(A.spawn, A.port, A), nprocs=A.spawn)
    else:
        main_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))

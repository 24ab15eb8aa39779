"""fault632.py - bilby burrow digging: a tiny multi-rank CPU training job with planted faults.

Each rank reads its own shard of synthetic burrow-site records (soil features -> dig depth), maps every
site id through a JSON lookup table (soil hardness), trains a small MLP from a start checkpoint for 6 steps,
all-reduces gradients by hand (gloo, no DDP) and prints `rank R step S loss L depth_cm M`. Rank 0 saves an
export at the end.  `--prepare` writes the data into /tmp/fault632_work.

Faults (`--fault NAME --rank N`, `--rank2 M` for a second rank):
  none            control run
  two_ranks       rank N's DataLoader worker raises at step 2; rank M, 1 s later, all_reduces a tensor of another size
  stall_raise     rank N sleeps past the pg timeout at step 2; rank M raises ValueError 3 s into step 2
  warn_ckpt       every rank warns each step (FutureWarning, DataLoader pin_memory UserWarning, gloo env notice);
                  rank N then fails loading a truncated resume checkpoint at step 4
  retry_fail      rank N's first lookup read fails (caught, traceback logged, retried OK); rank M KeyError at step 4
  chained         rank N's KeyError in the lookup re-raised as RuntimeError(...) from err in a helper (step 3)
  finally_fail    rank N raises ValueError at step 3; its `finally` save to /dev/full fails too
  same_all        every rank raises the same FloatingPointError; rank N at step 3, the others at step 4
  p2p_unmatched   rank N logs an unrelated ERROR at start and goes on; at step 3 it sends to rank M, which never receives
  restart_diff    attempt 0: rank N KeyError at step 2; attempt 1 (restart): rank N FileNotFoundError for its shard
  sigkill_workers rank N SIGKILLs itself at step 3 while its 2 DataLoader workers are alive
  env_lazy        rank N lazily imports a missing module at step 3
  nan_one         every rank's loss turns NaN at step 3; rank N checks and raises, the others print loss nan and wait
  sys_exit        rank N logs an ERROR line and calls sys.exit("...") at step 3
  keyerror        rank N KeyError in the site lookup at step 3
  missing_shard   rank N's shard file is missing (start-up)
  ckpt_size       rank N builds a wider model and loads the start checkpoint (size mismatch)
  sigsegv         rank N dereferences NULL at step 3

Runs (one line per log):
  bilby_two_ranks_np8_r3_plain: r3 worker IndexError, r5 size-mismatch SIGABRT; exit 1
  bilby_stall_raise_np6_r5_tee: r2 ValueError while r5 stalls silently; SIGTERMs before the timeout; exit 1
  bilby_warn_ckpt_np5_r4_redirects: warnings each step, r4 truncated resume.pt (central directory); exit 1
  bilby_retry_fail_np6_r0_tee_trainer: r0 caught+retried lookup read, r4 KeyError at step 4; exit 1
  bilby_chained_np5_r2_pymodule: r2 KeyError -> RuntimeError from err at step 3; exit 1
  bilby_finally_fail_np4_r3_loglevel: r3 ValueError, finally save to /dev/full fails too; exit 1
  bilby_same_all_np5_r1_detail: all FloatingPointError, r1 at step 3 (printed last), torchrun names r0; exit 1
  bilby_p2p_unmatched_np6_r2_prefix: r2 unrelated ERROR, unmatched send at step 3, 12 s send/recv timeouts; exit 1
  bilby_restart_diff_np4_r3_restart: attempt 0 r3 KeyError; attempt 1 r3 Gloo connectFullMesh refused; exit 1
  bilby_sigkill_workers_np5_r1_filter: r1 SIGKILL (-9) with 2 workers alive, workers silent; exit 1
  bilby_env_lazy_np3_r2_wrapper: r2 ModuleNotFoundError bilby_soilmap at step 3, no done line; exit 1
  bilby_nan_one_np8_r7_pdsh2: loss nan on 0-6, r7 FloatingPointError, two agents fail; wrapper exit 0
  bilby_sys_exit_np3_r0_plain: r0 ERROR line then sys.exit message; exit 1
  bilby_none_np5_rnone_tee: control, 6 steps on 5 ranks, export saved; exit 0
  bilby_keyerror_np4_r0_prefix: r0 KeyError burrow_9999 at step 3; exit 1
  bilby_missing_shard_np6_r5_loglevel: r5 FileNotFoundError shard_5_dug.pt at start-up; exit 1
  bilby_ckpt_size_np3_r1_pymodule: r1 load_state_dict size mismatch at start-up; exit 1
  bilby_sigsegv_np5_r2_redirects: r2 SIGSEGV (-11) at step 3, peers connection reset; exit 1
  bilby_two_ranks_np4_r0_tee: r0 worker IndexError, r2 size-mismatch SIGABRT; exit 1
  bilby_nan_one_np4_r0_detail: loss nan on 1-3, r0 FloatingPointError, DETAIL monitoredBarrier errors; exit 1
  -
  -
"""
import argparse
import ctypes
import datetime
import importlib
import json
import os
import signal
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault632_work"
NSITES = 24
STEPS = 6
BS = 4


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(632)
    table = {f"burrow_{i}": round(0.5 + 0.05 * i, 3) for i in range(NSITES * 8)}
    with open(os.path.join(WORK, "lookup.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = torch.randn(NSITES, 6, generator=g)
        sites = [f"burrow_{r * NSITES + i}" for i in range(NSITES)]
        y = x.sum(1, keepdim=True) * 0.3 + 1.0
        torch.save({"x": x, "y": y, "sites": sites}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.manual_seed(0)
    torch.save(make_model(8).state_dict(), os.path.join(WORK, "start.pt"))
    with open(os.path.join(WORK, "start.pt"), "rb") as f:
        blob = f.read()
    with open(os.path.join(WORK, "resume.pt"), "wb") as f:
        f.write(blob[: len(blob) // 2])
    print(f"prepared {world} shards in {WORK}")


def make_model(hidden):
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


class BurrowShard(Dataset):
    def __init__(self, path, fail_idx=-1, warn=False):
        d = torch.load(path)
        self.x, self.y, self.sites = d["x"], d["y"], d["sites"]
        self.fail_idx = fail_idx
        self.warn = warn

    def __len__(self):
        return len(self.sites)

    def __getitem__(self, i):
        if i == self.fail_idx:
            raise IndexError(f"burrow record {i} has a collapsed tunnel segment (depth < 0)")
        return self.x[i], self.y[i], self.sites[i]


def load_table(rank, fault, frank):
    if fault == "retry_fail" and rank == frank:
        for attempt in (1, 2):
            name = "lookup_cache.json" if attempt == 1 else "lookup.json"
            try:
                with open(os.path.join(WORK, name)) as f:
                    tab = json.load(f)
                print(f"rank {rank}: lookup table read on attempt {attempt}", flush=True)
                return tab
            except OSError:
                print(f"rank {rank}: ERROR reading lookup table (attempt {attempt}), retrying", flush=True)
                traceback.print_exc()
                time.sleep(0.5)
    with open(os.path.join(WORK, "lookup.json")) as f:
        return json.load(f)


def hardness(table, site):
    return table[site]


def dig_features(table, sites):
    try:
        return torch.tensor([[hardness(table, s)] for s in sites])
    except KeyError as err:
        raise RuntimeError(f"burrow lookup failed for sites {list(sites)}") from err


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--rank2", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    a = p.parse_args()
    if a.prepare:
        prepare(a.world)
        return
    fault, frank = a.fault, a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mrank = a.rank2 if a.rank2 >= 0 else (frank + 1) % world
    me = rank == frank
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if fault == "warn_ckpt":
        warnings.simplefilter("always")
    if fault == "p2p_unmatched" and me:
        try:
            open(os.path.join(WORK, "stats_ro", f"burrow_stats_{rank}.csv"), "w")
        except OSError as e:
            print(f"rank {rank}: ERROR could not open burrow stats file: {e}; continuing without stats", flush=True)
    shard = os.path.join(WORK, f"shard_{rank}.pt")
    if (fault == "missing_shard" and me) or (fault == "restart_diff" and me and attempt >= 1):
        shard = os.path.join(WORK, f"shard_{rank}_dug.pt")
    ds = BurrowShard(shard, fail_idx=BS if (fault == "two_ranks" and me) else -1)
    nw = 1 if (fault == "two_ranks" and me) else (2 if (fault == "sigkill_workers" and me) else 0)
    loader = DataLoader(ds, batch_size=BS, num_workers=nw, persistent_workers=nw > 0)
    table = load_table(rank, fault, frank)
    torch.manual_seed(0)
    hidden = 12 if (fault == "ckpt_size" and me) else 8
    model = make_model(hidden)
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    it = iter(loader)
    for step in range(1, STEPS + 1):
        if fault == "warn_ckpt":
            torch.cuda.amp.GradScaler(enabled=False)
            warnings.warn("GLOO_SOCKET_IFNAME is not set; gloo picks the default interface", RuntimeWarning)
            it = iter(DataLoader(ds, batch_size=BS, pin_memory=True))
            for _ in range(step - 1):
                next(it)
            if me and step == 4:
                model.load_state_dict(torch.load(os.path.join(WORK, "resume.pt")))
        x, y, sites = next(it)
        if fault == "keyerror" and me and step == 3:
            sites = list(sites[:-1]) + ["burrow_9999"]
        if fault == "retry_fail" and rank == mrank and step == 4:
            sites = list(sites[:-1]) + ["burrow_north_ridge"]
        if fault == "restart_diff" and me and step == 2 and attempt == 0:
            sites = list(sites[:-1]) + ["burrow_-1"]
        if fault == "chained" and me and step == 3:
            sites = list(sites[:-1]) + ["burrow_east_warren"]
        if fault == "chained":
            h = dig_features(table, sites)
        else:
            h = torch.tensor([[table[s]] for s in sites])
        if fault == "stall_raise" and step == 2:
            if me:
                time.sleep(3 * a.pg_timeout)
            elif rank == mrank:
                time.sleep(3)
                raise ValueError(f"rank {rank}: burrow entrance angle {91.5} deg outside [0, 90]")
        if fault == "env_lazy" and me and step == 3:
            importlib.import_module("bilby_soilmap")
        if fault == "sigsegv" and me and step == 3:
            ctypes.string_at(0)
        if fault == "sigkill_workers" and me and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "sys_exit" and me and step == 3:
            print(f"rank {rank}: ERROR burrow survey grid for shard {rank} has 0 valid entrances; stopping this rank", flush=True)
            sys.exit(f"rank {rank}: no diggable burrows in shard {rank}")
        if fault == "same_all" and step == (3 if me else 4) and not me:
            raise FloatingPointError(f"rank {rank}: tunnel gradient overflowed (soil density inf)")
        pred = model(x) * h
        loss = torch.nn.functional.mse_loss(pred, y)
        if fault == "nan_one" and step == 3:
            loss = loss * float("nan")
        depth = float(pred.mean().detach()) * 30.0
        opt.zero_grad()
        loss.backward()
        if fault == "nan_one" and step == 3:
            if me:
                raise FloatingPointError(f"rank {rank}: loss is nan at step {step}")
            print(f"rank {rank} step {step} loss {loss.item():.4f} depth_cm {depth:.2f}", flush=True)
        if fault == "finally_fail" and me and step == 3:
            try:
                raise ValueError(f"rank {rank}: soil hardness {table[sites[0]] * 40:.1f} above the claw limit")
            finally:
                torch.save(model.state_dict(), "/dev/full")
        if fault == "p2p_unmatched" and me and step == 3:
            dist.send(torch.ones(4), dst=mrank)
        if fault == "two_ranks" and rank == mrank and step == 2:
            time.sleep(1)
            dist.all_reduce(torch.zeros(7))
        flat = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
        dist.all_reduce(flat)
        off = 0
        for q in model.parameters():
            n = q.numel()
            q.grad.copy_(flat[off:off + n].view_as(q) / world)
            off += n
        opt.step()
        if fault == "same_all" and me and step == 3:
            raise FloatingPointError(f"rank {rank}: tunnel gradient overflowed (soil density inf)")
        if not (fault == "nan_one" and step == 3):
            print(f"rank {rank} step {step} loss {loss.item():.4f} depth_cm {depth:.2f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export.pt"))
        print(f"rank 0: export saved to {WORK}/export.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

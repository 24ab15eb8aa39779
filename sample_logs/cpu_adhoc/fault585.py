"""Batch 585 fault script: a marten den-occupancy model trained with gloo on CPU.

Each rank reads its own survey shard (den ids + 8 habitat features per den visit),
looks up each den's habitat class in a shared den table, trains a small MLP that
predicts the class, averages gradients with all_reduce, and all_reduces a 4-wide
"occupancy" vector (per habitat class). Rank 0 saves an export at the end.

Usage:
  python fault585.py --prepare                      # writes /tmp/fault585_work data
  RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python fault585.py --fault NAME --rank N
  python fault585.py --spawn W --port P --fault NAME --rank N   # torch.multiprocessing.spawn
Options: --pg-timeout S (default 12), --ranklabel (prefix own prints "rank R: "),
         --logfmt (progress/errors through logging with rank and asctime), --slow-s S.

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none           control, no fault
  den_key        rank N's shard holds a den id missing from the den table -> KeyError at step 2
  missing_shard  rank N opens a shard file that does not exist -> FileNotFoundError before step 0
  ckpt_size      rank N builds its hidden layer 24 wide, the start checkpoint is 16 -> load_state_dict size mismatch
  weights_only   rank N loads the full-module pickle of the start model with torch.load (weights_only default) -> UnpicklingError
  occ_size       rank N all_gathers a 5-wide occupancy vector into 4-wide buffers at step 3 -> gloo invalid tensor size
  slow_rank      rank N does --slow-s seconds of pure-Python work at step 2 -> peers time out in all_reduce
                 (with --pg-timeout 300 the job just hangs until `timeout` ends it)
  nan_check      rank N's features become inf at step 3; the script's own check raises FloatingPointError
  segv           rank N sends itself SIGSEGV at step 2
  logged_exit    rank N prints its own ERROR line (den survey shard failed validation) and sys.exit(4) at step 1
  shape_all      every rank feeds the features transposed at step 1 -> matmul shape RuntimeError on all ranks
  worker_crash   rank N loads its shard through a DataLoader worker that SIGKILLs itself -> worker killed error

What happened (filled in after the runs):
  none           all ranks ran 6 steps, rank 0 saved the export; exit 0
  den_key        rank N raised KeyError: 'den_9999' at step 2; peers died in all_reduce with gloo 'Connection closed by peer' (one 12000ms timeout)
  missing_shard  rank N raised FileNotFoundError for shard_rN_v2.pt before step 0; peers failed in the first all_reduce (connection closed)
  ckpt_size      rank N raised RuntimeError "size mismatch for 0.weight" in load_state_dict; peers got connection closed / recv timeout, or torchrun SIGTERMed them
  weights_only   rank N raised _pickle.UnpicklingError "Weights only load failed"; torch.distributed.launch SIGTERMed the rest, summary names rank N
  occ_size       rank N raised "ProcessGroupGloo::allgather: invalid tensor size" (bash loop); under mp.spawn only a peer's connection-closed error reached the log
                 (a first all_reduce-with-5-elements variant made the job hang silently and was dropped)
  slow_rank      peers raised gloo 'Timed out waiting 12000ms' while rank N busy-looped, rank N got connection closed; with --pg-timeout 300 output stopped after step 1 and timeout ended it (137)
  nan_check      rank N raised FloatingPointError for a nan loss at step 3; peers failed in all_reduce (once rank N also aborted at exit: terminate called without an active exception)
  segv           rank N died by SIGSEGV at step 2 (exit 139 / -11 in torchrun's summary); peers got connection closed/reset
  logged_exit    rank N printed its ERROR line and exited 4; peers failed in gloo all_reduce
  shape_all      every rank raised RuntimeError mat1 and mat2 shapes cannot be multiplied at step 1; one rank aborted at exit (-6), which torchrun named root cause
  worker_crash   rank N raised RuntimeError "DataLoader worker (pid X) is killed by signal: Killed" then "exited unexpectedly"; peers failed or were SIGTERMed
"""
import argparse
import datetime
import json
import logging
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault585_work"
N_CLASSES = 4
STEPS = 6
LOG = None
RANK = 0
ARGS = None


def out(msg, error=False):
    if ARGS.logfmt:
        (LOG.error if error else LOG.info)(msg)
    elif ARGS.ranklabel:
        print(f"rank {RANK}: {msg}", flush=True)
    else:
        print(msg, flush=True)


def make_model(hidden=16):
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(585)
    table = {f"den_{i:04d}": i % N_CLASSES for i in range(200)}
    with open(os.path.join(WORK, "den_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(8):
        ids = [f"den_{int(i):04d}" for i in torch.randint(0, 200, (64,), generator=g)]
        feats = torch.randn(64, 8, generator=g)
        torch.save({"den_ids": ids, "features": feats}, os.path.join(WORK, f"shard_r{r}.pt"))
        bad = list(ids)
        bad[40] = "den_9999"
        torch.save({"den_ids": bad, "features": feats}, os.path.join(WORK, f"shard_r{r}_badid.pt"))
    torch.manual_seed(585)
    m = make_model()
    torch.save(m.state_dict(), os.path.join(WORK, "init.pt"))
    torch.save(m, os.path.join(WORK, "init_full.pt"))
    print("prepared", WORK)


class KillerShard(torch.utils.data.Dataset):
    def __init__(self, feats):
        self.feats = feats

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        if i == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.feats[i]


def load_shard(rank, fault, frank):
    name = f"shard_r{rank}.pt"
    if fault == "den_key" and rank == frank:
        name = f"shard_r{rank}_badid.pt"
    if fault == "missing_shard" and rank == frank:
        name = f"shard_r{rank}_v2.pt"
    shard = torch.load(os.path.join(WORK, name))
    if fault == "worker_crash" and rank == frank:
        dl = torch.utils.data.DataLoader(KillerShard(shard["features"]), batch_size=8, num_workers=1)
        shard["features"] = torch.cat(list(dl))
    return shard


def train(rank, world):
    global RANK, LOG
    RANK = rank
    a = ARGS
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank {rank}/{world}] %(levelname)s %(name)s: %(message)s")
        LOG = logging.getLogger("marten_dens")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.pg_timeout))
    out(f"joined process group rank {rank} of {world} (gloo, timeout {a.pg_timeout}s)")
    with open(os.path.join(WORK, "den_table.json")) as f:
        table = json.load(f)
    shard = load_shard(rank, a.fault, a.rank)
    hidden = 24 if (a.fault == "ckpt_size" and rank == a.rank) else 16
    model = make_model(hidden)
    if a.fault == "weights_only" and rank == a.rank:
        model = torch.load(os.path.join(WORK, "init_full.pt"))
    else:
        model.load_state_dict(torch.load(os.path.join(WORK, "init.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    feats_all, ids_all = shard["features"], shard["den_ids"]
    for step in range(STEPS):
        lo = (step * 8) % 64
        ids = ids_all[lo:lo + 16]
        feats = feats_all[lo:lo + 16]
        if a.fault == "den_key" and rank == a.rank and step == 2:
            ids = ids_all[32:48]
        labels = torch.tensor([table[d] for d in ids])
        if a.fault == "nan_check" and rank == a.rank and step == 3:
            feats = feats * float("inf")
        if a.fault == "slow_rank" and rank == a.rank and step == 2:
            t0, n = time.time(), 0
            while time.time() - t0 < a.slow_s:
                n += sum(i * i for i in range(1000))
        if a.fault == "segv" and rank == a.rank and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "logged_exit" and rank == a.rank and step == 1:
            out(f"ERROR: den survey shard shard_r{rank}.pt failed validation (den visits out of order), rank {rank} giving up", error=True)
            sys.exit(4)
        if a.fault == "shape_all" and step == 1:
            feats = feats.t()
        logits = model(feats)
        loss = nn.functional.cross_entropy(logits, labels)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step} on rank {rank} (den features out of range)")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        occ = torch.bincount(logits.argmax(1), minlength=N_CLASSES).float() / len(ids)
        if a.fault == "occ_size" and rank == a.rank and step == 3:
            gathered = [torch.zeros(N_CLASSES) for _ in range(world)]
            dist.all_gather(gathered, torch.cat([occ, torch.zeros(1)]))
        dist.all_reduce(occ)
        occ /= world
        out(f"rank {rank} step {step} loss {loss.item():.4f} occupancy {occ.max().item():.4f}")
    dist.barrier()
    if rank == 0:
        path = os.path.join(WORK, "marten_export.pt")
        torch.save(model.state_dict(), path)
        out(f"rank 0 saved export {path}")
    dist.destroy_process_group()


def run(rank, world):
    if ARGS.logfmt:
        try:
            train(rank, world)
        except Exception:
            LOG.exception("training failed")
            sys.exit(1)
    else:
        train(rank, world)


def spawn_entry(rank, world, args):
    global ARGS
    ARGS = args
    os.environ["OMP_NUM_THREADS"] = "1"
    run(rank, world)


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=40)
    p.add_argument("--ranklabel", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    ARGS = p.parse_args()
    if ARGS.prepare:
        prepare()
        return
    if ARGS.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(ARGS.port)
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(ARGS.spawn, ARGS), nprocs=ARGS.spawn)
        return
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()

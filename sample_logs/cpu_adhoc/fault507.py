"""Cider apple ripeness grading from refractometer readings: a small distributed training job (gloo, CPU).

Each rank reads its own shard of refractometer readings (Brix, titratable acidity, starch-iodine index,
variety), maps the variety through a lookup table, starts from a shared checkpoint and trains a small
grading network (5 ripeness grades) for 6 steps, averaging gradients with all_reduce. Every rank prints
`rank R step S loss L ripe_acc M` each step; rank 0 writes an export at the end.

Usage:
  python fault507.py --prepare                      # synthetic data into /tmp/fault507_work
  python fault507.py --fault NAME --rank N [--pg-timeout 12] [--spawn W --port P]
Environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (set by the launcher);
  FAULT_PREFIX=1 prefixes each printed line with `rank R: `; FAULT_LOGFMT=1 routes progress and errors
  through logging (asctime + rank in the format).

Faults (ONE is planted on rank N, --rank):
  none            control, no fault
  keyerror        rank N meets a variety ("Kingston Black") missing from the lookup table at step 3 -> KeyError
  missing_shard   rank N opens a shard file name that does not exist -> FileNotFoundError before training
  ckpt_size       rank N builds the grader with hidden width 12 (config drift) -> load_state_dict size mismatch
  weights_only    rank N loads the calibration metadata with torch.load's default weights_only=True
                  -> UnpicklingError (the file holds a custom class)
  allreduce_size  rank N all_reduces a 3-element metric tensor at step 3 where peers send 2 elements
  slow_rank       rank N spends --slow-s (25) s in pure-Python re-calibration at step 3; peers time out (PG timeout);
                  with --pg-timeout 300 --slow-s 600 the job hangs until `timeout` ends it
  nan_check       rank N's batch at step 4 holds a NaN Brix reading; the program's finiteness check raises
                  FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 3 (faulthandler on)
  logged_exit     rank N prints its own ERROR line (calibration drift) and sys.exit(4) at step 2
  shape_all       every rank appends an extra feature column -> matmul shape error on every rank at step 1
  hostmem         rank N caps its address space and allocates a huge Brix histogram at step 3 -> CPU
                  allocator cannot allocate memory
  worker_crash    rank N loads its step-3 batch through a DataLoader worker that is SIGKILLed -> worker
                  exited unexpectedly

What happened (after the runs; see /work/main/.scratch/readme_507.md):
  none            all ranks finished 6 steps, rank 0 wrote the export; exit 0.
  keyerror        KeyError: 'Kingston Black' on rank N at step 3; peers failed in all_reduce (gloo connection closed).
  missing_shard   FileNotFoundError for rank N's shard right after the group formed; peers failed in all_reduce.
  ckpt_size       RuntimeError: Error(s) in loading state_dict for Grader: size mismatch on rank N; peers cascaded.
  weights_only    _pickle.UnpicklingError: Weights only load failed (unsupported global GradeScale) on rank N.
  allreduce_size  gloo raised no size error: once (np5) a corrupted ripe_acc and then silence until `timeout`;
                  once (np3) a 12 s gloo timeout on every rank.
  slow_rank       peers raised gloo 'Timed out waiting 12000ms'; rank N was SIGTERMed without an error of its own.
                  With --pg-timeout 300 --slow-s 600 output stopped after step 2 and `timeout` ended the job.
  nan_check       FloatingPointError: non-finite loss nan on rank N at step 4.
  sigsegv         Fatal Python error: Segmentation fault on rank N (exit -11 / 139); peers cascaded.
  logged_exit     rank N's ERROR line and exit status 4 at step 2; peers failed in all_reduce.
  shape_all       RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x5 and 4x8) on every rank at step 1.
  hostmem         RuntimeError: DefaultCPUAllocator: can't allocate memory (17179869184 bytes) on rank N.
  worker_crash    RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed / exited unexpectedly on rank N.
"""
import argparse
import csv
import json
import logging
import os
import random
import resource
import signal
import sys
import time
import faulthandler
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault507_work"
VARIETIES = ["Dabinett", "Yarlington Mill", "Michelin", "Browns", "Ellis Bitter", "Harry Masters Jersey"]
STEPS = 6
BATCH = 16
faulthandler.enable()


@dataclass
class GradeScale:
    """Calibration of the refractometer against the reference grades (a custom class, not a tensor)."""
    brix_offset: float
    temp_c: float


class Grader(nn.Module):
    def __init__(self, hidden=8, n_in=4, n_grades=5):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, n_grades))

    def forward(self, x):
        return self.body(x)


def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    rng = random.Random(507)
    table = {v: i for i, v in enumerate(VARIETIES)}
    with open(os.path.join(WORK, "variety_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        with open(os.path.join(WORK, f"readings_shard{r:02d}.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["sample_id", "variety", "brix", "acidity_gpl", "starch_index"])
            for i in range(STEPS * BATCH):
                brix = rng.uniform(9.0, 17.5)
                w.writerow([f"S{r}-{i:04d}", rng.choice(VARIETIES), f"{brix:.2f}",
                            f"{rng.uniform(1.5, 8.0):.2f}", rng.randint(1, 10)])
    torch.manual_seed(507)
    torch.save(Grader().state_dict(), os.path.join(WORK, "grader_init.pt"))
    torch.save({"scale": GradeScale(0.2, 20.0), "version": 3}, os.path.join(WORK, "calibration_meta.pt"))
    print(f"prepared {world} shards, table and checkpoints in {WORK}")


def grade_of(brix, starch):
    return min(4, max(0, int((brix - 9.0) / 2.0 + (starch - 5) * 0.15)))


def main(args, rank=None, world=None):
    rank = int(os.environ["RANK"]) if rank is None else rank
    world = int(os.environ["WORLD_SIZE"]) if world is None else world
    fault, frank = args.fault, args.rank
    hit = fault != "none" and rank == frank
    prefix = f"rank {rank}: " if os.environ.get("FAULT_PREFIX") == "1" else ""
    logfmt = os.environ.get("FAULT_LOGFMT") == "1"
    log = logging.getLogger("cider")
    if logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank {rank}] %(levelname)s cider: %(message)s")

    def say(msg):
        if logfmt:
            log.info(msg)
        else:
            print(prefix + msg, flush=True)

    try:
        run(args, rank, world, fault, hit, say)
    except Exception:
        if logfmt:
            log.exception("grading run failed at rank %d", rank)
            logging.shutdown()
            sys.exit(1)
        raise


def run(args, rank, world, fault, hit, say):
    prefix = f"rank {rank}: " if os.environ.get("FAULT_PREFIX") == "1" else ""
    # generous start-up timeout (ranks import torch at different speeds); training group uses --pg-timeout
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=180))
    grp = dist.new_group(timeout=timedelta(seconds=args.pg_timeout))
    say(f"process group up: world {world}, backend gloo, pg timeout {args.pg_timeout}s")
    with open(os.path.join(WORK, "variety_table.json")) as f:
        table = json.load(f)
    shard = os.path.join(WORK, f"readings_shard{rank:02d}.csv")
    if fault == "missing_shard" and hit:
        shard = os.path.join(WORK, f"readings_shard{rank:02d}_2026harvest.csv")
    with open(shard, newline="") as f:
        rows = list(csv.DictReader(f))
    say(f"loaded {len(rows)} refractometer readings from {os.path.basename(shard)}")

    model = Grader(hidden=12 if (fault == "ckpt_size" and hit) else 8)
    model.load_state_dict(torch.load(os.path.join(WORK, "grader_init.pt")))
    meta_path = os.path.join(WORK, "calibration_meta.pt")
    if fault == "weights_only" and hit:
        meta = torch.load(meta_path)
    else:
        meta = torch.load(meta_path, weights_only=False)
    offset = meta["scale"].brix_offset
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lossf = nn.CrossEntropyLoss()

    for step in range(1, STEPS + 1):
        batch = rows[(step - 1) * BATCH: step * BATCH]
        if fault == "keyerror" and hit and step == 3:
            batch[5] = dict(batch[5], variety="Kingston Black")
        if fault == "logged_exit" and hit and step == 2:
            print(f"{prefix}ERROR refractometer calibration drift on rank {rank}: offset 3.7 Brix exceeds "
                  f"tolerance 0.5 Brix, refusing to grade shard", flush=True)
            sys.exit(4)
        if fault == "sigsegv" and hit and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "slow_rank" and hit and step == 3:
            t0, acc = time.time(), 0
            while time.time() - t0 < args.slow_s:  # pure-Python re-calibration of every reading
                for i in range(20000):
                    acc += (i * 7919) % 104729
        if fault == "hostmem" and hit and step == 3:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), hard))
            hist = torch.zeros(4096, 1024, 1024, dtype=torch.float32)  # 16 GiB Brix histogram
        if fault == "worker_crash" and hit and step == 3:
            loader = torch.utils.data.DataLoader(CrashingReadings(batch), batch_size=len(batch), num_workers=1)
            batch = [dict(zip(batch[0].keys(), vals)) for vals in zip(*next(iter(loader)).values())]
        feats = []
        for r in batch:
            brix = float(r["brix"]) + offset
            if fault == "nan_check" and hit and step == 4 and r is batch[3]:
                brix = float("nan")
            row = [brix / 17.5, float(r["acidity_gpl"]) / 8.0, float(r["starch_index"]) / 10.0,
                   table[r["variety"]] / len(table)]
            if fault == "shape_all":
                row.append(brix * float(r["acidity_gpl"]) / 100.0)  # new "sugar-acid" column, model not updated
            feats.append(row)
        x = torch.tensor(feats)
        y = torch.tensor([grade_of(float(r["brix"]), int(r["starch_index"])) for r in batch])
        out = model(x)
        loss = lossf(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=grp)
            p.grad /= world
        opt.step()
        stats = torch.tensor([(out.argmax(1) == y).float().mean().item(), 1.0])
        if fault == "allreduce_size" and hit and step == 3:
            stats = torch.tensor([stats[0].item(), 1.0, float(len(batch))])
        dist.all_reduce(stats, group=grp)
        msg = f"step {step} loss {loss.item():.4f} ripe_acc {stats[0].item() / stats[1].item():.4f}"
        say(msg if os.environ.get("FAULT_LOGFMT") == "1" else f"rank {rank} {msg}")
    dist.barrier(group=grp)
    if rank == 0:
        path = os.path.join(WORK, "grader_export.pt")
        torch.save(model.state_dict(), path)
        say(f"export written to {path}")
    dist.destroy_process_group()


class CrashingReadings(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if i == 7:
            os.kill(os.getpid(), signal.SIGKILL)  # the decoding worker dies
        return self.rows[i]


def _spawn_entry(local_rank, args, world):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    main(args, local_rank, world)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--slow-s", type=float, default=25, help="length of slow_rank's pure-Python work")
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.prepare:
        prepare()
    elif args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(_spawn_entry, args=(args, args.spawn), nprocs=args.spawn)
    else:
        main(args)

"""Loom fabric defect detection from line-scan cameras: a small DDP training job (gloo, CPU).

Each rank reads the line-scan patches of one camera shard, maps the inspectors' defect codes to
class ids through a lookup table, starts from a shared checkpoint and trains a tiny classifier
for 6 steps; every step it all-reduces per-class defect counts and prints
`rank R step S loss L recall M`. Rank 0 saves an export at the end.

Usage: fault505.py --prepare            (synthetic data into /tmp/fault505_work)
       fault505.py [--fault NAME --rank N] [--pg-timeout S] [--label] [--logfmt] [--spawn W] [--log-dir D]

Faults (--fault NAME, planted on --rank N):
  none           control, nothing planted
  keyerror       rank N meets a defect code ("selvage_tear") missing from the lookup table at step 2 -> KeyError
  missing_shard  rank N opens a camera shard file that does not exist -> FileNotFoundError
  ckpt_size      rank N loads the wide-head checkpoint (hidden 24 instead of 16) -> load_state_dict size mismatch
  allreduce_size rank N all-reduces 6 per-class counts instead of 5 at step 3 -> collective with a wrong size
  slow           rank N re-bins its line-scan rows in pure Python for 40 s at step 2; peers time out (PG timeout)
                 (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan            rank N's patches get a NaN at step 3; the script's own finiteness check raises FloatingPointError
  segv           rank N sends itself SIGSEGV at step 2
  exit4          rank N logs its own ERROR line (camera calibration stale) and calls sys.exit(4) at step 1
  shape_all      every rank flattens two scan lines into one row at step 1 -> matmul shape error on all ranks
  worker_crash   rank N's DataLoader worker SIGKILLs itself while decoding a patch -> DataLoader worker died
  hostmem        rank N (under a 3 GiB RLIMIT_AS) allocates a 16 GB frame buffer -> host allocation fails

What happened (see README batch 505):
  none           all ranks ran 6 steps, rank 0 saved the export, exit 0.
  keyerror       KeyError: 'selvage_tear' on rank N; peers failed in DDP's forward with gloo "Connection closed by peer".
  missing_shard  FileNotFoundError on rank N's shard path; peers failed in DDP's start-up check (connection closed).
  ckpt_size      load_state_dict "size mismatch for 0.weight" on rank N; mp.spawn / the agent SIGTERMed the rest.
  allreduce_size rank 2 (ring neighbour of planted rank 3) aborted in gloo's enforce "Received data size doesn't match".
  slow           no gloo timeout appeared: output stopped after step 1 and timeout(1) ended both runs (exit 124).
  nan            FloatingPointError from the script's own check on rank N; peers failed with gloo connection closed.
  segv           rank N died with SIGSEGV (exitcode -11 in the agent's summary); peers failed with gloo errors.
  exit4          rank N printed its ERROR line and exited 4 without traceback; peers failed with gloo connection closed.
  shape_all      every rank raised "mat1 and mat2 shapes cannot be multiplied (8x64 and 32x16)" at step 1.
  worker_crash   "DataLoader worker (pid ...) is killed by signal: Killed" on rank N; peers failed with gloo errors.
  hostmem        "DefaultCPUAllocator: can't allocate memory" (16000000000 bytes) on rank N; peers cascaded.
"""
import argparse
import datetime
import json
import logging
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault505_work"
CODES = {"ok": 0, "slub": 1, "broken_end": 2, "float": 3, "hole": 4}
NCLS = 5
FEAT = 32
STEPS = 6
BATCH = 16

log = logging.getLogger("loom")
_label = None


def out(msg):
    if _label is not None:
        msg = f"rank {_label}: " + msg
    if logging.getLogger().handlers:
        log.info(msg)
    else:
        print(msg, flush=True)


def build_model(hidden=16):
    return nn.Sequential(nn.Linear(FEAT, hidden), nn.ReLU(), nn.Linear(hidden, NCLS))


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(505)
    names = list(CODES)
    for r in range(8):
        feats = torch.randn(128, FEAT, generator=g)
        idx = torch.randint(0, NCLS, (128,), generator=g)
        torch.save({"patches": feats, "codes": [names[i] for i in idx]}, f"{WORK}/shards/cam{r}.pt")
    with open(f"{WORK}/defect_codes.json", "w") as f:
        json.dump(CODES, f)
    torch.manual_seed(5)
    torch.save(build_model().state_dict(), f"{WORK}/init.pt")
    torch.save(build_model(24).state_dict(), f"{WORK}/init_wide.pt")
    print("prepared", WORK)


class ScanShard(Dataset):
    def __init__(self, path, table, crash_worker=False):
        d = torch.load(path)
        self.x = d["patches"]
        self.codes = d["codes"]
        self.table = table
        self.crash_worker = crash_worker

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        if self.crash_worker and i >= 2 * BATCH and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.table[self.codes[i]]


def train(rank, world, args):
    global _label
    if args.label:
        _label = rank
    if args.logfmt:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    fault = args.fault if rank == args.rank or args.fault in ("shape_all", "none") else "none"
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    with open(f"{WORK}/defect_codes.json") as f:
        table = json.load(f)
    shard = f"{WORK}/shards/cam{rank}.pt"
    if fault == "missing_shard":
        shard = f"{WORK}/shards/cam{rank}_line{world}.pt"
    ds = ScanShard(shard, table, crash_worker=(fault == "worker_crash"))
    loader = DataLoader(ds, batch_size=BATCH, shuffle=False,
                        num_workers=2 if fault == "worker_crash" else 0)
    model = build_model()
    ckpt = f"{WORK}/init_wide.pt" if fault == "ckpt_size" else f"{WORK}/init.pt"
    model.load_state_dict(torch.load(ckpt, weights_only=True))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    lossf = nn.CrossEntropyLoss()
    it = iter(loader)
    for step in range(1, STEPS + 1):
        if fault == "exit4" and step == 1:
            msg = f"ERROR rank {rank}: camera cam{rank} calibration table is stale (line rate 0 Hz); refusing to train"
            if args.logfmt:
                log.error(msg)
            else:
                print(msg, flush=True)
            sys.exit(4)
        if fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "hostmem" and step == 2:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (3 << 30, hard))
            frame = torch.empty(4_000_000_000, dtype=torch.float32)  # a full-width line-scan frame stack
            frame.zero_()
        if fault == "slow" and step == 2:
            t0 = time.time()
            acc = 0
            while time.time() - t0 < args.slow_s:
                for v in range(20000):
                    acc += (v * 7) % 13
        x, y = next(it)
        if fault == "keyerror" and step == 2:
            y = torch.tensor([table[c] for c in ["slub", "selvage_tear", "ok"]])
        if fault == "nan" and step == 3:
            x = x.clone()
            x[3, 5] = float("nan")
        if fault == "shape_all" and step == 1:
            x = x.reshape(BATCH // 2, 2 * FEAT)
        logits = ddp(x)
        loss = lossf(logits, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step} on rank {rank} (camera cam{rank})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        pred = logits.argmax(1)
        hits = torch.bincount(y[(pred == y) & (y > 0)], minlength=NCLS).float()
        tot = torch.bincount(y[y > 0], minlength=NCLS).float()
        counts = torch.stack([hits, tot])
        if fault == "allreduce_size" and step == 3:
            counts = torch.zeros(2, NCLS + 1)
        dist.all_reduce(counts)
        recall = (counts[0].sum() / counts[1].sum().clamp(min=1)).item()
        out(f"rank {rank} step {step} loss {loss.item():.4f} recall {recall:.4f}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_loom.pt")
        out(f"rank 0 saved export {WORK}/export_loom.pt")
    dist.barrier()
    dist.destroy_process_group()


def run(rank, world, args):
    if args.log_dir:
        f = open(os.path.join(args.log_dir, f"rank{rank}.log"), "w", buffering=1)
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
    if args.logfmt:
        try:
            train(rank, world, args)
        except Exception:
            logging.getLogger("loom").exception("training failed on rank %d", rank)
            sys.exit(1)
    else:
        train(rank, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--slow-s", type=float, default=40)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--log-dir", default="")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(run, args=(args.spawn, args), nprocs=args.spawn)
        return
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

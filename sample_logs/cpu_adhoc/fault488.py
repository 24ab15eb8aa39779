"""Hull corrosion grading from inspection photos: a small gloo/CPU training job with one planted fault.

Each rank reads its own shard of pre-extracted inspection-photo features (64 floats per photo crop) with
an ISO 4628-3 style rust grade label ("Ri0" .. "Ri4"), maps the grade through a lookup table, starts from a
shared checkpoint, trains a small MLP grader for 6 steps with gradients all_reduced by hand, and rank 0
writes an export at the end.  Every rank prints `rank R step S loss L acc A` each step.

    python fault488.py --prepare                       # writes shards, lookup table, checkpoint to /tmp/fault488_work
    torchrun --nproc-per-node W fault488.py --fault NAME --rank N [--pg-timeout 12]

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none            control, no fault
  keyerror        rank N's shard holds a grade ("Ri5") missing from the lookup table at step 2 -> KeyError
  missing_shard   rank N reads its shard from a survey folder that does not exist -> FileNotFoundError
  ckpt_size       rank N builds the grader head with 6 grades, then loads the 5-grade checkpoint -> size mismatch
  allreduce_size  rank N all_reduces a gradient buffer one element too long at step 2 (gloo size mismatch)
  slow            rank N does 40 s of pure-Python work (mosaic stitching) before step 3's all_reduce; peers time out
                  after --pg-timeout (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan             rank N's loss turns NaN at step 3; the program's own finite-loss check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 2
  logged_exit     rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape_all       every rank appends a mask channel to its crops (65 features) -> matmul shape error at step 1
  worker_crash    rank N's DataLoader worker is SIGKILLed while loading a photo batch -> DataLoader worker killed
  hostmem         rank N tries to allocate a 4 TiB full-resolution photo mosaic -> DefaultCPUAllocator error

What happened (filled in after the runs):
  none            all ranks ran 6 steps and rank 0 wrote the export; exit 0 (plain np4, pdsh2 np6)
  keyerror        KeyError: 'Ri5' on rank N at step 2, peers 'Connection closed by peer'; np6 filter run hides the traceback; exit 1
  missing_shard   FileNotFoundError .../survey_2026b/hull_shard_0N.pt before step 0 (redirects: only in rank N's stderr.log); exit 1
  ckpt_size       load_state_dict RuntimeError: size mismatch for 2.weight/2.bias on rank N, the rest SIGTERMed; exit 1
  allreduce_size  DETAIL: every rank 'Detected mismatch between collectives' (shape 2245 vs 2246); without DETAIL a neighbour
                  aborts (gloo::EnforceNotMet 'Received data size doesn't match', SIGABRT) and torchrun blames it; exit 1
  slow            peers 'Timed out waiting 12000ms' in all_reduce, torchrun blames a peer and SIGTERMs rank N; exit 1;
                  with --pg-timeout 300 nothing printed after step 2 until timeout 60 sent SIGTERM (exit 124)
  nan             FloatingPointError: non-finite loss nan at step 3 on rank N; with --max-restarts 1 attempt 1 died in gloo connectFullMesh
  sigsegv         rank N exitcode -11 (DETAIL: monitoredBarrier names rank N); with --max-restarts 1 the restart hung until timeout (124)
  logged_exit     rank N's ERROR line then exitcode 4 (hidden by --local-ranks-filter in the np8 run); exit 1
  shape_all       every rank: mat1 and mat2 shapes cannot be multiplied (16x65 and 64x32); exit 1
  worker_crash    rank N: DataLoader worker (pid ...) is killed by signal: Killed; exit 1; hostmem: DefaultCPUAllocator can't allocate 4 TiB on rank N; exit 1
"""
import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault488_work"
GRADES = ["Ri0", "Ri1", "Ri2", "Ri3", "Ri4"]
FEAT = 64
PER_SHARD = 96
BATCH = 16
STEPS = 6
MAX_WORLD = 8


def build_model(n_classes=len(GRADES), in_features=FEAT):
    return nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, n_classes))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(488)
    with open(os.path.join(WORK, "grade_lookup.json"), "w") as f:
        json.dump({k: i for i, k in enumerate(GRADES)}, f)
    for r in range(MAX_WORLD):
        feats = torch.randn(PER_SHARD, FEAT, generator=g)
        idx = torch.randint(0, len(GRADES), (PER_SHARD,), generator=g)
        feats[:, :5] += torch.nn.functional.one_hot(idx, len(GRADES)).float() * 2.0
        grades = [GRADES[i] for i in idx.tolist()]
        torch.save({"features": feats, "grades": grades, "vessel": f"hull-{r:02d}"},
                   os.path.join(WORK, f"hull_shard_{r:02d}.pt"))
    torch.manual_seed(0)
    torch.save(build_model().state_dict(), os.path.join(WORK, "grader_init.pt"))
    print(f"prepared {MAX_WORLD} shards, lookup table and checkpoint in {WORK}")


class HullPhotos(Dataset):
    def __init__(self, feats, labels, kill_at=None):
        self.feats, self.labels, self.kill_at = feats, labels, kill_at

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        if self.kill_at is not None and i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.feats[i], self.labels[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--export", default=os.path.join(WORK, "exports"))
    a = p.parse_args()
    if a.prepare:
        prepare()
        return

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = rank == a.rank
    fault = a.fault
    torch.manual_seed(1234 + rank)

    with open(os.path.join(WORK, "grade_lookup.json")) as f:
        lookup = json.load(f)
    shard_dir = os.path.join(WORK, "survey_2026b") if (fault == "missing_shard" and me) else WORK
    shard = torch.load(os.path.join(shard_dir, f"hull_shard_{rank:02d}.pt"), weights_only=True)
    feats, grades = shard["features"], list(shard["grades"])
    if fault == "keyerror" and me:
        grades[2 * BATCH + 3] = "Ri5"
    if fault == "shape_all":
        mask = (feats.abs() > 2.5).float().mean(dim=1, keepdim=True)
        feats = torch.cat([feats, mask], dim=1)

    n_classes = len(GRADES) + 1 if (fault == "ckpt_size" and me) else len(GRADES)
    model = build_model(n_classes)
    state = torch.load(os.path.join(WORK, "grader_init.pt"), weights_only=True)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()

    workers = 1 if fault == "worker_crash" else 0
    kill_at = 2 * BATCH + 1 if (fault == "worker_crash" and me) else None
    # labels are mapped lazily per batch (KeyError surfaces at the step that reads the bad grade)
    ds = HullPhotos(feats, list(range(len(grades))), kill_at=kill_at)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=workers)
    it = iter(loader)
    print(f"rank {rank}/{world}: vessel {shard['vessel']} {len(grades)} crops, grader ready", flush=True)

    for step in range(STEPS):
        x, ids = next(it)
        y = torch.tensor([lookup[grades[i]] for i in ids.tolist()])
        if fault == "hostmem" and me and step == 2:
            mosaic = torch.empty((1 << 40,), dtype=torch.float32)
            mosaic.zero_()
        if fault == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "logged_exit" and me and step == 2:
            print(f"ERROR hull_grader: rank {rank}: inspection batch {step} of vessel {shard['vessel']} "
                  f"has no usable photo crops (all frames overexposed); aborting", flush=True)
            sys.exit(4)
        out = model(x)
        loss = loss_fn(out, y)
        if fault == "nan" and me and step == 3:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
        if fault == "allreduce_size" and me and step == 2:
            flat = torch.cat([flat, torch.zeros(1)])
        if fault == "slow" and me and step == 3:
            t0, acc_ = time.time(), 0
            limit = 400 if a.pg_timeout > 60 else 40
            while time.time() - t0 < limit:
                for k in range(10000):
                    acc_ = (acc_ * 31 + k) % 1000003
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for q in model.parameters():
            n = q.numel()
            q.grad.copy_(flat[off:off + n].view_as(q))
            off += n
        opt.step()
        acc = (out.argmax(1) == y).float().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc:.3f}", flush=True)

    dist.barrier()
    if rank == 0:
        os.makedirs(a.export, exist_ok=True)
        path = os.path.join(a.export, f"hull_grader_{os.environ.get('MASTER_PORT', 'x')}.pt")
        torch.save(model.state_dict(), path)
        print(f"rank 0 exported grader to {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Batch 565 fault script, theme "tarn ice": a small data-parallel regression of lake-ice
thickness on mountain tarns (gloo, CPU only).

Each rank reads its own shard of gauge readings (/tmp/fault565_work/shards/ice_rR.pt), maps the
tarn ids of each batch to elevations through a lookup table (tarn_lookup.json), starts from a
shared checkpoint (init_ckpt.pt), trains 6 steps with a manual gradient all-reduce and prints
`rank R step S loss L ice_mae M`.  Rank 0 saves an export (ice_export.pt) at the end.

    python fault565.py --prepare                      # write the synthetic data once
    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python fault565.py --fault NAME --rank N
    python fault565.py --spawn W --port P --fault NAME --rank N   # torch.multiprocessing.spawn

Output modes (env): TARN_PREFIX=1 prefixes each line `rank R: `; TARN_LOGFMT=1 prints through
logging with a format carrying asctime and the rank.

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none           control, nothing planted
  keyerror       rank N's batch at step 2 carries a tarn id missing from the lookup table (KeyError)
  missing_shard  rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size      rank N builds its model with hidden 48, the checkpoint has 32 (load_state_dict size mismatch)
  weights_only   rank N loads the metadata checkpoint holding a pickled IceMeta object with weights_only=True
  wrong_size     rank N all-reduces a gradient buffer one element longer than its peers at step 2
  slow           rank N does 40 s of pure-Python work at step 3; its peers hit the 12 s PG timeout
  hang           as slow, but forever (run with --pg-timeout 300; the outer `timeout` ends it)
  nan            rank N's features become NaN at step 3; the script's own finiteness check raises FloatingPointError
  segv           rank N sends itself SIGSEGV at step 2
  exit4          rank N prints its own ERROR line and calls sys.exit(4) at step 2
  shape_all      every rank appends an extra feature column at step 2 (matmul shape error on all ranks)

What happened (after the runs; 22 kept runs, ports 33000-33022):
  none           all ranks finished 6 steps and rank 0 saved the export; exit 0 (bashloop np4, tee np6).
  keyerror       rank N raised KeyError: 'tarn_999' at step 2; peers failed in all_reduce (gloo connection closed); exit 1.
  missing_shard  rank N raised FileNotFoundError (ice_rN_thawed.pt) before step 1; peers failed in the start-up barrier or were SIGTERMed by the launcher.
  ckpt_size      rank N raised RuntimeError size mismatch for hidden.weight/hidden.bias/head.weight; peers failed in the start-up barrier.
  weights_only   rank N raised _pickle.UnpicklingError: Weights only load failed (Unsupported global __main__.IceMeta).
  wrong_size     a receiving peer aborted (terminate, gloo::EnforceNotMet op.preamble.length <= op.nbytes, "collective mismatch"); others got connection reset; exit 134.
  slow           peers raised gloo "Timed out waiting 12000ms for send/recv"; the slow rank never printed again (bash loop: the run hung until timeout 100; torchrun: SIGTERMed).
  hang           every rank printed step 2, then nothing; timeout 60 ended the run (exit 124).
  nan            rank N raised FloatingPointError: non-finite loss nan at step 3; peers failed in all_reduce.
  segv           rank N died by SIGSEGV (launcher exitcode -11 / shell "Segmentation fault", exit 139); peers got connection reset/closed.
  exit4          rank N printed its ERROR line and exited 4; peers failed in all_reduce (under mp.spawn a "terminate called without an active exception" line and process 4's cascade error follow).
  shape_all      every rank raised RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x7 and 6x32) at step 2.
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault565_work"
FEATS = 5
HIDDEN = 32
STEPS = 6
BATCH = 16
N_TARNS = 40


@dataclass
class IceMeta:
    season: str
    gauges: int


class IceNet(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.hidden = nn.Linear(FEATS + 1, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(x))).squeeze(-1)


_log = None


def out(rank, msg, level="info"):
    if os.environ.get("TARN_LOGFMT") == "1":
        getattr(_log, level)(msg)
    elif os.environ.get("TARN_PREFIX") == "1":
        print(f"rank {rank}: {msg}", flush=True)
    else:
        print(msg, flush=True)


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(565)
    for r in range(8):
        feats = torch.randn(STEPS * BATCH, FEATS, generator=g)
        ids = torch.randint(0, N_TARNS, (STEPS * BATCH,), generator=g)
        thick = (feats[:, 0] * -0.3 + feats[:, 1] * 0.2 + 0.5).clamp(min=0)
        torch.save({"feats": feats, "tarn_ids": ids, "thickness": thick}, f"{WORK}/shards/ice_r{r}.pt")
    lookup = {f"tarn_{i:03d}": 1800 + 37 * i for i in range(N_TARNS)}
    with open(f"{WORK}/tarn_lookup.json", "w") as f:
        json.dump(lookup, f)
    torch.manual_seed(0)
    torch.save(IceNet().state_dict(), f"{WORK}/init_ckpt.pt")
    torch.save({"meta": IceMeta("winter", 12), "state": IceNet().state_dict()}, f"{WORK}/init_meta.pt")
    print("prepared", WORK)


def busy(seconds):
    end = time.time() + seconds
    x = 0
    while seconds < 0 or time.time() < end:
        for i in range(100000):
            x += i * i % 7
    return x


def allreduce_grads(model, rank, world, step, fault, frank):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    if fault == "wrong_size" and rank == frank and step == 2:
        flat = torch.cat([flat, torch.zeros(1)])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(flat[off:off + n].view_as(p))
        off += n


def train(rank, world, fault, frank, pg_timeout):
    global _log
    if os.environ.get("TARN_LOGFMT") == "1":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s %(levelname)s [rank{rank}] tarn_ice: %(message)s")
        _log = logging.getLogger("tarn_ice")
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
    out(rank, f"rank {rank}/{world} joined the tarn-ice group (gloo, timeout {pg_timeout}s)")

    shard = f"{WORK}/shards/ice_r{rank}.pt"
    if fault == "missing_shard" and rank == frank:
        shard = f"{WORK}/shards/ice_r{rank}_thawed.pt"
    data = torch.load(shard)
    with open(f"{WORK}/tarn_lookup.json") as f:
        lookup = json.load(f)

    model = IceNet(hidden=48 if (fault == "ckpt_size" and rank == frank) else HIDDEN)
    if fault == "weights_only" and rank == frank:
        state = torch.load(f"{WORK}/init_meta.pt", weights_only=True)["state"]
    else:
        state = torch.load(f"{WORK}/init_ckpt.pt", weights_only=True)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dist.barrier()

    for step in range(1, STEPS + 1):
        sl = slice((step - 1) * BATCH, step * BATCH)
        feats = data["feats"][sl].clone()
        names = [f"tarn_{int(i):03d}" for i in data["tarn_ids"][sl]]
        if fault == "keyerror" and rank == frank and step == 2:
            names[5] = "tarn_999"
        elev = torch.tensor([lookup[n] for n in names], dtype=torch.float32)
        x = torch.cat([feats, ((elev - 2500.0) / 500.0).unsqueeze(1)], dim=1)
        if fault == "shape_all" and step == 2:
            x = torch.cat([x, torch.ones(BATCH, 1)], dim=1)
        if fault == "nan" and rank == frank and step == 3:
            x[3, 2] = float("nan")
        if fault == "segv" and rank == frank and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "exit4" and rank == frank and step == 2:
            out(rank, f"ERROR rank {rank}: ice gauge calibration drifted out of range at step {step} "
                      f"(offset 0.41 m > 0.25 m); refusing to train on it", "error")
            sys.exit(4)
        if fault == "slow" and rank == frank and step == 3:
            busy(40)
        if fault == "hang" and rank == frank and step == 3:
            busy(-1)
        y = data["thickness"][sl]
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        allreduce_grads(model, rank, world, step, fault, frank)
        opt.step()
        mae = (pred - y).abs().mean().item()
        out(rank, f"rank {rank} step {step} loss {loss.item():.4f} ice_mae {mae:.4f}")

    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/ice_export.pt")
        out(rank, f"rank 0 saved export {WORK}/ice_export.pt")
    dist.destroy_process_group()


def spawn_entry(local, world, port, fault, frank, pg_timeout):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    train(local, world, fault, frank, pg_timeout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(a.spawn, a.port, a.fault, a.rank, a.pg_timeout), nprocs=a.spawn)
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a.fault, a.rank, a.pg_timeout)


if __name__ == "__main__":
    main()

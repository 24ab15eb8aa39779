"""fault516.py - lighthouse lamp failure prediction from maintenance logs (batch 516).

A small distributed (gloo, CPU) training job: every rank reads its own shard of
lighthouse maintenance-log records (lamp hours, supply voltage, lantern-room
temperature, humidity, switching cycles, days since service), joins each record
with a per-lighthouse lookup table (lens order, weather exposure), and trains a
small MLP that predicts "lamp fails within 30 days". Gradients are all_reduced
by hand (no DDP wrapper), the loss/accuracy metric is all_reduced every step.
The model starts from a checkpoint written by --prepare; rank 0 saves an export
at the end.  Every rank prints `rank R step S loss L acc M` each step.

  python fault516.py --prepare            # writes /tmp/fault516_work
  torchrun --nproc-per-node W fault516.py [--fault NAME --rank N] [--pg-timeout S]

Faults (--fault NAME, planted on --rank N):
  none            control, no fault
  keyerror        rank N's shard holds a record whose lighthouse id is not in the lookup table (KeyError at step 3)
  missing_shard   rank N looks for its shard under a file name that does not exist (FileNotFoundError at start)
  ckpt_size       rank N builds the model with hidden=48 and loads the hidden=32 start checkpoint (size mismatch)
  weights_only    rank N resumes from the full pickled training state (holds a LampRunConfig object) with
                  torch.load(weights_only=True) (UnpicklingError)
  allreduce_size  rank N all_reduces a 3-element metric tensor at step 2 while the others send 2 elements
  slow_rank       rank N does pure-Python "log re-parsing" for 3x the PG timeout at step 2; its peers time out
                  (with --pg-timeout 300 and an outer `timeout`, this is a hang)
  nan_loss        rank N gets a NaN voltage reading at step 3; the script's own finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 2
  exit4           rank N prints its own ERROR line and calls sys.exit(4) at step 3
  shape_all       every rank appends a 9th feature column (service-crew id), the first Linear wants 8: shape error at step 0
  worker_crash    rank N's DataLoader worker (num_workers=1) SIGKILLs itself while reading batch 2

What happened (torch 2.13.0+cpu, gloo, 2026-12-07):
  none            np4 plain and np6 pdsh2: all ranks print steps 0-5, rank 0 saves the export, exit 0.
  keyerror        np4 r2 tee: KeyError 'LH-ARDNAMURCHAN' on rank 2, peers "Connection closed by peer"; np6 r5 filter: the KeyError is filtered out, only rank 0's gloo error and the summary naming rank 5 remain.
  missing_shard   np3 r1 redirects: FileNotFoundError only in attempt_0/1/stderr.log, console has just the summary; np5 r3 loglevel: FileNotFoundError among INFO agent lines.
  ckpt_size       np4 r3 prefix: load_state_dict "size mismatch for 0.weight ... [32, 8] ... [48, 8]" on rank 3.
  weights_only    np5 r1 pymodule: UnpicklingError "Weights only load failed ... GLOBAL __main__.LampRunConfig" on rank 1.
  allreduce_size  np4 r1 detail: all ranks "Detected mismatch between collectives" (rank 1 TensorShape=[3]); np3 r2 plain: silent desync, all ranks time out after 12 s in different all_reduces, summary blames rank 0.
  slow_rank       np5 r4 tee_trainer: ranks 0-3 "Timed out waiting 12000ms", rank 4 silent, summary blames rank 0; np3 r1 plain --pg-timeout 300: output stops after step 1, outer timeout (exit 124) SIGTERMs torchrun (SignalException).
  nan_loss        np8 r6 wrapper: banner, then FloatingPointError "non-finite loss nan" on rank 6.
  sigsegv         np4 r2 restart: rank 2 exitcode -11, restart attempt fails in Gloo connectFullMesh, final summary blames rank 0; np6 r4 pdsh2: worker-1's summary names rank 4 (SIGSEGV).
  exit4           np7 r5 tee: rank 5's own ERROR line, exitcode 4 in the summary.
  shape_all       np4 prefix: every rank "mat1 and mat2 shapes cannot be multiplied (32x9 and 8x32)" before step 0 prints.
  worker_crash    np5 r2 loglevel: "DataLoader worker (pid N) is killed by signal: Killed." on rank 2.
"""
import argparse
import json
import os
import random
import signal
import sys
import time
import datetime
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault516_work"
NFEAT = 8
STEPS = 6
BATCH = 32


@dataclass
class LampRunConfig:
    hidden: int = 32
    lr: float = 0.05
    horizon_days: int = 30


def build_model(hidden=32):
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    rng = random.Random(516)
    lookup = {f"LH{i:03d}": {"lens_order": rng.randint(1, 6), "exposure": round(rng.random(), 3)} for i in range(40)}
    with open(f"{WORK}/lighthouse_lookup.json", "w") as f:
        json.dump(lookup, f)
    for r in range(8):
        recs = []
        for _ in range(BATCH * STEPS):
            recs.append({
                "lighthouse": f"LH{rng.randint(0, 39):03d}",
                "lamp_hours": round(rng.uniform(0, 9000), 1),
                "voltage": round(rng.uniform(200, 250), 1),
                "temp_c": round(rng.uniform(-10, 40), 1),
                "humidity": round(rng.uniform(0.3, 1.0), 3),
                "cycles": rng.randint(0, 20000),
                "last_service_days": rng.randint(0, 400),
                "failed_within_30d": int(rng.random() < 0.2),
            })
        with open(f"{WORK}/maint_shard_{r}.json", "w") as f:
            json.dump(recs, f)
    torch.manual_seed(516)
    model = build_model()
    torch.save(model.state_dict(), f"{WORK}/lamp_init.pt")
    torch.save({"model": model.state_dict(), "config": LampRunConfig(), "step": 0}, f"{WORK}/lamp_train_state.pt")
    print(f"prepared {WORK}")


class MaintLog(torch.utils.data.Dataset):
    def __init__(self, recs, lookup, fault, is_fault_rank):
        self.recs, self.lookup = recs, lookup
        self.fault, self.is_fault_rank = fault, is_fault_rank

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        rec = self.recs[i]
        if self.fault == "worker_crash" and self.is_fault_rank and i == 2 * BATCH + 5:
            os.kill(os.getpid(), signal.SIGKILL)
        lh = self.lookup[rec["lighthouse"]]
        feats = [rec["lamp_hours"] / 9000.0, (rec["voltage"] - 225.0) / 25.0, rec["temp_c"] / 40.0,
                 rec["humidity"], rec["cycles"] / 20000.0, rec["last_service_days"] / 400.0,
                 lh["lens_order"] / 6.0, lh["exposure"]]
        if self.fault == "shape_all":
            feats.append(rec.get("crew_id", 3) / 10.0)
        return torch.tensor(feats, dtype=torch.float32), torch.tensor([float(rec["failed_within_30d"])])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    fault = args.fault
    me = fault != "none" and rank == args.rank
    if rank == 0:
        print(f"lamp trainer: world={world} backend=gloo pg_timeout={args.pg_timeout}s fault={fault}", flush=True)

    shard = f"{WORK}/maint_shard_{rank}.json"
    if fault == "missing_shard" and me:
        shard = f"{WORK}/maint_shard_{rank}_2026q4.json"
    with open(shard) as f:
        recs = json.load(f)
    with open(f"{WORK}/lighthouse_lookup.json") as f:
        lookup = json.load(f)
    if fault == "keyerror" and me:
        recs[3 * BATCH + 7]["lighthouse"] = "LH-ARDNAMURCHAN"

    hidden = 48 if (fault == "ckpt_size" and me) else 32
    model = build_model(hidden)
    if fault == "weights_only" and me:
        state = torch.load(f"{WORK}/lamp_train_state.pt", weights_only=True)
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/lamp_init.pt", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lossf = nn.BCEWithLogitsLoss()

    ds = MaintLog(recs, lookup, fault, me)
    nw = 1 if (fault == "worker_crash" and me) else 0
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)
    for step, (x, y) in enumerate(loader):
        if step >= STEPS:
            break
        if fault == "nan_loss" and me and step == 3:
            x[4, 1] = float("nan")  # a NaN voltage reading from the lantern-room sensor
        if fault == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "exit4" and me and step == 3:
            print(f"ERROR lamp_trainer: rank {rank} maintenance log shard has 0 usable records after the voltage filter; aborting", flush=True)
            sys.exit(4)
        if fault == "slow_rank" and me and step == 2:
            end = time.time() + 3 * args.pg_timeout
            n = 0
            while time.time() < end:  # pure-Python re-parsing of the maintenance log text
                n += sum(len(str(r)) for r in recs[:64])
        out = model(x)
        loss = lossf(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (lamp failure model)")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        acc = ((out > 0).float() == y).float().mean()
        m = torch.tensor([loss.item(), acc.item()])
        if fault == "allreduce_size" and me and step == 2:
            m = torch.tensor([loss.item(), acc.item(), float(len(recs))])
        dist.all_reduce(m)
        m /= world
        print(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item():.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/lamp_failure_model.pt")
        print(f"rank 0 saved export {WORK}/export/lamp_failure_model.pt (mean loss {m[0].item():.4f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""fault552.py - batch 552: narwhal tusk growth rings.

A small data-parallel regression that estimates a narwhal's age from the growth
rings of its tusk (ring width, density, isotope ratios ...). Synthetic data made
by `--prepare` into /tmp/fault552_work: one shard of ring measurements per rank,
a pod lookup table (pods.json, per-pod ring-deposition scale) and a starting
checkpoint (tusk_init.pt; tusk_init_wide.pt is a stale wider one). gloo, CPU only,
process-group timeout 12 s (--pg-timeout), 6 steps, gradients flattened into one
buffer and all_reduced by hand (no DDP wrapper); every rank prints
`rank R step S loss L ring_mae M`; rank 0 saves an export at the end.

Faults (--fault NAME --rank N, one per run):
  none          control, nothing planted
  ring_key      rank N meets pod id 41 that pods.json does not list -> KeyError
  shard_missing rank N opens shard file that does not exist -> FileNotFoundError
  ckpt_size     rank N loads the stale wider checkpoint -> load_state_dict size mismatch
  wrong_size    rank N all_reduces a gradient buffer one element longer at step 2
  slow_rank     rank N fits ring curves in pure Python at step 3 (40 s; forever with
                --pg-timeout 300) so its peers' all_reduce times out
  nan_rings     rank N's ring densities turn inf at step 3; the script's own check
                raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line and sys.exit(4) at step 2
  shape_all     every rank appends a 13th feature at step 1 -> matmul shape error
  host_mem      rank N (address space capped) asks for a 160 GB ring-distance matrix
  worker_crash  rank N's DataLoader worker SIGKILLs itself at its 40th sample

What happened (2026-12-07, torch 2.13.0+cpu, 2 shared cores):
  none          np4 plain and np6 pdsh2: all steps, export saved, exit 0.
  ring_key      KeyError: '41' in RingDataset.__getitem__ on rank N; peers gloo
                "Connection closed by peer"; with --local-ranks-filter hiding rank 5
                only the Root Cause (exitcode 1) remains.
  shard_missing FileNotFoundError rings_shard_0N_v2.pt before any step (redirects: in
                rank 1's stderr.log only).
  ckpt_size     load_state_dict RuntimeError "size mismatch ... [96, 12] ... [64, 12]".
  wrong_size    DETAIL: "Detected mismatch between collectives" ([898] vs [897]) on all
                ranks; plain: a peer aborts with gloo::EnforceNotMet "352 vs 348" (-6).
  slow_rank     peers "Timed out waiting 12000ms for recv/send"; with --pg-timeout 300
                output just stops until timeout SIGTERMs torchrun (exit 124).
  nan_rings     FloatingPointError "non-finite loss nan at step 3" from the script.
  segv          Root Cause exitcode -11 (SIGSEGV), no traceback from rank N.
  exit4         "ERROR rank N: ... 0 countable growth rings" then exitcode 4 (hidden by
                the filter at np8); with --max-restarts 1 the restart failed in gloo
                connectFullMesh.
  shape_all     "mat1 and mat2 shapes cannot be multiplied (32x13 and 12x64)" on every rank.
  host_mem      DefaultCPUAllocator: can't allocate memory: 160000000000 bytes.
  worker_crash  "DataLoader worker (pid X) is killed by signal: Killed" -> exited unexpectedly.
"""
import argparse
import json
import os
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault552_work"
FEAT = 12
HIDDEN = 64
ROWS = 256
BATCH = 32
STEPS = 6
MAXW = 8


def model_for(hidden=HIDDEN):
    return torch.nn.Sequential(torch.nn.Linear(FEAT, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(552)
    pods = {}
    for p in range(40):
        pods[str(p)] = {"name": f"pod_{p:02d}", "region": ["Baffin", "Svalbard", "Greenland E", "Hudson"][p % 4],
                        "ring_scale": round(0.8 + 0.01 * p, 3)}
    with open(os.path.join(WORK, "pods.json"), "w") as f:
        json.dump(pods, f)
    for r in range(MAXW):
        x = torch.randn(ROWS, FEAT, generator=g)
        pod = torch.randint(0, 40, (ROWS,), generator=g)
        age = (x[:, 0].abs() * 12 + x[:, 1] * 3 + 20).clamp(min=1)
        torch.save({"x": x, "pod": pod, "age": age}, os.path.join(WORK, f"rings_shard_{r:02d}.pt"))
    torch.manual_seed(0)
    torch.save(model_for().state_dict(), os.path.join(WORK, "tusk_init.pt"))
    torch.save(model_for(96).state_dict(), os.path.join(WORK, "tusk_init_wide.pt"))
    print(f"prepared {MAXW} shards, pods.json, tusk_init.pt in {WORK}")


class RingDataset(Dataset):
    def __init__(self, shard, pods, kill_at=None):
        self.x, self.pod, self.age = shard["x"], shard["pod"], shard["age"]
        self.pods = pods
        self.kill_at = kill_at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.kill_at is not None and i == self.kill_at and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        scale = self.pods[str(int(self.pod[i]))]["ring_scale"]
        return self.x[i], self.age[i] * scale


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
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = args.rank == rank
    fault = args.fault
    torch.manual_seed(1000 + rank)

    with open(os.path.join(WORK, "pods.json")) as f:
        pods = json.load(f)
    shard_name = f"rings_shard_{rank:02d}.pt"
    if fault == "shard_missing" and mine:
        shard_name = f"rings_shard_{rank:02d}_v2.pt"
    shard = torch.load(os.path.join(WORK, shard_name), weights_only=True)
    if fault == "ring_key" and mine:
        shard["pod"][3 * BATCH + 5] = 41
    print(f"rank {rank}/{world} loaded {shard_name}: {len(shard['x'])} tusk ring records", flush=True)

    model = model_for()
    ckpt = "tusk_init_wide.pt" if (fault == "ckpt_size" and mine) else "tusk_init.pt"
    model.load_state_dict(torch.load(os.path.join(WORK, ckpt), weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    workers = 1 if fault == "worker_crash" else 0
    ds = RingDataset(shard, pods, kill_at=40 if (fault == "worker_crash" and mine) else None)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=workers)
    it = iter(loader)
    for step in range(STEPS):
        x, y = next(it)
        if fault == "shape_all" and step == 1:
            x = torch.cat([x, x[:, :1] * 0.5], dim=1)  # "ring curvature" feature added on every rank
        if fault == "nan_rings" and mine and step == 3:
            x = x.clone()
            x[:, 2] = float("inf")
        if fault == "segv" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "exit4" and mine and step == 2:
            print(f"ERROR rank {rank}: tusk batch {step} has 0 countable growth rings; refusing to fit", flush=True)
            sys.exit(4)
        if fault == "host_mem" and mine and step == 2:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * resource.getpagesize()
            resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), hard))
            dmat = torch.empty(200000, 200000)  # pairwise ring-distance matrix
            del dmat
        if fault == "slow_rank" and mine and step == 3:
            t0 = time.time()
            limit = 40.0 if args.pg_timeout < 100 else 1e9
            coef = 0.0
            while time.time() - t0 < limit:
                for k in range(20000):  # pure-Python ring curve fit
                    coef += ((k % 97) * 0.001) ** 2 / (1 + k)
        pred = model(x).squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (ring density out of range)")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if fault == "wrong_size" and mine and step == 2:
            flat = torch.cat([flat, torch.zeros(1)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        opt.step()
        mae = (pred - y).abs().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} ring_mae {mae:.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        out = os.path.join(WORK, f"tusk_export_w{world}.pt")
        torch.save(model.state_dict(), out)
        print(f"rank 0 saved export {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Jacana lily-trotting: a small distributed training job with ONE planted fault.

Each rank reads its shard of synthetic jacana foraging walks (pad species, pad
diameter, leaf wetness, toe spread, ...), looks every pad species up in a
buoyancy table, and trains a small MLP that predicts the stride (cm) a jacana
takes to the next lily pad. Gradients are all_reduced by hand (gloo, CPU).
Rank 0 saves an export at the end.

    python fault600.py --prepare            # write shards, lookup table, start checkpoint
    torchrun --nproc-per-node 4 fault600.py --fault keyerror --rank 2

Faults (--fault NAME --rank N):
  none          control run, nothing planted
  keyerror      rank N meets a pad species missing from the buoyancy table (KeyError)
  missing_shard rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size     rank N builds its model with a wider hidden layer; load_state_dict size mismatch
  weights_only  rank N loads a start checkpoint holding a custom object; torch.load weights_only refuses it
  wrong_size    rank N all_reduces a stats tensor with 5 elements where the others send 4
  slow_rank     rank N does long pure-Python work (re-scoring pads) at step 2; peers hit the PG timeout
                (with --pg-timeout 300 the job hangs until an outer timeout ends it)
  nan           rank N's wetness feature turns NaN at step 3; the job's own finiteness check raises
  sigsegv       rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line (pad map checksum) and calls sys.exit(4)
  shape_all     every rank concatenates one feature too many; the first Linear fails (shape bug)
  host_oom      rank N caps its address space (RLIMIT_AS) and then allocates a huge pad-pair table
  worker_crash  the DataLoader worker of rank N segfaults while reading a sample

What happened (torch 2.13.0+cpu, gloo, 2026-12-07 runs):
  none          all ranks run 6 steps, rank 0 saves the export, exit 0
  keyerror      rank N: KeyError: 'victoria_cruziana' in the dataset lookup at step 2; peers see gloo connection closed; exit 1
  missing_shard rank N: FileNotFoundError for shard_N_v2.pt before step 0; the agent stops the others; exit 1
  ckpt_size     rank N: RuntimeError Error(s) in loading state_dict ... size mismatch for 0.weight; exit 1
  weights_only  rank N: _pickle.UnpicklingError Weights only load failed (Unsupported global __main__.TrotterMeta); exit 1
  wrong_size    with DETAIL: "Detected mismatch between collectives" on every rank (shape [5] vs [4]); without DETAIL
                gloo raises nothing: the others go on to step 4 and every rank times out after 12000ms; exit 1
  slow_rank     peers raise gloo "Timed out waiting 12000ms" at step 2, the summary blames a peer; exit 1;
                with --pg-timeout 300: no output after step 1 until timeout(1) ends it (exit 124)
  nan           rank N: FloatingPointError non-finite loss nan at step 3; with --max-restarts 1 the retry fails in
                Gloo connectFullMesh; exit 1
  sigsegv       rank N dies with exitcode -11 (SIGSEGV) at step 2, no traceback; peers see gloo connection closed
  error_exit    rank N prints ERROR ... refusing to train, sys.exit(4); exitcode 4, once instead an abort at exit
                ("terminate called without an active exception", exitcode -6)
  shape_all     every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (16x7 and 6x32); exit 1
  host_oom      rank N: RuntimeError DefaultCPUAllocator: can't allocate memory (6442450944 bytes); exit 1
  worker_crash  rank N: "Unexpected segmentation fault encountered in worker", RuntimeError DataLoader worker is
                killed by signal: Segmentation fault; exit 1
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault600_work"
SPECIES = ["nymphaea_alba", "nymphaea_lotus", "nuphar_lutea", "victoria_amazonica", "euryale_ferox", "nelumbo_nucifera"]
NFEAT = 6


class TrotterMeta:
    """Metadata object pickled into one checkpoint (not allowed under weights_only)."""

    def __init__(self, note):
        self.note = note


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(600)
    for r in range(8):
        n = 96
        feats = torch.rand(n, NFEAT - 1, generator=g)
        species = [SPECIES[int(i)] for i in torch.randint(0, len(SPECIES), (n,), generator=g)]
        stride = (feats @ torch.tensor([9.0, 4.0, -3.0, 6.0, 2.0])).unsqueeze(1) + 12.0
        torch.save({"feats": feats, "species": species, "stride": stride}, f"{WORK}/shard_{r}.pt")
    with open(f"{WORK}/buoyancy.json", "w") as f:
        json.dump({s: round(0.3 + 0.1 * i, 2) for i, s in enumerate(SPECIES)}, f)
    torch.manual_seed(600)
    m = make_model(32)
    torch.save(m.state_dict(), f"{WORK}/start_ckpt.pt")
    torch.save({"model": m.state_dict(), "meta": TrotterMeta("jacana v1")}, f"{WORK}/start_ckpt_meta.pt")
    print("prepared", WORK)


def make_model(hidden):
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class PadDataset(torch.utils.data.Dataset):
    def __init__(self, shard, table, crash):
        self.shard, self.table, self.crash = shard, table, crash

    def __len__(self):
        return len(self.shard["species"])

    def __getitem__(self, i):
        if self.crash and i == 40:
            os.kill(os.getpid(), signal.SIGSEGV)
        sp = self.shard["species"][i]
        buoy = torch.tensor([self.table[sp]])
        return torch.cat([self.shard["feats"][i], buoy]), self.shard["stride"][i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = rank == a.rank
    f = a.fault
    print(f"rank {rank}/{world} jacana lily-trotting: fault={f} target_rank={a.rank}", flush=True)

    shard_path = f"{WORK}/shard_{rank}.pt"
    if f == "missing_shard" and me:
        shard_path = f"{WORK}/shard_{rank}_v2.pt"
    shard = torch.load(shard_path)
    with open(f"{WORK}/buoyancy.json") as fh:
        table = json.load(fh)
    if f == "keyerror" and me:
        shard["species"][2 * 16 + 3] = "victoria_cruziana"

    hidden = 48 if (f == "ckpt_size" and me) else 32
    model = make_model(hidden)
    if f == "weights_only" and me:
        state = torch.load(f"{WORK}/start_ckpt_meta.pt", weights_only=True)["model"]
    else:
        state = torch.load(f"{WORK}/start_ckpt.pt", weights_only=True)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    workers = 1 if f == "worker_crash" else 0
    ds = PadDataset(shard, table, crash=(f == "worker_crash" and me))
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False, num_workers=workers)
    it = iter(loader)
    for step in range(a.steps):
        x, y = next(it)
        if f == "shape_all":
            x = torch.cat([x, x[:, :1]], dim=1)
        if f == "nan" and me and step == 3:
            x[:, 2] = float("nan")
        if f == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "error_exit" and me and step == 2:
            print(f"ERROR: rank {rank}: lily pad map checksum mismatch (expected 0x6a63, got 0x0000); refusing to train", flush=True)
            sys.exit(4)
        if f == "slow_rank" and me and step == 2:
            end = time.time() + 3 * a.pg_timeout + 10
            score = 0
            while time.time() < end:
                score += sum(i * i for i in range(2000)) % 7
        if f == "host_oom" and me and step == 2:
            import resource
            with open("/proc/self/status") as st:
                vm = [int(l.split()[1]) for l in st if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
            pairs = torch.empty(len(ds) * 4096, 4096)  # pad-pair distance table
            del pairs
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        n = 5 if (f == "wrong_size" and me and step == 3) else 4
        stats = torch.tensor([loss.item(), pred.mean().item(), float(len(x)), float(step)] + [0.0] * (n - 4))
        dist.all_reduce(stats)
        stride_cm = stats[1].item() / world
        print(f"rank {rank} step {step} loss {loss.item():.4f} stride_cm {stride_cm:.3f}", flush=True)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/jacana_trotter.pt")
        print("rank 0 saved export", f"{WORK}/export/jacana_trotter.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

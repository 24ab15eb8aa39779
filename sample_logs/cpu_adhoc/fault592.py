"""Batch 592 fault script: dunlin flocks over mudflats.

A small distributed training job (gloo, CPU only) that learns to predict the size of dunlin
flocks settling on tidal mudflat plots from per-plot features (tide height, wind, invertebrate
density, site code).  `--prepare` writes synthetic data into the work dir: one shard per rank,
a site lookup table (site code -> index) and a starting checkpoint (plus a wider checkpoint and
one with a pickled config object used by faults).  Training runs 6 steps; every rank prints
`rank R step S loss L flock_density M` each step; gradients are all_reduced by hand (no DDP);
rank 0 saves an export at the end.

Faults (`--fault NAME --rank N`), one per run:
  none          control, nothing planted
  site_key      rank N's shard holds a plot with site code "MF-99" that the lookup table lacks (KeyError)
  missing_shard rank N reads its shard from a tide window folder that does not exist (FileNotFoundError)
  ckpt_size     rank N starts from the wider checkpoint (hidden 48 instead of 32): load_state_dict size mismatch
  weights_only  rank N loads the checkpoint that carries a pickled FlockConfig with weights_only=True
  tide_sizes    rank N all_reduces its tide histogram with 7 bins instead of 8 (collective size mismatch)
  slow_rank     rank N counts flocks in pure Python before step 2's all_reduce for ~45 s; peers time out
                (with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan_loss      rank N's step-3 batch has an infinite tide height; the program's finiteness check raises
  segv          rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line (tide gauge calibration missing) and sys.exit(4) at step 2
  shape_all     every rank reshapes its features to 12 columns instead of 16 (matmul shape error)
  host_mem      rank N asks for a 64 TiB roost-density grid at step 2 (CPU allocator refuses)
  worker_crash  each rank reads through one DataLoader worker; rank N's worker SIGKILLs itself at step 2

What happened (runs of 2026-12-07, torch 2.13.0+cpu, gloo; logs dunlin_*):
  none          np4 plain: all ranks finish 6 steps, rank 0 saves the export, exit 0.
  site_key      np5 tee: rank 3 KeyError 'MF-99', peers "Connection closed by peer"; np8 filter: traceback hidden, summary names rank 6 exit 1.
  missing_shard np4 redirects: FileNotFoundError only in rank 2's stderr.log; np6 pdsh2: rank 5 FileNotFoundError on worker-1.
  ckpt_size     np3 pymodule: rank 1 load_state_dict "size mismatch for 0.weight" ([48,16] vs [32,16]).
  weights_only  np5 loglevel: rank 4 UnpicklingError "Unsupported global: GLOBAL __main__.FlockConfig".
  tide_sizes    np4 detail: every rank "Detected mismatch between collectives" (rank 1 TensorShape=[7]); np6 plain: no size error, all ranks gloo 12000 ms timeouts.
  slow_rank     np5 tee_trainer: peers gloo "Timed out waiting 12000ms", rank 2 silent then SIGTERM; np4 wrapper (--pg-timeout 300): output stops after step 1, timeout 60 ended it (124).
  nan_loss      np6 prefix: rank 4 FloatingPointError at step 3; np3 pymodule: rank 0 FloatingPointError at step 3.
  segv          np4 plain: rank 3 exitcode -11 (SIGSEGV); np7 restart: rank 5 SIGSEGV, the restart then failed in Gloo connectFullMesh.
  exit4         np5 wrapper: rank 1 "ERROR rank 1: tide gauge calibration missing ..." exit 4; np8 pdsh2: rank 7 same on worker-1.
  shape_all     np3 tee: all ranks RuntimeError "shape '[-1, 12]' is invalid for input of size 256"; rank 1 then SIGABRT (terminate called).
  host_mem      np4 prefix: rank 2 "DefaultCPUAllocator: can't allocate memory: you tried to allocate 70368744177664 bytes".
  worker_crash  np5 loglevel: rank 3 "DataLoader worker (pid ...) is killed by signal: Killed."
"""
import argparse, json, os, signal, sys, time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = os.environ.get("FAULT592_WORK", "/tmp/fault592_work")
NFEAT, HIDDEN, NBINS = 16, 32, 8
SITES = [f"MF-{i:02d}" for i in range(12)]


@dataclass
class FlockConfig:
    hidden: int = HIDDEN
    note: str = "dunlin roost model"


def make_model(hidden=HIDDEN):
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare():
    os.makedirs(os.path.join(WORK, "tide_window_A"), exist_ok=True)
    g = torch.Generator().manual_seed(592)
    table = {s: i for i, s in enumerate(SITES)}
    with open(os.path.join(WORK, "site_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(8):
        feats = torch.randn(6 * 16, NFEAT - 1, generator=g)
        sites = [SITES[(r * 7 + i) % len(SITES)] for i in range(6 * 16)]
        bad_sites = list(sites)
        bad_sites[16 * 2 + 5] = "MF-99"  # used by the site_key fault
        target = feats[:, :3].sum(1, keepdim=True).abs() * 40.0
        torch.save({"feats": feats, "sites": sites, "bad_sites": bad_sites, "target": target},
                   os.path.join(WORK, "tide_window_A", f"shard_{r:02d}.pt"))
    torch.manual_seed(0)
    torch.save(make_model().state_dict(), os.path.join(WORK, "start.pt"))
    torch.save(make_model(48).state_dict(), os.path.join(WORK, "start_wide.pt"))
    torch.save({"model": make_model().state_dict(), "config": FlockConfig()},
               os.path.join(WORK, "start_with_config.pt"))
    print("prepared", WORK)


class PlotSet(torch.utils.data.Dataset):
    def __init__(self, shard, table, use_bad, crash_at=None):
        self.shard, self.table, self.use_bad, self.crash_at = shard, table, use_bad, crash_at

    def __len__(self):
        return self.shard["feats"].shape[0]

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        sites = self.shard["bad_sites"] if self.use_bad else self.shard["sites"]
        code = self.table[sites[i]]
        x = torch.cat([self.shard["feats"][i], torch.tensor([code / len(SITES)])])
        return x, self.shard["target"][i]


def count_flocks_slowly(seconds):
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        for k in range(20000):
            n += (k * 31) % 7
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        return prepare()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    piddir = os.environ.get("FAULT592_PIDDIR")
    if piddir:
        with open(os.path.join(piddir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    me = a.rank == rank
    f = a.fault

    with open(os.path.join(WORK, "site_table.json")) as fh:
        table = json.load(fh)
    window = "tide_window_B" if (f == "missing_shard" and me) else "tide_window_A"
    shard = torch.load(os.path.join(WORK, window, f"shard_{rank % 8:02d}.pt"))

    model = make_model()
    if f == "ckpt_size" and me:
        model.load_state_dict(torch.load(os.path.join(WORK, "start_wide.pt")))
    elif f == "weights_only" and me:
        model.load_state_dict(torch.load(os.path.join(WORK, "start_with_config.pt"), weights_only=True)["model"])
    else:
        model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    ds = PlotSet(shard, table, use_bad=(f == "site_key" and me),
                 crash_at=(16 * 2 + 3 if (f == "worker_crash" and me) else None))
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False,
                                         num_workers=1 if f == "worker_crash" else 0)
    it = iter(loader)
    for step in range(a.steps):
        x, y = next(it)
        if f == "nan_loss" and me and step == 3:
            x = x.clone(); x[4, 0] = float("inf"); x[5, 0] = -float("inf")
        if f == "segv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "exit4" and me and step == 2:
            print(f"ERROR rank {rank}: tide gauge calibration missing for plot MF-{rank:02d}, aborting", file=sys.stderr, flush=True)
            sys.exit(4)
        if f == "shape_all" and step == 1:
            x = x.reshape(-1, 12)
        if f == "host_mem" and me and step == 2:
            grid = torch.empty(2 ** 44, dtype=torch.float32)  # roost density grid, 64 TiB
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite flock-count loss)")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if f == "slow_rank" and me and step == 2:
            count_flocks_slowly(45 if a.pg_timeout < 60 else 400)
        hist = torch.histc(x[:, 0], bins=NBINS, min=-3, max=3)
        if f == "tide_sizes" and me and step == 2:
            hist = hist[:NBINS - 1].clone()
        dist.all_reduce(hist)
        density = pred.detach().mean()
        dist.all_reduce(density)
        print(f"rank {rank} step {step} loss {loss.item():.4f} flock_density {density.item() / world:.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export_rank0.pt"))
        print("rank 0 saved export", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

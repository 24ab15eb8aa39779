"""Vole population cycles from trap counts: a small data-parallel forecaster (batch 501 fault script).

Each rank reads its own shard of live-trap counts (site id, season index, the last four
seasonal counts per 100 trap-nights) and learns to forecast next season's count with a small MLP.
Sites map to a habitat class through a lookup table; the model starts from a shared
checkpoint. Gradients and the metric (mean absolute error in voles per 100 trap-nights) are
averaged with all_reduce over gloo. Rank 0 writes an export at the end.

    python fault501.py --prepare                      # synthetic data into /tmp/fault501_work
    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python fault501.py [--fault NAME --rank N]
    python fault501.py --spawn W --port P [--fault NAME --rank N]    # torch.multiprocessing.spawn

Options: --label (prefix each printed line "rank R: "), --logfmt (progress/errors via logging),
--pg-timeout S (default 12), --steps (default 6).

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none          control, nothing planted
  keyerror      rank N's shard holds a site id that the habitat lookup table lacks -> KeyError
  missing_shard rank N's shard file is deleted before it is opened -> FileNotFoundError
  weights_only  rank N loads a start checkpoint that pickles a custom TrapCalibration object ->
                torch.load(weights_only=True) refuses it (UnpicklingError)
  allreduce_size at step 2 rank N all-reduces a gradient buffer one element longer than its peers'
  slow          at step 2 rank N re-fits the trap calibration in pure Python for 3 x pg-timeout
                seconds; its peers wait in all_reduce (with --pg-timeout 300 the job just hangs)
  nan           at step 3 rank N's count features get a zero trap-effort divisor; the program's
                own finiteness check raises FloatingPointError
  sigsegv       at step 2 rank N sends itself SIGSEGV
  error_exit    at step 1 rank N prints its own ERROR line (negative trap-night count) and sys.exit(4)
  shape_all     every rank: the habitat embedding is concatenated on the wrong axis at step 0
                -> RuntimeError from the first linear layer (no single rank at fault)
  host_oom      rank N caps its address space (RLIMIT_AS, +1.5 GiB) and then tries to build a
                6 GiB season x site density grid -> the CPU allocator fails
  worker_crash  rank N's DataLoader worker (num_workers=1) kills itself with SIGKILL at step 2

What happened (the runs of 2026-12-06, logs vole_<fault>_np<W>_r<N>_<form>):
  none          all 4 ranks print steps 0-5, rank 0 writes the export; exit 0.
  keyerror      rank N: KeyError: 'S-9917' before step 0; peers fail in all_reduce (gloo connection closed/reset).
  missing_shard rank N: FileNotFoundError for shard_N.pt.missing; peers fail in all_reduce.
  weights_only  rank N: _pickle.UnpicklingError "Weights only load failed" (Unsupported global
                __main__.TrapCalibration); torch.distributed.launch / torchrun SIGTERMs the rest.
  allreduce_size the ring neighbour of rank N aborts: terminate called after gloo::EnforceNotMet
                "op.preamble.length <= op.nbytes. 164 vs 160" (exit 134); the others, rank N included,
                see connection reset/closed.
  slow          peers: "Timed out waiting 12000ms for recv/send operation" at step 2; rank N then
                "Connection closed by peer". With --pg-timeout 300 nothing fails: output stops after
                step 1 and timeout(1) ends the job (exit 124).
  nan           rank N: FloatingPointError "non-finite feature at step 3 on rank N: 64 trap-density
                values are nan/inf"; peers fail in all_reduce, or mp.spawn SIGTERMs them.
  sigsegv       rank N dies silently of SIGSEGV at step 2 (agent summary exitcode -11, or the shell's
                "Segmentation fault", exit 139); peers see gloo connection reset/closed.
  error_exit    rank N prints "ERROR rank N: trap sheet for season 1 has negative trap-nights (-12)..."
                and exits 4 with no traceback; peers fail in all_reduce.
  shape_all     every rank: RuntimeError "mat1 and mat2 shapes cannot be multiplied (32x4 and 8x32)" at step 0.
  host_oom      rank N: RuntimeError "DefaultCPUAllocator: can't allocate memory: you tried to allocate
                6400000000 bytes. Error code 12"; mp.spawn SIGTERMs the rest.
  worker_crash  rank N: RuntimeError "DataLoader worker (pid X) is killed by signal: Killed." before step 0
                (the crashing batch is prefetched); peers fail in all_reduce.
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

WORK = "/tmp/fault501_work"
N_SITES = 24
LAGS = 4
N_HAB = 5
MAX_W = 8


class TrapCalibration:
    """Per-site trap efficiency (a custom object, which weights_only loading refuses)."""

    def __init__(self, eff):
        self.eff = eff


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(501)
    sites = [f"S-{1000 + i}" for i in range(N_SITES)]
    habitat = {s: i % N_HAB for i, s in enumerate(sites)}
    with open(os.path.join(WORK, "habitat_lookup.json"), "w") as f:
        json.dump(habitat, f)
    for r in range(MAX_W):
        n = 96
        site_idx = torch.randint(0, N_SITES, (n,), generator=g)
        phase = torch.rand(n, generator=g) * 6.28
        t = torch.arange(LAGS + 1).float()
        # 3-4 year vole cycle in counts per 100 trap-nights
        counts = 20 + 15 * torch.sin(phase[:, None] + t[None, :] * 1.7) + torch.randn(n, LAGS + 1, generator=g)
        effort = 80 + 40 * torch.rand(n, generator=g)
        torch.save({"site": [sites[i] for i in site_idx], "counts": counts, "trap_nights": effort},
                   os.path.join(WORK, f"shard_{r}.pt"))
    model = VoleNet()
    torch.save(model.state_dict(), os.path.join(WORK, "start.pt"))
    torch.save({"model": model.state_dict(), "calibration": TrapCalibration([0.9] * N_SITES)},
               os.path.join(WORK, "start_calibrated.pt"))
    print(f"prepared {MAX_W} shards, lookup table and start checkpoint in {WORK}")


class VoleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.hab = nn.Embedding(N_HAB, 4)
        self.body = nn.Sequential(nn.Linear(LAGS + 4, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, lags, hab, bug=False):
        e = self.hab(hab)
        x = torch.cat([lags, e], dim=0 if bug else 1)
        return self.body(x).squeeze(-1)


class TrapShard(Dataset):
    def __init__(self, path, habitat, rank, fault, fault_rank):
        d = torch.load(path)
        self.counts = d["counts"]
        self.effort = d["trap_nights"]
        self.rank = rank
        self.fault = fault
        self.fault_rank = fault_rank
        sites = list(d["site"])
        if fault == "keyerror" and rank == fault_rank:
            sites[37] = "S-9917"  # a site added in the field, never entered in the lookup table
        self.hab = torch.tensor([habitat[s] for s in sites])

    def __len__(self):
        return len(self.counts)

    def __getitem__(self, i):
        if (self.fault == "worker_crash" and self.rank == self.fault_rank
                and torch.utils.data.get_worker_info() is not None and i == 40):
            os.kill(os.getpid(), signal.SIGKILL)
        c = self.counts[i]
        return c[:LAGS] / 50.0, self.hab[i], c[LAGS] / 50.0, self.effort[i]


def main_worker(rank, world, args, log):
    def out(msg):
        if args.logfmt:
            log.info(msg)
        elif args.label:
            print(f"rank {rank}: {msg}", flush=True)
        else:
            print(msg, flush=True)

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    fr = args.rank
    fault = args.fault
    mine = rank == fr
    torch.manual_seed(0)
    out(f"rank {rank}/{world} joined gloo group, pg timeout {args.pg_timeout}s, fault={fault}")

    with open(os.path.join(WORK, "habitat_lookup.json")) as f:
        habitat = json.load(f)
    shard = os.path.join(WORK, f"shard_{rank}.pt")
    if fault == "missing_shard" and mine:
        shard = os.path.join(WORK, f"shard_{rank}.pt.missing")  # the copy to this node never arrived
    ds = TrapShard(shard, habitat, rank, fault, fr)
    nw = 1 if (fault == "worker_crash" and mine) else 0
    dl = DataLoader(ds, batch_size=16, shuffle=False, num_workers=nw)

    model = VoleNet()
    if fault == "weights_only" and mine:
        sd = torch.load(os.path.join(WORK, "start_calibrated.pt"), weights_only=True)["model"]
    else:
        sd = torch.load(os.path.join(WORK, "start.pt"), weights_only=True)
    model.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    it = iter(dl)
    for step in range(args.steps):
        try:
            lags, hab, target, effort = next(it)
        except StopIteration:
            it = iter(dl)
            lags, hab, target, effort = next(it)
        if fault == "nan" and mine and step == 3:
            effort = effort * 0.0  # a site sheet with trap-nights left blank
        if fault == "error_exit" and mine and step == 1:
            msg = f"ERROR rank {rank}: trap sheet for season {step} has negative trap-nights (-12); refusing to train on it"
            if args.logfmt:
                log.error(msg)
            else:
                print(msg, flush=True)
            sys.exit(4)
        density = lags * 100.0 / effort[:, None]
        if not torch.isfinite(density).all():
            raise FloatingPointError(
                f"non-finite feature at step {step} on rank {rank}: {int((~torch.isfinite(density)).sum())} trap-density values are nan/inf")
        if fault == "host_oom" and mine and step == 1:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * resource.getpagesize()
            resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 29), hard))
            grid = torch.zeros(2000, 400, 1000, dtype=torch.float64)  # season x site x cell, 6.4 GB
            del grid
        if fault == "sigsegv" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "slow" and mine and step == 2:
            # re-fit the trap calibration in pure Python (no collective calls meanwhile)
            t_end = time.time() + min(3 * args.pg_timeout, 900)
            acc = 0.0
            while time.time() < t_end:
                for k in range(20000):
                    acc += (k % 7) * 0.5
        pred = model(lags, hab, bug=(fault == "shape_all" and step == 0))
        loss = ((pred - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if fault == "allreduce_size" and mine and step == 2:
            flat = torch.cat([flat, torch.zeros(1)])  # an extra calibration term appended on this rank only
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        opt.step()
        mae = ((pred - target).abs().mean() * 50.0).detach().reshape(1)
        dist.all_reduce(mae)
        out(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.3f}")

    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "vole_forecaster_export.pt"))
        out(f"rank 0 wrote export {os.path.join(WORK, 'vole_forecaster_export.pt')}")
    dist.barrier()
    dist.destroy_process_group()


def run(rank, world, args):
    log = logging.getLogger("vole")
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
        try:
            main_worker(rank, world, args, log)
        except SystemExit:
            raise
        except BaseException:
            log.exception("training failed")
            logging.shutdown()
            sys.exit(1)
    else:
        main_worker(rank, world, args, log)


def spawn_entry(i, world, args):
    run(i, world, args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--label", action="store_true")
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

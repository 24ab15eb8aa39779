"""Mirage refraction mapping: a small distributed (gloo, CPU) training job for batch 557.

Each rank reads its own shard of synthetic ray samples (8 features per ray plus an
atmospheric layer id), looks the layer's refractive index up in a shared table, and
trains a small MLP that maps a ray to its apparent (mirage) displacement. Gradients
are averaged with all_reduce; every rank prints
`rank R step S loss L deviation M` each step; rank 0 writes an export at the end.

    python fault557.py --prepare                      # writes /tmp/fault557_work
    python fault557.py [--fault NAME --rank N] [--pg-timeout S] [--label] [--logfmt]
    python fault557.py --spawn W ...                  # torch.multiprocessing.spawn

Faults (--fault NAME --rank N plants one):
  none            control, nothing planted
  lut_key         rank N meets layer id 9 at step 2; the index table has layers 0..5 (KeyError)
  shard_missing   rank N opens its shard from a folder that does not exist (FileNotFoundError)
  ckpt_size       rank N builds the map with hidden=48, the start checkpoint has 32 (size mismatch)
  allreduce_size  rank N all_reduces a 3-element stats tensor at step 3, the others 2 elements
  slow_rank       rank N does ~30 s of pure-Python ray tracing at step 2; peers time out (12 s)
  hang            rank N waits forever for a "refraction cache" at step 2 (use --pg-timeout 300)
  nan_check       rank N's features get an inf at step 3; the program's own check raises FloatingPointError
  segv            rank N sends itself SIGSEGV at step 2
  error_exit      rank N prints its own ERROR line and calls sys.exit(4) at step 1
  shape_all       every rank concatenates the index twice at step 1 (matmul shape error)
  worker_crash    rank N's DataLoader worker SIGKILLs itself while loading (worker exited unexpectedly)

What happened (after the runs; machine heavily loaded by other jobs):
  none            np3 tee, np5 bashloop: every rank prints steps 0-5, rank 0 exports, exit 0.
  lut_key         np3 mpitag r2: KeyError: 'layer_9' on rank 2 after step 1; peers: gloo Connection closed by peer.
  shard_missing   np4 srunlabel r2: FileNotFoundError on rank 2 in torch.load; peers print nothing more; timeout, exit 124.
  ckpt_size       np3 spawn r2: load_state_dict size mismatch (32 vs 48) in process 2; spawn SIGTERMs the rest; exit 1.
  allreduce_size  np4 mpitag r2: no size error from gloo; two ranks time out (12000ms recv), two see Connection closed; exit 1.
  slow_rank       np4 pdsh2 r1: ranks 0, 2, 3 time out (12000ms) in all_reduce; agent SIGTERMs rank 1; exit 1.
  hang            np3 bashloop r2 --pg-timeout 300: output stops after step 1, no error; timeout 60 s, exit 124.
  nan_check       np3 logfmt r0: inf in rank 0's features -> NaN grads via all_reduce; every rank's check raises at step 4; exit 1.
  segv            np3 legacy r1: rank 1 exitcode -11 (SIGSEGV); peers Connection reset by peer; exit 1.
  error_exit      np3 files r1: rank1.log ends with its ERROR line (exit 4); peers Connection closed; they did not exit; timeout, exit 124.
  shape_all       np3 bashloop: every rank RuntimeError mat1 and mat2 shapes cannot be multiplied (16x10 and 9x32); exit 1.
  worker_crash    np3 ranklabel r1: DataLoader worker (pid N) is killed by signal: Killed on rank 1; peers Connection closed; exit 1.
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault557_work"
N_LAYERS = 6
STEPS = 6

log = logging.getLogger("mirage")
OPTS = None
RANK = 0


def out(msg, err=False):
    if OPTS.logfmt:
        (log.error if err else log.info)(msg)
        return
    if OPTS.label:
        msg = f"rank {RANK}: {msg}"
    print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def prepare():
    g = torch.Generator().manual_seed(557)
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        x = torch.randn(96, 8, generator=g)
        layer = torch.randint(0, N_LAYERS, (96,), generator=g)
        y = torch.stack([x[:, 0] * 0.3 + x[:, 1] * 0.1, x[:, 2] * 0.2], dim=1)
        torch.save({"x": x, "layer": layer, "y": y}, f"{WORK}/shards/shard_{r}.pt")
    lut = {f"layer_{k}": 1.0 + 0.00029 * (1 - k / 10) for k in range(N_LAYERS)}
    with open(f"{WORK}/refraction_lut.json", "w") as f:
        json.dump(lut, f, indent=1)
    torch.save(MirageMap(32).state_dict(), f"{WORK}/start.pt")
    print(f"prepared {WORK}")


class MirageMap(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.inp = nn.Linear(9, hidden)
        self.out = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


class RayShard(torch.utils.data.Dataset):
    def __init__(self, data, crash):
        self.data = data
        self.crash = crash

    def __len__(self):
        return self.data["x"].shape[0]

    def __getitem__(self, i):
        if self.crash and i >= 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data["x"][i], self.data["layer"][i], self.data["y"][i]


def trace_rays_python(seconds):
    # pure-Python ray march through the layers (deliberately slow)
    t0 = time.time()
    acc = 0.0
    while time.time() - t0 < seconds:
        for k in range(20000):
            acc += (k % 7) * 1e-9
    return acc


def run(rank, world):
    global RANK
    RANK = rank
    fault = OPTS.fault
    me = OPTS.rank == rank
    if OPTS.logfmt:
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=OPTS.pg_timeout))
    out(f"mirage map: rank {rank}/{world} ready (pg timeout {OPTS.pg_timeout}s)")

    shard_dir = f"{WORK}/shards"
    if fault == "shard_missing" and me:
        shard_dir = f"{WORK}/shards_refr"
    data = torch.load(f"{shard_dir}/shard_{rank}.pt")
    with open(f"{WORK}/refraction_lut.json") as f:
        lut = json.load(f)

    hidden = 48 if (fault == "ckpt_size" and me) else 32
    model = MirageMap(hidden)
    model.load_state_dict(torch.load(f"{WORK}/start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    loader = torch.utils.data.DataLoader(
        RayShard(data, crash=(fault == "worker_crash" and me)),
        batch_size=16,
        num_workers=1 if fault == "worker_crash" else 0,
    )
    it = iter(loader)
    for step in range(STEPS):
        x, layer, y = next(it)
        ids = layer.tolist()
        if fault == "lut_key" and me and step == 2:
            ids[3] = 9
        n = torch.tensor([lut[f"layer_{i}"] for i in ids]).unsqueeze(1)
        n = (n - 1.0) * 1000.0
        if fault == "error_exit" and me and step == 1:
            out(f"ERROR: refraction table has no entry for altitude band 3 on rank {rank}; aborting", err=True)
            sys.exit(4)
        if fault == "slow_rank" and me and step == 2:
            trace_rays_python(30)
        if fault == "hang" and me and step == 2:
            while not os.path.exists(f"{WORK}/refraction_cache.ready"):
                time.sleep(1)
        if fault == "segv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "nan_check" and me and step == 3:
            x = x.clone()
            x[0, 0] = float("inf")
        feats = torch.cat([x, n], dim=1)
        if fault == "shape_all" and step == 1:
            feats = torch.cat([x, n, n], dim=1)
        pred = model(feats)
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        dev = (pred - y).abs().mean().detach()
        stats = torch.stack([loss.detach(), dev])
        if fault == "allreduce_size" and me and step == 3:
            stats = torch.cat([stats, torch.ones(1)])
        dist.all_reduce(stats)
        stats /= world
        out(f"rank {rank} step {step} loss {loss.item():.4f} deviation {dev.item():.4f}")
        time.sleep(0.15)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export/mirage_map.pt")
        out(f"exported {WORK}/export/mirage_map.pt (mean loss {stats[0].item():.4f})")
    dist.destroy_process_group()


def spawn_entry(rank, world, port, opts):
    global OPTS
    OPTS = opts
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    main_rank(rank, world)


def main_rank(rank, world):
    if OPTS.logfmt:
        try:
            run(rank, world)
        except Exception:
            log.exception("training step failed")
            sys.exit(1)
    else:
        run(rank, world)


def main():
    global OPTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--label", action="store_true")
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    OPTS = ap.parse_args()
    if OPTS.prepare:
        prepare()
        return
    if OPTS.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(OPTS.spawn, OPTS.port, OPTS), nprocs=OPTS.spawn)
        return
    main_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()

"""Batch 509 fault script: quarry blast vibration forecasting (CPU, gloo).

Each rank reads its own shard of blast records (charge per delay, distance to the
monitoring station, hole depth, site id), looks up the site's geology constants in
a table, and trains a small MLP (DDP, gloo) that forecasts the peak particle
velocity (PPV, mm/s) at the station.  It starts from a checkpoint, runs 6 steps,
prints `rank R step S loss L ppv_mae M` every step and rank 0 saves an export.

    python fault509.py --prepare                  # synthetic data into /tmp/fault509_work
    python fault509.py --fault NAME --rank N      # under a launcher (RANK/WORLD_SIZE/... in env)
    python fault509.py --spawn W --fault NAME --rank N   # torch.multiprocessing.spawn inside

Faults (one per run, planted on rank N unless said otherwise):
  none           control, nothing planted
  keyerror       rank N's shard holds blasts from site "QX-17", which the geology table lacks -> KeyError
  missing_shard  rank N looks for this quarter's survey shard, which was never delivered -> FileNotFoundError
  ckpt_size      rank N resumes from the older checkpoint (hidden 24, not 32) -> load_state_dict size mismatch
  wrong_size     rank N all-reduces a 3-element metric vector where the others send 2 -> gloo size error
  slow           rank N re-fits the attenuation law in pure Python at step 3; peers time out (PG timeout)
                 (with --pg-timeout 300 the job just hangs until `timeout` ends it)
  nan            rank N's shard has a NaN charge; the program's own finiteness check raises FloatingPointError
  segv           rank N sends itself SIGSEGV at step 2
  exit4          rank N prints its own ERROR line (expired seismograph calibration) and sys.exit(4)
  shape_all      every rank adds the hole-depth column twice -> 5 features into a 4-input model (matmul error)
  worker_crash   rank N's DataLoader worker is killed (SIGKILL) while loading -> worker died
  memblow        rank N builds a dense blast x grid attenuation matrix (~1 TiB) -> CPU allocator refuses

Launcher forms: bashloop, ranklabel, srunlabel, mpitag, files, spawn, legacy, logfmt, tee, pdsh2.

What happened (runs of 2026-12-06, host shared with other jobs):
  none          np3 tee, np5 bashloop: every rank prints steps 0-5, rank 0 exports; exit 0.
  keyerror      rank N raises KeyError: 'QX-17' in __getitem__ at step 1; peers fail on gloo "Connection closed by
                peer" (one on a 12 s recv timeout); np4 run exit 124 (processes slow to exit on the loaded host), np6 exit 1.
  missing_shard rank 1 raises FileNotFoundError for shard_r1_2026q4.pt before init; rank 0's TCPStore times out
                "2/3 clients joined", rank 2 gets DistStoreError wait timeout; exit 1.
  ckpt_size     rank 3 raises RuntimeError "Error(s) in loading state_dict ... size mismatch"; peers fail in DDP's
                parameter-shape check on "Connection closed by peer"; exit 1.
  wrong_size    no gloo size error is printed: most ranks fail with 12000 ms send/recv timeouts in the step-2
                all_reduce, one on "Connection closed by peer"; exit 1.
  slow          peers raise gloo 12000 ms timeouts at step 3, rank N later "Connection closed by peer"; exit 1.
                With --pg-timeout 300 output stops after step 2 with no error until `timeout` ends it; exit 124.
  nan           rank 0 raises FloatingPointError (non-finite loss) at step 1; mp.spawn SIGTERMs the others; exit 1.
  segv          rank 3 dies with SIGSEGV (torchrun: exitcode -11) before step 2; peers closed/reset; exit 1.
  exit4         rank N prints its own ERROR line after step 1 and exits 4; peers "Connection closed"; exit 4.
  shape_all     every rank raises "mat1 and mat2 shapes cannot be multiplied (32x5 and 4x32)" at step 0; exit 1.
  worker_crash  rank 1 raises "DataLoader worker (pid N) is killed by signal: Killed."; peers follow; exit 1.
  memblow       rank 2 raises "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes"; exit 1.
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
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault509_work"
SITES = ["QA-01", "QA-02", "QB-05", "QC-11"]
HIDDEN = 32
STEPS = 6

log = None
LABEL = False
RANK = 0


def say(msg, level="info"):
    if log is not None:
        getattr(log, level)(msg)
    else:
        print((f"rank {RANK}: " if LABEL else "") + msg, flush=True)


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(509)
    table = {s: {"idx": i, "k": 1140.0 + 90 * i, "beta": 1.6 + 0.05 * i} for i, s in enumerate(SITES)}
    with open(f"{WORK}/geology.json", "w") as f:
        json.dump(table, f, indent=1)
    for r in range(8):
        n = 256
        charge = torch.rand(n, generator=g) * 400 + 50       # kg per delay
        dist_m = torch.rand(n, generator=g) * 900 + 100      # m
        depth = torch.rand(n, generator=g) * 15 + 5          # m
        site = [SITES[int(i)] for i in torch.randint(0, 4, (n,), generator=g)]
        torch.save({"charge": charge, "dist": dist_m, "depth": depth, "site": site}, f"{WORK}/shards/shard_r{r}.pt")
        bad = dict(charge=charge.clone(), dist=dist_m, depth=depth, site=list(site))
        bad["site"][37] = "QX-17"
        torch.save(bad, f"{WORK}/shards/shard_r{r}_qx.pt")
        nanb = dict(charge=charge.clone(), dist=dist_m, depth=depth, site=site)
        nanb["charge"][40:48] = float("nan")
        torch.save(nanb, f"{WORK}/shards/shard_r{r}_nan.pt")
    torch.manual_seed(0)
    torch.save(make_model(HIDDEN).state_dict(), f"{WORK}/start.pt")
    torch.save(make_model(24).state_dict(), f"{WORK}/start_v1.pt")
    print("prepared", WORK)


def make_model(hidden):
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class Blasts(Dataset):
    def __init__(self, path, table, fault, kill_worker):
        self.d = torch.load(path)
        self.table = table
        self.fault = fault
        self.kill_worker = kill_worker

    def __len__(self):
        return len(self.d["charge"])

    def __getitem__(self, i):
        if self.kill_worker and i >= 64:
            os.kill(os.getpid(), signal.SIGKILL)
        geo = self.table[self.d["site"][i]]
        q, r, h = self.d["charge"][i], self.d["dist"][i], self.d["depth"][i]
        sd = r / torch.sqrt(q)                                  # scaled distance
        ppv = geo["k"] * sd ** (-geo["beta"])                    # USBM attenuation law
        cols = [torch.log(sd), torch.log(q), h / 20, torch.tensor(float(geo["idx"]) / 4)]
        if self.fault == "shape_all":
            cols.append(h / 20)                                  # depth added twice by a refactor
        return torch.stack(cols).float(), torch.log(ppv).float().reshape(1)


def refit_attenuation(seconds):
    t0 = time.time()
    acc = 0.0
    while time.time() - t0 < seconds:
        for k in range(20000):
            acc += (k % 7) * 1e-9
    return acc


def worker(local_rank, args, spawn_world=None):
    global RANK, log, LABEL
    if spawn_world is not None:
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(spawn_world))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    RANK = rank
    LABEL = args.label
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}/{world}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("ppv_forecast")
    planted = args.fault != "none" and (rank == args.rank or args.fault == "shape_all")
    try:
        run(rank, world, args, planted)
    except Exception:
        if log is not None:
            log.exception("training failed on rank %d", rank)
            sys.exit(1)
        raise


def run(rank, world, args, planted):
    f = args.fault
    with open(f"{WORK}/geology.json") as fh:
        table = json.load(fh)
    shard = f"{WORK}/shards/shard_r{rank}.pt"
    if planted and f == "missing_shard":
        shard = f"{WORK}/shards/shard_r{rank}_2026q4.pt"
    elif planted and f == "keyerror":
        shard = f"{WORK}/shards/shard_r{rank}_qx.pt"
    elif planted and f == "nan":
        shard = f"{WORK}/shards/shard_r{rank}_nan.pt"
    if not os.path.exists(shard):
        open(shard, "rb")  # raises FileNotFoundError with the path
    ds = Blasts(shard, table, f, kill_worker=planted and f == "worker_crash")
    nw = 1 if (planted and f == "worker_crash") else 0
    dl = DataLoader(ds, batch_size=32, shuffle=False, num_workers=nw)

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    say(f"rank {rank}/{world} joined (gloo), forecasting PPV on {len(ds)} blasts from {shard}")

    ck = f"{WORK}/start_v1.pt" if (planted and f == "ckpt_size") else f"{WORK}/start.pt"
    model = make_model(HIDDEN)
    model.load_state_dict(torch.load(ck))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)

    it = iter(dl)
    for step in range(STEPS):
        if planted and f == "memblow" and step == 2:
            n_blasts = 1 << 20
            grid = torch.empty(n_blasts, 1 << 18)                # blast x ground-grid attenuation matrix
            grid.fill_(0.0)
        if planted and f == "slow" and step == 3:
            refit_attenuation(400 if args.pg_timeout > 100 else 30)
        if planted and f == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if planted and f == "exit4" and step == 2:
            say(f"ERROR rank {rank}: seismograph calibration for station ST-4 expired 2026-11-30; "
                f"refusing to train on uncalibrated PPV readings", "error")
            sys.exit(4)
        x, y = next(it)
        pred = ddp(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (check charge/distance inputs)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        mae = (pred.detach().exp() - y.exp()).abs().mean()
        metric = torch.tensor([loss.item(), mae.item()])
        if planted and f == "wrong_size" and step == 2:
            metric = torch.tensor([loss.item(), mae.item(), float(len(x))])
        dist.all_reduce(metric)
        metric /= world
        say(f"rank {rank} step {step} loss {loss.item():.4f} ppv_mae {mae.item():.3f}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_ppv.pt")
        say(f"exported model to {WORK}/export_ppv.pt (mean loss {metric[0].item():.4f})")
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        import torch.multiprocessing as mp
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(worker, args=(args, args.spawn), nprocs=args.spawn)
    else:
        worker(0, args)


if __name__ == "__main__":
    main()

"""A hundred-and-ninety-seventh hand-run batch: TIME-SERIES ANOMALY DETECTION WITH AN AUTOENCODER.

Every rank generates (once) and reads its own synthetic multivariate sensor series from
/tmp/fault197_work/series/sensor_R.pt (8 sensors, sines plus noise plus a few injected spikes), cuts it into
sliding windows of --window steps, and trains a small 1-D convolutional autoencoder (8 sensors -> latent 8 ->
8 sensors) under DDP on gloo, starting from ckpt/ae_init.pt (saved by rank 0).  It prints `rank R step S loss L`
(loss all_reduced).  Then each rank scores its windows by reconstruction error, takes the config's quantile of
the errors as its local threshold, the thresholds are all_reduced (mean), anomalies are counted per sensor and
the counts all_gathered; rank 0 prints the totals.  destroy_process_group() ends the job.

Faults:
  window    - rank N's window is off by its series length (window longer than the series): program's ValueError
  sensors   - every rank: config n_sensors=6 while the series and init checkpoint have 8 channels
  nofile    - rank N reads series/sensors_R.pt (typo), FileNotFoundError
  quantile  - rank N uses quantile 99 (percent instead of fraction): torch.quantile RuntimeError
  nanrec    - rank N's series has a NaN-filled block; the program's reconstruction check raises
  gatherlen - rank N all_gathers counts for 9 sensors (an extra 'all sensors' slot) against 8
  cfgkey    - every rank: the config names the threshold key 'q_threshold', the code reads 'threshold_q'
  ckpt      - rank N builds the model with latent 16 from an old config and loads ckpt/ae_init.pt (latent 8)
  rescan    - rank N rescans its whole history (--stall seconds) before the threshold all_reduce
  sigkill   - rank N sends itself SIGKILL after step 2
  exit2     - rank N prints its own 'sensor clock skew' error line and exits with code 2
  none      - control, clean run

What happened (filled in after the runs):
  window    - rank N: ValueError window length 288 exceeds series length 256; peers closed
  sensors   - every rank: load_state_dict size mismatch [16, 8, 5] vs [16, 6, 5] (not the conv)
  nofile    - rank N: FileNotFoundError .../series/sensors_N.pt; peers closed by peer in DDP()
  quantile  - rank N: RuntimeError quantile() q must be in the range [0, 1] but got 99
  nanrec    - rank N: FloatingPointError reconstruction is not finite at step 0 (832 values)
  gatherlen - another rank aborts on gloo::EnforceNotMet 36 vs 32 (SIGABRT); rank N reset by peer
  cfgkey    - every rank: KeyError 'threshold_q' after training
  ckpt      - rank N: size mismatch for enc.2.weight [8, 16, 5] vs [16, 16, 5]; peers closed
  rescan    - PG 12 s: peers time out 12000ms in the threshold all_reduce; PG 300 s: hung, killed
  sigkill   - rank N: SIGKILL after step 2 (exitcode -9 / signal SIGKILL); peers closed by peer
  exit2     - rank N: its ERROR sensor clock skew line, exit code 2, no traceback; peers closed
  none      - clean, exit 0, rank 0 prints the anomalies per sensor
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault197_work"
N_SENSORS = 8
SERIES_LEN = 256


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    return p.parse_args()


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def make_logger(a, rank):
    if not a.logfmt:
        return None
    lg = logging.getLogger("tsad")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    return lg


class AE(nn.Module):
    def __init__(self, sensors, latent):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv1d(sensors, 16, 5, padding=2), nn.ReLU(), nn.Conv1d(16, latent, 5, padding=2))
        self.dec = nn.Sequential(nn.Conv1d(latent, 16, 5, padding=2), nn.ReLU(), nn.Conv1d(16, sensors, 5, padding=2))

    def forward(self, x):
        return self.dec(torch.relu(self.enc(x)))


def make_series(rank):
    g = torch.Generator().manual_seed(100 + rank)
    t = torch.arange(SERIES_LEN, dtype=torch.float32)
    base = torch.stack([torch.sin(t / (5 + k) + rank) for k in range(N_SENSORS)])
    x = base + 0.1 * torch.randn(N_SENSORS, SERIES_LEN, generator=g)
    for _ in range(4):
        i = int(torch.randint(0, SERIES_LEN, (1,), generator=g))
        x[int(torch.randint(0, N_SENSORS, (1,), generator=g)), i] += 3.0
    return x


def windows(series, w):
    if w > series.shape[1]:
        raise ValueError(f"window length {w} exceeds series length {series.shape[1]} for this rank")
    return series.unfold(1, w, w // 2).permute(1, 0, 2).contiguous()


def worker(rank, world, a):
    if a.spawn:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    lg = make_logger(a, rank)
    say = (lambda m: lg.info(m)) if lg else (lambda m: print(m, flush=True))
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    cfg = {"n_sensors": N_SENSORS, "latent": 8, "lr": 0.01, "threshold_q": 0.95}
    if a.fault == "sensors":
        cfg["n_sensors"] = 6
    if a.fault == "cfgkey":
        cfg["q_threshold"] = cfg.pop("threshold_q")
    if a.fault == "ckpt" and bad:
        cfg["latent"] = 16
    os.makedirs(f"{WORK}/series", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    path = f"{WORK}/series/sensor_{rank}.pt"
    if not os.path.exists(path):
        torch.save(make_series(rank), path)
    if rank == 0:
        torch.manual_seed(0)
        torch.save(AE(N_SENSORS, 8).state_dict(), f"{WORK}/ckpt/ae_init.pt")
    dist.barrier()
    if a.fault == "nofile" and bad:
        path = f"{WORK}/series/sensors_{rank}.pt"
    series = torch.load(path)
    if a.fault == "nanrec" and bad:
        series[:, 100:140] = float("nan")
    series = (series - series.nanmean(dim=1, keepdim=True)) / 1.5
    win = a.window + (SERIES_LEN if a.fault == "window" and bad else 0)
    x = windows(series, win)
    say(f"rank {rank}: {x.shape[0]} windows of {win} steps x {x.shape[1]} sensors from {path}")
    model = AE(cfg["n_sensors"], cfg["latent"])
    model.load_state_dict(torch.load(f"{WORK}/ckpt/ae_init.pt"))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"])
    for step in range(a.steps):
        opt.zero_grad()
        rec = ddp(x)
        if not torch.isfinite(rec).all():
            raise FloatingPointError(f"rank {rank}: reconstruction is not finite at step {step} "
                                     f"({int((~torch.isfinite(rec)).sum())} non-finite values)")
        loss = ((rec - x) ** 2).mean()
        loss.backward()
        opt.step()
        l = loss.detach().clone()
        dist.all_reduce(l)
        say(f"rank {rank} step {step} loss {l.item() / world:.4f}")
        if a.fault == "sigkill" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.fault == "exit2" and bad and step == 2:
            msg = f"ERROR rank {rank}: sensor clock skew 4.2 s exceeds 1.0 s on series {path}; refusing to score"
            lg.error(msg[6:]) if lg else print(msg, file=sys.stderr, flush=True)
            sys.exit(2)
    with torch.no_grad():
        err = ((model(x) - x) ** 2).mean(dim=2)
    q = cfg["threshold_q"]
    if a.fault == "quantile" and bad:
        q = 99.0
    thr = torch.quantile(err.flatten(), q)
    if a.fault == "rescan" and bad:
        say(f"rank {rank}: threshold drifted, rescanning full sensor history")
        time.sleep(a.stall)
    t = thr.clone()
    dist.all_reduce(t)
    t /= world
    counts = (err > t).sum(dim=0)
    if a.fault == "gatherlen" and bad:
        counts = torch.cat([counts, counts.sum().view(1)])
    out = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(out, counts)
    say(f"rank {rank}: local threshold {thr.item():.4f}, global {t.item():.4f}, {int(counts.sum())} anomalies")
    if rank == 0:
        say(f"anomalies per sensor (all ranks): {torch.stack(out).sum(0).tolist()}")
    dist.destroy_process_group()


def main():
    a = parse()
    if a.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(a.port)
        mp.spawn(worker, args=(a.spawn, a), nprocs=a.spawn)
    else:
        worker(0, 0, a)


if __name__ == "__main__":
    main()

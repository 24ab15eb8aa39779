"""Fjord depth soundings: a small distributed regression job (gloo, CPU) with one planted fault.

Each rank reads its own CSV shard of echo-sounder soundings (station, lat, lon, tide, shore distance,
depth), maps the station to its fjord basin through a lookup table (basins.json), starts from a
checkpoint (start.pt) and trains SoundingNet for 6 steps; rank 0 saves an export at the end.
Every rank prints `rank R step S loss L rmse_m M` each step.

    python fault536.py --prepare                      # writes synthetic data into /tmp/fault536_work
    torchrun --nproc-per-node W fault536.py --fault NAME --rank N [--pg-timeout 12] [--no-ddp]

Faults (--fault, planted on --rank N unless said otherwise):
  none          control: nothing planted
  keyerror      rank N's shard names a station (ST-999) the basin table lacks -> KeyError at step 2
  missing_shard rank N reads its shard from a resampled folder that was never written -> FileNotFoundError
  ckpt_size     rank N resumes from the stale hidden=24 checkpoint -> load_state_dict size mismatch
  wrong_size    rank N all_reduces a depth histogram of 17 bins instead of 16 -> gloo size mismatch
  slow          rank N re-fits its tide table in pure Python at step 2 (45 s) -> peers' collective times out
                (with --pg-timeout 300 and a longer fit: a hang, ended by `timeout`)
  nan           rank N's shard has a NaN depth -> the script's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 3
  exit4         rank N prints its own ERROR line (tide datum check) and calls sys.exit(4) at step 1
  shape_all     every rank: the tide-corrected feature column added at step 3 gives 6 features for a
                5-input layer -> matmul shape error on all ranks
  hostmem       rank N builds a dense 40000x40000 depth grid under a small address-space limit
                -> DefaultCPUAllocator can't allocate memory
  worker_crash  rank N's DataLoader worker is killed (SIGKILL) while loading a batch at step 2

What happened (22 kept runs; labels in the runs' .expect.toml):
  none          np4 and np6: all ranks ran 6 steps, rank 0 saved the export, exit 0
  keyerror      KeyError: 'ST-999' on rank N at step 2, peers get gloo "Connection closed by peer"; with
                --local-ranks-filter 0,1 only the peers' errors and the summary (root cause rank 5) show; exit 1
  missing_shard FileNotFoundError (shards_resampled/...) on rank N before step 0; redirects: only in rank 1's stderr.log; exit 1
  ckpt_size     RuntimeError: Error(s) in loading state_dict ... size mismatch for fc1/fc2/out on rank N; exit 1
  wrong_size    DETAIL: "Detected mismatch between collectives" on every rank (rank 1 TensorShape=[17]);
                plain np8: a peer aborts with gloo::EnforceNotMet "Received data size doesn't match" (SIGABRT); exit 1
  slow          np4: peers raise gloo "Timed out waiting 12000ms", summary blames rank 0; exit 1.
                --pg-timeout 300: output stops after step 1, no error, `timeout` ends it (exit 124)
  nan           FloatingPointError: non-finite loss nan at step 3 on rank N; pdsh2: the second agent also
                loses the c10d store when the first exits; exit 1
  sigsegv       rank N exitcode -11 (SIGSEGV), no traceback; with --max-restarts 1 the restarted attempt
                fails instead in gloo connectFullMesh (connection refused) on rank 1; exit 1
  exit4         rank N's ERROR line then exitcode 4 (filtered out under --local-ranks-filter: only exitcode 4 shows); exit 1
  shape_all     RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x6 and 5x5) on every rank at step 3; exit 1
  hostmem       RuntimeError: DefaultCPUAllocator: can't allocate memory (6400000000 bytes) on rank N; exit 1
  worker_crash  RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed on rank N; exit 1
"""
import argparse
import csv
import datetime
import json
import math
import os
import random
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault536_work"
MAX_WORLD = 8
STEPS = 6
BATCH = 64
N_BASINS = 8
HIST_BINS = 16


class SoundingNet(nn.Module):
    def __init__(self, hidden=32, n_feat=5):
        super().__init__()
        self.basin = nn.Embedding(N_BASINS, 4)
        self.fc1 = nn.Linear(n_feat + 4, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, feats, basin):
        x = torch.cat([feats, self.basin(basin)], dim=1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.out(x).squeeze(1)


class ShardDataset(torch.utils.data.Dataset):
    def __init__(self, rows, basins, crash_at=None):
        self.rows, self.basins, self.crash_at = rows, basins, crash_at

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        r = self.rows[i]
        basin = self.basins[r["station"]]
        feats = torch.tensor([float(r["lat"]) - 60.0, float(r["lon"]) - 5.0, float(r["tide_m"]),
                              float(r["shore_km"]), float(r["slope"])])
        return feats, torch.tensor(basin), torch.tensor(float(r["depth_m"]) / 100.0)


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    rng = random.Random(536)
    stations = [f"ST-{i:03d}" for i in range(40)]
    basins = {s: i % N_BASINS for i, s in enumerate(stations)}
    with open(f"{WORK}/basins.json", "w") as f:
        json.dump(basins, f, indent=1)
    for r in range(MAX_WORLD):
        with open(f"{WORK}/shards/soundings_r{r}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["station", "lat", "lon", "tide_m", "shore_km", "slope", "depth_m"])
            for _ in range(STEPS * BATCH):
                st = rng.choice(stations)
                shore = rng.uniform(0.05, 4.0)
                slope = rng.uniform(0.02, 0.4)
                depth = 20 + 140 * shore * slope + 15 * basins[st] + rng.gauss(0, 4)
                w.writerow([st, f"{rng.uniform(60.5, 61.4):.5f}", f"{rng.uniform(5.0, 7.5):.5f}",
                            f"{rng.uniform(-1.2, 1.2):.3f}", f"{shore:.3f}", f"{slope:.3f}", f"{depth:.2f}"])
    torch.manual_seed(536)
    torch.save(SoundingNet().state_dict(), f"{WORK}/start.pt")
    torch.save(SoundingNet(hidden=24).state_dict(), f"{WORK}/start_h24.pt")
    print(f"prepared {MAX_WORLD} shards, basins.json, start.pt, start_h24.pt in {WORK}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--no-ddp", action="store_true", help="all_reduce gradients by hand instead of DDP")
    a = p.parse_args()
    if a.prepare:
        return prepare()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    torch.manual_seed(100 + rank)

    with open(f"{WORK}/basins.json") as f:
        basins = json.load(f)
    shard_dir = f"{WORK}/shards_resampled" if (a.fault == "missing_shard" and me) else f"{WORK}/shards"
    with open(f"{shard_dir}/soundings_r{rank}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    if a.fault == "keyerror" and me:
        rows[2 * BATCH + 17]["station"] = "ST-999"
    if a.fault == "nan" and me:
        rows[3 * BATCH + 5]["depth_m"] = "nan"
    print(f"rank {rank}/{world}: {len(rows)} soundings from {shard_dir}/soundings_r{rank}.csv", flush=True)

    ckpt = f"{WORK}/start_h24.pt" if (a.fault == "ckpt_size" and me) else f"{WORK}/start.pt"
    model = SoundingNet()
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
    if a.no_ddp:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    else:
        net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    workers = 1 if a.fault == "worker_crash" else 0
    crash_at = 2 * BATCH + 3 if (a.fault == "worker_crash" and me) else None
    loader = torch.utils.data.DataLoader(ShardDataset(rows, basins, crash_at), batch_size=BATCH,
                                         shuffle=False, num_workers=workers)
    if a.fault == "hostmem" and me:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 768 * 2**20, hard))

    for step, (feats, basin, depth) in enumerate(loader):
        if a.fault == "exit4" and me and step == 1:
            print(f"ERROR fjord_train: rank {rank}: soundings_r{rank}.csv fails the tide-datum check "
                  f"(chart datum offset 3.20 m > 0.50 m allowed); refusing to train on it", flush=True)
            sys.exit(4)
        if a.fault == "sigsegv" and me and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "hostmem" and me and step == 2:
            grid = torch.zeros(40000, 40000)  # dense bathymetry grid, 6.4 GB
            depth = depth + grid[0, 0]
        if a.fault == "slow" and me and step == 2:
            # re-fit the harmonic tide table in pure Python
            t0, acc, limit = time.time(), 0.0, (45 if a.pg_timeout < 100 else 10**6)
            while time.time() - t0 < limit:
                for k in range(20000):
                    acc += math.sin(k * 0.0001) * math.cos(k * 0.0003)
        if a.fault == "shape_all" and step == 3:
            feats = torch.cat([feats, (feats[:, 2] * 0.93).unsqueeze(1)], dim=1)  # tide-corrected column
            feats = nn.functional.linear(feats, torch.eye(5, 5))  # datum projection
        pred = net(feats, basin)
        loss = nn.functional.mse_loss(pred, depth)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                                     f"(check soundings_r{rank}.csv rows {step * BATCH}..{step * BATCH + BATCH - 1})")
        opt.zero_grad()
        loss.backward()
        if a.no_ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        hist = torch.histc(depth * 100.0, bins=HIST_BINS + (1 if (a.fault == "wrong_size" and me) else 0),
                           min=0, max=400)
        dist.all_reduce(hist)
        rmse = math.sqrt(loss.item()) * 100.0
        print(f"rank {rank} step {step} loss {loss.item():.4f} rmse_m {rmse:.2f}", flush=True)

    dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/fjord_depth_final.pt")
        print(f"rank 0: saved export to {WORK}/export/fjord_depth_final.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

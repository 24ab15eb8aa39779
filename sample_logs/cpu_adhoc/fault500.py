"""Mead fermentation monitor: a small distributed training job (gloo, CPU) that learns to
predict a batch's specific gravity drop from fermenter sensor readings (temperature, pH,
CO2 bubble rate, must sugar, honey grade, yeast attenuation from a strain lookup table).

Run `python fault500.py --prepare` once (writes /tmp/fault500_work: per-rank fermenter shards,
a yeast-strain lookup table, starting checkpoints), then launch it with torchrun.
Every rank prints `rank R step S loss L gravity_mae M` per step; rank 0 writes an export at the end.

Faults (`--fault NAME --rank N`; one per run):
  none            control, nothing planted
  yeast_key       rank N's fermenter log names a yeast strain missing from the lookup table (KeyError)
  missing_shard   rank N looks for its shard under a cellar folder that does not exist (FileNotFoundError)
  ckpt_size       rank N resumes from the wide (hidden 48) checkpoint of another model version (size mismatch)
  weights_only    rank N loads a checkpoint that pickles a custom BatchNote object (weights_only refusal)
  allreduce_size  rank N appends a temperature-offset element to its flat gradient before all_reduce
  slow_rank       rank N recomputes a sugar curve in pure Python for 45 s at step 3 (peers time out;
                  with --pg-timeout 300 the job hangs until `timeout` ends it)
  nan_gravity     rank N's hydrometer readings turn NaN at step 3; the script's own check raises
  self_signal     rank N sends itself a signal (--kill-with SEGV|KILL|ABRT) at step 2
  logged_exit     rank N prints its own ERROR line (calibration drift) and calls sys.exit(4) at step 2
  shape_all       every rank appends a Brix column to its features: the model's first layer rejects it
  host_oom        rank N caps its address space and allocates a 2 GiB sensor history (host allocator fails)
  worker_crash    rank N's DataLoader worker is SIGKILLed while reading batch 3

What happened (one line per fault, from the runs; details in .scratch/readme_500.md):
  none            all ranks finished 6 steps, rank 0 saved the export, exit 0
  yeast_key       KeyError: 'K1V-1116-wild' on rank N before the first broadcast; peers get gloo "Connection closed by peer"; exit 1
  missing_shard   FileNotFoundError for shards/cellar_B/fermenter_0N.pt on rank N (in its redirected stderr.log); exit 1
  ckpt_size       RuntimeError: Error(s) in loading state_dict for MeadNet: size mismatch (48 vs 32) on rank N; exit 1
  weights_only    _pickle.UnpicklingError: Weights only load failed (__main__.BatchNote) on rank N; exit 1
  allreduce_size  DETAIL: every rank raises "Detected mismatch between collectives" (rank N shape 1314); without DETAIL a peer
                  aborts with gloo EnforceNotMet "Received data size doesn't match" (SIGABRT) and the others get connection resets; exit 1
  slow_rank       peers raise gloo "Timed out waiting 12000ms" at step 3 while rank N prints nothing; with --pg-timeout 300 the
                  output stops after step 2 until `timeout` SIGTERMs torchrun (exit 124)
  nan_gravity     FloatingPointError from the script's own loss check on rank N at step 3; exit 1
  self_signal     rank N dies by SIGSEGV (-11) or SIGKILL (-9) with no traceback; peers get connection resets; exit 1
  logged_exit     rank N prints "ERROR mead_monitor: ... calibration drift ..." and exits 4; peers get "Connection closed by peer"
  shape_all       RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x7 and 6x32) on every rank; exit 1
  host_oom        RuntimeError: DefaultCPUAllocator: can't allocate memory (2147483648 bytes) on rank N; exit 1
  worker_crash    rank N's DataLoader worker is SIGKILLed: "DataLoader worker (pid ...) is killed by signal: Killed", or
                  (when the kill lands mid-transfer) a ConnectionResetError from multiprocessing's resource_sharer; exit 1
"""
import argparse
import json
import math
import os
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault500_work"
FEATURES = 6
HIDDEN = 32
STEPS = 6
BATCH = 16
STRAINS = {"EC-1118": 0.98, "71B-1122": 0.82, "D47": 0.86, "QA23": 0.90, "K1V-1116": 0.95}


class BatchNote:
    def __init__(self, cellar, note):
        self.cellar = cellar
        self.note = note


class MeadNet(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(500)
    names = list(STRAINS)
    for r in range(8):
        n = BATCH * STEPS
        temp = 14 + 8 * torch.rand(n, generator=g)
        ph = 3.2 + 0.8 * torch.rand(n, generator=g)
        co2 = torch.rand(n, generator=g) * 3
        sugar = 0.08 + 0.06 * torch.rand(n, generator=g)
        grade = torch.randint(1, 4, (n,), generator=g).float()
        strain = [names[int(i)] for i in torch.randint(0, len(names), (n,), generator=g)]
        torch.save({"temp": temp, "ph": ph, "co2": co2, "sugar": sugar, "grade": grade, "strain": strain,
                    "fermenter": f"FV-{r:02d}"}, f"{WORK}/shards/fermenter_{r:02d}.pt")
    with open(f"{WORK}/yeast_strains.json", "w") as f:
        json.dump(STRAINS, f, indent=1)
    torch.manual_seed(0)
    torch.save(MeadNet().state_dict(), f"{WORK}/ckpt/start.pt")
    torch.save(MeadNet(48).state_dict(), f"{WORK}/ckpt/start_wide.pt")
    torch.save({"model": MeadNet().state_dict(), "note": BatchNote("cellar-B", "racked on day 14")},
               f"{WORK}/ckpt/start_noted.pt")
    print("prepared", WORK)


class FermenterLog(Dataset):
    def __init__(self, x, y, crash_at=None):
        self.x, self.y, self.crash_at = x, y, crash_at

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.crash_at is not None and i >= self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--kill-with", default="SEGV")
    ap.add_argument("--pg-timeout", type=float, default=12)
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.fault != "none" and rank == a.rank
    torch.manual_seed(1234 + rank)

    with open(f"{WORK}/yeast_strains.json") as f:
        table = json.load(f)
    shard_path = f"{WORK}/shards/fermenter_{rank:02d}.pt"
    if me and a.fault == "missing_shard":
        shard_path = f"{WORK}/shards/cellar_B/fermenter_{rank:02d}.pt"
    shard = torch.load(shard_path)
    strains = list(shard["strain"])
    if me and a.fault == "yeast_key":
        strains[5] = "K1V-1116-wild"
    atten = torch.tensor([table[s] for s in strains])
    x = torch.stack([(shard["temp"] - 18) / 4, (shard["ph"] - 3.6) / 0.4, shard["co2"] - 1.5,
                     (shard["sugar"] - 0.11) / 0.03, shard["grade"] - 2, atten - 0.9], dim=1)
    y = shard["sugar"] * atten * (0.6 + 0.02 * shard["temp"]) * 10
    if a.fault == "shape_all":
        brix = (shard["sugar"] * 250).unsqueeze(1)
        x = torch.cat([x, brix], dim=1)

    model = MeadNet()
    ckpt = f"{WORK}/ckpt/start.pt"
    if me and a.fault == "ckpt_size":
        ckpt = f"{WORK}/ckpt/start_wide.pt"
    if me and a.fault == "weights_only":
        state = torch.load(f"{WORK}/ckpt/start_noted.pt")["model"]
    else:
        state = torch.load(ckpt)
    model.load_state_dict(state)
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    crash_at = 3 * BATCH if (me and a.fault == "worker_crash") else None
    loader = DataLoader(FermenterLog(x, y, crash_at), batch_size=BATCH, shuffle=False,
                        num_workers=1 if crash_at is not None else 0)
    for step, (xb, yb) in enumerate(loader, start=1):
        if me and a.fault == "nan_gravity" and step == 3:
            xb = xb.clone()
            xb[4:9, 3] = float("nan")
        if me and a.fault == "self_signal" and step == 2:
            os.kill(os.getpid(), getattr(signal, "SIG" + a.kill_with))
        if me and a.fault == "logged_exit" and step == 2:
            print(f"ERROR mead_monitor: rank {rank} hydrometer calibration drift 0.0071 SG exceeds limit 0.0020 "
                  f"on {shard['fermenter']}; refusing to train on uncalibrated readings", flush=True)
            sys.exit(4)
        if me and a.fault == "host_oom" and step == 2:
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
            history = torch.zeros(512 << 20, dtype=torch.float32)  # 2 GiB of sensor history
            del history
        if me and a.fault == "slow_rank" and step == 3:
            end = time.time() + 45
            curve = 0.0
            while time.time() < end:
                curve += sum(math.exp(-k / 900.0) for k in range(2000))
        pred = model(xb)
        loss = nn.functional.mse_loss(pred, yb)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} "
                                     f"(non-finite gravity reading on {shard['fermenter']})")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if me and a.fault == "allreduce_size" and step == 2:
            flat = torch.cat([flat, torch.tensor([0.5])])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        opt.step()
        mae = (pred.detach() - yb).abs().mean()
        dist.all_reduce(mae)
        print(f"rank {rank} step {step} loss {loss.item():.5f} gravity_mae {mae.item() / world:.5f}", flush=True)
    dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/mead_monitor.pt")
        print(f"rank 0 saved export {WORK}/export/mead_monitor.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

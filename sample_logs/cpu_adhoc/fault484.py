"""Wildfire spread prediction from fuel and wind grids (batch 484 fault script).

A small CNN reads per-rank shards of 32x32 landscape tiles (fuel model codes, wind u/v,
slope, currently burning mask), maps fuel codes to base spread rates through a lookup
table, and predicts which cells burn in the next interval. gloo backend, CPU only,
DDP (or gradients all_reduced by hand with --manual-allreduce), 6 steps; every rank prints
`rank R step S loss L burn_iou M`; rank 0 writes an export at the end.

  python fault484.py --prepare            # writes shards, fuel table, start checkpoint
  torchrun --nproc-per-node W fault484.py --fault NAME --rank N [--pg-timeout 12]

Faults (one per run, planted on rank N):
  none          control, no fault
  fuel_key      rank N's tile holds fuel code 99, absent from the fuel table -> KeyError 'FM99'
  shard_missing rank N opens a wind shard that does not exist -> FileNotFoundError
  ckpt_size     rank N loads a start checkpoint made for 6 input channels -> size mismatch in load_state_dict
  gather_shape  rank N all_gathers a 5-value fire-front stats tensor where peers send 4 -> gloo size error
  slow_rank     rank N spends ~45 s in pure-Python fire-perimeter tracing at step 3; peers time out
                in the gradient all_reduce (with --pg-timeout 300 the job just hangs)
  nan_check     rank N's wind grid holds inf; the script's own finiteness check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line (empty ignition mask) and sys.exit(4)
  shape_all     every rank: the head's Linear expects 16*8*8 features but gets 16*16*16 -> mat1/mat2 RuntimeError
  host_mem      rank N builds a wind-perturbation ensemble of ~6 GB under a small RLIMIT_AS -> allocator error
  worker_crash  rank N's DataLoader worker SIGKILLs itself on its 3rd tile -> DataLoader worker exited unexpectedly

What happened (22 runs, 2026-12-06, torch 2.13.0+cpu, gloo):
  none          np4 plain and np4 pdsh2: all ranks finish 6 steps, rank 0 saves the export, exit 0.
  fuel_key      np4 r2 tee, np6 r5 pymodule: KeyError 'FM99' on the planted rank, peers get gloo "Connection closed by peer", exit 1.
  shard_missing np3 r1 redirects (traceback only in the log-dir's stderr.log), np5 r3 loglevel: FileNotFoundError for the wind shard, exit 1.
  ckpt_size     np4 r3 tee_trainer, np6 r0 wrapper: load_state_dict "size mismatch for c1.weight" ([16,6,3,3] vs [16,5,3,3]), exit 1.
  gather_shape  np4 r1 detail: DETAIL reports "Detected mismatch between collectives" on every rank (rank 1 TensorShape=[5]);
                np8 r6 plain: rank 6 "ProcessGroupGloo::allgather: invalid tensor size at index 0"; exit 1.
  slow_rank     np5 r4 prefix: ranks 0/3 "Timed out waiting 12000ms" in all_reduce, ranks 1/2 connection closed, rank 4 silent and SIGTERMed, exit 1;
                np4 r2 plain --pg-timeout 300: output stops after step 2, timeout SIGTERMs torchrun at 60 s, exit 124.
  nan_check     np6 r2 filter: rank 2's FloatingPointError is filtered out of the console, only the summary names it; np3 r0 restart: FloatingPointError,
                then the restarted attempt fails at Gloo connectFullMesh (connection refused); exit 1.
  segv          np4 r3 filter: rank 3 exitcode -11 (SIGSEGV) in the summary only; np8 r5 pdsh2: rank 5 SIGSEGV on agent worker-1, both agents exit 1.
  exit4         np5 r1 wrapper, np4 r2 restart: the rank's own ERROR line and exitcode 4 (restart: second attempt fails at connectFullMesh); exit 1.
  shape_all     np3 tee: every rank "mat1 and mat2 shapes cannot be multiplied (4x4096 and 1024x64)", exit 1.
  host_mem      np4 r1 loglevel: "DefaultCPUAllocator: can't allocate memory: you tried to allocate 6291456000 bytes", exit 1.
  worker_crash  np6 r4 prefix, np4 r0 tee_trainer: "DataLoader worker (pid N) is killed by signal: Killed" / "exited unexpectedly", exit 1.
"""
import argparse, json, os, resource, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault484_work"
G = 32
N_TILES = 48


class FireNet(nn.Module):
    def __init__(self, cin=5, head_in=16 * 16 * 16):
        super().__init__()
        self.c1 = nn.Conv2d(cin, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(head_in, 64)
        self.up = nn.Conv2d(16 + 1, 1, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.c1(x))
        h = F.max_pool2d(F.relu(self.c2(h)), 2)          # 16 x 16 x 16
        g = torch.sigmoid(self.head(h.flatten(1)))        # 64 global context values
        g = g.view(-1, 1, 8, 8)
        g = F.interpolate(g, size=(G, G), mode="nearest")
        h = F.interpolate(h, size=(G, G), mode="nearest")
        return self.up(torch.cat([h, g], 1)).squeeze(1)


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    gen = torch.Generator().manual_seed(484)
    table = {f"FM{c}": round(0.2 + 0.15 * c, 3) for c in range(1, 14)}
    with open(f"{WORK}/fuel_table.json", "w") as f:
        json.dump(table, f)
    for r in range(8):
        fuel = torch.randint(1, 14, (N_TILES, G, G), generator=gen)
        wind = torch.randn(N_TILES, 2, G, G, generator=gen) * 4
        slope = torch.rand(N_TILES, G, G, generator=gen)
        burning = (torch.rand(N_TILES, G, G, generator=gen) > 0.93).float()
        nxt = ((F.max_pool2d(burning.unsqueeze(1), 3, 1, 1).squeeze(1) + (fuel > 6).float() * 0.3) > 0.9).float()
        torch.save({"fuel": fuel, "slope": slope, "burning": burning, "next": nxt}, f"{WORK}/shards/fuel_rank{r}.pt")
        torch.save({"wind": wind}, f"{WORK}/shards/wind_rank{r}.pt")
    torch.manual_seed(0)
    torch.save(FireNet().state_dict(), f"{WORK}/init.pt")
    torch.save(FireNet(cin=6).state_dict(), f"{WORK}/init_6ch.pt")
    print("prepared", WORK)


class TileSet(Dataset):
    def __init__(self, fuel, wind, table, crash_at=None):
        self.fuel, self.wind, self.table, self.crash_at = fuel, wind, table, crash_at

    def __len__(self):
        return self.fuel["fuel"].shape[0]

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        codes = self.fuel["fuel"][i]
        rates = torch.empty(G, G)
        uniq = {int(c) for c in codes.flatten()}
        lut = {c: self.table[f"FM{c}"] for c in uniq}
        for c, v in lut.items():
            rates[codes == c] = v
        x = torch.stack([rates, self.wind["wind"][i, 0], self.wind["wind"][i, 1],
                         self.fuel["slope"][i], self.fuel["burning"][i]])
        return x, self.fuel["next"][i]


def trace_perimeter(seconds):
    # pure-Python flood fill over a big synthetic perimeter, repeated until `seconds` pass
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        seen = set()
        stack = [(0, 0)]
        while stack and len(seen) < 200000:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            x, y = p
            if x < 450:
                stack.append((x + 1, y))
            if y < 450:
                stack.append((x, y + 1))
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--manual-allreduce", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        return prepare()

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    torch.manual_seed(1234 + rank)
    print(f"rank {rank}/{world} wildfire spread trainer up, fault={a.fault} target_rank={a.rank}", flush=True)

    with open(f"{WORK}/fuel_table.json") as f:
        table = json.load(f)
    fuel = torch.load(f"{WORK}/shards/fuel_rank{rank}.pt")
    wind_path = f"{WORK}/shards/wind_rank{rank}.pt"
    if a.fault == "shard_missing" and me:
        wind_path = f"{WORK}/shards/wind_rank{rank}_2026-08-14T18.pt"
    wind = torch.load(wind_path)
    if a.fault == "fuel_key" and me:
        fuel["fuel"][5, 10:14, 20:24] = 99
    if a.fault == "nan_check" and me:
        wind["wind"][6, 0, 3, 7] = float("inf")

    crash_at = 2 if (a.fault == "worker_crash" and me) else None
    nw = 1 if a.fault == "worker_crash" else 0
    loader = DataLoader(TileSet(fuel, wind, table, crash_at), batch_size=4, num_workers=nw, shuffle=False)

    model = FireNet(head_in=16 * 8 * 8 if a.fault == "shape_all" else 16 * 16 * 16)
    ckpt = f"{WORK}/init_6ch.pt" if (a.fault == "ckpt_size" and me) else f"{WORK}/init.pt"
    sd = torch.load(ckpt, weights_only=True)
    if a.fault != "shape_all":
        model.load_state_dict(sd)
    if a.manual_allreduce:
        net = model
    else:
        net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)

    it = iter(loader)
    for step in range(a.steps):
        x, y = next(it)
        if a.fault == "segv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "exit4" and me and step == 2:
            print(f"ERROR rank {rank}: ignition mask empty for tile batch {step} (no burning cells); cannot score spread", flush=True)
            sys.exit(4)
        if a.fault == "host_mem" and me and step == 1:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/statm") as f:
                vsz = int(f.read().split()[0]) * resource.getpagesize()
            resource.setrlimit(resource.RLIMIT_AS, (vsz + (512 << 20), hard))
            ens = torch.empty((1500, 2, 512, 1024))  # ~6 GB wind-perturbation ensemble
            ens.normal_()
        if a.fault == "slow_rank" and me and step == 3:
            n = trace_perimeter(45)
            print(f"rank {rank} traced perimeter {n} times", flush=True)
        logits = net(x)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (check wind grids)")
        opt.zero_grad()
        loss.backward()
        if a.manual_allreduce:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        with torch.no_grad():
            pred = (logits > 0).float()
            inter = (pred * y).sum()
            union = ((pred + y) > 0).float().sum().clamp(min=1)
            iou = (inter / union).item()
        stats = torch.tensor([loss.item(), iou, float(y.sum()), float(pred.sum())])
        if a.fault == "gather_shape" and me and step == 3:
            stats = torch.cat([stats, torch.tensor([float(x[:, 4].sum())])])
        out = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(out, stats)
        print(f"rank {rank} step {step} loss {loss.item():.4f} burn_iou {iou:.4f}", flush=True)

    dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/firenet_final.pt")
        print(f"rank 0 saved export {WORK}/export/firenet_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

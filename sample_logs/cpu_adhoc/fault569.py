"""Wadi flood-stage forecaster: a small data-parallel training job (gloo, CPU).

Each rank reads its own shard of rain-gauge readings (synthetic, made by --prepare),
maps every gauge id to its wadi catchment through a lookup table, starts from a
checkpoint, trains 6 steps averaging gradients with all_reduce, and rank 0 writes an
export of the forecaster at the end.  Every rank prints
`rank R step S loss L peak_err M` each step.

Faults (--fault NAME --rank N plants one):
  none           control run, nothing planted
  gauge_key      rank N meets a gauge id that is not in the catchment table (KeyError)
  missing_shard  rank N opens a shard file that does not exist (FileNotFoundError)
  ckpt_size      rank N builds a wider hidden layer than the start checkpoint (load_state_dict size mismatch)
  allreduce_size rank N all-reduces a gradient buffer one element longer than its peers
  slow_rank      rank N does pure-Python work (a basin re-index) before its all_reduce; peers wait
                 (with --pg-timeout 300 and a long --slow-s it is a hang that `timeout` ends)
  nan_loss       rank N gets a NaN gauge reading; the program's own finiteness check raises FloatingPointError
  segv           rank N sends itself SIGSEGV in step 2
  logged_exit    rank N prints its own ERROR line (stale telemetry) and calls sys.exit(4)
  shape_all      every rank stacks one extra feature column (matmul shape error on all ranks)
  host_mem       rank N tries to allocate a huge flood-extent grid under a small RLIMIT_AS
  loader_worker  rank N's DataLoader worker is killed (SIGKILL) while reading a batch

What happened (21 runs, 2026-12-07, torch 2.13.0+cpu, gloo, ports 33400-33420):
  none           np4 bashloop, np6 tee: all 6 steps, export saved, exit 0.
  gauge_key      np6 r3 ranklabel, np3 r1 tee: KeyError: 'WD-9999' on the planted rank in step 2; peers get gloo "Connection closed by peer".
  missing_shard  np5 r2 srunlabel, np4 r3 legacy: FileNotFoundError for shards_2026/shard_N.pt; peers closed/12000ms timeout, or SIGTERMed by the launcher.
  ckpt_size      np4 r1 mpitag, np8 r6 logfmt: load_state_dict "size mismatch for 0.weight ..." on the planted rank; peers fail in their first all_reduce.
  allreduce_size np4 r2 bashloop, np6 r5 pdsh2: a receiving PEER (rank 1 / rank 4) aborts with gloo::EnforceNotMet "Received data size doesn't match expected size"; the planted rank only sees a connection reset.
  slow_rank      np3 r1 logfmt: peers time out after 12000ms, rank 1 then sees connection closed; np3 r2 bashloop (--pg-timeout 300): output stops after step 1, timeout 60 ends it (exit 124).
  nan_loss       np4 r3 spawn, np5 r2 srunlabel: FloatingPointError: non-finite loss nan at step 3 from the script's own check.
  segv           np5 r4 tee: torchrun root cause exitcode -11 (SIGSEGV); np4 r1 files: rank1.log stops silently, exit 139.
  logged_exit    np3 r2 legacy, np5 r3 mpitag: "ERROR rank N: telemetry ... stale" then exit 4, no traceback.
  shape_all      np4 pdsh2: every rank "mat1 and mat2 shapes cannot be multiplied (16x18 and 17x8)" in step 2.
  host_mem       np3 r1 files: DefaultCPUAllocator: can't allocate memory (10752000000 bytes) under the RLIMIT_AS cap.
  loader_worker  np3 r2 ranklabel: "DataLoader worker (pid N) is killed by signal: Killed." before any step completes.
"""
import argparse, json, logging, os, resource, signal, sys, time

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault569_work"
FEAT, HID = 16, 8
LOG = None
PREFIX = ""


def out(msg, level="info"):
    if LOG is not None:
        getattr(LOG, level)(msg)
    else:
        print(PREFIX + msg, flush=True)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(569)
    table = {f"WD-{i:04d}": i % 7 for i in range(200)}
    with open(f"{WORK}/catchments.json", "w") as f:
        json.dump(table, f)
    for r in range(world):
        ids = [f"WD-{(r * 37 + k) % 200:04d}" for k in range(96)]
        rain = torch.rand(96, FEAT, generator=g) * 40.0
        stage = rain.mean(1, keepdim=True) / 10.0 + torch.rand(96, 1, generator=g)
        torch.save({"gauge_ids": ids, "rain": rain, "stage": stage}, f"{WORK}/shard_{r}.pt")
    torch.manual_seed(569)
    torch.save(make_model(HID).state_dict(), f"{WORK}/start.pt")
    print(f"prepared {world} shards, catchment table and start checkpoint in {WORK}")


def make_model(hid):
    return nn.Sequential(nn.Linear(FEAT + 1, hid), nn.ReLU(), nn.Linear(hid, 1))


class GaugeSet(torch.utils.data.Dataset):
    def __init__(self, shard, kill):
        self.s, self.kill = shard, kill

    def __len__(self):
        return len(self.s["gauge_ids"])

    def __getitem__(self, i):
        if self.kill and i >= 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.s["rain"][i], self.s["stage"][i], i


def train(rank, world, a):
    global LOG, PREFIX
    if a.label:
        PREFIX = f"rank {rank}: "
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [wadi][rank {rank}] %(levelname)s %(message)s")
        LOG = logging.getLogger("wadi")
    f, N = a.fault, a.rank
    mine = f != "none" and (rank == N or f == "shape_all")
    from datetime import timedelta
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=a.pg_timeout))
    out(f"rank {rank}/{world} joined gloo group, pg timeout {a.pg_timeout}s")
    with open(f"{WORK}/catchments.json") as fh:
        table = json.load(fh)
    shard_path = f"{WORK}/shard_{rank}.pt"
    if mine and f == "missing_shard":
        shard_path = f"{WORK}/shards_2026/shard_{rank}.pt"
    shard = torch.load(shard_path)
    model = make_model(12 if (mine and f == "ckpt_size") else HID)
    model.load_state_dict(torch.load(f"{WORK}/start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = GaugeSet(shard, mine and f == "loader_worker")
    if f == "loader_worker":
        it = iter(torch.utils.data.DataLoader(ds, batch_size=16, num_workers=1))
    else:
        it = iter(torch.utils.data.DataLoader(ds, batch_size=16))
    for step in range(1, 7):
        rain, stage, idx = next(it)
        if mine and f == "logged_exit" and step == 1:
            out(f"ERROR rank {rank}: telemetry for catchment {rank % 7} is stale (last gauge reading 2026-11-29T03:00Z); refusing to train", "error")
            sys.exit(4)
        ids = [shard["gauge_ids"][int(i)] for i in idx]
        if mine and f == "gauge_key" and step == 2:
            ids[5] = "WD-9999"
        catch = torch.tensor([float(table[g]) for g in ids]).unsqueeze(1)
        x = torch.cat([rain / 40.0, catch / 7.0], 1)
        if mine and f == "nan_loss" and step == 3:
            x[3, 2] = float("nan")
        if mine and f == "shape_all" and step == 2:
            x = torch.cat([x, rain[:, :1] / 40.0], 1)
        if mine and f == "host_mem" and step == 2:
            with open("/proc/self/status") as st:
                vm = [int(l.split()[1]) for l in st if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))
            grid = torch.zeros(7, 4000, 4000, 12, dtype=torch.float64)  # flood-extent grid per catchment
        if mine and f == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        pred = model(x)
        loss = ((pred - stage) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} on rank {rank} at step {step} (gauge batch {ids[0]}..{ids[-1]})")
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if mine and f == "allreduce_size" and step == 2:
            flat = torch.cat([flat, torch.zeros(1)])
        if mine and f == "slow_rank" and step == 2:
            t0, acc = time.time(), 0
            while time.time() - t0 < a.slow_s:  # re-index basins in pure Python
                acc += sum(k * k for k in range(20000))
        dist.all_reduce(flat)
        flat /= world
        o = 0
        for p in model.parameters():
            n = p.numel(); p.grad.copy_(flat[o:o + n].view_as(p)); o += n
        opt.step()
        m = torch.tensor([loss.item(), (pred - stage).abs().max().item()])
        dist.all_reduce(m)
        out(f"rank {rank} step {step} loss {m[0].item() / world:.4f} peak_err {m[1].item() / world:.4f}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_wadi_forecaster.pt")
        out(f"rank 0 saved export {WORK}/export_wadi_forecaster.pt")
    dist.barrier()
    dist.destroy_process_group()
    out(f"rank {rank} done")


def spawned(rank, world, a):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    train(rank, world, a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", type=int, default=0)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--slow-s", type=float, default=30)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare(a.prepare); return
    torch.set_num_threads(1)
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawned, args=(a.spawn, a), nprocs=a.spawn)
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

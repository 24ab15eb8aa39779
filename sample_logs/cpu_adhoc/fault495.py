"""Glacier lake outburst flood (GLOF) risk scoring: a small distributed training job (gloo, CPU).

Each rank reads its shard of synthetic lake records (lake area, moraine dam slope, freeboard,
upstream glacier retreat, region code), looks up a per-region hazard prior in a table, and trains
a small MLP that scores outburst risk. Gradients are all_reduced by hand. Rank 0 exports the
model at the end.

Faults (--fault NAME --rank N):
  none          control, no fault
  region_key    rank N meets a region code missing from the prior table (KeyError)
  missing_shard rank N's shard file was never written (FileNotFoundError)
  ckpt_size     rank N builds a wider hidden layer than the start checkpoint (load_state_dict size mismatch)
  weights_only  rank N's start checkpoint holds a pickled custom object; torch.load(weights_only=True) refuses it
  wrong_size    rank N all_reduces a gradient buffer one element short (gloo size mismatch)
  slow_rank     rank N does pure-Python hazard simulation before step 3; peers time out in all_reduce
  nan_check     rank N's freeboard column goes NaN; the program's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line (dam survey stale) and sys.exit(4)
  shape_all     every rank builds the feature matrix with one column too few (matmul shape error)
  host_mem      rank N caps its address space and builds a huge risk grid (MemoryError)
  worker_crash  rank N's DataLoader worker dies (os._exit in the worker) at step 2
  skip_allreduce rank N skips the step-2 loss all_reduce; the ranks' collectives fall out of step

What happened (torch 2.13.0+cpu, gloo, 2026-12-06):
  none          np4 plain and np8 pdsh2: all ranks finish 6 steps, rank 0 exports, exit 0 (a first np4 run hit
                'terminate called without an active exception' at teardown; a barrier before destroy fixed it)
  region_key    KeyError: 'KAR' on the planted rank before step 0; torchrun SIGTERMs the rest
  missing_shard FileNotFoundError for shard_4_v2.pt, traceback only in the --redirects log dir
  ckpt_size     RuntimeError: size mismatch in load_state_dict on the planted rank
  weights_only  _pickle.UnpicklingError: Weights only load failed (__main__.Custom not allowed)
  wrong_size    DETAIL: 'Detected mismatch between collectives' on all ranks; plain: gloo::EnforceNotMet abort (SIGABRT) on the planted rank
  slow_rank     peers hit gloo 'Timed out waiting 12000ms'; with --pg-timeout 300 the job hangs until timeout kills it
  nan_check     FloatingPointError from the finiteness check (rank hidden by --local-ranks-filter)
  sigsegv       exitcode -11 (SIGSEGV) on the planted rank, peers see connection closed/reset
  error_exit    own ERROR line then exit 4; with --max-restarts 1 the second attempt ended in a gloo timeout on rank 0
  shape_all     RuntimeError mat1 and mat2 shapes cannot be multiplied (32x5 and 6x32) on every rank
  host_mem      RuntimeError DefaultCPUAllocator: can't allocate memory (8589934592 bytes)
  worker_crash  RuntimeError: DataLoader worker exited unexpectedly with exit code 3
  skip_allreduce DETAIL: collective mismatch (shape [] vs [257]); plain: a peer rank aborts on gloo size mismatch (132 vs 4)
"""
import argparse, os, sys, time, signal, math, resource
import torch, torch.nn as nn, torch.distributed as dist
from datetime import timedelta

WORK = "/tmp/fault495_work"
NFEAT = 6
REGIONS = ["HKH", "AND", "ALP", "TIE", "ALA", "PAT", "CAU", "NZL"]


class Custom:  # for weights_only
    def __init__(self):
        self.note = "surveyed 2019"


def prepare(max_world=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for r in range(max_world):
        x = torch.rand(256, NFEAT - 1, generator=g)
        reg = torch.randint(0, len(REGIONS), (256,), generator=g)
        y = (x[:, 0] * 0.5 + x[:, 1] * 0.3 - x[:, 2] * 0.2 + 0.1 * torch.rand(256, generator=g)).clamp(0, 1)
        torch.save({"x": x, "region": [REGIONS[i] for i in reg], "y": y}, f"{WORK}/shard_{r}.pt")
    table = {k: 0.1 * (i + 1) for i, k in enumerate(REGIONS)}
    torch.save(table, f"{WORK}/region_prior.pt")
    torch.manual_seed(1)
    torch.save(make_model(32).state_dict(), f"{WORK}/start.pt")
    torch.save({"model": make_model(32).state_dict(), "survey": Custom()}, f"{WORK}/start_meta.pt")
    print("prepared", WORK)


def make_model(hidden):
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1), nn.Sigmoid())


class LakeSet(torch.utils.data.Dataset):
    def __init__(self, x, crash):
        self.x, self.crash = x, crash
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        if self.crash and i >= 64:
            os._exit(3)
        return i


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare(); return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == rank
    f = a.fault
    if f == "host_mem" and me:
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
    shard = f"{WORK}/shard_{rank}.pt" if not (f == "missing_shard" and me) else f"{WORK}/shard_{rank}_v2.pt"
    data = torch.load(shard)
    table = torch.load(f"{WORK}/region_prior.pt")
    regions = list(data["region"])
    if f == "region_key" and me:
        regions[37] = "KAR"
    prior = torch.tensor([table[r] for r in regions])
    ncols = NFEAT - 1 if f == "shape_all" else NFEAT
    x = torch.cat([data["x"], prior[:, None]], 1)[:, :ncols]
    y = data["y"]
    if f == "nan_check" and me:
        x[11, 2] = float("nan")
    hidden = 48 if (f == "ckpt_size" and me) else 32
    model = make_model(hidden)
    if f == "weights_only" and me:
        sd = torch.load(f"{WORK}/start_meta.pt", weights_only=True)["model"]
    else:
        sd = torch.load(f"{WORK}/start.pt", weights_only=True)
    model.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(LakeSet(x, f == "worker_crash" and me), batch_size=32,
                                         num_workers=1 if (f == "worker_crash" and me) else 0)
    it = iter(loader)
    for step in range(a.steps):
        idx = next(it)
        xb, yb = x[idx], y[idx]
        if not torch.isfinite(xb).all():
            raise FloatingPointError(f"rank {rank}: non-finite lake features in batch {step} (freeboard column)")
        if f == "sigsegv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "error_exit" and me and step == 2:
            print(f"ERROR rank {rank}: dam survey for shard {rank} is stale (older than 5 years); refusing to score", flush=True)
            sys.exit(4)
        if f == "slow_rank" and me and step == 3:
            s = 0.0
            t0 = time.time()
            while time.time() - t0 < a.pg_timeout * 3 + 30:
                for k in range(20000):
                    s += math.sin(k) * math.exp(-k * 1e-5)
        if f == "host_mem" and me and step == 2:
            grid = torch.zeros(4096, 4096, 64, dtype=torch.float64)  # 8 GiB hazard grid
        pred = model(xb).squeeze(1)
        loss = ((pred - yb) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if f == "wrong_size" and me and step == 1:
            flat = flat[:-1].clone()
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel(); p.grad.copy_(flat[off:off + n].view_as(p)); off += n
        opt.step()
        lt = loss.detach().clone()
        if not (f == "skip_allreduce" and me and step == 2):
            dist.all_reduce(lt)
        lt /= world
        mae = (pred - yb).abs().mean().item()
        print(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae:.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_glof.pt")
        print("rank 0 exported", f"{WORK}/export_glof.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

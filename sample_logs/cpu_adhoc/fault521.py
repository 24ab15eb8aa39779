"""Batch 521 fault script: permafrost thaw-depth regression from borehole temperature sensors.

Each rank reads its own shard of borehole sensor readings (temperatures at 8 depths), maps the
borehole id to a site through a lookup table, and trains a small MLP (DDP, gloo, CPU) to predict the
active-layer thaw depth. 6 steps; each step every rank prints
`rank R step S loss L thaw_mae_cm M`; rank 0 saves an export at the end.

Faults (`--fault NAME --rank N`):
  none            control, nothing planted
  keyerror        rank N's shard holds a borehole id missing from the site lookup table (KeyError, step 2)
  missing_shard   rank N's shard file was never written (FileNotFoundError at start-up)
  ckpt_size       rank N builds the model with hidden=48 and loads the hidden=32 checkpoint (size mismatch)
  allreduce_size  rank N all-reduces a 3-element metric tensor where the others send 2 (step 3)
  slow_rank       rank N does pure-Python sensor de-spiking for --slow-s seconds at step 2; peers time out
  nan             rank N's thaw depth gets a NaN; the script's finiteness check raises FloatingPointError (step 3)
  sigsegv         rank N sends itself SIGSEGV at step 4
  error_exit      rank N logs its own ERROR line (sensor calibration) and calls sys.exit(4) at step 2
  shape_all       every rank appends a depth-bin column (9 features for an 8-input model) at step 1
  worker_crash    the DataLoader worker of rank N is SIGKILLed while reading item 5
  host_mem        rank N allocates a 3-D interpolation grid at a bogus resolution (host allocation fails)

What happened (gloo, CPU, torch 2.13.0+cpu; peers of a dead rank fail with 'Connection closed by peer'):
  none            all ranks finish 6 steps, rank 0 saves the export, exit 0
  keyerror        KeyError: 'BH-X17' on rank N at step 2; peers fail in backward (one aborts: terminate called)
  missing_shard   FileNotFoundError on rank N before DDP; peers fail in DDP's parameter check or time out
  ckpt_size       load_state_dict size mismatch (32 vs 48) on rank N; peers fail in DDP's parameter check
  allreduce_size  no gloo size error: the others finish the all-reduce with wrong values, rank N times out in it,
                  the others then time out in the next DDP all-reduce
  slow_rank       peers time out after 12 s in DDP's all-reduce; with --pg-timeout 300 the job just stops (timeout 124)
  nan             FloatingPointError from the script's own check on rank N at step 3
  sigsegv         rank N dies with SIGSEGV at step 4 (launcher: exitcode -11); peers see closed/reset connections
  error_exit      rank N's ERROR line, exit code 4; the launcher stops the rest
  shape_all       every rank: mat1 and mat2 shapes cannot be multiplied (8x9 and 8x32) at step 1
  worker_crash    rank N: DataLoader worker killed by signal: Killed, exited unexpectedly, before step 0
  host_mem        rank N: DefaultCPUAllocator: can't allocate memory (442368000000000 bytes) at start-up
"""
import argparse, logging, os, signal, sys, time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault521_work"
NFEAT, HID = 8, 32
LOG = None
ARGS = None


def out(rank, msg, err=False, level="info"):
    if ARGS.logfmt:
        getattr(LOG, level)(msg)
        return
    pre = f"rank {rank}: " if ARGS.label else ""
    print(pre + msg, file=sys.stderr if err else sys.stdout, flush=True)


def prepare(maxw=8):
    os.makedirs(WORK, exist_ok=True)
    g = np.random.default_rng(521)
    table = {f"BH{i:03d}": i % 5 for i in range(40)}
    np.save(f"{WORK}/site_table.npy", table, allow_pickle=True)
    for r in range(maxw):
        temps = g.normal(-2.0, 1.5, size=(64, NFEAT)).astype(np.float32)
        ids = np.array([f"BH{(r * 5 + j) % 40:03d}" for j in range(64)])
        depth = (0.6 + 0.1 * temps.mean(1) + 0.02 * g.normal(size=64)).astype(np.float32)
        np.savez(f"{WORK}/shard_{r}.npz", temps=temps, ids=ids, depth=depth)
    torch.manual_seed(0)
    torch.save(make_model(HID).state_dict(), f"{WORK}/init_ckpt.pt")
    print("prepared", WORK)


def make_model(hid):
    return nn.Sequential(nn.Linear(NFEAT, hid), nn.Tanh(), nn.Linear(hid, 1))


class Boreholes(Dataset):
    def __init__(self, d, crash):
        self.t, self.y, self.crash = torch.from_numpy(d["temps"]), torch.from_numpy(d["depth"]), crash

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.crash and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.t[i], self.y[i]


def despike(n_s):
    t0 = time.time(); x = 0.0
    while time.time() - t0 < n_s:
        for k in range(20000):
            x = (x * 1.0000001 + k) % 97.0
    return x


def worker(rank, world):
    global LOG
    a = ARGS
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
        LOG = logging.getLogger("permafrost")
    from datetime import timedelta
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=a.pg_timeout))
    bad = lambda f: a.fault == f and rank == a.rank
    torch.manual_seed(rank)
    if bad("host_mem"):
        res = 48000  # metres -> should have been 48 cells
        out(rank, f"building thaw interpolation grid {res}x{res}x{res}")
        grid = torch.empty(res, res, res, dtype=torch.float32)
    shard = f"{WORK}/shard_{rank}.npz" if not bad("missing_shard") else f"{WORK}/shard_{rank}_2026-07.npz"
    d = np.load(shard)
    table = np.load(f"{WORK}/site_table.npy", allow_pickle=True).item()
    ids = list(d["ids"])
    if bad("keyerror"):
        ids[17] = "BH-X17"
    model = make_model(48 if bad("ckpt_size") else HID)
    model.load_state_dict(torch.load(f"{WORK}/init_ckpt.pt", weights_only=True))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    dl = DataLoader(Boreholes(d, bad("worker_crash")), batch_size=8,
                    num_workers=1 if a.fault == "worker_crash" else 0)
    it = iter(dl)
    for step in range(6):
        x, y = next(it)
        sites = torch.tensor([table[b] for b in ids[step * 8:(step + 1) * 8]], dtype=torch.float32)
        if bad("keyerror") and step == 2:
            sites = torch.tensor([table[b] for b in ids[16:24]])
        if a.fault == "shape_all" and step == 1:
            x = torch.cat([x, sites[:, None] / 5.0], 1)
        if bad("slow_rank") and step == 2:
            out(rank, f"de-spiking raw sensor series for borehole {ids[0]}")
            despike(a.slow_s)
        if bad("error_exit") and step == 2:
            out(rank, f"ERROR calibration offset for borehole {ids[0]} sensor 3 out of range (+41.7 C); aborting",
                err=True, level="error")
            sys.exit(4)
        if bad("sigsegv") and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
        pred = ddp(x).squeeze(1)
        if bad("nan") and step == 3:
            pred = pred * torch.tensor(float("nan"))
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"thaw depth loss is not finite on rank {rank} at step {step}: {loss.item()}")
        opt.zero_grad(); loss.backward(); opt.step()
        m = torch.tensor([(pred - y).abs().mean().item() * 100, 1.0])
        if bad("allreduce_size") and step == 3:
            m = torch.tensor([m[0].item(), 1.0, float(len(ids))])
        dist.all_reduce(m)
        out(rank, f"rank {rank} step {step} loss {loss.item():.4f} thaw_mae_cm {m[0].item() / world:.2f}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_thaw_model.pt")
        out(rank, f"saved export to {WORK}/export_thaw_model.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_entry(rank, world, ns):
    global ARGS
    ARGS = ns
    os.environ["RANK"] = str(rank)
    worker(rank, world)


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--slow-s", type=float, default=30)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    ARGS = p.parse_args()
    if ARGS.prepare:
        prepare(); return
    if ARGS.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(ARGS.spawn, ARGS), nprocs=ARGS.spawn)
        return
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()

"""Batch 580 fault script, theme "kestrel hovering".

A small hover-controller model learns, from per-rank shards of wind readings
(gust, lift, wing-beat rate, ...) and a wind-sector lookup table, how much
correction a kestrel needs to hold its hover. gloo backend, CPU only, DDP
(or hand all_reduce with --no-ddp), 6 steps; every rank prints
`rank R step S loss L hover_err M`; rank 0 saves an export at the end.
`--prepare` writes the shards, the sector table and a start checkpoint.

Faults (--fault NAME --rank N):
  none           control, nothing planted
  bad_sector     rank N's shard names a wind sector missing from the table -> KeyError
  missing_shard  rank N looks for a shard file that is not there -> FileNotFoundError
  ckpt_size      rank N builds a wider hover head; load_state_dict refuses the start checkpoint (size mismatch)
  gather_shape   rank N all_reduces a hover_err vector of the wrong length (collective size mismatch)
  slow_rank      rank N does endless pure-Python wing-beat smoothing at step 2; its peers time out
                 (with --pg-timeout 300 this is a hang that `timeout` ends)
  nan_wind       rank N's gust readings turn NaN at step 3; the script's own finiteness check raises FloatingPointError
  sigsegv        rank N sends itself SIGSEGV at step 2
  error_exit     rank N prints its own ERROR line (perch sensor offline) and sys.exit(4) at step 1
  shape_all      every rank feeds the wing-beat features untransposed -> matmul shape error on every rank
  host_oom       rank N caps its address space and builds a huge thermal map -> MemoryError
  worker_crash   rank N's DataLoader worker SIGKILLs itself -> DataLoader worker killed

What happened (see the kestrel_*.expect.toml files beside the logs):
  none           4 ranks ran 6 steps, rank 0 saved the export, exit 0
  bad_sector     KeyError: 'NNW-gust' on the planted rank before step 0; the agent SIGTERMs the rest and names it (np5 tee, np3 wrapper)
  missing_shard  FileNotFoundError for shard_N.thermals.pt on the planted rank (np3 loglevel; np6 redirects: only in the log-dir's stderr.log)
  ckpt_size      RuntimeError size mismatch in load_state_dict on the planted rank (np4 pymodule, np8 prefix)
  gather_shape   DETAIL: 'Detected mismatch between collectives' on all ranks naming the planted rank; plain gloo: no size error,
                 the step-2 values disagree and every rank then hits the 12 s gloo timeout
  slow_rank      peers hit 'Timed out waiting 12000ms', some abort (terminate called), summary blames a peer (np6);
                 with --pg-timeout 300 the output stops after step 1 and timeout ends it, exit 124 (np4, hung)
  nan_wind       FloatingPointError from the script's check on the planted rank, peers 'Connection closed by peer'
                 (np4 filter: the planted rank is filtered out of the console)
  sigsegv        planted rank exitcode -11 (SIGSEGV), peers 'Connection reset/closed by peer'; with --max-restarts 1 it fails
                 twice; under pdsh2 the second agent also loses the c10d rendezvous store
  error_exit     ERROR line then exit code 4 on the planted rank (np7 filter: the ERROR line is filtered out)
  shape_all      RuntimeError mat1 and mat2 shapes cannot be multiplied on all 5 ranks
  host_oom       MemoryError on rank 2; the --max-restarts 1 attempt then failed at gloo connectFullMesh
  worker_crash   RuntimeError: DataLoader worker (pid N) is killed by signal: Killed on the planted rank
"""
import argparse, json, os, signal, sys, time, datetime, resource

import torch
import torch.nn as nn
import torch.distributed as dist

WORK = os.environ.get("KESTREL_WORK", "/tmp/fault580_work")
SECTORS = ["N", "NE", "E", "SE", "S", "SW", "W", "NW"]
FEAT = 6
HIDDEN = 32


class HoverNet(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.sector_emb = nn.Embedding(len(SECTORS), 4)
        self.body = nn.Sequential(nn.Linear(FEAT + 4, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 2)

    def forward(self, x, sec):
        return self.head(self.body(torch.cat([x, self.sector_emb(sec)], dim=1)))


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(580)
    with open(os.path.join(WORK, "sectors.json"), "w") as f:
        json.dump({s: i for i, s in enumerate(SECTORS)}, f)
    for r in range(8):
        n = 96
        sectors = [SECTORS[i % 8] for i in torch.randint(0, 8, (n,), generator=g).tolist()]
        if r >= 0:
            bad = list(sectors)
            bad[5] = "NNW-gust"
            torch.save({"x": torch.randn(n, FEAT, generator=g), "sectors": bad,
                        "y": torch.randn(n, 2, generator=g)}, os.path.join(WORK, f"shard_{r}_badsector.pt"))
        torch.save({"x": torch.randn(n, FEAT, generator=g), "sectors": sectors,
                    "y": torch.randn(n, 2, generator=g)}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.manual_seed(0)
    torch.save(HoverNet().state_dict(), os.path.join(WORK, "hover_start.pt"))
    print("prepared", WORK)


class WindDataset(torch.utils.data.Dataset):
    def __init__(self, x, sec, y, crash):
        self.x, self.sec, self.y, self.crash = x, sec, y, crash

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.crash and i >= 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.sec[i], self.y[i]


def smooth_wingbeats(n):
    acc = 0.0
    k = 0
    while True:  # pure-Python work, never yields to the collectives
        acc = (acc * 0.999 + (k % 7) * 0.001) % 13.0
        k += 1
        if n and k > n:
            return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-ddp", action="store_true")
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.fault != "none" and (a.rank == rank)
    print(f"[kestrel] rank {rank}/{world} hovering up, fault={a.fault}", flush=True)

    with open(os.path.join(WORK, "sectors.json")) as f:
        table = json.load(f)
    shard = os.path.join(WORK, f"shard_{rank % 8}.pt")
    if me and a.fault == "missing_shard":
        shard = os.path.join(WORK, f"shard_{rank}.thermals.pt")
    if me and a.fault == "bad_sector":
        shard = os.path.join(WORK, f"shard_{rank % 8}_badsector.pt")
    data = torch.load(shard, weights_only=True)
    sec = torch.tensor([table[s] for s in data["sectors"]])
    x, y = data["x"], data["y"]

    model = HoverNet(hidden=HIDDEN + 8 if (me and a.fault == "ckpt_size") else HIDDEN)
    model.load_state_dict(torch.load(os.path.join(WORK, "hover_start.pt"), weights_only=True))
    ddp = model if a.no_ddp else nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    workers = 1 if (me and a.fault == "worker_crash") else 0
    loader = torch.utils.data.DataLoader(WindDataset(x, sec, y, me and a.fault == "worker_crash"),
                                         batch_size=16, num_workers=workers)
    it = iter(loader)
    for step in range(a.steps):
        try:
            xb, sb, yb = next(it)
        except StopIteration:
            it = iter(loader)
            xb, sb, yb = next(it)
        if me and a.fault == "error_exit" and step == 1:
            print(f"ERROR: rank {rank}: perch sensor offline, cannot read wing-beat rate; giving up", flush=True)
            sys.exit(4)
        if me and a.fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if me and a.fault == "slow_rank" and step == 2:
            smooth_wingbeats(0)
        if me and a.fault == "host_oom" and step == 1:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/status") as f:
                vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, hard))
            thermal_map = [bytearray(64 * 2**20) for _ in range(64)]
            print(len(thermal_map))
        if me and a.fault == "nan_wind" and step == 3:
            xb = xb.clone()
            xb[:, 0] = float("nan")
        if a.fault == "shape_all":
            out = model.head(model.body[0].weight @ torch.cat([xb, model.sector_emb(sb)], 1))
        else:
            out = ddp(xb, sb)
        loss = nn.functional.mse_loss(out, yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: hover loss is {loss.item()} (non-finite wind readings)")
        opt.zero_grad()
        loss.backward()
        if a.no_ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        err = (out - yb).abs().mean(0).detach()
        if me and a.fault == "gather_shape" and step == 2:
            err = torch.cat([err, err[:1]])
        dist.all_reduce(err)
        print(f"rank {rank} step {step} loss {loss.item():.4f} hover_err {err.sum().item() / world:.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "hover_export.pt"))
        print("[kestrel] rank 0 saved export hover_export.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

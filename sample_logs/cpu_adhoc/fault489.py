"""Subway ridership forecasting per station: a small distributed (gloo, CPU) training job.

Each rank reads its own shard of hourly station counts (station id, hour, weekday, 4 lagged counts,
target), maps station ids to embedding rows through a lookup table, starts from a checkpoint and trains
a DDP model for 6 steps. Every step it all-gathers per-station counts and all-reduces error stats, then
prints `rank R step S loss L mape M`. Rank 0 saves an export at the end.

    python fault489.py --prepare                      # synthetic data into /tmp/fault489_work
    python fault489.py --fault NAME --rank N          # under a launcher (env RANK/WORLD_SIZE/...)

Faults (one per run, planted on rank N unless said otherwise):
  none          control, nothing planted
  keyerror      rank N's shard holds a station id the lookup table lacks -> KeyError
  missing_shard rank N's shard file is missing -> FileNotFoundError
  ckpt_size     rank N loads a checkpoint built for more stations -> load_state_dict size mismatch
  gather_size   rank N all-gathers a per-station count vector one entry too long -> gloo invalid tensor size
  slow          rank N does ~45 s of pure-Python work before step 3; peers time out after --pg-timeout
  hang          rank N spins forever in pure Python before step 3 (run with --pg-timeout 300, `timeout` ends it)
  nan           rank N's lag features turn to NaN at step 2; the program's own check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 2
  exit4         rank N prints its own ERROR line (holiday calendar missing) and sys.exit(4)
  shape_all     every rank concatenates the embedding with the wrong feature slice -> matmul shape error
  worker_crash  rank N's DataLoader worker is SIGKILLed while loading a batch

What happened (see readme_489.md for the runs):
  none          all ranks finished 6 steps, rank 0 wrote the export, exit 0.
  keyerror      rank N raised KeyError: 'ST9999' building its dataset; peers got 'Connection closed by peer' in DDP set-up (bashloop) or torchrun SIGTERMed them.
  missing_shard rank N raised FileNotFoundError on shards_2026w48/shard_rN.pt; peers got 'Connection closed by peer' in DDP set-up.
  ckpt_size     rank N raised RuntimeError size mismatch for emb.weight in load_state_dict; peers closed-connection errors, or mp.spawn SIGTERMed them.
  gather_size   rank N raised ProcessGroupGloo::allgather invalid tensor size; peers saw a closed connection or a 12 s timeout (np5: one peer hung until `timeout`).
  slow          peers raised gloo 'Timed out waiting 12000ms' after step 2; torchrun SIGTERMed the slow rank and blamed a peer.
  hang          output stopped after step 2; `timeout` ended the run with exit 124.
  nan           rank N raised FloatingPointError from its own finiteness check; peers failed in the next collective.
  segv          rank N died of SIGSEGV after step 1 (exitcode -11 / shell 'Segmentation fault', exit 139); peers saw the connection closed or reset.
  exit4         rank N printed ERROR and exited 4; peers failed in the next collective or were stopped.
  shape_all     RuntimeError mat1 and mat2 shapes cannot be multiplied (32x12 and 14x32) at step 1; mp.spawn showed process 0's and SIGTERMed the rest.
  worker_crash  rank N raised RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed; peers got 'Connection closed by peer'.
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

WORK = "/tmp/fault489_work"
N_STATIONS = 40
STEPS = 6
LOG = None
LABEL = False


def out(rank, msg):
    if LOG is not None:
        if msg.startswith("ERROR: "):
            LOG.error(msg[7:])
        else:
            LOG.info(msg)
    elif LABEL:
        print(f"rank {rank}: {msg}", flush=True)
    else:
        print(msg, flush=True)


class RidershipModel(nn.Module):
    def __init__(self, n_stations=N_STATIONS, dim=8):
        super().__init__()
        self.emb = nn.Embedding(n_stations, dim)
        self.mlp = nn.Sequential(nn.Linear(dim + 6, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, sid, feats, bad_slice=False):
        f = feats[:, :4] if bad_slice else feats
        return self.mlp(torch.cat([self.emb(sid), f], dim=1)).squeeze(1)


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(489)
    table = {f"ST{1000 + i}": i for i in range(N_STATIONS)}
    with open(f"{WORK}/station_table.json", "w") as f:
        json.dump(table, f)
    for r in range(8):
        n = 256
        sids = [f"ST{1000 + int(i)}" for i in torch.randint(0, N_STATIONS, (n,), generator=g)]
        hour = torch.randint(0, 24, (n,), generator=g).float() / 23
        wday = torch.randint(0, 7, (n,), generator=g).float() / 6
        lags = torch.rand(n, 4, generator=g) * 5
        target = lags.mean(1) * (1 + 0.5 * torch.sin(hour * 6.28)) + 0.1 * torch.randn(n, generator=g)
        torch.save({"station": sids, "feats": torch.cat([hour[:, None], wday[:, None], lags], 1),
                    "target": target}, f"{WORK}/shard_r{r}.pt")
    torch.save(RidershipModel().state_dict(), f"{WORK}/init_ckpt.pt")
    torch.save(RidershipModel(n_stations=N_STATIONS + 8).state_dict(), f"{WORK}/init_ckpt_v2.pt")
    print("prepared", WORK)


class ShardSet(Dataset):
    def __init__(self, shard, table, crash=False):
        self.sids = torch.tensor([table[s] for s in shard["station"]])
        self.feats, self.target, self.crash = shard["feats"], shard["target"], crash

    def __len__(self):
        return len(self.target)

    def __getitem__(self, i):
        if self.crash and i >= 100:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.sids[i], self.feats[i], self.target[i]


def train(rank, world, args):
    global LOG
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank {rank}/{world}] %(levelname)s %(name)s: %(message)s")
        LOG = logging.getLogger("subway")
    fault, frank = args.fault, args.rank
    me = fault != "none" and rank == frank
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    with open(f"{WORK}/station_table.json") as f:
        table = json.load(f)
    shard_path = f"{WORK}/shard_r{rank}.pt"
    if me and fault == "missing_shard":
        shard_path = f"{WORK}/shards_2026w48/shard_r{rank}.pt"
    shard = torch.load(shard_path)
    if me and fault == "keyerror":
        shard["station"][17] = "ST9999"
    model = RidershipModel()
    ckpt = f"{WORK}/init_ckpt_v2.pt" if me and fault == "ckpt_size" else f"{WORK}/init_ckpt.pt"
    model.load_state_dict(torch.load(ckpt, weights_only=True))
    ds = ShardSet(shard, table, crash=me and fault == "worker_crash")
    workers = 1 if fault == "worker_crash" else 0
    dl = DataLoader(ds, batch_size=32, shuffle=False, num_workers=workers)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    out(rank, f"start world={world} stations={len(table)} samples={len(ds)} ckpt={os.path.basename(ckpt)}")
    it = iter(dl)
    for step in range(1, STEPS + 1):
        sid, feats, target = next(it)
        if me and fault == "nan" and step == 2:
            feats = feats.clone()
            feats[5:9, 2:] = float("nan")
        if me and fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if me and fault == "exit4" and step == 2:
            out(rank, f"ERROR: holiday calendar {WORK}/calendar_2026.csv not found on rank {rank}; cannot build weekday features")
            sys.exit(4)
        if me and fault in ("slow", "hang") and step == 3:
            t0, x = time.time(), 0
            while fault == "hang" or time.time() - t0 < 45:
                for k in range(100000):
                    x = (x * 31 + k) % 1000003
        pred = ddp(sid, feats, bad_slice=fault == "shape_all")
        if not torch.isfinite(pred).all():
            raise FloatingPointError(f"non-finite prediction at step {step} on rank {rank}: "
                                     f"{int((~torch.isfinite(pred)).sum())} of {pred.numel()} values")
        loss = nn.functional.mse_loss(pred, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        counts = torch.bincount(sid, minlength=N_STATIONS).float()
        if me and fault == "gather_size":
            counts = torch.cat([counts, torch.zeros(1)])
        gathered = [torch.zeros(N_STATIONS) for _ in range(world)]
        dist.all_gather(gathered, counts)
        stats = torch.tensor([loss.item() * len(target),
                              ((pred - target).abs() / target.abs().clamp(min=0.5)).sum().item(), len(target)])
        dist.all_reduce(stats)
        out(rank, f"rank {rank} step {step} loss {stats[0] / stats[2]:.4f} mape {stats[1] / stats[2]:.4f}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_subw.pt")
        out(rank, f"saved export {WORK}/export_subw.pt")
    dist.destroy_process_group()


def main():
    global LABEL
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    args = p.parse_args()
    LABEL = args.label
    if args.prepare:
        return prepare()
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(train, args=(args.spawn, args), nprocs=args.spawn)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.logfmt:
        try:
            train(rank, world, args)
        except Exception:
            LOG.exception("training failed on rank %d", rank)
            sys.exit(1)
    else:
        train(rank, world, args)


if __name__ == "__main__":
    main()

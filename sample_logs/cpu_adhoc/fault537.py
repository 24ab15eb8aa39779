"""Batch 537 fault script: a tiny distributed model of mangrove root growth (gloo, CPU only).

Each rank reads its own shard of synthetic tide/salinity/sediment readings, looks up a per-species
root growth coefficient in a lookup table, starts from a shared checkpoint and trains a small MLP
predicting prop-root growth (mm/day) for 6 steps, all-reducing gradients by hand. Every rank prints
`rank R step S loss L growth_mm M` per step; rank 0 saves an export at the end.

  --prepare                 write shards, lookup table and start checkpoint into /tmp/fault537_work
  --fault NAME --rank N     plant ONE fault on rank N (or on every rank where stated)

Faults:
  none            control run, nothing planted
  keyerror        rank N's shard names a species ("Rhizophora_x") missing from the lookup table -> KeyError
  missing_shard   rank N's shard file was never written -> FileNotFoundError
  ckpt_size       rank N loads a checkpoint with a hidden layer of 48 instead of 32 -> load_state_dict size mismatch
  gather_shape    rank N contributes a wrong-sized tensor to the root-count all_gather -> gloo size error
  slow            rank N recomputes a pure-Python root-branching simulation for ages; peers time out (pg timeout)
                  (with --pg-timeout 300 the job just hangs until `timeout` ends it)
  nan             rank N's salinity reading is NaN; the script's own finiteness check raises FloatingPointError
  segv            rank N sends itself SIGSEGV mid-training
  exit4           rank N prints its own ERROR line (sediment probe out of range) and calls sys.exit(4)
  shape_all       every rank builds its feature matrix with one column too many -> matmul shape RuntimeError
  worker_crash    rank N's DataLoader worker kills itself with SIGKILL -> DataLoader worker killed
  skip_collective rank N skips the gradient all_reduce at step 2; peers end up waiting (gloo timeout)
  hostmem         rank N (address space capped at 3 GiB) tries to build a 4 GiB tide-history buffer -> allocator error

What happened (the kept runs, see the README text):
  none            3 ranks ran 6 steps, rank 0 saved the export, exit 0
  keyerror        rank 2 raised KeyError 'Rhizophora_x' before any collective; peers: gloo "Connection closed by peer"; exit 1
  missing_shard   rank 3 raised FileNotFoundError for shard_rank3_tidal.pt; peers: gloo connection closed; exit 1
  ckpt_size       rank 1 (np4) raised "Error(s) in loading state_dict ... size mismatch"; peers: connection closed; exit 1
  gather_shape    rank 4 raised "ProcessGroupGloo::allgather: invalid tensor size"; torchrun named local_rank 4; exit 1
  slow            pg timeout 12 s: peers raised gloo "Timed out waiting 12000ms", rank 2 kept computing, timeout ended it (124);
                  pg timeout 300 s: output just stopped after "re-simulating root branching", timeout 60 ended it (124)
  nan             rank 3 (files) / rank 2 (spawn) raised FloatingPointError from the script's own check; exit 1
  segv            rank 1 (two torchrun agents): exitcode -11 SIGSEGV in ChildFailedError; rank 2 (bash loop): "Segmentation fault", 139
  exit4           rank 6 (np8) printed ERROR, peers lost the connection, rank 6 never finished exiting: timeout 124;
                  rank 3 (np4) printed ERROR then "terminate called without an active exception", Aborted: 134
  shape_all       every rank raised "mat1 and mat2 shapes cannot be multiplied (16x5 and 4x32)"; exit 1
  worker_crash    rank 2 / rank 1 raised "DataLoader worker (pid ...) is killed by signal: Killed"; exit 1
  skip_collective every rank, rank 3 included (it waits in barrier), raised gloo "Timed out waiting 12000ms"; exit 1
  hostmem         rank 1 raised RuntimeError "DefaultCPUAllocator: can't allocate memory" (not MemoryError); peers lost the
                  connection; the job did not exit by itself, timeout ended it (124)
"""
import argparse
import datetime
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault537_work"
SPECIES = ["Rhizophora_mangle", "Avicennia_germinans", "Laguncularia_racemosa", "Bruguiera_gymnorhiza"]
HIDDEN = 32
NFEAT = 4

log = None
PREFIX = ""


def out(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(PREFIX + msg, file=sys.stderr if err else sys.stdout, flush=True)


def make_model(hidden=HIDDEN):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def prepare(world=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(537)
    for r in range(world):
        feats = torch.rand(64, NFEAT, generator=g)  # tide, salinity, sediment, light
        species = [SPECIES[(r + i) % len(SPECIES)] for i in range(64)]
        torch.save({"feats": feats, "species": species}, f"{WORK}/shard_rank{r}.pt")
    torch.save({s: 0.5 + 0.1 * i for i, s in enumerate(SPECIES)}, f"{WORK}/growth_table.pt")
    torch.save(make_model().state_dict(), f"{WORK}/start_ckpt.pt")
    torch.save(make_model(48).state_dict(), f"{WORK}/start_ckpt_wide.pt")
    print("prepared", WORK)


class RootDataset(torch.utils.data.Dataset):
    def __init__(self, feats, target, crash):
        self.feats, self.target, self.crash = feats, target, crash

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        if self.crash and i >= 16:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.feats[i], self.target[i]


def branching_sim(n):
    # pure-Python root branching recurrence (deliberately slow)
    a = 0
    for i in range(n):
        a = (a * 31 + i) % 1000003
    return a


def train(rank, world, args):
    global PREFIX, log
    if args.ranklabel:
        PREFIX = f"rank {rank}: "
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("mangrove")
    fault = args.fault if (args.fault == "shape_all" or rank == args.rank) else "none"

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    out(f"rank {rank} joined world {world}, pg timeout {args.pg_timeout}s")

    shard_path = f"{WORK}/shard_rank{rank}.pt"
    if fault == "missing_shard":
        shard_path = f"{WORK}/shard_rank{rank}_tidal.pt"
    shard = torch.load(shard_path)
    table = torch.load(f"{WORK}/growth_table.pt")
    if fault == "keyerror":
        shard["species"][5] = "Rhizophora_x"
    coef = torch.tensor([table[s] for s in shard["species"]])
    feats = shard["feats"]
    if fault == "nan":
        feats[3, 1] = float("nan")
    if fault == "shape_all":
        feats = torch.cat([feats, torch.ones(len(feats), 1)], dim=1)
    target = (coef * (1.0 + feats[:, 0] - 0.5 * feats[:, 1])).unsqueeze(1) if fault != "shape_all" \
        else coef.unsqueeze(1)

    model = make_model()
    ckpt = f"{WORK}/start_ckpt_wide.pt" if fault == "ckpt_size" else f"{WORK}/start_ckpt.pt"
    model.load_state_dict(torch.load(ckpt))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    if fault == "hostmem":
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        out(f"rank {rank} building tide history buffer")
        hist = torch.empty(1 << 30, dtype=torch.float32)  # 4 GiB
        hist.fill_(0.0)

    loader = torch.utils.data.DataLoader(RootDataset(feats, target, fault == "worker_crash"),
                                         batch_size=16, num_workers=1 if fault == "worker_crash" else 0)

    # root counts per rank, gathered once
    counts = torch.tensor([float(len(feats))])
    if fault == "gather_shape":
        counts = torch.tensor([float(len(feats)), 0.0, 0.0])
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, counts)

    step = 0
    it = iter(loader)
    while step < 6:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        if fault == "slow" and step == 2:
            out(f"rank {rank} re-simulating root branching")
            branching_sim(10 ** 10)
        if fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "exit4" and step == 2:
            out(f"ERROR rank {rank}: sediment probe reading 412.0 mg/l out of range [0, 80]; aborting", err=True)
            sys.exit(4)
        pred = model(x)
        if not torch.isfinite(pred).all():
            raise FloatingPointError(f"rank {rank}: non-finite root growth prediction at step {step}")
        loss = ((pred - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not (fault == "skip_collective" and step == 2):
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        out(f"rank {rank} step {step} loss {loss.item():.4f} growth_mm {pred.mean().item():.3f}")
        step += 1

    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_rank0.pt")
        out(f"rank 0 saved export {WORK}/export_rank0.pt")
    dist.destroy_process_group()


def spawn_entry(local_rank, world, args):
    train(local_rank, world, args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--ranklabel", action="store_true")
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

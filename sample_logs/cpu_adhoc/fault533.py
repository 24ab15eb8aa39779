"""Harp string tension drift prediction: a small distributed training job with planted faults (batch 533).

Each rank reads its shard of tuning-session records (humidity, temperature, hours since tuning, pluck
strength, string index, plus a string id looked up in a gauge table), predicts the drift of the string's
tension in cents with a small MLP, all-reduces its gradients over gloo (CPU), and prints
`rank R step S loss L drift_mae_cents M` each step.  Rank 0 saves an export at the end.

    python fault533.py --prepare                      # writes /tmp/fault533_work (shards, gauge table, checkpoints)
    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python fault533.py --fault NAME --rank N
    python fault533.py --spawn W --port P --fault NAME --rank N   # torch.multiprocessing.spawn inside

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none            control run, nothing planted
  keyerror        rank N reads the re-tuned shard whose records name string id 'F#7', missing from the gauge table (KeyError)
  missing_shard   rank N looks for its shard in shards_v2/, which was never written (FileNotFoundError)
  ckpt_size       rank N starts from init_wide.pt (hidden 24 instead of 16): load_state_dict size mismatch
  weights_only    rank N starts from init_meta.pt, which pickles a TuningMeta object: torch.load(weights_only=True) refuses it
  gather_size     at step 2 rank N all_gathers a 3-element metric tensor where the others send 1 element
  slow            at step 3 rank N does pure-Python smoothing work for 2.5 x the PG timeout; its peers time out
                  (with --pg-timeout 300 the job just hangs until an outside timeout ends it)
  nan             at step 3 rank N's loss becomes NaN; the program's own finiteness check raises FloatingPointError
  segv            at step 2 rank N sends itself SIGSEGV
  exit4           at step 3 rank N prints its own ERROR line and calls sys.exit(4)
  shape_all       at step 2 every rank appends an extra feature column (a shape bug): mat1/mat2 cannot be multiplied
  hostmem         at step 2 rank N sizes a history buffer by samples x hours x cents (2**41 floats): CPU allocator refuses
  worker_crash    rank N's DataLoader worker is SIGKILLed while loading the batch of step 2

What happened (filled in after the runs; the machine was heavily loaded, so some runs met the 100 s timeout):
  none          all ranks ran 6 steps and rank 0 saved the export; exit 0 (bashloop np4, tee np3).
  keyerror      rank N raised KeyError: 'F#7' in the gauge lookup at step 2; peers failed in all_reduce (connection closed, or gloo's 12000 ms send/recv timeout).
  missing_shard rank N raised FileNotFoundError for shards_v2/shard_000N.pt before its first step; peers failed in their first all_reduce (closed/reset).
  ckpt_size     rank N raised RuntimeError Error(s) in loading state_dict for DriftNet (size mismatch); peers got gloo connection closed.
  weights_only  rank N raised _pickle.UnpicklingError Weights only load failed (TuningMeta); the launcher SIGTERMed the others.
  gather_size   rank N's all_gather raised RuntimeError ProcessGroupGloo::allgather: invalid tensor size (expected (3), got (1)); peers got connection closed.
  slow          rank N stalled at step 3; 12 s later peers raised gloo 'Timed out waiting 12000ms', and rank N failed with connection closed when it came back.
  slow (pg 300) nothing failed; output stopped after step 2 until timeout(1) killed the job at 60 s (exit 124).
  nan           rank N raised FloatingPointError from the program's own check at step 3; peers got connection closed or torchrun's SIGTERM.
  segv          rank N died of SIGSEGV at step 2 (bash 'Segmentation fault', exit 139; or torchrun's exitcode -11); peers got connection closed/reset.
  exit4         rank N printed its ERROR line and called sys.exit(4); leaving with the gloo group alive it aborted ('terminate called without an active exception', exit 134); peers got connection closed.
  shape_all     every rank raised RuntimeError mat1 and mat2 shapes cannot be multiplied (16x7 and 6x16) at step 2; mp.spawn reported process 1.
  hostmem       rank N raised RuntimeError DefaultCPUAllocator: can't allocate memory (8796093022208 bytes) at step 2; peers got connection closed.
  worker_crash  rank N's DataLoader raised RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed; peers got connection closed.
"""
import argparse
import datetime
import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault533_work"
STEPS = 6
BATCH = 16
STRINGS = [f"{n}{o}" for o in range(1, 7) for n in "CDEFGAB"]

log = None
LABEL = False
RANK = 0


def out(msg):
    if log is not None:
        log.info(msg)
    else:
        print((f"rank {RANK}: " if LABEL else "") + msg, flush=True)


def err(msg):
    if log is not None:
        log.error(msg)
    else:
        print((f"rank {RANK}: " if LABEL else "") + msg, file=sys.stderr, flush=True)


class TuningMeta:
    def __init__(self, luthier, pitch_a4):
        self.luthier = luthier
        self.pitch_a4 = pitch_a4


class DriftNet(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def prepare():
    g = torch.Generator().manual_seed(533)
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    table = {s: 0.5 + 0.05 * i for i, s in enumerate(STRINGS)}
    with open(f"{WORK}/gauge_table.json", "w") as f:
        json.dump(table, f)
    for r in range(8):
        n = 128
        x = torch.rand(n, 5, generator=g)
        ids = [STRINGS[int(i)] for i in torch.randint(0, len(STRINGS), (n,), generator=g)]
        gauge = torch.tensor([table[s] for s in ids])
        y = 3.0 * x[:, 0] - 2.0 * x[:, 1] + 0.5 * x[:, 2] * gauge + 0.1 * torch.randn(n, generator=g)
        torch.save({"x": x, "ids": ids, "y": y}, f"{WORK}/shards/shard_{r:04d}.pt")
        ids2 = list(ids)
        ids2[BATCH * 2 + 3] = "F#7"
        torch.save({"x": x, "ids": ids2, "y": y}, f"{WORK}/shards/shard_{r:04d}_retuned.pt")
    torch.manual_seed(533)
    torch.save(DriftNet().state_dict(), f"{WORK}/ckpt/init.pt")
    torch.save(DriftNet(24).state_dict(), f"{WORK}/ckpt/init_wide.pt")
    torch.save({"model": DriftNet().state_dict(), "meta": TuningMeta("Salvi workshop", 440.0)},
               f"{WORK}/ckpt/init_meta.pt")
    print(f"prepared {WORK}")


class ShardSet(Dataset):
    def __init__(self, path, table, kill_at=None):
        d = torch.load(path)
        self.x, self.ids, self.y = d["x"], d["ids"], d["y"]
        self.table = table
        self.kill_at = kill_at

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.kill_at is not None and i >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        gauge = self.table[self.ids[i]]
        return torch.cat([self.x[i], torch.tensor([gauge])]), self.y[i]


def train(rank, world, args):
    global RANK
    RANK = rank
    fault = args.fault if (args.rank == rank or args.fault in ("shape_all", "none")) else "none"
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    with open(f"{WORK}/gauge_table.json") as f:
        table = json.load(f)
    shard = f"{WORK}/shards/shard_{rank:04d}.pt"
    if fault == "keyerror":
        shard = f"{WORK}/shards/shard_{rank:04d}_retuned.pt"
    if fault == "missing_shard":
        shard = f"{WORK}/shards_v2/shard_{rank:04d}.pt"
    kill_at = BATCH * 2 if fault == "worker_crash" else None
    ds = ShardSet(shard, table, kill_at)
    dl = DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=1 if fault == "worker_crash" else 0)

    model = DriftNet()
    ck = f"{WORK}/ckpt/init.pt"
    if fault == "ckpt_size":
        ck = f"{WORK}/ckpt/init_wide.pt"
    if fault == "weights_only":
        ck = f"{WORK}/ckpt/init_meta.pt"
    state = torch.load(ck, weights_only=True)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out(f"rank {rank}/{world} loaded {os.path.basename(ck)} and {os.path.basename(shard)} ({len(ds)} sessions)")

    it = iter(dl)
    for step in range(STEPS):
        x, y = next(it)
        if fault == "shape_all" and step == 2:
            x = torch.cat([x, x[:, :1] * 0.0], dim=1)  # bug: humidity duplicated as a 7th column
        if fault == "hostmem" and step == 2:
            hist = torch.zeros(2 ** 41)  # samples x hours x cents history buffer
            x = x + hist[:1]
        if fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "exit4" and step == 3:
            err(f"ERROR rank {rank}: tension sensor calibration for string A5 is out of range (412.9 N > 380 N), giving up")
            sys.exit(4)
        if fault == "slow" and step == 3:
            deadline = time.time() + 2.5 * args.pg_timeout
            acc = 0.0
            while time.time() < deadline:  # pure-Python drift smoothing over every session
                for k in range(20000):
                    acc += (k % 7) * 1e-9
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        if fault == "nan" and step == 3:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (tension drift head)")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        mae = (pred - y).abs().mean().detach().reshape(1)
        if fault == "gather_size" and step == 2:
            mae = torch.cat([mae, mae, mae])
        gathered = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(gathered, mae)
        m = torch.cat(gathered).mean().item()
        out(f"rank {rank} step {step} loss {loss.item():.4f} drift_mae_cents {m * 10:.3f}")
    dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/harp_drift.pt")
        out(f"rank 0 saved export {WORK}/export/harp_drift.pt")
    dist.destroy_process_group()


def spawn_entry(rank, world, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    train(rank, world, args)


def main():
    global log, LABEL
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29800)
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--label", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    LABEL = args.label
    if args.logfmt:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
        log = logging.getLogger("harp.train")
        try:
            train(rank, world, args)
        except Exception:
            log.exception("training failed")
            sys.exit(1)
    else:
        train(rank, world, args)


if __name__ == "__main__":
    main()

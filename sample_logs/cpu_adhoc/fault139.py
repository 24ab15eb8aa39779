"""A hundred-and-thirty-ninth hand-run batch: DATALOADER WORKER PROCESSES.

A small DDP classifier (Linear(8,32)-ReLU-Linear(32,4); `--ddp 0`: gradients all-reduced by hand) whose
input pipeline is the focus: a map-style Dataset with 2 DataLoader workers (`worker_init_fn` seeding,
`persistent_workers`, `pin_memory=False`, a custom `collate_fn`, a DistributedSampler with `set_epoch`),
or (`--iterable 1`) an IterableDataset that splits its record stream by rank and worker id. Each rank
trains 2 epochs printing `rank R step S loss L`, all_reduces [loss_sum, n] and a class histogram at each
epoch end; after epoch 0 rank 0 saves a checkpoint and the eval rank reloads it into an eval copy.

Faults:
- getitem: rank N's label table is shifted by one: a worker raises ValueError in __getitem__.
- wkill: rank N's workers get a 1 MB memory guard: a worker SIGKILLs itself in __getitem__.
- wsegv: rank N uses the native decoder, which dereferences NULL in a worker (SIGSEGV).
- collate: every rank returns variable-length samples; the collate_fn's torch.stack fails in a worker.
- winit: rank N's entries are missing from the worker shard map: KeyError in worker_init_fn.
- iterempty: (--iterable 1) rank N's records are mostly shorter than min_len: its stream runs short.
- whang: rank N's worker waits on a stale lock file; DataLoader timeout=5 fires on rank N.
- pickle: every rank uses the spawn context with an open index file handle in the Dataset.
- nan: rank N's shard has a dead (constant) feature: the standardize transform divides 0 by 0.
- ckpt: rank 0 saves the DDP wrapper's state_dict; eval rank N's strict load finds "module." keys.
- mismatch: rank N's class histogram has an extra "ignore" bin (5 against 4) in the all_reduce.
- none: control, set_epoch forgotten (--set-epoch 0); the run succeeds.
What happened (filled in after the runs):
- getitem: ValueError 'label 4 out of range [0, 4)' (line 89) re-raised as Caught ValueError in DataLoader worker process 0.
- wkill: rank N: DataLoader worker (pid P) is killed by signal: Killed / worker(s) exited unexpectedly; peers Connection closed.
- wsegv: 'Unexpected segmentation fault encountered in worker.' then rank N: killed by signal: Segmentation fault.
- collate: every rank: Caught RuntimeError in worker 0: stack expects each tensor to be equal size (line 127).
- winit: rank N: Caught KeyError in DataLoader worker process 0, KeyError: (N, 0) in worker_init (line 122).
- iterempty: rank N ran out of batches early (not empty): gloo EnforceNotMet size mismatch abort, SIGABRT (-6).
- whang: rank N: RuntimeError: DataLoader timed out after 5 seconds (line 193); peers Connection closed by peer.
- pickle: every rank: TypeError: cannot pickle '_io.BufferedReader' object starting the spawn workers (line 193).
- nan: FloatingPointError 'rank N step 0: non-finite loss nan' (line 196); --max-restarts 1: retry connectFullMesh.
- ckpt: eval rank N: Error(s) in loading state_dict: Missing '0.weight'... Unexpected 'module.0.weight' (line 223).
- mismatch: DETAIL: every rank Detected mismatch, TensorShape=[5] on rank N (line 211); plain: 12000ms timeouts.
- none: every rank trained 2 epochs and printed done; exit 0 (map-style and IterableDataset runs).
"""
import argparse
import ctypes
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info

NCLS = 4
DIM = 8


def sample(idx, length=DIM):
    g = torch.Generator().manual_seed(1000 + idx)
    return torch.randn(length, generator=g)


class ShardDataset(Dataset):
    def __init__(self, n, rank, cfg):
        self.n, self.rank, self.cfg = n, rank, cfg
        self.labels = [i % NCLS + cfg["label_offset"] for i in range(n)]
        self.index_fh = open(cfg["index_path"], "rb") if cfg["keep_index_open"] else None
        self.dead = cfg["dead_channel"]
        xs = torch.stack([self._raw(i) for i in range(n)])
        self.mean, self.std = xs.mean(0), xs.std(0)

    def _raw(self, idx):
        x = sample(idx)
        if self.dead is not None:
            x[self.dead] = 0.25
        return x

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        cfg = self.cfg
        if cfg["max_rss_mb"] and rss_mb() > cfg["max_rss_mb"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg["decoder"] == "native" and idx % 5 == 3:
            ctypes.string_at(0)
        if cfg["lock_path"]:
            while os.path.exists(cfg["lock_path"]):
                time.sleep(1.0)
        y = self.labels[idx]
        if not 0 <= y < NCLS:
            raise ValueError(f"sample {idx}: label {y} out of range [0, {NCLS})")
        length = DIM + (idx % 3 if cfg["variable_len"] else 0)
        x = (self._raw(idx) - self.mean) / self.std
        if length != DIM:
            x = torch.cat([x, torch.zeros(length - DIM)])
        return x, y


class StreamDataset(IterableDataset):
    def __init__(self, total, rank, world, cfg):
        lengths = [DIM + (i % 3) - (2 if cfg["short_records"] else 0) for i in range(total)]
        self.records = [i for i in range(total) if lengths[i] >= cfg["min_len"]]
        self.rank, self.world = rank, world

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        mine = self.records[self.rank::self.world]
        for idx in mine[wid::nw]:
            yield sample(idx), idx % NCLS


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


SHARD_MAP = {}


def worker_init(worker_id):
    info = get_worker_info()
    rank = int(os.environ["RANK"])
    shard = SHARD_MAP[(rank, worker_id)]
    torch.manual_seed(info.seed % 2**31 + shard)


def collate(batch):
    xs = torch.stack([b[0] for b in batch])
    ys = torch.tensor([b[1] for b in batch], dtype=torch.long)
    return xs, ys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--iterable", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--set-epoch", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--work", default="/tmp/fault139_work")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    on = a.rank in (-1, rank)
    f = a.fault if on else "none"
    os.makedirs(a.work, exist_ok=True)
    index_path = os.path.join(a.work, "index.bin")
    if rank == 0 and not os.path.exists(index_path):
        with open(index_path, "wb") as fh:
            fh.write(bytes(range(64)))
    dist.barrier()
    lock = os.path.join(a.work, f"stage_{rank}.lock")
    if f == "whang":
        open(lock, "w").close()
    elif os.path.exists(lock):
        os.remove(lock)
    cfg = dict(label_offset=1 if f == "getitem" else 0, keep_index_open=f == "pickle", index_path=index_path,
               dead_channel=3 if f == "nan" else None, max_rss_mb=1 if f == "wkill" else 0,
               decoder="native" if f == "wsegv" else "torch", lock_path=lock if f == "whang" else None,
               variable_len=f == "collate", short_records=f == "iterempty", min_len=DIM)
    for r in range(world):
        if not (f == "winit" and r == rank):
            SHARD_MAP.update({(r, 0): 2 * r, (r, 1): 2 * r + 1})
    print(f"rank {rank}/{world} pid {os.getpid()} workers=2 iterable={a.iterable}", flush=True)

    if a.iterable:
        ds = StreamDataset(96, rank, world, cfg)
        sampler = None
    else:
        ds = ShardDataset(96, rank, cfg)
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, worker_init_fn=worker_init,
                        persistent_workers=True, pin_memory=False, collate_fn=collate,
                        timeout=5 if f == "whang" else 0,
                        multiprocessing_context="spawn" if f == "pickle" else None)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, NCLS))
    model = DDP(net) if a.ddp else net
    if not a.ddp:
        for prm in net.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lossf = nn.CrossEntropyLoss()
    step = 0
    for epoch in range(a.epochs):
        if sampler is not None and a.set_epoch:
            sampler.set_epoch(epoch)
        tot, cnt = 0.0, 0
        hist = torch.zeros(NCLS + 1 if f == "mismatch" else NCLS)
        for xb, yb in loader:
            loss = lossf(model(xb), yb)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()}")
            opt.zero_grad()
            loss.backward()
            if not a.ddp:
                for prm in net.parameters():
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
            opt.step()
            tot += loss.item() * len(yb)
            cnt += len(yb)
            hist += torch.bincount(yb, minlength=len(hist)).float()
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
        stats = torch.tensor([tot, float(cnt)])
        dist.all_reduce(stats)
        dist.all_reduce(hist)
        if rank == 0:
            print(f"epoch {epoch} mean loss {stats[0] / stats[1]:.4f} samples {int(stats[1])} "
                  f"hist {hist.tolist()}", flush=True)
        if epoch == 0:
            ckpt = os.path.join(a.work, "epoch0.pt")
            if rank == 0:
                torch.save((model if a.fault == "ckpt" else net).state_dict(), ckpt)
            dist.barrier()
            eval_rank = a.rank if a.fault == "ckpt" and a.rank >= 0 else 0
            if rank == eval_rank:
                evalnet = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, NCLS))
                evalnet.load_state_dict(torch.load(ckpt, map_location="cpu"))
                print(f"rank {rank} reloaded {ckpt} for eval", flush=True)
            dist.barrier()
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-sixty-seventh hand-run batch: STREAMING DATA FROM TAR SHARDS (WEBDATASET STYLE).

At start every rank writes its share of small tar shards (data/shard-XXXX.tar, each member pair
<key>.npy (16 float32 features) + <key>.json ({"label": k})) and the shard list data/shards.txt.  An
IterableDataset reads the list, splits shards across ranks (shard i -> rank i % world) and DataLoader workers
(--num-workers 0 or 2), decodes each pair, shuffles with a buffer (WDS_SHUFFLE_BUF, default 64) and feeds a small
MLP classifier under DDP on gloo (or --ddp 0: gradients all-reduced by hand).  Each epoch runs --steps steps,
then the sample count is all_reduced for a samples-per-second line; rank 0 saves wds.pt at the end and
--resume loads it.

Faults:
  tartrunc     - rank N's first shard is truncated (a partial copy): tarfile error while streaming it
  labelkey     - every rank's writer stores the class under "cls", the decoder reads "label" (KeyError)
  shapedecode  - rank N decodes features as (4, 4) instead of (16,) (shape error in the model)
  listmissing  - rank N reads the shard list from a node-local dir that was never synced (FileNotFoundError)
  shufneg      - rank N gets WDS_SHUFFLE_BUF=-64 from its node profile (the program's ValueError)
  countlen     - rank N all_reduces the epoch sample count as [samples, bytes] (length 2 vs 1 elsewhere)
  workerkill   - on rank N a DataLoader worker is killed by SIGKILL (the OOM-killer's way) while decoding
  nanfeat      - rank N decodes a NaN feature at step 3 (the program's finite check raises)
  indexcorrupt - rank N prints a 'shard index corrupt' error line and exits with code 4
  stall        - rank N's shard read blocks at step 3 (a stuck network read); the others wait in the allreduce
  ckptkeys     - every rank resumes wds.pt into the DDP wrapper instead of the module (missing/unexpected keys)
  segv         - rank N dies by SIGSEGV in the native decode path at step 2
  none         - control, clean run

What happened (filled in after the runs):
  tartrunc     - rank N tarfile.ReadError 'unexpected end of data' on its truncated shard; Root Cause rank N
  labelkey     - every rank KeyError: 'label' (in DataLoader worker 0 with --num-workers 2); redirects run: per-rank stderr only
  shapedecode  - rank N RuntimeError 'mat1 and mat2 shapes cannot be multiplied (32x4 and 16x32)'; np4 run: rank 2 aborted (-6)
  listmissing  - rank 1 FileNotFoundError 'data_local/shards.txt'; the restart died in Gloo connectFullMesh Connection refused
  shufneg      - rank 1 ValueError 'shuffle buffer size must be >= 1, got -64' at startup; Root Cause rank 1
  countlen     - no size error: the length-2 all_reduce timed out (Timed out waiting 12000ms send/recv); others Connection closed
  workerkill   - rank 2 RuntimeError 'DataLoader worker (pid ...) is killed by signal: Killed.'; Root Cause rank 2
  nanfeat      - rank 1 FloatingPointError 'non-finite feature in decoded batch at step 3'; Root Cause rank 1
  indexcorrupt - rank 2 'ERROR rank 2: shard index corrupt ...' then exit 4 (no traceback); Root Cause rank 2 exitcode 4
  stall        - rank 1 blocks at step 3; ranks 0/2 'Timed out waiting 12000ms' in the DDP allreduce; rank 1 SIGTERM
  ckptkeys     - every rank 'Error(s) in loading state_dict for DistributedDataParallel: Missing key(s) "module.fc1.weight"'
  segv         - rank 1 killed by SIGSEGV at step 2 (exitcode -11); peers Connection reset by peer
  none         - 3 ranks ran 2 epochs of 5 steps (120 samples each), rank 0 saved wds.pt
"""
import argparse
import io
import json
import os
import random
import signal
import sys
import tarfile
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

FEAT = 16
CLASSES = 4
PER_SHARD = 48


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--shards-per-rank", type=int, default=2)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--resume", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--data", default="data")
    p.add_argument("--work", default="/tmp/fault167_work")
    return p.parse_args()


def hit(a, rank, name):
    return a.fault == name and (a.rank == -1 or a.rank == rank)


def write_shards(a, rank, world):
    os.makedirs(a.data, exist_ok=True)
    n = world * a.shards_per_rank
    names = ["shard-%04d.tar" % i for i in range(n)]
    tmp = os.path.join(a.data, "shards.txt.%d" % rank)
    with open(tmp, "w") as f:
        f.write("\n".join(names) + "\n")
    os.replace(tmp, os.path.join(a.data, "shards.txt"))
    w = np.random.RandomState(0).randn(FEAT, CLASSES)
    label_key = "cls" if hit(a, rank, "labelkey") else "label"
    for i in range(rank, n, world):
        rs = np.random.RandomState(100 + i)
        path = os.path.join(a.data, names[i])
        with tarfile.open(path + ".tmp", "w") as tf:
            for j in range(PER_SHARD):
                key = "s%04d_%03d" % (i, j)
                x = rs.randn(FEAT).astype(np.float32)
                buf = io.BytesIO()
                np.save(buf, x)
                meta = json.dumps({label_key: int(np.argmax(x @ w)), "shard": i}).encode()
                for ext, data in (("npy", buf.getvalue()), ("json", meta)):
                    ti = tarfile.TarInfo("%s.%s" % (key, ext))
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
        if hit(a, rank, "tartrunc") and i == rank:
            with open(path + ".tmp", "r+b") as f:
                f.truncate(int(os.path.getsize(path + ".tmp") * 0.55) // 1024 * 1024 + 612)
        os.replace(path + ".tmp", path)


class TarStream(IterableDataset):
    def __init__(self, a, rank, world, shuffle_buf):
        self.a, self.rank, self.world, self.buf = a, rank, world, shuffle_buf
        list_dir = "data_local" if hit(a, rank, "listmissing") else a.data
        with open(os.path.join(list_dir, "shards.txt")) as f:
            self.shards = [l.strip() for l in f if l.strip()]

    def my_shards(self):
        mine = self.shards[self.rank::self.world]
        wi = get_worker_info()
        if wi is not None:
            mine = mine[wi.id::wi.num_workers]
        return mine

    def samples(self):
        a = self.a
        n = 0
        for name in self.my_shards():
            with tarfile.open(os.path.join(a.data, name)) as tf:
                pending = {}
                for m in tf:
                    key, ext = m.name.rsplit(".", 1)
                    pending.setdefault(key, {})[ext] = tf.extractfile(m).read()
                    if len(pending[key]) < 2:
                        continue
                    item = pending.pop(key)
                    yield self.decode(item, n)
                    n += 1

    def decode(self, item, n):
        a = self.a
        x = np.load(io.BytesIO(item["npy"]))
        meta = json.loads(item["json"])
        y = meta["label"]
        if hit(a, self.rank, "shapedecode"):
            x = x.reshape(4, 4)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.tensor(y)

    def native_decode(self, s, k):
        a = self.a
        if hit(a, self.rank, "workerkill") and get_worker_info() is not None and k == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        if hit(a, self.rank, "segv") and k == 2 * a.batch + 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if hit(a, self.rank, "nanfeat") and k == 3 * a.batch + 5:
            s[0][7] = float("nan")
        if hit(a, self.rank, "stall") and k == 3 * a.batch + 2:
            time.sleep(3600)
        return s

    def __iter__(self):
        rng = random.Random(self.rank)
        pool = []
        k = 0
        for s in self.samples():
            pool.append(s)
            if len(pool) >= self.buf:
                yield self.native_decode(pool.pop(rng.randrange(len(pool))), k)
                k += 1
        rng.shuffle(pool)
        for s in pool:
            yield self.native_decode(s, k)
            k += 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEAT, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main():
    a = parse()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    write_shards(a, rank, world)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    os.makedirs(a.work, exist_ok=True)
    buf_env = "-64" if hit(a, rank, "shufneg") else os.environ.get("WDS_SHUFFLE_BUF", "64")
    shuffle_buf = int(buf_env)
    if shuffle_buf < 1:
        raise ValueError("shuffle buffer size must be >= 1, got %d (WDS_SHUFFLE_BUF=%r)" % (shuffle_buf, buf_env))
    ds = TarStream(a, rank, world, shuffle_buf)
    print("rank %d/%d shards %s workers %d shuffle_buf %d" % (rank, world, ds.shards[rank::world], a.num_workers,
                                                            shuffle_buf), flush=True)
    if hit(a, rank, "indexcorrupt"):
        print("ERROR rank %d: shard index corrupt: %s/%s lists 96 members, tar header count 71 (offset 36864)"
              % (rank, a.data, ds.shards[rank]), flush=True)
        sys.exit(4)
    nw = 2 if a.fault == "workerkill" else a.num_workers
    model = Net()
    net = DDP(model) if a.ddp else model
    if a.resume:
        sd = torch.load(os.path.join(a.work, "wds.pt"))
        target = net if a.fault == "ckptkeys" else model
        target.load_state_dict(sd)
        print("rank %d resumed %s" % (rank, os.path.join(a.work, "wds.pt")), flush=True)
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    lossf = nn.CrossEntropyLoss()
    step = 0
    for epoch in range(a.epochs):
        loader = DataLoader(ds, batch_size=a.batch, num_workers=nw)
        it = iter(loader)
        t0 = time.time()
        seen = 0
        for _ in range(a.steps):
            x, y = next(it)
            if not torch.isfinite(x).all():
                bad = (~torch.isfinite(x)).nonzero()[0].tolist()
                raise FloatingPointError("non-finite feature in decoded batch at step %d (rank %d, index %s)"
                                         % (step, rank, bad))
            opt.zero_grad()
            loss = lossf(net(x), y)
            loss.backward()
            if not a.ddp:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            seen += x.shape[0]
            print("rank %d step %d loss %.4f" % (rank, step, loss.item()), flush=True)
            step += 1
        del it, loader
        if hit(a, rank, "countlen"):
            cnt = torch.tensor([seen, seen * FEAT * 4], dtype=torch.int64)
        else:
            cnt = torch.tensor([seen], dtype=torch.int64)
        dist.all_reduce(cnt)
        dt = time.time() - t0
        if rank == 0:
            print("epoch %d samples %d (%.1f samples/s)" % (epoch, int(cnt[0]), cnt[0].item() / dt), flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.work, "wds.pt"))
        print("saved %s" % os.path.join(a.work, "wds.pt"), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A thirty-second hand-run batch: the DATA PIPELINE. Faults inside DataLoader worker processes and datasets, on one
rank R of a small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), 8 steps of 16 samples, process-group timeout
15 s). Every rank reads a synthetic map-style dataset of {"x": "f,f,...", "label": int} records through a
DataLoader(num_workers=--workers) with a DistributedSampler(shuffle=False); the record at fault is the third sample of
rank R's step-3 batch. Progress is printed in one of four formats (--style): plain `[rankR] step S/8 loss L`, `tqdm`
(a real tqdm bar on rank 0), `log` (logging records `<date> INFO data_train: ...` on every rank) and `json`
(`{"rank": R, "step": S, "loss": L, ...}` on every rank). --noise makes every rank print data-side noise that is no
error: a corrupt record skipped on purpose (a warnings.warn UserWarning) and, with pin_memory on this CPU-only torch,
torch's own pin_memory UserWarning; with --workers above 2, PyTorch's own worker-count UserWarning appears anyway.

Faults (--fault, on --rank):
  key       __getitem__: the record was written with the key 'labels' -> KeyError: 'label'
  value     __getitem__: a corrupt field 'n/a' -> ValueError: could not convert string to float: 'n/a'
  fnf       __getitem__: opens the record's shard file, which is missing -> FileNotFoundError
  unicode   __getitem__: decodes a record's bytes as UTF-8 -> UnicodeDecodeError
  trunc     __getitem__: raises OSError('image file is truncated (7 bytes not processed)'), PIL's message (no PIL here)
  sigkill / segv / sigbus   __getitem__ in a worker: the worker sends itself the signal
  hang_to   __getitem__ in a worker sleeps 60 s; the DataLoader has timeout=--dl-timeout (5) -> DataLoader timed out
  hang      __getitem__ sleeps 60 s, no DataLoader timeout: the peers time out in DDP's all-reduce
  collate   the record's x has 9 features: default_collate's torch.stack fails (RuntimeError: stack expects ...)
  memory    __getitem__ allocates bytearray(1 << 50) -> MemoryError
  winit     worker_init_fn raises on rank R (RuntimeError: could not open the record index ...)
  prefetch  set-up: the loader options come from a per-rank config; rank R's says num_workers=0 while every rank
            passes prefetch_factor=4 -> DataLoader's ValueError (prefetch_factor option could only be specified in
            multiprocessing...) before the first step, after DDP was built
  uneven    rank R's shard is shorter (5 batches, not 8); it leaves the loop, prints its summary and, with
            --final barrier, waits in dist.barrier(); with --final exit, destroys its group and returns
  handled   no failure: rank R's bad record raises KeyError: 'label' inside __getitem__, which catches it, prints the
            traceback (traceback.print_exc()) and a 'dropping malformed record' line, and uses the next record
  none      no fault
"""
import argparse, datetime, json, logging, os, signal, sys, time, traceback, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--workers", type=int, default=2)
p.add_argument("--style", choices=["plain", "tqdm", "log", "json"], default="plain")
p.add_argument("--noise", action="store_true")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--dl-timeout", type=int, default=5)
p.add_argument("--final", choices=["barrier", "exit"], default="barrier")
p.add_argument("--data-dir", default="/tmp/job/data")
a = p.parse_args()
B, FAULT_STEP = 16, 3
log = logging.getLogger("data_train")


class Records(Dataset):
    def __init__(self, n, rank, world):
        self.n, self.rank, self.world = n, rank, world
        # the sample at fault: rank R's step-3 batch, third sample (DistributedSampler(shuffle=False) gives rank r the
        # global indices r, r+W, r+2W, ...)
        self.bad = (FAULT_STEP * B + 2) * world + a.rank if rank == a.rank else -1
        self.noisy = (1 * B + 5) * world + rank if a.noise else -1

    def __len__(self):
        return self.n

    def raw(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return {"x": ",".join(f"{v:.4f}" for v in x.tolist()), "label": i % 4, "shard": i // 256}

    def __getitem__(self, i):
        rec = self.raw(i)
        if i == self.noisy:
            warnings.warn(f"skipping corrupt record {i} in shard {rec['shard']:05d} (bad checksum); using record {i + 1}")
            rec = self.raw(i + 1)
        if i == self.bad:
            f = a.fault
            inw = get_worker_info() is not None
            if f == "key":
                rec["labels"] = rec.pop("label")
            elif f == "value":
                parts = rec["x"].split(","); parts[5] = "n/a"; rec["x"] = ",".join(parts)
            elif f == "fnf":
                with open(os.path.join(a.data_dir, f"shard-{rec['shard'] + 7:05d}.bin"), "rb") as fh:
                    fh.read()
            elif f == "unicode":
                b"caption: \xff\xfe\x00broken".decode("utf-8")
            elif f == "trunc":
                raise OSError("image file is truncated (7 bytes not processed)")
            elif f in ("sigkill", "segv", "sigbus") and inw:
                os.kill(os.getpid(), {"sigkill": signal.SIGKILL, "segv": signal.SIGSEGV, "sigbus": signal.SIGBUS}[f])
            elif f in ("hang", "hang_to"):
                time.sleep(60)
            elif f == "collate":
                rec["x"] += ",0.0000"
            elif f == "memory":
                buf = bytearray(1 << 50)
            elif f == "handled":
                try:
                    bad = dict(rec); bad["labels"] = bad.pop("label"); bad["label"]
                except KeyError:
                    traceback.print_exc()
                    print(f"rank {self.rank}: dropping malformed record {i} (shard {rec['shard']:05d}), using record {i + 1}",
                          file=sys.stderr, flush=True)
                    rec = self.raw(i + 1)
        x = torch.tensor([float(v) for v in rec["x"].split(",")])
        return x, torch.tensor(rec["label"])


def worker_init(rank):
    def init(wid):
        if a.fault == "winit" and rank == a.rank and wid == 1 % max(a.workers, 1):
            raise RuntimeError(f"could not open the record index {a.data_dir}/index-{rank:02d}.idx for worker {wid}")
    return init


def progress(rank, step, loss, bar):
    if a.style == "plain":
        print(f"[rank{rank}] step {step}/{a.steps} loss {loss:.4f}", flush=True)
    elif a.style == "log":
        log.info("epoch 0 iter %d/%d loss=%.4f lr=1.0e-03", step, a.steps, loss)
    elif a.style == "json":
        print(json.dumps({"rank": rank, "step": step, "loss": round(loss, 4), "samples": step * B}), flush=True)
    elif bar is not None:
        bar.set_postfix(loss=f"{loss:.4f}"); bar.update(1)


@record
def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.style == "log":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps = a.steps
    if a.fault == "uneven" and rank == a.rank:
        steps = 5
    ds = Records(steps * B * world, rank, world)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False, drop_last=False)
    kw = dict(timeout=a.dl_timeout) if (a.fault == "hang_to" and a.workers > 0) else {}
    workers = a.workers
    if a.fault == "prefetch":
        kw["prefetch_factor"] = 4
        if rank == a.rank:
            workers = 0
    dl = DataLoader(ds, batch_size=B, sampler=sampler, num_workers=workers, worker_init_fn=worker_init(rank),
                    pin_memory=a.noise, persistent_workers=workers > 0, **kw)
    if a.style == "log":
        log.info("rank %d/%d: %d records, %d batches, num_workers=%d", rank, world, len(sampler), len(dl), workers)
    bar = None
    if a.style == "tqdm" and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=a.steps, desc="train", file=sys.stderr)
    n = 0
    for step, (x, y) in enumerate(dl, 1):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        progress(rank, step, loss.item(), bar)
        n = step
        time.sleep(0.2)
    if bar is not None:
        bar.close()
    if a.style == "log":
        log.info("rank %d finished its shard after %d batches", rank, n)
    else:
        print(f"rank {rank}: end of data after {n} batches", flush=True)
    if a.fault == "uneven" and a.final == "exit":
        dist.destroy_process_group()
        return
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""fault629.py - mesquite root depth: a tiny multi-rank CPU training job with planted data-pipeline faults.

Each rank reads its own shard of synthetic mesquite sites (soil features, a soil class looked up through
a JSON table to a depth factor) and regresses root depth (m) with a DDP-wrapped linear model on gloo/CPU.
`--prepare` writes the shards, lookup.json and start.pt into /tmp/fault629_work.  6 steps; each rank prints
`rank R step S loss L root_depth_m M`; rank 0 saves export.pt at the end.

Faults (--fault NAME --rank N):
  none            control run
  worker_sigkill  a DataLoader worker of rank N sends itself SIGKILL at its 3rd item
  worker_segv     a DataLoader worker of rank N sends itself SIGSEGV at its 3rd item
  loader_timeout  DataLoader(timeout=2); rank N's worker sleeps 6 s on an item
  npy_truncated   rank N's .npy shard is cut short before np.load
  gzip_truncated  rank N's gzip soil-notes member is cut short before it is read
  jsonl_broken    one line of rank N's JSONL site file is broken
  collate_stack   rank N's collate_fn stacks tensors of unequal size
  vocab_keyerror  rank N's worker looks up a soil class missing from lookup.json (KeyError)
  memmap_short    rank N maps its shard with np.memmap asking for more rows than the file holds
  file_removed    rank N's shard file is removed after step 2 (workers reopen it per item)
  worker_init     worker_init_fn raises on rank N
  pin_memory      pin_memory=True with a batch type whose pin_memory() raises on rank N
  len_wrong       rank N's Dataset __len__ claims more rows than it has (IndexError)
  unicode_decode  rank N's text shard is latin-1, read as utf-8
  cache_race      every rank writes the same cache file; rank N reads it half-written (torch.load)
  stall           rank N sleeps past the process-group timeout at step 3
  nan_loss        rank N's data holds NaN; the finiteness check raises FloatingPointError

Runs (one line per kept log):
  mesquite_none_np5_rnone_bashloop: control, 6 steps on 5 ranks, export saved, exit 0
  mesquite_worker_sigkill_np6_r5_ranklabel: rank 5 'DataLoader worker ... killed by signal: Killed', peers gloo closed; exit 124
  mesquite_npy_truncated_np3_r1_files: rank 1 ValueError 'Failed to read all data for array'; peers gloo closed
  mesquite_loader_timeout_np3_r0_mpitag: rank 0 'DataLoader timed out after 2 seconds'; peers gloo closed
  mesquite_jsonl_broken_np3_r2_legacy: rank 2 JSONDecodeError; launch agent names rank 2 root cause
  mesquite_collate_stack_np5_r2_logfmt: rank 2 'stack expects each tensor to be equal size' in worker
  mesquite_vocab_keyerror_np3_r1_tee: rank 1 'Caught KeyError in DataLoader worker' ('petrocalcic_horizon')
  mesquite_memmap_short_np4_r3_pdsh2: rank 3 'mmap length is greater than file size' on node worker-1
  mesquite_worker_segv_np4_r2_srunlabel: rank 2 worker 'killed by signal: Segmentation fault'
  mesquite_unicode_decode_np5_r4_bashloop: rank 4 UnicodeDecodeError byte 0xe9 at start-up
  mesquite_file_removed_np3_r2_bashloop: rank 2 'Caught FileNotFoundError in DataLoader worker' after step 3
  mesquite_gzip_truncated_np4_r3_spawn (--workers 0): see README (spawn run; first try dropped)
  (unused)
  (unused)
  (unused)
  (unused)
  (unused)
  (unused)
  (unused)
  (unused)
  (unused)
  (unused)
"""
import argparse, datetime, gzip, json, logging, os, signal, sys, time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault629_work"
NROWS = 24
CLASSES = ["caliche", "sandy_loam", "clay", "gravel"]
LOG = None


def say(msg):
    if LOG is not None:
        LOG.info(msg)
    else:
        print(msg, flush=True)


def prepare():
    os.makedirs(WORK, exist_ok=True)
    rng = np.random.default_rng(629)
    json.dump({c: 0.5 + i for i, c in enumerate(CLASSES)}, open(f"{WORK}/lookup.json", "w"))
    for r in range(8):
        x = rng.normal(size=(NROWS, 4)).astype(np.float32)
        np.save(f"{WORK}/shard{r}.npy", x)
        with open(f"{WORK}/sites{r}.jsonl", "w") as f:
            for i in range(NROWS):
                f.write(json.dumps({"site": i, "soil": CLASSES[i % 4], "depth_m": float(abs(x[i, 0]) * 10)}) + "\n")
        with gzip.open(f"{WORK}/notes{r}.gz", "wt") as f:
            for i in range(400):
                f.write(f"site {i} mesquite taproot reaches caliche at {i % 17} m\n")
        with open(f"{WORK}/sites{r}.txt", "w", encoding="utf-8") as f:
            for i in range(NROWS):
                f.write(f"site {i} depth {abs(x[i, 0]) * 10:.2f} m\n")
    torch.save(nn.Linear(4, 1).state_dict(), f"{WORK}/start.pt")
    print("prepared", WORK, flush=True)


class Batch:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def pin_memory(self):
        raise RuntimeError("mesquite Batch.pin_memory: cannot pin a root-depth batch holding a ragged soil profile")


class Sites(Dataset):
    def __init__(self, rank, fault, frank, lookup):
        self.rank, self.fault, self.mine = rank, fault, rank == frank
        self.path = f"{WORK}/shard{rank}.npy"
        self.lookup = lookup
        self.n = NROWS
        if self.mine and fault == "len_wrong":  # the file holds 18 rows, __len__ still says NROWS
            np.save(self.path, np.load(self.path)[:18])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.mine and self.fault in ("worker_sigkill", "worker_segv") and i == 2 + 4 * 2:
            os.kill(os.getpid(), signal.SIGKILL if self.fault == "worker_sigkill" else signal.SIGSEGV)
        if self.mine and self.fault == "loader_timeout" and i == 9:
            time.sleep(6)
        arr = np.load(self.path, mmap_mode="r")
        row = np.array(arr[i], dtype=np.float32)
        soil = CLASSES[i % 4]
        if self.mine and self.fault == "vocab_keyerror" and i == 9:
            soil = "petrocalcic_horizon"
        factor = self.lookup[soil]
        x = torch.from_numpy(row)
        y = torch.tensor([float(abs(row[0]) * factor)])
        return x, y


def make_collate(rank, fault, frank, pinned):
    def collate(items):
        xs = [it[0] for it in items]
        ys = [it[1] for it in items]
        if rank == frank and fault == "collate_stack" and len(xs) > 2:
            xs[2] = torch.cat([xs[2], torch.zeros(1)])
        x, y = torch.stack(xs), torch.stack(ys)
        return Batch(x, y) if pinned else (x, y)
    return collate


def bad_init(wid):
    raise OSError(f"worker_init_fn: cannot open soil-moisture probe for worker {wid}")


def worker(rank, world, args):
    global LOG
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s [rank %(rank)s] %(levelname)s %(message)s")
        LOG = logging.LoggerAdapter(logging.getLogger("mesquite"), {"rank": rank})
    fault, frank = args.fault, args.rank
    mine = rank == frank or frank == -1
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    say(f"rank {rank}/{world} joined gloo group (fault={fault} on rank {frank})")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model.load_state_dict(torch.load(f"{WORK}/start.pt"))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    lookup = json.load(open(f"{WORK}/lookup.json"))

    # side files every rank reads at start-up
    if mine and fault == "npy_truncated":
        p = f"{WORK}/shard{rank}.npy"
        data = open(p, "rb").read()
        open(p, "wb").write(data[: len(data) - 200])
        np.load(p)
    if mine and fault == "gzip_truncated":
        p = f"{WORK}/notes{rank}.gz"
        data = open(p, "rb").read()
        open(p, "wb").write(data[: len(data) // 2])
    notes = gzip.open(f"{WORK}/notes{rank}.gz", "rt").read().count("\n")
    if mine and fault == "jsonl_broken":
        p = f"{WORK}/sites{rank}.jsonl"
        lines = open(p).read().splitlines()
        lines[7] = lines[7][:-9] + ', "soil" "clay"}'
        open(p, "w").write("\n".join(lines) + "\n")
    sites = [json.loads(l) for l in open(f"{WORK}/sites{rank}.jsonl")]
    if mine and fault == "unicode_decode":
        p = f"{WORK}/sites{rank}.txt"
        open(p, "w", encoding="latin-1").write("site 0 depth 53.00 m  r\xe9sum\xe9: ra\xedz de mezquite \xb5m\n")
    text = open(f"{WORK}/sites{rank}.txt", encoding="utf-8").read()
    if mine and fault == "memmap_short":
        mm = np.memmap(f"{WORK}/shard{rank}.npy", dtype=np.float32, mode="r", offset=128, shape=(NROWS * 4, 4))
    if fault == "cache_race":
        cache = f"{WORK}/depth_cache.pt"
        if rank == frank:
            time.sleep(0.3)
        else:
            big = {"depth": torch.randn(400000)}
            with open(cache, "wb") as f:
                torch.save(big, f)
                f.flush()
        if rank == frank:
            with open(cache, "wb") as f:
                f.write(open(f"{WORK}/start.pt", "rb").read()[:300])
            torch.load(cache)
    say(f"rank {rank} read {len(sites)} sites, {notes} notes, {len(text)} text bytes")

    pinned = mine and fault == "pin_memory"
    ds = Sites(rank, fault, frank, lookup)
    kw = dict(batch_size=4, shuffle=False, num_workers=args.workers,
              collate_fn=make_collate(rank, fault, frank, pinned))
    if args.workers > 0:
        kw["timeout"] = 2 if fault == "loader_timeout" else 0
        if mine and fault == "worker_init":
            kw["worker_init_fn"] = bad_init
    if pinned:
        kw["pin_memory"] = True
        kw["pin_memory_device"] = "cpu"
    loader = DataLoader(ds, **kw)
    it = iter(loader)
    for step in range(6):
        if mine and fault == "file_removed" and step == 2:
            os.remove(f"{WORK}/shard{rank}.npy")
        if mine and fault == "stall" and step == 3:
            say(f"rank {rank} waiting on the soil probe...")
            time.sleep(40)
        b = next(it)
        x, y = (b.x, b.y) if isinstance(b, Batch) else b
        if mine and fault == "nan_loss" and step == 3:
            x = x.clone(); x[1, 2] = float("nan")
        pred = ddp(x)
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (root depth regression diverged)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        depth = pred.detach().mean()
        dist.all_reduce(depth)
        say(f"rank {rank} step {step} loss {loss.item():.4f} root_depth_m {depth.item() / world:.3f}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export.pt")
        say("rank 0 saved export to " + f"{WORK}/export.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_entry(rank, world, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    worker(rank, world, args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        torch.multiprocessing.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    try:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # torch's hook prints the traceback; then leave without
        sys.stdout.flush(); sys.stderr.flush()  # waiting on the gloo group / loader teardown
        os._exit(1)


if __name__ == "__main__":
    main()

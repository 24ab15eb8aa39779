"""Batch 517 fault script: pottery glaze crackle classification from kiln photos.

A small distributed (gloo, CPU) training job: each rank reads its shard of synthetic
16x16 grey "kiln photos" with a glaze code per photo, maps the code to a crackle class
(none / fine / coarse / crazing) through a lookup table, starts from a shared checkpoint,
trains a tiny conv net under DDP for 6 steps and prints
`rank R step S loss L acc A` every step; rank 0 saves an export at the end.

    python fault517.py --prepare                      # writes /tmp/fault517_work
    python fault517.py [--fault NAME --rank N] [--pg-timeout 12] [--label] [--logfmt]
    python fault517.py --spawn W --port P ...         # torch.multiprocessing.spawn inside

Faults (--fault NAME, planted on --rank N unless said otherwise):
  none          control, nothing planted
  keyerror      rank N's shard holds a glaze code missing from the lookup table (KeyError, step 2)
  missing_shard rank N opens a shard file that does not exist (FileNotFoundError, start-up)
  ckpt_size     rank N builds the net with hidden=48 and loads the hidden=32 checkpoint (size mismatch)
  weights_only  rank N loads the checkpoint variant that pickles a KilnMeta object (weights_only refusal)
  gather_size   rank N all_gathers 5 per-class counts instead of 4 at step 3 (collective size mismatch)
  slow          rank N spends pg_timeout+10 s in pure-Python colour-histogram work at step 3; peers time out
                (with --pg-timeout 300 this is a hang that `timeout` ends)
  nan           rank N's step-4 batch carries a NaN pixel; the script's own finiteness check raises
  sigsegv       rank N sends itself SIGSEGV at step 3
  exit4         rank N prints its own ERROR line (kiln calibration missing) and sys.exit(4) at step 2
  shape_all     every rank pools to 5x5 while the head expects 4x4 (matmul shape error on every rank)
  hostmem       rank N caps its address space and builds a 4 GiB photo cache (host memory error)
  worker_crash  rank N's DataLoader worker is SIGKILLed while decoding a photo (worker died)

What happened (the runs, 2026-12-07, on a heavily loaded shared 2-core machine):
  none          np4 bashloop and np6 pdsh2: all ranks finished 6 steps, rank 0 saved the export, exit 0
  keyerror      KeyError: 'tenmoku_oilspot' on rank N at step 2; peers got gloo connection closed or 12000ms recv timeouts
                (np4 ranklabel exit 124: teardown outlasted the 100 s timeout; np6 mpitag dropped: no step within 100 s)
  missing_shard FileNotFoundError for glaze_shard_N_v2.pt on rank N right after the group formed; peers connection closed
  ckpt_size     RuntimeError size mismatch for fc1.weight/fc1.bias/fc2.weight on rank N; peers connection closed
  weights_only  _pickle.UnpicklingError "Weights only load failed ... __main__.KilnMeta" on rank N; launcher SIGTERMed the rest
  gather_size   a peer of rank N (not N itself) aborted: terminate called, gloo::EnforceNotMet "Received data size doesn't match"; exit 134
  slow          12 s: peers' gloo recv/send timed out at step 3, rank N then got connection closed (exit 124 on the loaded box);
                300 s: output stopped after step 2 until `timeout` ended it after 60 s (exit 124)
  nan           FloatingPointError: non-finite loss nan at step 4 on rank N; one peer aborted on teardown (exit 134)
  sigsegv       rank N died of SIGSEGV (torchrun: exitcode -11); peers got gloo connection reset
  exit4         rank N printed ERROR: kiln calibration ... and exited 4 (spawn: ProcessExitedException; files: exit 4)
  shape_all     RuntimeError mat1 and mat2 shapes cannot be multiplied (16x200 and 128x32) on every rank, step 1
  hostmem       RuntimeError DefaultCPUAllocator: can't allocate memory (4294967296 bytes) on rank N
  worker_crash  RuntimeError DataLoader worker (pid ...) is killed by signal: Killed. on rank N; peers connection closed
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
import torch.nn.functional as F

WORK = "/tmp/fault517_work"
CLASSES = ["none", "fine", "coarse", "crazing"]
GLAZES = {"celadon": 1, "raku_white": 3, "shino": 2, "tenmoku": 0, "ash_green": 1,
          "ying_qing": 2, "nuka": 0, "chun_blue": 3}
STEPS = 6
BATCH = 16


class KilnMeta:
    def __init__(self, kiln, cone):
        self.kiln, self.cone = kiln, cone


class GlazeNet(nn.Module):
    def __init__(self, hidden=32, pool=4):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.pool = pool
        self.fc1 = nn.Linear(8 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, len(CLASSES))

    def forward(self, x):
        x = F.relu(self.conv(x))
        x = F.adaptive_avg_pool2d(x, self.pool).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(517)
    codes = list(GLAZES)
    for r in range(8):
        imgs = torch.rand(STEPS * BATCH, 1, 16, 16, generator=g)
        idx = torch.randint(0, len(codes), (STEPS * BATCH,), generator=g)
        torch.save({"images": imgs, "codes": [codes[i] for i in idx]}, f"{WORK}/shards/glaze_shard_{r}.pt")
    with open(f"{WORK}/glaze_table.json", "w") as f:
        json.dump(GLAZES, f)
    torch.manual_seed(0)
    sd = GlazeNet().state_dict()
    torch.save(sd, f"{WORK}/init.pt")
    torch.save({"model": sd, "meta": KilnMeta("anagama-2", 10)}, f"{WORK}/init_meta.pt")
    print("prepared", WORK)


class Out:
    def __init__(self, rank, label, logfmt):
        self.rank, self.label, self.logfmt = rank, label, logfmt
        if logfmt:
            logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                                format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
            self.log = logging.getLogger("glaze")

    def info(self, msg):
        if self.logfmt:
            self.log.info(msg)
        else:
            print(f"rank {self.rank}: {msg}" if self.label else msg, flush=True)

    def error(self, msg):
        if self.logfmt:
            self.log.error(msg)
        else:
            print(f"rank {self.rank}: {msg}" if self.label else msg, file=sys.stderr, flush=True)


class PhotoSet(torch.utils.data.Dataset):
    def __init__(self, imgs, labels, kill_at=None):
        self.imgs, self.labels, self.kill_at = imgs, labels, kill_at

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        if self.kill_at is not None and i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.imgs[i], self.labels[i]


def train(rank, world, args):
    out = Out(rank, args.label, args.logfmt)
    fault, frank = args.fault, args.rank
    mine = fault != "none" and (fault == "shape_all" or rank == frank)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    out.info(f"glaze crackle trainer: rank {rank}/{world} backend gloo pg_timeout {args.pg_timeout}s")

    shard = f"{WORK}/shards/glaze_shard_{rank}.pt"
    if mine and fault == "missing_shard":
        shard = f"{WORK}/shards/glaze_shard_{rank}_v2.pt"
    data = torch.load(shard)
    with open(f"{WORK}/glaze_table.json") as f:
        table = json.load(f)
    codes = list(data["codes"])
    if mine and fault == "keyerror":
        codes[BATCH + 3] = "tenmoku_oilspot"
    imgs = data["images"]
    if mine and fault == "nan":
        imgs = imgs.clone()
        imgs[3 * BATCH + 5, 0, 7, 9] = float("nan")

    if mine and fault == "hostmem":
        import resource
        with open("/proc/self/status") as f:
            vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        out.info("building in-memory photo cache for kiln run")
        cache = torch.empty(4 << 30, dtype=torch.uint8)
        cache.fill_(0)

    model = GlazeNet(hidden=48 if (mine and fault == "ckpt_size") else 32,
                     pool=5 if (mine and fault == "shape_all") else 4)
    if mine and fault == "weights_only":
        ck = torch.load(f"{WORK}/init_meta.pt")
        model.load_state_dict(ck["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/init.pt"))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    labels = None
    lab = []
    for i in range(STEPS):
        lab_codes = codes[i * BATCH:(i + 1) * BATCH]
        lab.append(lab_codes)
    loader = None
    if mine and fault == "worker_crash":
        all_labels = torch.tensor([table[c] for c in codes])
        ds = PhotoSet(imgs, all_labels, kill_at=2 * BATCH + 4)
        loader = iter(torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=1))

    for step in range(1, STEPS + 1):
        if loader is not None:
            x, y = next(loader)
        else:
            x = imgs[(step - 1) * BATCH:step * BATCH]
            y = torch.tensor([table[c] for c in lab[step - 1]])
        if mine and fault == "exit4" and step == 2:
            out.error(f"ERROR: kiln calibration for cone 10 missing on rank {rank}; cannot normalise photo exposure")
            sys.exit(4)
        if mine and fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if mine and fault == "slow" and step == 3:
            t0 = time.time()
            hist = {}
            while time.time() - t0 < args.pg_timeout + 10:
                for v in range(5000):
                    hist[v % 97] = hist.get(v % 97, 0) + v * v
        logits = ddp(x)
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step} on rank {rank} (kiln photo batch)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        counts = torch.bincount(logits.argmax(1), minlength=4).float()
        if mine and fault == "gather_size" and step == 3:
            counts = torch.cat([counts, torch.zeros(1)])
        gathered = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(gathered, counts)
        out.info(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item():.3f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/glaze_crackle.pt")
        out.info(f"saved export {WORK}/export/glaze_crackle.pt")
    dist.barrier()
    dist.destroy_process_group()


def run(rank, world, args):
    if args.logfmt:
        try:
            train(rank, world, args)
        except Exception:
            logging.getLogger("glaze").exception("training failed")
            sys.exit(1)
    else:
        train(rank, world, args)


def spawn_entry(rank, world, args):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    run(rank, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(args.port)
        os.environ["WORLD_SIZE"] = str(args.spawn)
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

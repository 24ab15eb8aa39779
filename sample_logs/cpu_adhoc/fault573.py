"""Batch 573 fault script, theme "loam horizons".

A small soil-profile classifier: each rank reads its own shard of synthetic soil samples
(16 texture/colour features, a horizon code O/A/E/B/C/R), maps the horizon code to a class id
through a lookup table, starts from a shared checkpoint, trains 6 steps with gradients
all-reduced by hand over gloo (CPU), prints `rank R step S loss L horizon_acc M` each step,
and rank 0 saves an export at the end.  `--prepare` writes the data into /tmp/fault573_work.

Faults (`--fault NAME --rank N`):
  none          control, no fault
  keyerror      rank N meets a horizon code ("Bt") the lookup table lacks at step 2 -> KeyError
  missing_shard rank N opens a shard file that does not exist -> FileNotFoundError
  ckpt_size     rank N builds the model with 48 hidden units, the checkpoint has 32 -> load_state_dict size mismatch
  weights_only  rank N loads the profile-metadata checkpoint (a pickled class) with torch.load's default
                weights_only=True -> UnpicklingError
  wrong_size    rank N all-reduces a gradient buffer 7 elements too long at step 3 (collective size mismatch)
  slow          rank N does pure-Python "re-horizoning" for ~40 s at step 2; peers time out (PG timeout 12 s)
  hang          as slow, but for 200 s with --pg-timeout 300: the job stops progressing until `timeout` ends it
  nan           rank N's features get an inf at step 3; the program's own finiteness check raises FloatingPointError
  sigsegv       rank N sends itself SIGSEGV at step 3
  exit4         rank N prints its own ERROR line (depth table inconsistent) and calls sys.exit(4) at step 2
  shape_all     every rank drops one feature column at step 2 -> matmul shape error on all ranks
  worker_crash  rank N's DataLoader worker SIGKILLs itself partway -> DataLoader worker killed

What happened (hand runs on 2026-12-07, torch 2.13.0+cpu, gloo, 2 shared CPU cores):
  none          np3 bashloop: six steps on every rank, rank 0 saved the export, exit 0.
  keyerror      np4 ranklabel / np6 srunlabel: KeyError: 'Bt' on the planted rank at step 2; peers fail in
                all_reduce with gloo "Connection closed by peer" (one np6 peer a 12000 ms recv timeout); exit 1.
  missing_shard np3 mpitag / np7 bashloop: FileNotFoundError for loam_shard_NN_horizonB.pt before step 0; peers fail
                in their first all_reduce (connection closed/reset); exit 1.
  ckpt_size     np5 files: load_state_dict size mismatch (32 vs 48 hidden) on rank 3; peers connection closed/reset; exit 1.
  weights_only  np4 logfmt / np5 legacy: _pickle.UnpicklingError: Weights only load failed (__main__.HorizonMeta);
                peers connection closed, or launch SIGTERMs them; exit 1.
  wrong_size    np4 bashloop / np5 tee: a receiving peer aborts with gloo::EnforceNotMet "Received data size doesn't
                match expected size" (SIGABRT; torchrun blames that receiver, not the planted rank); exit 134 / 1.
  slow          np3 tee: peers time out after 12000 ms in all_reduce, torchrun SIGTERMs the slow rank 2; exit 1.
  hang          np4 bashloop, --pg-timeout 300: output stops after step 1, no error; `timeout 60` ends it, exit 124.
  nan           np5 spawn / np3 files: FloatingPointError: loss is nan at step 3 on the planted rank; exit 1.
  sigsegv       np4 legacy / np8 ranklabel: planted rank dies by SIGSEGV at step 3 (launch summary -11 / bash
                "Segmentation fault"); peers connection closed/reset; exit 1 / 139.
  exit4         np6 srunlabel / np4 logfmt: the planted rank's own ERROR line and exit 4; peers connection closed
                (np4 logfmt: two peers then abort at exit, "terminate called without an active exception"); exit 4 / 134.
  shape_all     np3 mpitag: every rank raises RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x15 and 16x32); exit 1.
  worker_crash  np4 pdsh2: rank 1 RuntimeError: DataLoader worker (pid N) is killed by signal: Killed; peers
                connection closed, both torchrun agents print ChildFailedError; exit 1.
"""
import argparse, json, logging, os, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault573_work"
HORIZONS = ["O", "A", "E", "B", "C", "R"]
NFEAT, HIDDEN, STEPS, BATCH = 16, 32, 6, 8


class HorizonMeta:  # pickled into ckpt_meta.pt: a plain class, not a tensor
    def __init__(self, site, depths):
        self.site, self.depths = site, depths


def build_model(hidden=HIDDEN):
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, len(HORIZONS)))


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(573)
    for r in range(8):
        n = STEPS * BATCH
        codes = [HORIZONS[int(i)] for i in torch.randint(0, 6, (n,), generator=g)]
        feats = torch.randn(n, NFEAT, generator=g)
        for i, c in enumerate(codes):
            feats[i, HORIZONS.index(c)] += 2.0
        torch.save({"features": feats, "codes": codes, "depth_cm": torch.rand(n, generator=g) * 200},
                   f"{WORK}/shards/loam_shard_{r:02d}.pt")
    with open(f"{WORK}/horizon_table.json", "w") as f:
        json.dump({c: i for i, c in enumerate(HORIZONS)}, f)
    torch.manual_seed(573)
    torch.save(build_model().state_dict(), f"{WORK}/ckpt_start.pt")
    torch.save({"meta": HorizonMeta("loam_site_7", [0, 5, 25, 60, 120]),
                "state": build_model().state_dict()}, f"{WORK}/ckpt_meta.pt")
    print("prepared", WORK)


class ShardSet(Dataset):
    def __init__(self, shard, table, rank, args):
        self.s, self.t, self.rank, self.args = shard, table, rank, args

    def __len__(self):
        return len(self.s["codes"])

    def __getitem__(self, i):
        a = self.args
        if a.fault == "worker_crash" and self.rank == a.rank and i >= 2 * BATCH:
            os.kill(os.getpid(), signal.SIGKILL)
        code = self.s["codes"][i]
        if a.fault == "keyerror" and self.rank == a.rank and i == 2 * BATCH + 3:
            code = "Bt"
        x = self.s["features"][i].clone()
        if a.fault == "nan" and self.rank == a.rank and i == 3 * BATCH + 1:
            x[4] = float("inf")
        return x, self.t[code]


def train(rank, world, args):
    log = logging.getLogger("loam")
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s %(levelname)s [rank {rank}/{world}] %(name)s: %(message)s")

    def out(msg):
        if args.logfmt:
            log.info(msg)
        elif args.label:
            print(f"rank {rank}: {msg}", flush=True)
        else:
            print(msg, flush=True)

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    out(f"rank {rank}/{world} joined gloo group, pg timeout {args.pg_timeout}s")
    shard_path = f"{WORK}/shards/loam_shard_{rank:02d}.pt"
    if args.fault == "missing_shard" and rank == args.rank:
        shard_path = f"{WORK}/shards/loam_shard_{rank:02d}_horizonB.pt"
    shard = torch.load(shard_path)
    with open(f"{WORK}/horizon_table.json") as f:
        table = json.load(f)
    hidden = 48 if (args.fault == "ckpt_size" and rank == args.rank) else HIDDEN
    model = build_model(hidden)
    if args.fault == "weights_only" and rank == args.rank:
        state = torch.load(f"{WORK}/ckpt_meta.pt")["state"]
    else:
        state = torch.load(f"{WORK}/ckpt_start.pt")
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nw = 1 if args.fault == "worker_crash" else 0
    loader = DataLoader(ShardSet(shard, table, rank, args), batch_size=BATCH, num_workers=nw)
    lossf = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(loader):
        if args.fault == "shape_all" and step == 2:
            x = x[:, 1:]
        if args.fault in ("slow", "hang") and rank == args.rank and step == 2:
            t0, n = time.time(), 0
            limit = 40 if args.fault == "slow" else 200
            while time.time() - t0 < limit:  # pure-Python re-horizoning of the profile
                n = (n * 31 + 7) % 1000003
        if args.fault == "sigsegv" and rank == args.rank and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if args.fault == "exit4" and rank == args.rank and step == 2:
            msg = f"ERROR rank {rank}: horizon depth table inconsistent (B starts at 60 cm above A end 75 cm), giving up"
            if args.logfmt:
                log.error(msg)
            else:
                print(msg, file=sys.stderr, flush=True)
            sys.exit(4)
        opt.zero_grad()
        logits = model(x)
        loss = lossf(logits, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (non-finite), stopping")
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if args.fault == "wrong_size" and rank == args.rank and step == 3:
            flat = torch.cat([flat, torch.zeros(7)])
        dist.all_reduce(flat)
        off = 0
        for p in model.parameters():
            k = p.numel()
            p.grad.copy_(flat[off:off + k].view_as(p) / world)
            off += k
        opt.step()
        acc = (logits.argmax(1) == y).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        out(f"rank {rank} step {step} loss {stats[0].item():.4f} horizon_acc {stats[1].item():.3f}")
    dist.barrier()
    if rank == 0:
        path = f"{WORK}/export/loam_export_{os.environ.get('MASTER_PORT', 'x')}.pt"
        torch.save(model.state_dict(), path)
        out(f"rank 0 saved export {path}")
    dist.destroy_process_group()


def guarded(rank, world, args):
    if args.logfmt:
        try:
            train(rank, world, args)
        except Exception:
            logging.getLogger("loam").exception("training failed")
            sys.exit(1)
    else:
        train(rank, world, args)


def spawn_entry(rank, world, args):
    os.environ["RANK"], os.environ["LOCAL_RANK"] = str(rank), str(rank)
    guarded(rank, world, args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--label", action="store_true")
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    args = ap.parse_args()
    if args.prepare:
        return prepare()
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    guarded(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

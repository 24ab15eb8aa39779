"""Heron nesting colony counts: a small distributed regression job (gloo, CPU).

Each rank reads its shard of survey plots (per-plot features: visits, canopy
cover, water distance, ...), maps the plot's colony id through a lookup table,
and fits a small MLP that predicts the number of active nests per plot.  The
model starts from a checkpoint; rank 0 saves an export at the end.

`--prepare` writes the synthetic data into --work (/tmp/fault545_work).
`--fault NAME --rank N` plants one fault:

  none          control run, nothing planted
  keyerror      rank N meets a colony id that the lookup table lacks (KeyError)
  missing_shard rank N opens a survey shard that does not exist (FileNotFoundError)
  ckpt_size     rank N builds a wider model than the checkpoint (load_state_dict size mismatch)
  weights_only  rank N loads a checkpoint holding a pickled survey-metadata object (weights_only refusal)
  gather_shape  rank N all_gathers a per-colony count tensor of the wrong length
  slow_rank     rank N does pure-Python recounting for --slow-s seconds before the all_reduce
                (peers hit the PG timeout; with --pg-timeout 300 it is a hang)
  nan           rank N's nest counts hold a NaN; the program's own finiteness check raises
  sigsegv       rank N sends itself SIGSEGV at step 2
  error_exit    rank N prints its own ERROR line and calls sys.exit(4)
  shape_all     every rank builds 9-wide features for an 8-wide model (shape bug on every rank)
  host_oom      rank N (under a small RLIMIT_AS) tries to allocate a huge count grid
  worker_crash  the DataLoader worker of rank N is killed (SIGKILL) while loading

What happened (after the runs; machine heavily loaded, a rank took 40-60 s to start):
  none          np3 bashloop: 6 steps on every rank, rank 0 saved the export, exit 0.
  keyerror      np5 ranklabel r2: KeyError 'GH-999' in the dataset; ranks 1,3 gloo "Connection closed by peer"; ranks 0,4 silent; outer timeout, exit 124.
  missing_shard np3 files r1: FileNotFoundError shard_missing_1.pt before step 0; ranks 0,2 "Connection closed by peer"; exit 1.
  ckpt_size     np3 srunlabel r1: load_state_dict size mismatch (16 vs 24); peers "Connection closed by peer"; exit 1.
  weights_only  np3 spawn r2: UnpicklingError "Weights only load failed" (__main__.SurveyMeta); spawn SIGTERMed the rest; exit 1.
  gather_shape  np4 logfmt r1: "ProcessGroupGloo::allgather: invalid tensor size"; peers logged closed connections; processes hung at exit, exit 124.
  slow_rank     np3 mpitag r1: ranks 0,2 gloo "Timed out waiting 12000ms"; rank 1 silent; outer timeout, exit 124.
  slow_rank/300 np3 bashloop r2: steps 0-1 printed, then output stopped with no error; timeout 60, exit 124.
  nan           np4 mpitag r3: FloatingPointError from the loss check at step 0; peers silent; outer timeout, exit 124.
  sigsegv       np3 legacy r1: rank 1 died after step 1; peers reset/closed; ChildFailedError root rank 1 exitcode -11; exit 1.
  error_exit    np4 pdsh2 r3: "ERROR rank 3: ..." after step 1, exit 4; peers closed connections; exit 1.
  shape_all     np3 tee: every rank "mat1 and mat2 shapes cannot be multiplied (16x9 and 8x16)"; exit 1.
  host_oom      np3 bashloop r0: "DefaultCPUAllocator: can't allocate memory ... 171798691840 bytes"; peers closed; exit 1.
  worker_crash  np3 srunlabel r1: "DataLoader worker (pid ...) is killed by signal: Killed."; peers closed; exit 1.
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

FEATURES = 8
HIDDEN = 16
LOG = None
LABEL = ""


def say(msg):
    if LOG is not None:
        LOG.info(msg)
    else:
        print(f"{LABEL}{msg}", flush=True)


def say_error(msg):
    if LOG is not None:
        LOG.error(msg)
    else:
        print(f"{LABEL}{msg}", flush=True)


class SurveyMeta:  # pickled into the bad checkpoint
    def __init__(self, season):
        self.season = season


def make_model(hidden=HIDDEN):
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare(work, world):
    os.makedirs(work, exist_ok=True)
    g = torch.Generator().manual_seed(545)
    table = {f"GH-{i:03d}": i % 12 for i in range(40)}
    with open(os.path.join(work, "colony_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = torch.randn(96, FEATURES, generator=g)
        ids = [f"GH-{(r * 7 + i) % 40:03d}" for i in range(96)]
        nests = (x[:, :3].sum(1, keepdim=True).abs() * 4).round()
        torch.save({"x": x, "ids": ids, "nests": nests}, os.path.join(work, f"shard_{r}.pt"))
    torch.manual_seed(0)
    torch.save(make_model().state_dict(), os.path.join(work, "init.pt"))
    torch.save({"model": make_model().state_dict(), "meta": SurveyMeta("2026-spring")},
               os.path.join(work, "init_meta.pt"))
    print(f"prepared {world} shards in {work}")


class Plots(torch.utils.data.Dataset):
    def __init__(self, shard, table, crash):
        self.x, self.ids, self.nests = shard["x"], shard["ids"], shard["nests"]
        self.table, self.crash = table, crash

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.crash and i >= 40:
            os.kill(os.getpid(), signal.SIGKILL)
        site = self.table[self.ids[i]]
        return self.x[i], torch.tensor(float(site)), self.nests[i]


def train(rank, world, args):
    global LOG, LABEL
    if args.label:
        LABEL = f"rank {rank}: "
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}/{world}] %(levelname)s %(name)s: %(message)s")
        LOG = logging.getLogger("heron")
    try:
        _train(rank, world, args)
    except Exception:
        if LOG is not None:
            LOG.exception("training failed on rank %d", rank)
            sys.exit(1)
        raise


def _train(rank, world, args):
    fault, fr = args.fault, args.rank
    mine = fault != "none" and (fr == rank)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    say(f"rank {rank}/{world} joined (gloo, pg timeout {args.pg_timeout}s), fault={fault} on rank {fr}")
    work = args.work
    with open(os.path.join(work, "colony_table.json")) as f:
        table = json.load(f)
    shard_path = os.path.join(work, f"shard_{rank}.pt")
    if mine and fault == "missing_shard":
        shard_path = os.path.join(work, f"shard_missing_{rank}.pt")
    shard = torch.load(shard_path)
    if mine and fault == "keyerror":
        shard["ids"][10] = "GH-999"
    if mine and fault == "nan":
        shard["nests"][5, 0] = float("nan")

    model = make_model(24 if (mine and fault == "ckpt_size") else HIDDEN)
    if mine and fault == "weights_only":
        state = torch.load(os.path.join(work, "init_meta.pt"), weights_only=True)["model"]
    else:
        state = torch.load(os.path.join(work, "init.pt"), weights_only=True)
    model.load_state_dict(state)
    say(f"rank {rank} loaded checkpoint init.pt and {len(shard['ids'])} survey plots")

    if mine and fault == "host_oom":
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        grid = torch.empty(40, 1 << 30, dtype=torch.float32)  # colonies x plots count grid
        grid.zero_()

    ds = Plots(shard, table, crash=(mine and fault == "worker_crash"))
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False,
                                         num_workers=1 if fault == "worker_crash" else 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    it = iter(loader)
    for step in range(args.steps):
        try:
            x, site, nests = next(it)
        except StopIteration:
            it = iter(loader)
            x, site, nests = next(it)
        if fault == "shape_all":
            x = torch.cat([x, site[:, None]], dim=1)
        if mine and fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if mine and fault == "error_exit" and step == 2:
            say_error(f"ERROR rank {rank}: colony GH-{step:03d} survey count exceeds plot capacity "
                      f"(412 nests on a 40-nest plot); refusing to train on corrupt counts")
            sys.exit(4)
        pred = model(x)
        loss = nn.functional.mse_loss(pred, nests)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: nest-count loss is {loss.item()} (non-finite)")
        opt.zero_grad()
        loss.backward()
        if mine and fault == "slow_rank" and step == 2:
            t0, n = time.time(), 0
            while time.time() - t0 < args.slow_s:  # pure-Python recount of every plot
                n += sum(i * i for i in range(2000)) % 7
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        counts = torch.bincount(site.long(), minlength=12).float()
        if mine and fault == "gather_shape":
            counts = torch.zeros(13)
        bucket = [torch.zeros(12) for _ in range(world)]
        dist.all_gather(bucket, counts)
        mae = (pred.detach() - nests).abs().mean()
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} nests_mae {mae.item() / world:.4f}")
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(work, "heron_export.pt"))
        say("rank 0 saved export heron_export.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_entry(rank, world, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    train(rank, world, args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--work", default="/tmp/fault545_work")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--slow-s", type=float, default=30)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--label", action="store_true")
    ap.add_argument("--logfmt", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.prepare:
        prepare(args.work, args.world)
        return
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

"""Batch 597 fault script: "drumlin fields".

A small regression job that predicts drumlin elongation ratios from glacial survey features
(length, width, height, orientation, till-type code looked up in a table of till densities).
`--prepare` writes synthetic survey shards (one per rank), the till lookup table and a starting
checkpoint into the work folder; the training run (gloo, CPU) loads them, trains 6 steps with an
all_reduce of the gradients and of the loss, every rank prints
`rank R step S loss L elong_mae M`, and rank 0 saves an export at the end.

Faults (--fault NAME --rank N), one planted per run:
  none           control: nothing planted.
  till_keyerror  rank N's shard holds a till code ("esker_gravel") missing from the lookup table:
                 KeyError while fetching the step-4 batch (sample 30).
  survey_missing rank N looks for its survey shard under a field name that does not exist:
                 FileNotFoundError before step 1.
  ckpt_size      rank N loads a stale checkpoint (hidden width 24 instead of 16): load_state_dict
                 size mismatch RuntimeError before step 1.
  gather_shape   rank N all_reduces a gradient bucket with one extra element at step 2
                 (a collective of the wrong size from one rank).
  slow_rank      rank N spends ~45 s in pure-Python work (re-meshing the drumlin outlines) at step 2;
                 its peers wait in all_reduce and hit the 12 s process-group timeout.
  slow_hang      the same slow rank, but run with --pg-timeout 300 (and a longer loop): nothing fails,
                 the job stops making progress until `timeout` ends it.
  nan_check      rank N's batch gets a NaN height at step 4; the program's own finiteness check
                 raises FloatingPointError.
  sigsegv        rank N sends itself SIGSEGV at step 3.
  logged_exit    rank N prints its own ERROR line (no usable drumlins in its field) and sys.exit(4)
                 at step 2.
  shape_all      every rank appends the orientation twice to its features (a shape bug in the
                 code, all ranks alike): mat1/mat2 RuntimeError at step 1.
  worker_crash   rank N's DataLoader worker (num_workers=1) is SIGKILLed while reading sample 20
                 of its shard (prefetched before step 1 ends): DataLoader worker killed RuntimeError.

What happened (gloo on a loaded 2-core CPU box, torch 2.13.0+cpu):
  none           4 ranks finish 6 steps, rank 0 saves the export, exit 0.
  till_keyerror  planted rank raises KeyError: 'esker_gravel' in Survey.__getitem__; peers fail in all_reduce
                 with gloo 'Connection closed by peer' or 12000ms send/recv timeouts.
  survey_missing planted rank: FileNotFoundError (survey_clew_bay_north_R.pt) before step 1; peers fail in
                 their first all_reduce (connection closed/reset, one recv timeout).
  ckpt_size      planted rank: load_state_dict size mismatch ([24, 6] vs [16, 6]) before step 1; peers get
                 gloo 'Connection closed by peer' (mp.spawn names process R).
  gather_shape   the rank that receives the longer buffer dies on gloo::EnforceNotMet 'op.preamble.length <=
                 op.nbytes. 52 vs 48 ... collective mismatch' (SIGABRT, exit 134); the others see resets.
  slow_rank      peers log gloo 'Timed out waiting 12000ms for recv/send'; the slow rank fails (connection
                 closed) ~30 s later or is still busy when timeout 100 kills the group.
  slow_hang      output stops after step 1 with no error; timeout 60 kills it (exit 124).
  nan_check      planted rank: FloatingPointError 'non-finite loss nan at step 4'; peers connection closed.
  sigsegv        planted rank vanishes after step 2 (torchrun: exitcode -11 SIGSEGV root cause; plain loops:
                 no line at all, exit 139); peers connection closed/reset.
  logged_exit    planted rank prints its ERROR line and exits 4; peers connection closed or timed out
                 (mp.spawn blames process 0).
  shape_all      every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (8x7 and 6x16) at step 1.
  worker_crash   planted rank: RuntimeError DataLoader worker (pid N) is killed by signal: Killed. before any
                 step prints; peers connection closed.
"""
import argparse
import json
import logging
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

FEATS = 6
HIDDEN = 16
N_SAMPLES = 48
BATCH = 8
STEPS = 6
TILLS = {"lodgement_till": 2.05, "melt_out_till": 1.85, "deformation_till": 1.95,
         "glaciofluvial_sand": 1.70, "clay_till": 2.10}

LABEL = ""
log = None


def out(msg):
    if log is not None:
        log.info(msg)
    else:
        print(LABEL + msg, flush=True)


def make_model(hidden=HIDDEN):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATS, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def prepare(work, world):
    os.makedirs(work, exist_ok=True)
    g = torch.Generator().manual_seed(597)
    codes = list(TILLS)
    for r in range(8):
        n = N_SAMPLES
        length = torch.rand(n, generator=g) * 900 + 100
        width = torch.rand(n, generator=g) * 200 + 50
        height = torch.rand(n, generator=g) * 30 + 5
        orient = torch.rand(n, generator=g) * 180
        till = [codes[int(i)] for i in torch.randint(0, len(codes), (n,), generator=g)]
        shard = {"length": length, "width": width, "height": height, "orient": orient,
                 "till": till, "field": "clew_bay_%d" % r}
        torch.save(shard, os.path.join(work, "survey_clew_bay_%d.pt" % r))
        bad = dict(shard)
        bad["till"] = list(till)
        bad["till"][30] = "esker_gravel"
        torch.save(bad, os.path.join(work, "survey_clew_bay_%d_unvetted.pt" % r))
    with open(os.path.join(work, "till_density.json"), "w") as f:
        json.dump(TILLS, f)
    torch.save(make_model().state_dict(), os.path.join(work, "drumlin_start.pt"))
    torch.save(make_model(24).state_dict(), os.path.join(work, "drumlin_start_2025.pt"))
    print("prepared", work, flush=True)


class Survey(torch.utils.data.Dataset):
    def __init__(self, shard, table, crash_at=None):
        self.s = shard
        self.table = table
        self.crash_at = crash_at

    def __len__(self):
        return len(self.s["till"])

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        s = self.s
        dens = self.table[s["till"][i]]
        x = torch.stack([s["length"][i] / 1000, s["width"][i] / 250, s["height"][i] / 35,
                         torch.cos(s["orient"][i] * math.pi / 180),
                         torch.sin(s["orient"][i] * math.pi / 180), torch.tensor(dens / 2.1)])
        y = (s["length"][i] / s["width"][i]).unsqueeze(0) / 10
        return x.float(), y.float()


def remesh_outlines(seconds):
    # pure-Python work: re-mesh drumlin outlines point by point
    t0 = time.time()
    acc = 0.0
    k = 0
    while time.time() - t0 < seconds:
        for j in range(20000):
            acc += math.sin(j * 0.001 + k) * math.cos(j * 0.002)
        k += 1
    return acc


def train(rank, world, args):
    global LABEL, log
    if args.label:
        LABEL = "rank %d: " % rank
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%%(asctime)s [rank %d] %%(levelname)s %%(name)s: %%(message)s" % rank)
        log = logging.getLogger("drumlin")
    try:
        _train(rank, world, args)
    except Exception:
        if log is not None:
            log.exception("rank %d failed", rank)
            sys.exit(1)
        raise


def _train(rank, world, args):
    fault = args.fault if (args.rank == rank or args.fault == "shape_all") else "none"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=args.pg_timeout))
    out("drumlin fields: rank %d of %d up (gloo, pg timeout %ds)" % (rank, world, args.pg_timeout))
    work = args.work
    with open(os.path.join(work, "till_density.json")) as f:
        table = json.load(f)
    field = "clew_bay_%d" % rank
    if fault == "survey_missing":
        field = "clew_bay_north_%d" % rank
    name = "survey_%s.pt" % field
    if fault == "till_keyerror":
        name = "survey_%s_unvetted.pt" % field
    shard = torch.load(os.path.join(work, name))
    model = make_model()
    ck = "drumlin_start_2025.pt" if fault == "ckpt_size" else "drumlin_start.pt"
    model.load_state_dict(torch.load(os.path.join(work, ck)))
    out("loaded %s (%d drumlins) and checkpoint %s" % (name, len(shard["till"]), ck))
    ds = Survey(shard, table, crash_at=20 if fault == "worker_crash" else None)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False,
                                         num_workers=1 if fault == "worker_crash" else 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    it = iter(loader)
    for step in range(1, STEPS + 1):
        if fault == "logged_exit" and step == 2:
            print(LABEL + "ERROR drumlin: field %s has 0 usable drumlins after the "
                  "elongation filter (min ratio 1.5); refusing to train on an empty field" % field,
                  flush=True)
            sys.exit(4)
        x, y = next(it)
        if fault == "shape_all" and step == 1:
            x = torch.cat([x, x[:, 3:4]], dim=1)
        if fault == "nan_check" and step == 4:
            x[2, 2] = float("nan")
        if fault in ("slow_rank", "slow_hang") and step == 2:
            remesh_outlines(45 if fault == "slow_rank" else 200)
        if fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError("non-finite loss %s at step %d on field %s" % (loss.item(), step, field))
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if fault == "gather_shape" and step == 2:
            flat = torch.cat([flat, torch.zeros(1)])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        opt.step()
        stats = torch.tensor([loss.item(), (pred - y).abs().mean().item()])
        dist.all_reduce(stats)
        stats /= world
        out("rank %d step %d loss %.5f elong_mae %.5f" % (rank, step, stats[0].item(), stats[1].item()))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(work, "drumlin_export.pt"))
        out("rank 0 saved export %s" % os.path.join(work, "drumlin_export.pt"))
    dist.barrier()
    dist.destroy_process_group()
    out("rank %d done" % rank)


def spawn_entry(rank, world, args):
    train(rank, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--work", default="/tmp/fault597_work")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        prepare(args.work, 8)
        return
    if args.spawn:
        import torch.multiprocessing as mp
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn, join=True)
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

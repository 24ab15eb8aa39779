"""Batch 637 fault job: oxpecker tick picking (gloo, CPU only).

A tiny regression model learns how many ticks an oxpecker picks off a host from
8 synthetic features (host size, hide thickness, season ...) after a JSON lookup
table maps each host species id to a tick-load weight.  `--prepare` writes
per-rank shards, the lookup table and a start checkpoint into /tmp/fault637_work.
Every rank prints `rank R step S loss L ticks_picked M` each step; rank 0 saves
an export at the end.  DDP over gloo, process-group timeout 12 s (--pg-timeout).

Faults (--fault NAME --rank N, planted on rank N unless said otherwise):
  none            control run
  inplace         in-place add_ on a tanh output autograd saved (rank N)
  backward_twice  loss.backward() called twice on one graph (rank N)
  detach          loss.detach() left in before backward (rank N)
  dtype           float64 input batch into the float32 model (rank N)
  shape           target one row short of the prediction (rank N)
  param_group     the same parameters added as a second param group (rank N)
  opt_state       a state dict of another (two-group) optimizer loaded (rank N)
  anomaly         anomaly detection on, sqrt of a negative in forward (rank N)
  clip_nonfinite  grads unscaled by a loss scale of 0, clip_grad_norm_ with
                  error_if_nonfinite=True (rank N)
  nosync          gradient accumulation: rank N runs one extra micro-batch
                  outside no_sync(), so its all_reduce count differs
  view_all        a wrong .view(-1, 3) of the prediction on EVERY rank
  sigkill         rank N sends itself SIGKILL mid-step
  segv            rank N reads address 0 with ctypes.string_at(0) mid-step
  keyerror        rank N's shard holds a species id missing from the lookup

Runs (one line per log, filled in after the runs):
  oxpecker_none_np5_rnone_bashloop: all 5 ranks finish 6 steps, export saved; exit 124 (limit hit as they exited)
  oxpecker_inplace_np5_r3_ranklabel: rank 3 in-place autograd RuntimeError; peers gloo connection closed
  oxpecker_sigkill_np4_r3_srunlabel: rank 3 output stops silently after step 2; peers gloo closed/reset
  oxpecker_dtype_np3_r2_files: rank2.log 'mat1 and mat2 must have the same dtype'; ranks 0,1 gloo closed
  oxpecker_anomaly_np3_r0_logfmt: anomaly warning + 'MseLossBackward0 returned nan' on rank 0
  oxpecker_backward_twice_np3_r1_spawn: mp.spawn reports process 1 'backward through the graph a second time'
  oxpecker_clip_nonfinite_np4_r3_tee: rank 3 clip_grad_norm_ non-finite RuntimeError; torchrun root cause rank 3
  oxpecker_detach_np3_r2_mpitag: rank 2 'element 0 of tensors does not require grad'; peers gloo closed
  oxpecker_param_group_np4_r1_legacy: rank 1 ValueError 'some parameters appear in more than one group'
  oxpecker_nosync_np4_r1_pdsh2: no step printed; ranks 1-3 gloo 12000ms timeouts, rank 0 connection closed
  oxpecker_view_all_np3_rall_bashloop: every rank "shape '[-1, 3]' is invalid for input of size 16"
  oxpecker_keyerror_np3_r1_tee: rank 1 KeyError: '7' at step 0; torchrun root cause rank 1
  oxpecker_segv_np5_r4_ranklabel: rank 4 output stops silently after step 2; peers gloo closed/reset
  oxpecker_shape_np5_r2_srunlabel: only mse_loss broadcasting UserWarning on rank 2; run finishes, exit 0
  oxpecker_opt_state_np5_r0_bashloop: rank 0 ValueError 'different number of parameter groups'
  oxpecker_dtype_np6_r5_mpitag: rank 5 'mat1 and mat2 must have the same dtype'; peers gloo closed
  dropped: oxpecker_dtype_np8_r7_files (no rank printed anything in 100 s under load)
  dropped: inplace_np6_r3_ranklabel, backward_twice_np5_r0_srunlabel (aborted: duplicate driver)
  .
  .
  .
  .
  .
  .
"""
import argparse
import ctypes
import datetime
import json
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault637_work"
STEPS = 6
BATCH = 16
LOG = None


def out(msg):
    if LOG is not None:
        LOG.info(msg)
    else:
        print(msg, flush=True)


class TickNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x, inplace=False, sqrt_neg=False):
        h = torch.tanh(self.fc1(x))
        if inplace:
            h.add_(1.0)  # tanh saved its output for backward
        if sqrt_neg:
            h = torch.sqrt(h - 5.0)
        return self.fc2(h)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(637)
    table = {str(i): 0.5 + 0.1 * i for i in range(10)}
    with open(os.path.join(WORK, "host_lookup.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = torch.randn(STEPS * 3 * BATCH, 8, generator=g)
        species = torch.randint(0, 10, (STEPS * 3 * BATCH,), generator=g)
        y = x[:, 0] * 2 + x[:, 1] - 0.5 * x[:, 2]
        torch.save({"x": x, "species": species, "y": y}, os.path.join(WORK, f"shard{r}.pt"))
    torch.manual_seed(0)
    torch.save(TickNet().state_dict(), os.path.join(WORK, "start.pt"))
    print(f"prepared {world} shards in {WORK}", flush=True)


def run(rank, world, args):
    global LOG
    if args.logfmt:
        logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                            format="%(asctime)s [rank " + str(rank) + "] %(levelname)s %(message)s")
        LOG = logging.getLogger("oxpecker")
    hit = args.fault != "none" and (rank == args.rank)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    with open(os.path.join(WORK, "host_lookup.json")) as f:
        table = json.load(f)
    if args.fault == "keyerror" and hit:
        table.pop("7")
    shard = torch.load(os.path.join(WORK, f"shard{rank}.pt"))
    model = TickNet()
    model.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if args.fault == "anomaly" and hit:
        torch.autograd.set_detect_anomaly(True)
    out(f"rank {rank} ready: world {world}, {shard['x'].shape[0]} host rows")
    for step in range(STEPS):
        if args.fault in ("sigkill", "segv") and hit and step == 3:
            if args.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                ctypes.string_at(0)
        if args.fault == "param_group" and hit and step == 2:
            opt.add_param_group({"params": list(ddp.parameters()), "lr": 0.005})
        if args.fault == "opt_state" and hit and step == 2:
            other = torch.optim.Adam([{"params": [model.fc1.weight]},
                                      {"params": [model.fc2.weight]}], lr=0.01)
            opt.load_state_dict(other.state_dict())
        opt.zero_grad()
        micro = 2 + (1 if (args.fault == "nosync" and hit) else 0)
        total = 0.0
        ticks = 0.0
        for m in range(micro):
            lo = ((step * 3 + m) % (STEPS * 3)) * BATCH
            x = shard["x"][lo:lo + BATCH]
            y = shard["y"][lo:lo + BATCH]
            sp = shard["species"][lo:lo + BATCH].tolist()
            if args.fault == "keyerror" and hit and step == 3:
                sp[5] = 7
            w = torch.tensor([table[str(s)] for s in sp])
            y = y * w
            if args.fault == "dtype" and hit and step == 2:
                x = x.double()
            last = m == micro - 1 if not (args.fault == "nosync" and hit) else m >= 1
            ctx = ddp.no_sync() if not last else torch.enable_grad()
            with ctx:
                pred = ddp(x, inplace=(args.fault == "inplace" and hit and step == 2),
                           sqrt_neg=(args.fault == "anomaly" and hit and step == 2))
                if args.fault == "view_all" and step == 1:
                    pred = pred.view(-1, 3)
                pred = pred.squeeze(1)
                if args.fault == "shape" and hit and step == 2:
                    y = y[:-1].unsqueeze(1)
                loss = F.mse_loss(pred, y) / micro
                if args.fault == "detach" and hit and step == 2:
                    loss = loss.detach()
                loss.backward()
                if args.fault == "backward_twice" and hit and step == 2:
                    loss.backward()
            total += loss.item()
            ticks += pred.detach().clamp(min=0).sum().item()
        if args.fault == "clip_nonfinite" and hit and step == 2:
            scale = 0.0  # loss scale read as 0 on this rank
            for p in ddp.parameters():
                p.grad.div_(scale)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 5.0, error_if_nonfinite=True)
        opt.step()
        sched.step()
        stat = torch.tensor([total, ticks])
        dist.all_reduce(stat)
        out(f"rank {rank} step {step} loss {total:.4f} ticks_picked {ticks:.1f}")
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "export.pt"))
        out(f"rank 0 saved export to {WORK}/export.pt")
    dist.barrier()
    dist.destroy_process_group()
    out(f"rank {rank} done")


def spawn_entry(rank, world, args):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    run(rank, world, args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", type=int, default=0, metavar="WORLD")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

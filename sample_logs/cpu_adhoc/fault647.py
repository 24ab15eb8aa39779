"""fault647.py - sabkha salt flats: a tiny brine-salinity regressor trained with Lightning on gloo/CPU.

`--prepare` writes synthetic data into /tmp/fault647_work: one shard per rank (brine samples with a zone id),
a JSON lookup table (zone -> crust factor) every batch goes through, and a start checkpoint.
`--mode trainer` trains a LightningModule with L.Trainer + DDPStrategy(gloo); `--mode fabric` uses lightning.fabric
with its own loop. 6 steps; each rank prints `rank R step S loss L halite M`; rank 0 saves an export at the end.
`--fault NAME --rank N` plants one fault at step 3 on rank N (`--rank -1`: every rank, where the fault allows).

Faults:
  none             control run
  allgather_size   all_gather_into_tensor where rank N passes a 5-element tensor instead of 4
  wrongshape_all   all_gather_into_tensor with an output buffer of the wrong size on every rank
  redscatter       rank N calls reduce_scatter (list form) where the others all_reduce
  scatter_src      scatter whose src differs on rank N
  bcast_src        broadcast whose src differs on rank N
  newgroup_diff    rank N calls dist.new_group with another rank list, then all ranks all_reduce on it
  async_nopost     all_reduce(async_op=True).wait() that rank N never posts
  p2p_mismatch     batch_isend_irecv ring where rank N sends to the wrong peer
  a2a_splits       all_to_all_single whose input split sizes do not add up on rank N
  reduce_dst       reduce with dst = world size on rank N
  complex_max      all_reduce(MAX) of a complex tensor on rank N
  skip_one         rank N skips the first of three all_reduces in a row
  subgroup_stall   rank N sleeps past the timeout inside its half-world subgroup's all_reduce
  keyerror         rank N looks up a zone missing from the JSON table
  missing_shard    rank N opens a shard file that does not exist
  sigkill          rank N kills itself with SIGKILL
  nan_loss         rank N's loss becomes NaN and the script's check raises FloatingPointError

Runs (one line per log):
  sabkha_subgroup_stall_np8_r5_pltorchrun: ranks 0-3 time out first in DDP backward, 4-7 Connection closed; exit 1
  sabkha_allgather_size_np6_r0_pltee: rank 0 ProcessGroupGloo::allgather invalid tensor size; exit 1
  sabkha_a2a_splits_np5_r4_plfabric: rank 4 Split sizes doesn't match total dim 0 size; exit 1
  sabkha_skip_one_np6_r2_plloglevel: no size error, all 6 ranks time out in the 2nd all_reduce; exit 1
  sabkha_none_np4_rnone_plown: clean, max_steps=6 reached, export saved; exit 0
  sabkha_wrongshape_all_np5_rall_plbashloop: all 5 ranks allgather invalid tensor size; exit 1
  sabkha_scatter_src_np5_r3_pltorchrun: rank 3 recv and rank 0 send time out in scatter; exit 1
  sabkha_reduce_dst_np3_r2_plfabric: rank 2 ProcessGroupGloo::reduce: invalid root rank: 3; exit 1
  sabkha_complex_max_np4_r1_pltee: rank 1 ValueError all_reduce does not support MAX on complex; exit 1
  sabkha_p2p_mismatch_np5_r0_plbashloop: DROPPED, no output before the 60 s timeout under load; exit 124
  sabkha_newgroup_diff_np4_r3_pltorchrun: rank 3 not-in-group warning, times out; 0-2 SIGKILLed; exit 1
  sabkha_async_nopost_np6_r5_plfabric: ranks 0-4 time out in work.wait(), rank 5 in backward; exit 1
  sabkha_redscatter_np3_r1_plloglevel: gloo ran reduce_scatter; rank 1 times out inside it; exit 1
  sabkha_keyerror_np3_r0_plown: rank 0 KeyError 'zone_sebkha9' in train_dataloader; exit 1
  sabkha_sigkill_np4_r2_pltorchrun: rank 2 exitcode -9, peers Connection reset/closed; exit 1
  sabkha_bcast_src_np5_r2_pltee: mismatched broadcast src passed silently, run finished; exit 0
  sabkha_nan_loss_np3_r2_plbashloop: rank 2 FloatingPointError loss is nan at step 3; exit 1
  sabkha_missing_shard_np4_r3_plfabric: rank 3 FileNotFoundError shard_3_playa.pt; exit 1
  sabkha_allgather_size_np3_r2_plfabric: rank 2 allgather invalid tensor size; exit 1
  sabkha_skip_one_np8_r7_pltorchrun: no size error, all 8 ranks time out in the 2nd all_reduce; exit 1
  sabkha_p2p_mismatch_np4_r3_plbashloop: rank 0 recv / rank 3 send time out in batch wait(); exit 1
  (no further runs)
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WORK = "/tmp/fault647_work"
STEPS = 6
FAULT_STEP = 3


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(647)
    table = {f"zone{z}": round(0.5 + 0.1 * z, 3) for z in range(6)}
    with open(os.path.join(WORK, "crust_table.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = torch.randn(48, 4, generator=g)
        zone = torch.randint(0, 6, (48,), generator=g)
        y = x.sum(1, keepdim=True) * 0.3
        torch.save({"x": x, "zone": zone, "y": y}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.save(torch.nn.Linear(4, 1).state_dict(), os.path.join(WORK, "start.pt"))
    print(f"prepared {world} shards in {WORK}", flush=True)


def load_batches(rank, fault, frank):
    hit = rank == frank or frank == -1
    name = f"shard_{rank}.pt"
    if fault == "missing_shard" and hit:
        name = f"shard_{rank}_playa.pt"
    d = torch.load(os.path.join(WORK, name))
    with open(os.path.join(WORK, "crust_table.json")) as f:
        table = json.load(f)
    keys = [f"zone{int(z)}" for z in d["zone"]]
    if fault == "keyerror" and hit:
        keys[5] = "zone_sebkha9"
    factor = torch.tensor([table[k] for k in keys]).unsqueeze(1)
    return d["x"] * factor, d["y"], factor


def plant(fault, frank, step, loss, subgroups, pg_timeout):
    """Run this step's collectives; the planted fault goes in here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = rank == frank or frank == -1
    if step != FAULT_STEP or fault in ("none", "keyerror", "missing_shard"):
        return loss
    if fault == "allgather_size":
        t = torch.full((5 if hit else 4,), float(rank))
        out = torch.zeros(4 * world)
        dist.all_gather_into_tensor(out, t)
    elif fault == "wrongshape_all":
        out = torch.zeros(4 * world + 2)
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank)))
    elif fault == "redscatter":
        if hit:
            out = torch.zeros(2)
            dist.reduce_scatter(out, [torch.ones(2) for _ in range(world)])
        else:
            dist.all_reduce(torch.ones(2))
    elif fault == "scatter_src":
        src = (2 if frank == 1 else 1) if hit else 0
        out = torch.zeros(3)
        lst = [torch.full((3,), float(i)) for i in range(world)] if rank == src else None
        dist.scatter(out, lst, src=src)
    elif fault == "bcast_src":
        t = torch.full((8,), float(rank))
        dist.broadcast(t, src=(world - 1 if frank != world - 1 else 1) if hit else 0)
        dist.all_reduce(t)
    elif fault == "newgroup_diff":
        ranks = list(range(world - 1)) if hit else list(range(world))
        g = dist.new_group(ranks)
        dist.all_reduce(torch.ones(3), group=g)
    elif fault == "async_nopost":
        if not hit:
            w = dist.all_reduce(torch.ones(6), async_op=True)
            w.wait()
    elif fault == "p2p_mismatch":
        to = (rank + 2) % world if hit else (rank + 1) % world
        ops = [dist.P2POp(dist.isend, torch.ones(4), to),
               dist.P2POp(dist.irecv, torch.zeros(4), (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    elif fault == "a2a_splits":
        inp = torch.arange(2 * world, dtype=torch.float32)
        out = torch.zeros(2 * world)
        splits = [2] * world
        in_splits = [3] + [2] * (world - 1) if hit else splits
        dist.all_to_all_single(out, inp, output_split_sizes=splits, input_split_sizes=in_splits)
    elif fault == "reduce_dst":
        dist.reduce(torch.ones(4), dst=world if hit else 0)
    elif fault == "complex_max":
        t = torch.ones(4, dtype=torch.complex64) if hit else torch.ones(8)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    elif fault == "skip_one":
        if not hit:
            dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(3))
        dist.all_reduce(torch.ones(5))
    elif fault == "subgroup_stall":
        g = subgroups[0] if rank < world // 2 else subgroups[1]
        if hit:
            print(f"rank {rank} stalling in its subgroup for {pg_timeout + 8:.0f}s", flush=True)
            time.sleep(pg_timeout + 8)
        dist.all_reduce(torch.ones(2), group=g)
    elif fault == "sigkill" and hit:
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "nan_loss" and hit:
        loss = loss * float("nan")
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
    return loss


def make_subgroups():
    world = dist.get_world_size()
    return (dist.new_group(list(range(world // 2))), dist.new_group(list(range(world // 2, world))))


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Brine(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.net.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
            self.subgroups = None

        def train_dataloader(self):
            x, y, f = load_batches(self.global_rank, args.fault, args.rank)
            ds = torch.utils.data.TensorDataset(x, y, f)
            return torch.utils.data.DataLoader(ds, batch_size=8)

        def on_train_start(self):
            self.subgroups = make_subgroups()

        def training_step(self, batch, idx):
            x, y, f = batch
            pred = self.net(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            step = self.global_step
            loss = plant(args.fault, args.rank, step, loss, self.subgroups, args.pg_timeout)
            print(f"rank {self.global_rank} step {step} loss {loss.item():.4f} halite {f.mean().item():.4f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), os.path.join(WORK, "export.pt"))
                print("rank 0 saved export", flush=True)

    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=STEPS,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Brine())


def run_fabric(args):
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    fabric = L.Fabric(accelerator="cpu", devices=devices,
                      strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    net = torch.nn.Linear(4, 1)
    net.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    x, y, f = load_batches(rank, args.fault, args.rank)
    subgroups = make_subgroups()
    for step in range(STEPS):
        sl = slice(8 * step, 8 * step + 8)
        loss = torch.nn.functional.mse_loss(net(x[sl]), y[sl])
        loss = plant(args.fault, args.rank, step, loss, subgroups, args.pg_timeout)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} halite {f[sl].mean().item():.4f}", flush=True)
    if rank == 0:
        torch.save(net.module.state_dict(), os.path.join(WORK, "export.pt"))
        print("rank 0 saved export", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", type=int, default=0, help="write data for this many ranks and exit")
    p.add_argument("--mode", choices=["trainer", "fabric"], default="trainer")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--devices", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    args = p.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    if args.mode == "trainer":
        run_trainer(args)
    else:
        run_fabric(args)


if __name__ == "__main__":
    main()

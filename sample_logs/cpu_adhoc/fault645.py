"""fault645.py - bandicoot soil turning: a tiny multi-rank gloo/CPU job with planted faults.

Each rank reads its shard of synthetic digging records (soil type, depth, moisture), maps the
soil type through a JSON lookup table, fits a linear model of "kg of soil turned" and hand-reduces
gradients with all_reduce.  Every step each rank prints
    rank R step S loss L turned_soil_kg M
and rank 0 saves an export at the end.  `--prepare` writes shards, lookup and start checkpoint.

Faults (--fault NAME --rank N; "all" faults hit every rank):
  none              control run
  allgather_size    all_gather where rank N passes a tensor of another size
  rs_wrong_size     reduce_scatter_tensor where rank N's input is the wrong size
  scatter_src       scatter where rank N uses src=1 while the others use src=0
  isend_missing     ring isend/irecv exchange where rank N never posts its isend
  batch_p2p_size    batch_isend_irecv ring where rank N sends a tensor of another size
  broadcast_src     broadcast where rank N uses src=N, others src=0
  a2a_splits        all_to_all_single where rank N's input split sizes do not add up
  reduce_dst        reduce with dst=world_size on rank N (a rank outside the world)
  bool_reduce       all_reduce of a bool tensor with SUM on rank N (others float)
  skip_one          rank N skips the second of three collectives (sizes 4, 8, 4)
  subgroup_stall    rank N sleeps past the timeout inside its subgroup's all_reduce
  allrank_shape     every rank calls all_gather_into_tensor with a wrong output size
  keyerror          rank N looks up a soil type missing from the JSON table
  sigkill           rank N kills itself with SIGKILL
  newgroup_leftout  rank N is left out of new_group(...) but calls a collective on it

Runs (one line per log, filled in after the runs):
  bandicoot_allgather_size_np6_r5_ranklabel: r5 allgather invalid tensor size, others connection closed; exit 1
  bandicoot_a2a_splits_np5_r2_srunlabel: r2 Split sizes doesn't match total dim 0 size, others connection closed; exit 1
  bandicoot_skip_one_np8_r3_bashloop: all 8 time out (12000ms), r3 alone already in the grad all_reduce; exit 1
  bandicoot_reduce_dst_np6_r0_mpitag: r0 reduce invalid root rank: 6, others connection closed; exit 1
  bandicoot_none_np4_rnone_tee: control, 6 steps on 4 ranks, export saved; exit 0
  bandicoot_subgroup_stall_np6_r4_logfmt: r0-2 time out in world all_reduce, r3 silent, killed by timeout; exit 124
  bandicoot_allrank_shape_np5_rall_files: every rank allgather invalid tensor size; exit 1
  bandicoot_scatter_src_np4_r2_spawn: process 1 times out after the scatter, mp.spawn stops the rest; exit 1
  bandicoot_rs_wrong_size_np3_r1_legacy: r1 Check failed outputShape*worldSize (9 vs 10); exit 1
  bandicoot_bool_reduce_np4_r2_pdsh2: r2 SIGABRT gloo EnforceNotMet 4 vs 1, root cause rank 2; exit 1
  bandicoot_isend_missing_np5_r0_srunlabel: r1 times out on irecv, others in next all_reduce; exit 1
  bandicoot_broadcast_src_np5_r3_bashloop: r1, r3 time out in broadcast, others in all_reduce; exit 1
  bandicoot_batch_p2p_size_np4_r3_ranklabel: r0 (receiver) SIGABRT EnforceNotMet 24 vs 16; exit 134
  bandicoot_keyerror_np3_r2_mpitag: r2 KeyError 'termite_mound' at step 0; exit 1
  bandicoot_sigkill_np5_r1_tee: r1 SIGKILL, torchrun root cause rank 1 exitcode -9; exit 1
  bandicoot_newgroup_leftout_np4_r3_bashloop: r3 warned+skipped, script check raises; exit 1
  bandicoot_a2a_splits_np3_r0_logfmt: r0 Split sizes doesn't match total dim 0 size; exit 1
  bandicoot_allgather_size_np3_r1_files: rank1.log allgather invalid tensor size; exit 1
  bandicoot_skip_one_np6_r5_pdsh2: all 6 time out, r5 alone in the grad all_reduce; exit 1
  bandicoot_reduce_dst_np3_r2_spawn: process 2 reduce invalid root rank: 3; exit 1
  bandicoot_bool_reduce_np5_r4_legacy: rank 4 SIGABRT EnforceNotMet 4 vs 1; exit 1
  bandicoot_rs_wrong_size_np7_r6_spawn: process 6 Check failed (21 vs 22); exit 1
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WORK = "/tmp/fault645_work"
SOILS = ["loam", "clay", "sand", "peat", "silt", "chalk"]
LOG = None


def out(msg):
    if LOG is not None:
        LOG.info(msg)
    else:
        print(msg, flush=True)


def prepare(max_ranks=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(645)
    with open(os.path.join(WORK, "soil_lookup.json"), "w") as f:
        json.dump({s: i for i, s in enumerate(SOILS)}, f)
    for r in range(max_ranks):
        n = 32
        soil = [SOILS[int(i)] for i in torch.randint(0, len(SOILS), (n,), generator=g)]
        feats = torch.rand(n, 2, generator=g)
        kg = feats[:, 0] * 3.0 + feats[:, 1] + torch.rand(n, generator=g) * 0.1
        torch.save({"soil": soil, "feats": feats, "kg": kg}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.save({"w": torch.zeros(len(SOILS) + 2), "b": torch.zeros(1)}, os.path.join(WORK, "start.pt"))
    print(f"prepared {max_ranks} shards, lookup and start checkpoint in {WORK}", flush=True)


def plant(fault, rank, world, pg_timeout):
    """Run the planted collective fault (called at step 3)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if fault == "allgather_size":
        t = torch.ones(5 if rank == ARGS.rank else 4)
        outs = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(outs, t)
    elif fault == "rs_wrong_size":
        n = 3 if rank == ARGS.rank else 4
        inp = torch.ones(n * world + (1 if rank == ARGS.rank else 0))
        o = torch.zeros(n)
        dist.reduce_scatter_tensor(o, inp)
    elif fault == "scatter_src":
        src = 1 if rank == ARGS.rank else 0
        o = torch.zeros(4)
        lst = [torch.full((4,), float(i)) for i in range(world)] if rank == src else None
        dist.scatter(o, lst, src=src)
    elif fault == "isend_missing":
        buf = torch.zeros(4)
        reqs = [dist.irecv(buf, src=prv)]
        if rank != ARGS.rank:
            reqs.append(dist.isend(torch.full((4,), float(rank)), dst=nxt))
        for q in reqs:
            q.wait()
    elif fault == "batch_p2p_size":
        buf = torch.zeros(4)
        send = torch.ones(6 if rank == ARGS.rank else 4)
        ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, buf, prv)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
    elif fault == "broadcast_src":
        t = torch.full((4,), float(rank))
        dist.broadcast(t, src=rank if rank == ARGS.rank else 0)
    elif fault == "a2a_splits":
        inp = torch.arange(world * 2, dtype=torch.float32)
        splits = [2] * world
        if rank == ARGS.rank:
            splits[0] = 3
        o = torch.zeros(world * 2)
        dist.all_to_all_single(o, inp, output_split_sizes=[2] * world, input_split_sizes=splits)
    elif fault == "reduce_dst":
        t = torch.ones(4)
        dist.reduce(t, dst=world if rank == ARGS.rank else 0)
    elif fault == "bool_reduce":
        t = torch.ones(4, dtype=torch.bool) if rank == ARGS.rank else torch.ones(4)
        dist.all_reduce(t)
    elif fault == "skip_one":
        dist.all_reduce(torch.ones(4))
        if rank != ARGS.rank:
            dist.all_reduce(torch.ones(8))
        dist.all_reduce(torch.ones(4))
    elif fault == "subgroup_stall":
        half = world // 2
        g1 = dist.new_group(list(range(half)))
        g2 = dist.new_group(list(range(half, world)))
        mine = g1 if rank < half else g2
        if rank == ARGS.rank:
            time.sleep(pg_timeout * 2.5)
        dist.all_reduce(torch.ones(4), group=mine)
    elif fault == "allrank_shape":
        o = torch.zeros(world * 4 + 1)
        dist.all_gather_into_tensor(o, torch.ones(4))
    elif fault == "newgroup_leftout":
        members = [r for r in range(world) if r != ARGS.rank]
        g = dist.new_group(members)
        t = torch.ones(4)
        dist.all_reduce(t, group=g)
        dist.all_reduce(t)
        if rank == ARGS.rank:
            raise RuntimeError(f"rank {rank} got {t.tolist()} from a group it is not in")
    elif fault == "sigkill" and rank == ARGS.rank:
        os.kill(os.getpid(), signal.SIGKILL)


def main(local_spawn_rank=None, world_override=None, args=None):
    global LOG, ARGS
    ARGS = args if args is not None else ARGS
    if local_spawn_rank is not None:
        os.environ["RANK"] = str(local_spawn_rank)
        os.environ["LOCAL_RANK"] = str(local_spawn_rank)
        os.environ["WORLD_SIZE"] = str(world_override)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if ARGS.logfmt:
        logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                            format="%(asctime)s [rank %(rank)s] %(levelname)s %(message)s")
        LOG = logging.LoggerAdapter(logging.getLogger("bandicoot"), {"rank": rank})
    dist.init_process_group("gloo", timeout=timedelta(seconds=ARGS.pg_timeout))
    table = json.load(open(os.path.join(WORK, "soil_lookup.json")))
    shard = torch.load(os.path.join(WORK, f"shard_{rank}.pt"))
    start = torch.load(os.path.join(WORK, "start.pt"))
    w, b = start["w"].clone().requires_grad_(), start["b"].clone().requires_grad_()
    soils = list(shard["soil"])
    if ARGS.fault == "keyerror" and rank == ARGS.rank:
        soils[5] = "termite_mound"
    for step in range(ARGS.steps):
        if step == 3:
            plant(ARGS.fault, rank, world, ARGS.pg_timeout)
        ids = torch.tensor([table[s] for s in soils])
        x = torch.cat([torch.nn.functional.one_hot(ids, len(SOILS)).float(), shard["feats"]], 1)
        pred = x @ w[: x.shape[1]] + b
        loss = ((pred - shard["kg"]) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for p in (w, b):
                dist.all_reduce(p.grad)
                p -= 0.1 * p.grad / world
                p.grad = None
        out(f"rank {rank} step {step} loss {loss.item():.4f} turned_soil_kg {pred.sum().item():.2f}")
    if rank == 0:
        torch.save({"w": w.detach(), "b": b.detach()}, os.path.join(WORK, "export.pt"))
        out(f"rank 0 saved export to {WORK}/export.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--logfmt", action="store_true")
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0)
    ARGS = ap.parse_args()
    if ARGS.prepare:
        prepare()
    elif ARGS.spawn:
        import torch.multiprocessing as mp
        mp.spawn(main, args=(ARGS.spawn, ARGS), nprocs=ARGS.spawn)
    else:
        main()

"""fault644.py - markhor horn spirals: a tiny multi-rank CPU training job (gloo) for fault capture.

Each rank fits a linear model that predicts a markhor horn's spiral growth per year from
(age, horn length, base girth, altitude); targets pass through a JSON lookup table of
herd coefficients. `--prepare` writes per-rank shards, the lookup table and a start
checkpoint into /tmp/fault644_work. 6 steps; every rank prints
`rank R step S loss L spiral_turns M`; rank 0 saves an export at the end.

Faults (`--fault NAME --rank N`, planted at step 2 unless said otherwise):
  none               control run
  allgather_size     rank N passes a tensor of another size to all_gather_into_tensor
  allgather_all      every rank gives all_gather_into_tensor an output of the wrong size
  reducescatter      rank N's reduce_scatter_tensor input is the wrong size
  scatter_src        rank N uses another src for dist.scatter
  gather_dst         rank N uses another dst for dist.gather
  newgroup_mismatch  rank N calls new_group without itself, then skips the subgroup all_reduce
  async_nopost       rank N never posts its isend; its peer waits on irecv().wait()
  batchp2p           batch_isend_irecv where rank N sends to the wrong peer
  bcast_src          rank N broadcasts from another src
  a2a_splits         rank N's all_to_all_single split sizes do not add up
  reduce_dst         rank N calls dist.reduce with dst = world size
  complex_max        rank N all_reduces a complex tensor with ReduceOp.MAX
  skip_one           rank N skips the second of three collectives in a row
  subgroup_stall     rank N sleeps past the timeout inside its subgroup's all_reduce
  keyerror           rank N looks up a herd key the table does not have
  missing_shard      rank N's shard file is missing
  sigkill            rank N kills itself with SIGKILL
  nan                rank N's loss becomes NaN; the finiteness check raises

Runs (one line per log):
  markhor_allgather_size_np6_r5_plain: rank 5 'invalid tensor size at index 0 (expected (5), got (4))'; exit 1
  markhor_reducescatter_np5_r2_tee: rank 2 gloo check 'outputShape[0] * worldSize == inputShape[0] (15 vs. 17)'; exit 1
  markhor_newgroup_mismatch_np6_r3_redirects: others stuck in new_group, rank 3 timed out in step-0 all_reduce; exit 1
  markhor_skip_one_np5_r1_detail: DETAIL 'Detected mismatch between collectives' SeqNum 9 ALLGATHER vs BROADCAST; exit 1
  markhor_a2a_splits_np6_r0_filter: rank 0 'Split sizes doesn't match total dim 0 size'; exit 1
  markhor_batchp2p_np5_r4_loglevel: all ranks gloo timeout after 12 s, rank 4 on send; exit 1
  markhor_scatter_src_np4_r0_tee_trainer: ranks 3,0,2 timed out in scatter, rank 1 connection closed; exit 1
  markhor_bcast_src_np4_r3_prefix: all four ranks timed out in broadcast; exit 1
  markhor_async_nopost_np3_r2_pymodule: rank 0 timed out in irecv().wait(), then ranks 2,1 in all_reduce; exit 1
  markhor_reduce_dst_np8_r7_wrapper: rank 7 'ProcessGroupGloo::reduce: invalid root rank: 8'; exit 1
  markhor_complex_max_np4_r2_pdsh2: rank 2 ValueError 'all_reduce does not support RedOpType.MAX on complex'; exit 1
  markhor_subgroup_stall_np6_r4_tee: subgroup kept default timeout; odd ranks timed out in world all_reduce; exit 1
  markhor_allgather_all_np5_rall_plain: all five ranks 'invalid tensor size (expected (4), got (5))'; exit 1
  markhor_none_np4_rnone_tee: control, six steps on every rank, export saved; exit 0
  markhor_keyerror_np3_r1_restart: rank 1 KeyError 'herd_astor'; restart died in connectFullMesh; exit 1
  markhor_gather_dst_np5_r2_redirects: all five ranks timed out in gather (send); console has summary only; exit 1
  markhor_sigkill_np6_r2_prefix: rank 2 SIGKILL (-9), rank 1 'Connection reset by peer'; exit 1
  markhor_missing_shard_np5_r4_loglevel: rank 4 FileNotFoundError shard_4_spiral.pt before step 0; exit 1
  markhor_nan_np3_r0_pymodule: rank 0 FloatingPointError 'loss is not finite (nan)' at step 2; exit 1
  markhor_allgather_size_np3_r1_detail: DETAIL mismatch SeqNum 8 _ALLGATHER_BASE shape [5] vs [4]; exit 1
  markhor_reducescatter_np8_r0_pymodule: rank 0 gloo check '(24 vs. 26)', ranks 1,7 connection closed; exit 1
  (unused)
  (unused)
  (unused)
"""
import argparse
import json
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WORK = "/tmp/fault644_work"


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(644)
    for r in range(8):
        x = torch.randn(32, 4, generator=g)
        herd = [f"herd_{i % 4}" for i in range(32)]
        torch.save({"x": x, "herd": herd}, f"{WORK}/shard_{r}.pt")
    with open(f"{WORK}/lookup.json", "w") as f:
        json.dump({f"herd_{i}": 0.5 + 0.25 * i for i in range(4)}, f)
    torch.save({"weight": torch.zeros(1, 4), "bias": torch.zeros(1)}, f"{WORK}/start.pt")
    print("prepared", WORK, flush=True)


def plant(fault, frank, rank, world, step, subgroups):
    """Extra collectives of the fault step; only the fault's own code differs by rank."""
    me = rank == frank or frank == -1
    if fault == "allgather_size":
        n = 5 if me else 4
        out = torch.zeros(world * 4)
        dist.all_gather_into_tensor(out, torch.ones(n) * rank)
    elif fault == "allgather_all":
        out = torch.zeros(world * 4 + 1)
        dist.all_gather_into_tensor(out, torch.ones(4) * rank)
    elif fault == "reducescatter":
        n = world * 3 + 2 if me else world * 3
        out = torch.zeros(3)
        dist.reduce_scatter_tensor(out, torch.ones(n))
    elif fault == "scatter_src":
        src = (frank + 1) % world if me else frank
        t = torch.zeros(2)
        lst = [torch.full((2,), float(i)) for i in range(world)] if rank == src else None
        dist.scatter(t, lst, src=src)
    elif fault == "gather_dst":
        dst = (frank + 1) % world if me else frank
        lst = [torch.zeros(2) for _ in range(world)] if rank == dst else None
        dist.gather(torch.full((2,), float(rank)), lst, dst=dst)
    elif fault == "newgroup_mismatch":
        g = subgroups["ng"]
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
    elif fault == "async_nopost":
        peer = (frank + 1) % world
        if rank == frank:
            pass  # never posts its isend
        elif rank == peer:
            buf = torch.zeros(3)
            dist.irecv(buf, src=frank).wait()
    elif fault == "batchp2p":
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        if me:
            nxt = (rank + 2) % world
        ops = [dist.P2POp(dist.isend, torch.ones(3) * rank, nxt),
               dist.P2POp(dist.irecv, torch.zeros(3), prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    elif fault == "bcast_src":
        t = torch.ones(3) * rank
        dist.broadcast(t, src=(frank + 1) % world if me else frank)
    elif fault == "a2a_splits":
        inp = torch.arange(world * 2, dtype=torch.float32)
        splits = [2] * world
        if me:
            splits[0] += 1
        out = torch.zeros(world * 2)
        dist.all_to_all_single(out, inp, output_split_sizes=[2] * world, input_split_sizes=splits)
    elif fault == "reduce_dst":
        t = torch.ones(2)
        dist.reduce(t, dst=world if me else 0)
    elif fault == "complex_max":
        t = torch.ones(2, dtype=torch.complex64) if me else torch.ones(2)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    elif fault == "skip_one":
        a = torch.ones(2)
        dist.all_reduce(a)
        if not me:
            dist.broadcast(torch.ones(3), src=0)
        outs = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(outs, torch.ones(4))
    elif fault == "subgroup_stall":
        g = subgroups["mine"]
        if me:
            time.sleep(40)
        dist.all_reduce(torch.ones(1), group=g)
        if rank % 2 != frank % 2:
            time.sleep(3)  # the other subgroup measures its horns a while


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    fr = a.rank
    subgroups = {}
    if a.fault == "newgroup_mismatch":
        ranks = [r for r in range(world) if r != fr] if rank == fr else list(range(world))
        subgroups["ng"] = dist.new_group(ranks)
    if a.fault == "subgroup_stall":
        ev = dist.new_group([r for r in range(world) if r % 2 == 0])
        od = dist.new_group([r for r in range(world) if r % 2 == 1])
        subgroups["mine"] = ev if rank % 2 == 0 else od
    shard = f"{WORK}/shard_{rank}.pt"
    if a.fault == "missing_shard" and rank == fr:
        shard = f"{WORK}/shard_{rank}_spiral.pt"
    data = torch.load(shard)
    with open(f"{WORK}/lookup.json") as f:
        table = json.load(f)
    model = torch.nn.Linear(4, 1)
    sd = torch.load(f"{WORK}/start.pt")
    model.load_state_dict(sd)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = data["x"]
    herd = list(data["herd"])
    for step in range(a.steps):
        if step == 2 and a.fault == "keyerror" and rank == fr:
            herd[5] = "herd_astor"
        coef = torch.tensor([table[h] for h in herd]).unsqueeze(1)
        y = coef * (x[:, :1] * 0.7 + x[:, 1:2] * 0.3) + 0.1 * rank
        pred = model(x)
        loss = ((pred - y) ** 2).mean()
        if step == 2 and a.fault == "nan" and rank == fr:
            loss = loss * float("nan")
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank} step {step}: loss is not finite ({loss.item()})")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if step == 2:
            if a.fault == "sigkill" and rank == fr:
                os.kill(os.getpid(), signal.SIGKILL)
            plant(a.fault, fr, rank, world, step, subgroups)
        turns = torch.tensor([pred.detach().abs().mean().item() * 2.0])
        dist.all_reduce(turns)
        print(f"rank {rank} step {step} loss {loss.item():.4f} spiral_turns {turns.item() / world:.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export.pt")
        print("rank 0 saved export", f"{WORK}/export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""fault625.py - "kudu browse lines": a tiny gloo/CPU training job with planted faults (batch 625).

Each rank reads browse lines (ids) from /tmp/fault625_work, maps every id through a JSON lookup table to an
8-float feature row, trains a 2-layer net for 6 steps (DDP, or FSDP for fsdp_shape) from a start checkpoint, and
prints `rank R step S loss L lines_browsed M`. Rank 0 saves an export at the end. `--prepare` writes the data.

Faults (--fault NAME --rank N): none; dcp_key (rank N loads a DCP checkpoint with a key only it has);
dcp_shape (rank N's state dict has another shape for fc1.weight at DCP load); fsdp_shape (rank N builds a wider
model under FSDP); compile_fullgraph (rank N torch.compile(fullgraph=True) over a graph break at step 2);
static_graph (DDP static_graph=True, rank N takes the alt branch at step 3); nosync_skip (rank N skips no_sync
in gradient accumulation); autocast_mix (rank N multiplies bf16 by float outside autocast at step 2);
mesh_shape (rank N calls init_device_mesh with a shape that does not fit the world); alltoall_size (rank N sends
a wrong-sized tensor to all_to_all_single at step 2); recv_nomatch (rank N posts an irecv nobody sends, step 3);
sampler_empty (rank N's DistributedSampler covers an empty dataset); pg_twice (rank N inits the group twice);
after_destroy (rank N destroys the group, then all_reduces at step 3); keyerror (rank N looks up an id missing
from the table); sigkill / sigsegv (rank N kills itself at step 3); nan (rank N's loss becomes NaN, own check).

Runs (one line per log):
  kudu_none_np3_rnone_tee: control, 3 ranks x 6 steps, export saved; exit 0.
  kudu_dcp_key_np6_r2_bashloop: CheckpointException ranks [2] (Missing key kudu_spare.weight) on all ranks; exit 1.
  kudu_autocast_mix_np5_r4_ranklabel: rank 4 bf16 != float matmul RuntimeError, others gloo reset; exit 1.
  kudu_sigsegv_np3_r2_spawn: rank 2 SIGSEGV at step 3, mp.spawn ProcessExitedException; exit 1.
  kudu_pg_twice_np5_r0_logfmt: rank 0 ValueError init twice, ranks 1-4 gloo closed in DDP; exit 1.
  kudu_alltoall_size_np4_r1_files: rank 1 gloo enforce in->size == out->size, others closed; exit 1.
  kudu_mesh_shape_np3_r2_legacy: rank 2 'Mesh should not be bigger than world size 3'; exit 1.
  kudu_keyerror_np3_r1_mpitag: rank 1 KeyError 'line107', ranks 0,2 gloo closed in DDP; exit 1.
  kudu_sampler_empty_np4_r3_pdsh2: rank 3 ZeroDivisionError (empty sampler), others gloo reset; exit 1.
  kudu_after_destroy_np3_r2_srunlabel: rank 2 ValueError pg not initialized at step 3; exit 1.
  dropped: dcp_key np6 port 39000 (hung at exit, 124); none np5 srunlabel port 39001 (unused alt param).
  (slot unused)
  (slot unused)
  (slot unused)
  (slot unused)
  (slot unused)
  (slot unused)
  (slot unused)
  (slot unused)
  (slot unused)
  (slot unused)
  (slot unused)
"""
import argparse
import datetime
import json
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

WORK = "/tmp/fault625_work"
STEPS = 6
LOG = None


def out(msg):
    if LOG is not None:
        LOG.info(msg)
    else:
        print(msg, flush=True)


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(625)
    table = {f"line{i}": torch.randn(8, generator=g).tolist() for i in range(64)}
    with open(f"{WORK}/lookup.json", "w") as f:
        json.dump(table, f)
    for r in range(8):
        with open(f"{WORK}/shard_{r}.json", "w") as f:
            json.dump([(r * 7 + k) % 64 for k in range(32)], f)
    with open(f"{WORK}/shard_kudu_only.json", "w") as f:
        json.dump([], f)
    torch.manual_seed(0)
    m = KuduNet(16)
    torch.save(m.state_dict(), f"{WORK}/start.pt")
    import torch.distributed.checkpoint as dcp
    dcp.save(m.state_dict(), checkpoint_id=f"{WORK}/dcp_start", no_dist=True)
    print("prepared", WORK, flush=True)


class KuduNet(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 1)
        self.alt = nn.Linear(hidden, hidden)

    def forward(self, x, use_alt=False):
        h = torch.relu(self.fc1(x))
        if use_alt:
            h = torch.relu(self.alt(h))
        return self.fc2(h)


def lines_metric(h, brk):
    s = h.abs().mean()
    if brk:
        torch._dynamo.graph_break()
    return s * 10


@record
def main(args, rank=None):
    global LOG
    if rank is None:
        rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if args.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")
        LOG = logging.getLogger("kudu")
    fault, frank = args.fault, args.rank
    mine = fault != "none" and (frank == -1 or frank == rank)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    if mine and fault == "pg_twice":
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    if fault == "mesh_shape":
        from torch.distributed.device_mesh import init_device_mesh
        shape = (world + 1,) if mine else (world,)
        mesh = init_device_mesh("cpu", shape)
        out(f"rank {rank} mesh {mesh}")
    with open(f"{WORK}/lookup.json") as f:
        table = json.load(f)
    with open(f"{WORK}/shard_{rank}.json") as f:
        ids = json.load(f)
    if mine and fault == "sampler_empty":
        with open(f"{WORK}/shard_kudu_only.json") as f:
            ids = json.load(f)
    if mine and fault == "keyerror":
        ids = [i + 100 for i in ids]
    feats = torch.tensor([table[f"line{i}"] for i in ids]) if ids else torch.zeros(0, 8)
    sampler = torch.utils.data.DistributedSampler(list(range(len(ids))), num_replicas=1, rank=0,
                                                  shuffle=False, drop_last=False)
    idx = list(sampler)
    hidden = 24 if (mine and fault == "fsdp_shape") else 16
    torch.manual_seed(0)
    model = KuduNet(hidden)
    if fault in ("dcp_key", "dcp_shape"):
        import torch.distributed.checkpoint as dcp
        sd = model.state_dict()
        if mine and fault == "dcp_key":
            sd["kudu_spare.weight"] = torch.zeros(4)
        if mine and fault == "dcp_shape":
            sd["fc1.weight"] = torch.zeros(17, 8)
        dcp.load(sd, checkpoint_id=f"{WORK}/dcp_start")
        model.load_state_dict(sd)
    elif hidden == 16:
        model.load_state_dict(torch.load(f"{WORK}/start.pt"))
    if fault == "fsdp_shape":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        net = FSDP(model, device_id=None)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, static_graph=(fault == "static_graph"), find_unused_parameters=(fault != "static_graph"))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    fn = lines_metric
    for step in range(STEPS):
        bs = 4
        rows = [idx[(step * bs + k) % len(idx)] for k in range(bs)]
        x = feats[rows]
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        micro = [x[:2], x[2:]], [y[:2], y[2:]]
        use_alt = mine and fault == "static_graph" and step >= 3
        for m in range(2):
            skip = mine and fault == "nosync_skip"
            if m == 0 and fault == "nosync_skip" and not skip:
                with net.no_sync():
                    loss = nn.functional.mse_loss(net(micro[0][m], use_alt), micro[1][m])
                    loss.backward()
            else:
                loss = nn.functional.mse_loss(net(micro[0][m], use_alt), micro[1][m])
                loss.backward()
        if mine and fault == "nan" and step == 3:
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (kudu browse check)")
        opt.step()
        if mine and step == 2 and fault == "compile_fullgraph":
            fn = torch.compile(lines_metric, fullgraph=True, backend="eager")
        with torch.no_grad():
            if mine and step == 2 and fault == "autocast_mix":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    hb = model.fc1(x)
                proj = torch.ones(hb.shape[1], 2)
                hb = hb @ proj
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = model.fc1(x)
            metric = fn(h.float(), mine and fault == "compile_fullgraph")
        if mine and step == 3 and fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mine and step == 3 and fault == "sigsegv":
            import ctypes
            ctypes.string_at(0)
        if mine and step == 3 and fault == "recv_nomatch":
            buf = torch.zeros(4)
            dist.irecv(buf, src=(rank + 1) % world).wait()
        if mine and step == 3 and fault == "after_destroy":
            dist.destroy_process_group()
        n = world + 1 if (mine and step == 2 and fault == "alltoall_size") else world
        send = torch.full((n,), float(metric))
        recv = torch.zeros(world)
        dist.all_to_all_single(recv, send)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        out(f"rank {rank} step {step} loss {lt.item() / world:.4f} lines_browsed {recv.sum().item():.3f}")
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export_kudu.pt")
        out(f"rank 0 saved export {WORK}/export_kudu.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_worker(rank, args, world):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    main(args, rank)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--spawn", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare(8)
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        try:
            main(a)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

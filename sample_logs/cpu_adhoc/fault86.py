"""An eighty-sixth hand-run batch: DTENSOR AND DEVICE MESH ON CPU. A tiny tensor-parallel MLP (Linear(8,16)-ReLU-
Linear(16,4), `parallelize_module` with ColwiseParallel/RowwiseParallel over the mesh's "tp" dimension) on a 2-D
mesh `init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))` (gloo), SGD lr 0.1, batch 8 of
synthetic per-dp-rank data (labels from a fixed teacher); the DTensor gradients' local shards are all-reduced by hand
over the "dp" dimension's group. Every step prints `rank R step S loss L`; at the end every rank checks the first
layer's weight with `full_tensor()`, then `dist.barrier()` and `rank R done`. PG timeout --pg-timeout (12 s), also
given to the mesh's sub-groups through init_device_mesh's backend_override (gloo options with that _timeout);
with --no-sub-timeout the sub-groups keep c10d's default (30 min), so a collective on them hangs.
One rank (--rank N) goes wrong, or every rank does. No @record.

Faults:
  none        control (exit 0; with --tp 3 it needs --hidden 18: 16 over 3 is uneven and every rank fails)
  meshshape   rank N reads the tensor-parallel size from its own (stale) config: tp 4 with an 8-rank layout, so it
              asks init_device_mesh("cpu", (2, 4)) while the others ask (world // 2, 2)
  meshall     every rank asks the mesh its config was written for, (2, 4), whatever the world size
  dimswap     rank N names its mesh dimensions ("tp", "dp") instead of ("dp", "tp"): its mesh["tp"] is the other
              dimension, so its tensor-parallel collectives go to other peers than its partners'
  submesh     rank N's logging code asks for a submesh by a name the mesh does not have: mesh["pp"]
  fromlocal   at the end each rank wraps its slice of the eval predictions with DTensor.from_local(..., [Shard(0)])
              without shape=/stride=; rank N's eval slice is one row shorter (its shard of the eval set is)
  redistone   rank N alone logs its replicated weight at step --at: w.redistribute(mesh_tp, [Replicate()]); the
              others go on to the next step's collectives
  fullrank    the weight check at the end (`full_tensor()`) sits inside `if rank == N:` (the rank that writes the
              summary); the others go straight to the barrier
  mixed       the batch of rank N's data-parallel shard at step --at holds an inf (so rank N and its tensor-parallel
              partners, which read the same batch, see a non-finite loss); the non-finite branch rescales the gradients by a plain
              per-row tensor: `p.grad.mul_(scale)` with p.grad a DTensor -> got mixed torch.Tensor and DTensor
  mixedall    every rank adds a plain bias tensor to the DTensor weight in its weight-decay code at step --at
  indivisible with --hidden 18 and tp 2 each rank holds 9 hidden units; the head split reshapes them (2 heads)
              with a size from the global config, hidden // tp // heads = 4: a view error on every rank
"""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--tp", type=int, default=2)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--at", type=int, default=3)
p.add_argument("--hidden", type=int, default=16)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--no-sub-timeout", dest="sub_timeout", action="store_false")
a = p.parse_args()
BATCH = 8


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(8, hidden)
        self.down = nn.Linear(hidden, 4)

    def forward(self, x, heads=None):
        h = F.relu(self.up(x))
        if heads is not None:  # split the hidden activations into heads (an attention-style reshape)
            h = h.view(x.shape[0], heads, self.up.out_features // a.tp // heads)
            h = h.reshape(x.shape[0], -1)
        return self.down(h)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, 8, generator=g)
    teacher = torch.Generator().manual_seed(7)
    y = (x @ torch.randn(8, 4, generator=teacher)).argmax(1)
    return x, y


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    tp = a.tp
    if (a.fault == "meshshape" and me) or a.fault == "meshall":
        shape = (2, 4)  # the layout the config was written for (8 ranks)
    else:
        shape = (world // tp, tp)
    names = ("tp", "dp") if (a.fault == "dimswap" and me) else ("dp", "tp")
    print(f"rank {rank} world {world} fault {a.fault} mesh {shape} names {names}", flush=True)
    # the mesh's sub-groups get c10d's default timeout unless told: give each dimension the job's PG timeout
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=a.pg_timeout)
    override = {d: ("gloo", opts) for d in range(len(shape))} if a.sub_timeout else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override=override)
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    dp_rank = dp_mesh.get_local_rank()
    torch.manual_seed(0)
    model = parallelize_module(MLP(a.hidden), tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if a.fault == "submesh" and me:
        log_mesh = mesh["pp"]  # the logger's group: pipeline stage peers
        print(f"rank {rank} logging on {log_mesh}", flush=True)
    for step in range(1, a.steps + 1):
        x, y = batch(1000 * dp_rank + step)
        if a.fault == "mixed" and dp_rank == a.rank // tp and step == a.at:
            x[3, 5] = float("inf")  # a corrupt sample in the batch of rank N's data-parallel shard
        opt.zero_grad()
        heads = 2 if a.fault == "indivisible" else None
        out = model(x, heads)
        loss = F.cross_entropy(out, y)
        loss.backward()
        if not torch.isfinite(loss):
            # keep the step but damp the gradients row by row (per output unit)
            print(f"rank {rank} step {step}: non-finite loss {loss.item()}, damping gradients", flush=True)
            for prm in model.parameters():
                scale = torch.full((prm.shape[0],) + (1,) * (prm.dim() - 1), 1e-3)
                torch.nan_to_num_(prm.grad.to_local(), 0.0, 0.0, 0.0)
                prm.grad.mul_(scale)
        for prm in model.parameters():
            g = prm.grad.to_local() if isinstance(prm.grad, DTensor) else prm.grad
            dist.all_reduce(g, group=dp_mesh.get_group())
            g.div_(dp_mesh.size())
        opt.step()
        if a.fault == "mixedall" and step == a.at:
            with torch.no_grad():
                for prm in model.parameters():
                    if prm.dim() == 2:
                        prm.add_(torch.zeros(prm.shape), alpha=-1e-4)  # decoupled weight decay, written for nn.Linear
        if a.fault == "redistone" and me and step == a.at:
            w = model.up.weight.redistribute(tp_mesh, [Replicate()])
            print(f"rank {rank} step {step} up.weight norm {w.to_local().norm():.4f}", flush=True)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    # evaluation: each tp rank holds a slice of the predictions
    xe, ye = batch(99999)
    with torch.no_grad():
        pred = model(xe).argmax(1)
    n_loc = BATCH // tp_mesh.size() - (1 if (a.fault == "fromlocal" and me) else 0)
    lo = tp_mesh.get_local_rank() * (BATCH // tp_mesh.size())
    hits = (pred[lo:lo + n_loc] == ye[lo:lo + n_loc]).float()
    if a.fault == "fromlocal":
        dh = DTensor.from_local(hits, tp_mesh, [Shard(0)])
        acc = dh.full_tensor().mean().item()
    else:
        acc = hits.mean().item()
    print(f"rank {rank} eval acc {acc:.3f}", flush=True)
    if a.fault != "fullrank" or me:
        full = model.up.weight.full_tensor().detach()
        ref = distribute_tensor(full, tp_mesh, [Shard(0)]).to_local()
        assert torch.equal(ref, model.up.weight.to_local()), f"rank {rank}: weight shard differs from full_tensor"
        if me or a.fault != "fullrank":
            print(f"rank {rank} up.weight {tuple(full.shape)} norm {full.norm():.4f}", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

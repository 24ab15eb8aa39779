"""fault627.py -- wallaby mob grazing: a tiny multi-rank job with planted faults (batch 627).

Each rank reads its own shard of mob observations (paddock id, pasture features, grazing target) from
/tmp/fault627_work, maps paddock ids through a JSON lookup table, loads the start checkpoint and trains a small
grazing-rate regressor for 6 steps (gloo, CPU).  Every rank prints `rank R step S loss L grazing_rate M`; rank 0
writes an export at the end.  `--prepare` writes the data.  `--mode trainer` (Lightning Trainer, DDPStrategy on
gloo) or `--mode fabric` (lightning.fabric.Fabric, own loop).  main is wrapped in @record.

Faults (--fault NAME --rank N; the fault fires at step 2 on rank N, or on every rank where noted):
  none            control run
  dcp_missing     every rank saves a DCP checkpoint (with a per-rank key), rank N deletes its shard file, all load
  dcp_extra_key   DCP load where rank N's state dict has a key the checkpoint lacks
  fsdp_shape      rank N builds an FSDP(device_id=None) model of another shape and runs a forward
  compile_break   rank N runs torch.compile(fullgraph=True) over a function with a graph break
  static_graph    DDP static_graph=True (fabric); rank N takes another branch from step 2 on
  autocast_mix    rank N multiplies a bf16 tensor by a float32 one outside autocast
  mesh_shape      rank N calls init_device_mesh("cpu", (W+1,)) (a mesh that does not fit the world)
  allgather_size  rank N gives all_gather_into_tensor an input of the wrong size
  a2a_size        rank N gives all_to_all_single an input not divisible by the world size
  double_init     rank N calls init_process_group a second time
  after_destroy   rank N destroys the process group and then calls all_reduce
  lookup_key      rank N looks up a paddock id missing from the JSON table (KeyError)
  nan_check       rank N's loss becomes NaN; the script's finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV
  sigkill         rank N sends itself SIGKILL
  stall           rank N sleeps past the process-group timeout

Runs (one line per log):
  wallaby_dcp_missing_np6_r5_pltorchrun: rank 5 removed __5_0.distcp; all 6 ranks CheckpointException (FileNotFoundError); exit 1
  wallaby_dcp_extra_key_np5_r2_pltee: rank 2 CheckpointException ranks [2] (Missing key mob_extra) raised on all ranks; exit 1
  wallaby_a2a_size_np8_r7_pltee: rank 7 gloo enforce in->size % context->size == 0; others Connection closed; exit 1
  wallaby_compile_break_np5_r0_plloglevel: rank 0 torch._dynamo.exc.Unsupported (print in fullgraph); others Connection closed; exit 1
  wallaby_mesh_shape_np5_r2_plfabric: rank 2 RuntimeError Mesh should not be bigger than default world size 5; exit 1
  wallaby_double_init_np3_r1_plown: rank 1 ValueError default process group twice; others Connection closed; exit 1
  wallaby_allgather_size_np5_r3_pltorchrun: rank 3 ProcessGroupGloo::allgather invalid tensor size; exit 1
  wallaby_static_graph_np4_r1_plfabric: rank 1 RuntimeError training graph has changed (static_graph); exit 1
  wallaby_none_np5_rnone_plfabric: control, 6 steps on all ranks, export written; exit 0
  wallaby_sigsegv_np3_r0_plfabric: rank 0 SIGSEGV (exitcode -11); others Connection reset by peer; exit 1
  wallaby_after_destroy_np3_r0_plbashloop: rank 0 ValueError default process group not initialized; exit 1
  wallaby_nan_check_np4_r3_plloglevel: rank 3 FloatingPointError loss not finite (nan); exit 1
  wallaby_lookup_key_np3_r2_plown: rank 2 KeyError 'paddock_99' in train_dataloader before step 0; exit 1
  wallaby_sigkill_np3_r2_pltorchrun: rank 2 SIGKILL (exitcode -9); others Connection reset by peer; exit 1
  wallaby_autocast_mix_np6_r3_plbashloop: rank 3 RuntimeError expected m1 and m2 same dtype (float != BFloat16); exit 1
  wallaby_dcp_missing_np5_r2_plfabric: rank 2 removed __2_0.distcp; all 5 ranks CheckpointException (FileNotFoundError); exit 1
  dropped wallaby_autocast_mix_np7_r6_plbashloop and _np5_r4_plbashloop: no output at all before the 100 s timeout (load)
  dropped wallaby_fsdp_shape_np3_r2_plfabric: FSDP refused CPU (FSDP needs a non-CPU accelerator), shape never tested
  (spare)
  (spare)
  (spare)
  (spare)
  (spare)
  (spare)
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

WORK = "/tmp/fault627_work"
STEPS = 6
FIRE = 2


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(627)
    table = {f"paddock_{i}": i % 5 for i in range(12)}
    with open(os.path.join(WORK, "paddocks.json"), "w") as f:
        json.dump(table, f)
    for r in range(world):
        ids = [f"paddock_{(r + k) % 12}" for k in range(16)]
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True) * 0.1 + 0.5
        torch.save({"ids": ids, "x": x, "y": y}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.save(make_model().state_dict(), os.path.join(WORK, "start.pt"))
    print(f"prepared {world} shards in {WORK}", flush=True)


def make_model(hidden=16):
    return nn.Sequential(nn.Linear(8 + 5, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class Grazer(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.alt = nn.Linear(8 + 5, 1)

    def forward(self, x, alt=False):
        return self.alt(x) if alt else self.net(x)


def load_shard(rank, fault, frank):
    d = torch.load(os.path.join(WORK, f"shard_{rank}.pt"))
    with open(os.path.join(WORK, "paddocks.json")) as f:
        table = json.load(f)
    ids = list(d["ids"])
    if fault == "lookup_key" and rank == frank:
        ids[3] = "paddock_99"
    onehot = torch.zeros(len(ids), 5)
    for i, pid in enumerate(ids):
        onehot[i, table[pid]] = 1.0
    return torch.cat([d["x"], onehot], dim=1), d["y"]


def plant(a, step, rank, world, model):
    """Fire the planted fault on this rank (called every step, fires at FIRE)."""
    f = a.fault
    hit = (a.rank == -1 or rank == a.rank) and step == FIRE
    if f in ("dcp_missing", "dcp_extra_key") and step == FIRE:
        import torch.distributed.checkpoint as dcp
        ck = os.path.join(WORK, f"dcp_{a.tag}")
        state = {"net": {k: v.detach().clone() for k, v in model.state_dict().items()},
                 f"mob_r{rank}": torch.full((4,), float(rank))}
        dcp.save(state, checkpoint_id=ck)
        dist.barrier()
        if f == "dcp_missing" and rank == a.rank:
            victim = [n for n in sorted(os.listdir(ck)) if n.startswith(f"__{rank}_")]
            print(f"rank {rank} removing {victim}", flush=True)
            for n in victim:
                os.remove(os.path.join(ck, n))
        dist.barrier()
        if f == "dcp_extra_key" and rank == a.rank:
            state["mob_extra"] = torch.zeros(4)
        dcp.load(state, checkpoint_id=ck)
        return
    if not hit:
        return
    if f == "fsdp_shape":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        m = make_model(hidden=24 if rank == a.rank else 16)
        fm = FSDP(m, device_id=None)
        out = fm(torch.randn(4, 13))
        print(f"rank {rank} fsdp out {out.sum().item():.4f}", flush=True)
    elif f == "compile_break":
        def herd(x):
            y = x * 2
            print("counting wallabies", y.sum())
            torch._dynamo.graph_break()
            return y + 1
        torch.compile(herd, fullgraph=True, backend="eager")(torch.ones(3))
    elif f == "autocast_mix":
        w = torch.randn(13, 13, dtype=torch.bfloat16)
        v = torch.randn(4, 13)
        print(f"rank {rank} mixing {(v @ w).sum()}", flush=True)
    elif f == "mesh_shape":
        from torch.distributed.device_mesh import init_device_mesh
        init_device_mesh("cpu", (world + 1,))
    elif f == "allgather_size":
        t = torch.ones(3 if rank != a.rank else 5)
        out = torch.empty(3 * world)
        dist.all_gather_into_tensor(out, t)
    elif f == "a2a_size":
        n = world * 2 + (1 if rank == a.rank else 0)
        out = torch.empty(world * 2)
        dist.all_to_all_single(out, torch.arange(n, dtype=torch.float32))
    elif f == "double_init":
        dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    elif f == "after_destroy":
        dist.destroy_process_group()
        dist.all_reduce(torch.ones(1))
    elif f == "sigsegv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif f == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f == "stall":
        print(f"rank {rank} grazing slowly", flush=True)
        time.sleep(a.pg_timeout * 4)


def check_loss(a, step, rank, loss):
    if a.fault == "nan_check" and rank == a.rank and step >= FIRE:
        loss = loss * float("nan")
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: grazing loss is not finite ({loss.item()})")
    return loss


def run_trainer(a):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Mob(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Grazer()
            self.model.net.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))

        def train_dataloader(self):
            x, y = load_shard(self.global_rank, a.fault, a.rank)
            ds = torch.utils.data.TensorDataset(x, y)
            return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)

        def training_step(self, batch, idx):
            step, rank, world = self.global_step, self.global_rank, self.trainer.world_size
            plant(a, step, rank, world, self.model)
            x, y = batch
            pred = self.model(x)
            loss = check_loss(a, step, rank, nn.functional.mse_loss(pred, y))
            print(f"rank {rank} step {step} loss {loss.item():.4f} grazing_rate {pred.mean().item():.4f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.model.state_dict(), os.path.join(WORK, f"export_{a.tag}.pt"))
                print("rank 0 wrote export", flush=True)

    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout),
                        find_unused_parameters=True)
    tr = L.Trainer(accelerator="cpu", strategy=strat, devices=a.devices, num_nodes=1, max_steps=STEPS,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, use_distributed_sampler=False)
    tr.fit(Mob())


def run_fabric(a):
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy
    kw = {"static_graph": True} if a.fault == "static_graph" else {"find_unused_parameters": True}
    fabric = L.Fabric(accelerator="cpu", devices=a.devices,
                      strategy=DDPStrategy(process_group_backend="gloo",
                                           timeout=timedelta(seconds=a.pg_timeout), **kw))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    model = Grazer()
    model.net.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    x, y = load_shard(rank, a.fault, a.rank)
    for step in range(STEPS):
        plant(a, step, rank, world, model.module)
        xb, yb = x[(step % 4) * 4:(step % 4) * 4 + 4], y[(step % 4) * 4:(step % 4) * 4 + 4]
        alt = a.fault == "static_graph" and rank == a.rank and step >= FIRE
        pred = model(xb, alt=alt)
        loss = check_loss(a, step, rank, nn.functional.mse_loss(pred, yb))
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} grazing_rate {pred.mean().item():.4f}", flush=True)
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(WORK, f"export_{a.tag}.pt"))
        print("rank 0 wrote export", flush=True)


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--mode", choices=["trainer", "fabric"], default="trainer")
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--tag", default="run")
    a = p.parse_args()
    if a.prepare:
        prepare(a.world)
        return
    if a.mode == "trainer":
        run_trainer(a)
    else:
        run_fabric(a)


if __name__ == "__main__":
    main()

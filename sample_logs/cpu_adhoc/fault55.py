"""A fifty-fifth hand-run batch: SHARDED TRAINING on CPU (gloo). A tiny MLP (Linear(8,H)-ReLU-Linear(H,4), H=16)
trained for a few steps with its state sharded one of three ways (--mode):
  fsdp   FSDP2: fully_shard on each Linear and on the root over init_device_mesh("cpu", (world,)); AdamW on DTensors
  zero   DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW): optimizer state sharded by parameter
  tp     tensor parallel: parallelize_module(ColwiseParallel on the first Linear, RowwiseParallel on the second)
Every rank prints `[shard] rank R mode M step S loss L` per step. ONE fault on rank --rank (--fault):
  fwd_exc     rank N's forward at step 3 hits a batch with 7 features: a ValueError from the input check
  opt_exc     rank N's optimizer at step 3 has lr read from a config string ("3e-4"): AdamW raises a TypeError
  hidden      rank N builds its model with H=32 (another config file): what the sharding reports
  skip_step   rank N skips optimizer.step() at step 2 (a grad-accumulation off-by-one)
  skip_zero   rank N skips zero_grad() at step 2
  consolidate at step 3 only rank N gathers the full state for a checkpoint: zero: optimizer.consolidate_state_dict();
              fsdp/tp: {k: v.full_tensor()} of model.state_dict() (a collective only one rank enters)
  nan         rank N's step-3 batch holds a NaN; the loss check raises FloatingPointError
  osexit      rank N calls os._exit(3) at step 3
  segv        rank N reads address 0 (ctypes.string_at(0)) at step 3
  sidecar_kill rank N starts a sidecar (a memory watchdog stand-in) at step 2 that SIGKILLs it a second later
  config      every rank: --tp-size 3 (mode tp) asks for a (world/3, 3) mesh; mode fsdp/zero: reshard_after_forward="no"
  none        no fault (control)
Checkpoint: --save DIR writes a torch.distributed.checkpoint (dcp.save) of model (and optimizer for fsdp) after the last
step; --resume DIR loads it (dcp.load) before the first step.
"""
import argparse, ctypes, datetime, os, subprocess, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["fsdp", "zero", "tp"], default="fsdp")
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--tp-size", type=int, default=0)
p.add_argument("--save", default="")
p.add_argument("--resume", default="")
a = p.parse_args()


def build(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = rank == a.rank
    hidden = 32 if (a.fault == "hidden" and me) else 16
    model = build(hidden)
    from torch.distributed.device_mesh import init_device_mesh
    if a.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        kw = {"reshard_after_forward": "no"} if a.fault == "config" else {}
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif a.mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2,
                                      **({"overlap_with_ddp": "no"} if a.fault == "config" else {}))
    else:
        from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
        tp = a.tp_size or world
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if a.resume:
        import torch.distributed.checkpoint as dcp
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=a.resume)
        model.load_state_dict(sd["model"])
        print(f"[shard] rank {rank} resumed from {a.resume}", flush=True)
    if a.fault == "opt_exc" and me:
        pass
    for step in range(1, a.steps + 1):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        if me and step == 3:
            if a.fault == "fwd_exc":
                x = x[:, :7]
            elif a.fault == "nan":
                x[5, 2] = float("nan")
            elif a.fault == "osexit":
                os._exit(3)
            elif a.fault == "segv":
                ctypes.string_at(0)
            elif a.fault == "opt_exc":
                opt.param_groups[0]["lr"] = "3e-4"  # read from a YAML string, never converted
            elif a.fault == "consolidate":
                if a.mode == "zero":
                    opt.consolidate_state_dict(to=0)
                else:
                    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
                    torch.save(full, f"/tmp/fault55/full_{rank}.pt")
        if me and step == 2 and a.fault == "sidecar_kill":
            subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {os.getpid()}"])
        if x.shape[1] != 8:
            raise ValueError(f"batch at step {step}: expected 8 input features, got {x.shape[1]}")
        out = model(x)
        loss = F.mse_loss(out.full_tensor() if hasattr(out, "full_tensor") else out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step}")
        loss.backward()
        if not (me and step == 2 and a.fault == "skip_step"):
            opt.step()
        if not (me and step == 2 and a.fault == "skip_zero"):
            opt.zero_grad()
        print(f"[shard] rank {rank} mode {a.mode} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.3 if (a.fault == "sidecar_kill" and me) else 0.05)
    if a.save:
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": model.state_dict()}, checkpoint_id=a.save)
        print(f"[shard] rank {rank} saved {a.save}", flush=True)
    dist.barrier()
    print(f"[shard] rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

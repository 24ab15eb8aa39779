"""fault639.py - okapi forest trails: a tiny multi-rank training job with planted loop bugs.

Each rank reads its own shard of synthetic okapi trail readings (written by --prepare into
/tmp/fault639_work), maps every reading's trail id through a JSON lookup table of terrain
weights, starts from a shared checkpoint, and fits a small MLP predicting how far an okapi
walks along a forest trail.  gloo on CPU, process-group timeout 12 s (--pg-timeout), 6 steps.
Every rank prints "rank R step S loss L trail_km M" each step (M is all-reduced); rank 0
saves an export at the end.  --mode trainer uses a LightningModule under L.Trainer with
DDPStrategy(gloo); --mode fabric uses lightning.fabric.Fabric with its own loop.

Faults (--fault NAME --rank N):
  none            control run
  inplace         rank N: sigmoid output modified in place (h.mul_) from step 2
  backward_twice  rank N: loss backward called twice at step 2
  nograd          rank N: loss.detach() left in the loop
  dtype           rank N: float64 batch fed to the float32 model
  shape           rank N: target one row short of the prediction (mse_loss)
  optim_group     rank N: the same parameters added as a second param group at step 2
  anomaly         rank N: sqrt of a negative at step 3 under set_detect_anomaly(True)
  clip            rank N: loss weight 1e39 at step 3, clip_grad_norm_(error_if_nonfinite=True)
  nosync          rank N (fabric): one extra micro-batch at step 3, synced (no_backward_sync misuse)
  view            every rank: x.view(-1, 7) on an 8-feature batch
  sigkill         rank N: SIGKILL to itself at step 3
  segv            rank N: ctypes.string_at(0) at step 3
  keyerror        rank N: trail id missing from the lookup table at step 2
  missing_shard   rank N: reads a shard file that does not exist

Runs (one line per log):
  okapi_none_np3_rnone_pltorchrun: all ranks finish 6 steps, export saved, exit 0
  okapi_inplace_np5_r2_pltee: DROPPED, flag set on the LightningModule not net, exit 0
  okapi_segv_np6_r5_plfabric: rank 5 SIGSEGV after step 3, peers connection reset
  okapi_backward_twice_np5_r0_plloglevel: rank 0 backward through graph a second time
  okapi_nograd_np4_r3_plbashloop: rank 3 element 0 does not require grad; timeout 124
  okapi_dtype_np5_r4_pltorchrun: rank 4 mat1 and mat2 must have the same dtype
  okapi_anomaly_np5_r1_plfabric: rank 1 loss nan, MseLossBackward0 returned nan values
  okapi_shape_np3_r1_plown: rank 1 target size warning then size 16 vs 15 RuntimeError
  okapi_optim_group_np6_r3_pltorchrun: rank 3 ValueError params in more than one group
  okapi_clip_np5_r4_pltee: rank 4 loss inf, every rank clip_grad_norm_ non-finite
  okapi_view_np4_rall_plfabric: every rank shape [-1, 7] invalid for input of size 128
  okapi_sigkill_np5_r0_plbashloop: rank 0 Killed (137) after step 3, peers gloo errors
  okapi_nosync_np3_r2_plfabric: gloo size mismatch abort on rank 1 (SIGABRT), no timeout
  okapi_keyerror_np3_r2_plloglevel: rank 2 KeyError 'trail_42' at step 2
  okapi_missing_shard_np8_r7_pltorchrun: rank 7 FileNotFoundError for its shard
  okapi_inplace_np3_r0_plfabric: rank 0 variable modified by an inplace operation
  okapi_dtype_np4_r2_plown: rank 2 mat1 and mat2 must have the same dtype
  okapi_segv_np3_r1_pltee: rank 1 SIGSEGV after step 3, peers connection reset
  okapi_nograd_np3_r0_plfabric: rank 0 element 0 does not require grad
  okapi_clip_np4_r1_plfabric: rank 1 loss inf, every rank clip_grad_norm_ non-finite
  okapi_backward_twice_np7_r6_pltee: rank 6 backward through graph a second time
  -
  -
  -
"""
import argparse
import ctypes
import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault639_work"
BATCH = 16


def prepare(max_ranks=8):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(639)
    lookup = {f"trail_{i}": 0.5 + 0.1 * i for i in range(10)}
    with open(os.path.join(WORK, "terrain.json"), "w") as f:
        json.dump(lookup, f)
    for r in range(max_ranks):
        x = torch.rand(BATCH * 8, 8, generator=g)
        ids = torch.randint(0, 10, (BATCH * 8,), generator=g)
        torch.save({"x": x, "ids": ids}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.manual_seed(0)
    torch.save(TrailNet().state_dict(), os.path.join(WORK, "start.pt"))
    print("prepared", WORK, flush=True)


class TrailNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 1)
        self.fault_inplace = False
        self.fault_sqrt = False

    def forward(self, x):
        h = torch.sigmoid(self.l1(x))
        if self.fault_inplace:
            h.mul_(0.5)
        out = self.l2(h)
        if self.fault_sqrt:
            out = torch.sqrt(out - 10.0)
        return out


class Job:
    def __init__(self, args, rank):
        self.args, self.rank = args, rank
        self.me = args.fault != "none" and (args.rank == rank)
        name = f"shard_{rank}.pt" if not (args.fault == "missing_shard" and self.me) else f"shard_{rank}_okapi.pt"
        shard = torch.load(os.path.join(WORK, name))
        self.x, self.ids = shard["x"], shard["ids"]
        with open(os.path.join(WORK, "terrain.json")) as f:
            self.lookup = json.load(f)

    def batch(self, step):
        sl = slice(step * BATCH, (step + 1) * BATCH)
        x, ids = self.x[sl], self.ids[sl].tolist()
        if self.args.fault == "keyerror" and self.me and step == 2:
            ids[3] = 42
        w = torch.tensor([self.lookup[f"trail_{i}"] for i in ids]).unsqueeze(1)
        x = x * w
        y = x.sum(dim=1, keepdim=True) * 0.3
        return x, y

    def step(self, model, opt, backward, step, params):
        import torch.distributed as dist
        a, me = self.args, self.me
        x, y = self.batch(step)
        if a.fault == "dtype" and me:
            x = x.double()
        if a.fault == "view":
            x = x.view(-1, 7)
        if a.fault == "inplace" and me and step >= 2:
            model_core(model).fault_inplace = True
        if a.fault == "anomaly" and me and step == 3:
            model_core(model).fault_sqrt = True
        pred = model(x)
        if a.fault == "shape" and me:
            y = y[:-1]
        loss = F.mse_loss(pred, y)
        if a.fault == "clip" and me and step == 3:
            loss = loss * 1e39
        if a.fault == "nograd" and me:
            loss = loss.detach()
        km = torch.tensor([float(x.sum()) / 10.0])
        dist.all_reduce(km)
        print(f"rank {self.rank} step {step} loss {loss.item():.4f} trail_km {km.item():.3f}", flush=True)
        if a.fault == "sigkill" and me and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.fault == "segv" and me and step == 3:
            ctypes.string_at(0)
        backward(loss)
        if a.fault == "backward_twice" and me and step == 2:
            backward(loss)
        if a.fault == "nosync" and me and step == 3:
            loss2 = F.mse_loss(model(x), y)
            backward(loss2)
        torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
        if a.fault == "optim_group" and me and step == 2:
            getattr(opt, "optimizer", opt).add_param_group({"params": list(params), "lr": 0.01})
        opt.step()
        opt.zero_grad()


def model_core(m):
    for attr in ("net", "module", "_forward_module"):
        while hasattr(m, attr) and isinstance(getattr(m, attr), nn.Module):
            m = getattr(m, attr)
    return m


def export(model):
    torch.save(model_core(model).state_dict(), os.path.join(WORK, "export.pt"))
    print("rank 0 saved export", os.path.join(WORK, "export.pt"), flush=True)


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class TrailModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = TrailNet()
            self.net.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
            self.job = None

        def forward(self, x):
            return self.net(x)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(range(args.steps)), batch_size=1)

        def training_step(self, batch, idx):
            if self.job is None:
                self.job = Job(args, self.global_rank)
            self.job.step(self, self.optimizers(), self.manual_backward, idx, list(self.parameters()))

        def on_train_end(self):
            if self.global_rank == 0:
                export(self.net)

    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=args.steps, max_epochs=1,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(TrailModule())


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    net = TrailNet()
    net.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = fabric.setup(net, opt)
    job = Job(args, fabric.global_rank)
    for step in range(args.steps):
        job.step(model, opt, fabric.backward, step, list(model.parameters()))
    if fabric.global_rank == 0:
        export(model)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="trainer", choices=["trainer", "fabric"])
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    if args.mode == "trainer":
        run_trainer(args)
    else:
        run_fabric(args)


if __name__ == "__main__":
    main()

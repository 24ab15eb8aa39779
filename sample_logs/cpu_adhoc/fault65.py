"""A sixty-fifth hand-run batch: DTYPES AND PRECISION. A tiny DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4),
cross_entropy, SGD lr 0.1, batch 16, 5 steps, 0.1 s a step, PG timeout 15 s, no @record) where one rank (--rank N)
or every rank holds tensors of another dtype or precision. Progress lines: `rank R step S loss L dtype D`; a start
line `rank R world W params D`; after the loop every rank all-reduces its mean loss and prints `rank R done`.

Faults (--fault):
  f64          rank N builds its model in float64 (model.double(), inputs cast to match) before DDP wraps it
  bf16         rank N builds its model in bfloat16 before DDP wraps it
  deff64       rank N calls torch.set_default_dtype(torch.float64) before building the model (model AND batches f64)
  deflate      rank N calls torch.set_default_dtype(torch.float64) after DDP was built, before step 3 (a helper
               that 'enables double precision for the eval metrics'): its step-3 batch is float64, the model float32
  half         rank N calls model.module.half() after DDP was built, before step 2 ('to save memory'); inputs float32
  acmix        rank N runs the forward under torch.autocast("cpu", dtype=torch.bfloat16); the logits then go through
               a float32 calibration matrix outside autocast (the other ranks run it all in float32)
  intavg       after step 2 every rank all-reduces its count of correct predictions with ReduceOp.AVG; rank N's
               count is an int64 tensor, the others' float32 (--all: every rank's is int64)
  gather       after step 2 every rank all_gathers its loss statistics; rank N built its tensor from numpy (float64)
  boolflag     after step 2 every rank all-reduces a 'stop' flag; rank N's is a bool tensor, the others' float32
  cplxmax      after step 2 every rank all-reduces the max of its features' spectrum (torch.fft.rfft); rank N
               forgot .abs() so its tensor is complex64, and ReduceOp.MAX on it
  label        rank N's labels are float32 (its shard stored the class ids as floats)
  fp16scale    manual loss scaling: every rank multiplies its loss by 2**16 in its "amp dtype" and unscales the
               gradients; rank N's amp dtype is float16, so its scaled loss overflows to inf; the script's finite
               check raises FloatingPointError
  ckptassign   rank N loads a bf16 checkpoint (written by an inference export) into its model with
               load_state_dict(assign=True) before DDP: its parameters become bfloat16
  ckpt         rank N loads the same bf16 checkpoint with a plain load_state_dict (values cast to float32) before DDP
  acwarn       control: rank N wraps its forward in the deprecated torch.cpu.amp.autocast(dtype=torch.bfloat16)
               (a FutureWarning); gradients stay float32 and DDP all-reduces them fine
  none         control
"""
import argparse, datetime, os, sys, time
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--all", action="store_true")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--ckpt", default="/tmp/fault65_state/export_bf16.pt")
a = p.parse_args()
BATCH = 16


def say(rank, msg):
    print(f"rank {rank} {msg}", flush=True)


def batch(rank, step, dtype=None):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(BATCH, 8, generator=g, dtype=dtype or torch.get_default_dtype())
    y = torch.randint(0, 4, (BATCH,), generator=g)
    return x, y


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    f = a.fault
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    if f == "deff64" and me:
        torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if me and f == "f64":
        net = net.double()
    if me and f == "bf16":
        net = net.bfloat16()
    if me and f in ("ckpt", "ckptassign"):
        sd = torch.load(a.ckpt)
        say(rank, f"loading {a.ckpt} (tensors {sd['0.weight'].dtype})")
        net.load_state_dict(sd, assign=(f == "ckptassign"))
    say(rank, f"world {world} params {next(net.parameters()).dtype}")
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calib = torch.eye(4) + 0.01  # float32 calibration of the logits
    for step in range(1, a.steps + 1):
        if me and f == "deflate" and step == 3:
            torch.set_default_dtype(torch.float64)  # the eval helper wants double precision metrics
        if me and f == "half" and step == 2:
            model.module.half()  # save memory
        pdt = next(net.parameters()).dtype
        x, y = batch(rank, step)
        if me and f in ("f64", "bf16", "ckptassign"):
            x = x.to(pdt)
        if me and f == "label":
            y = y.float()
        opt.zero_grad()
        if me and f == "acmix":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            logits = logits @ calib
        elif me and f == "acwarn":
            with torch.cpu.amp.autocast(dtype=torch.bfloat16):
                logits = model(x)
            logits = logits.float() @ calib
        else:
            logits = model(x) @ calib.to(pdt) if pdt != torch.float32 else model(x) @ calib
        loss = F.cross_entropy(logits, y)
        if f == "fp16scale":
            amp = torch.float16 if me else torch.float32
            scaled = loss.to(amp) * 2.0 ** 16
            if not torch.isfinite(scaled):
                raise FloatingPointError(f"rank {rank}: scaled loss is {scaled.item()} at step {step} "
                                         f"(loss {loss.item():.4f} x 65536 in {amp})")
            scaled.backward()
            for prm in model.parameters():
                prm.grad.div_(2.0 ** 16)
        else:
            loss.backward()
        opt.step()
        say(rank, f"step {step} loss {loss.item():.4f} dtype {logits.dtype}")
        if step == 2 and f == "intavg":
            correct = (logits.argmax(1) == y).sum()
            c = correct if (me or a.all) else correct.float()
            dist.all_reduce(c, op=dist.ReduceOp.AVG)
            say(rank, f"mean correct {c.item()}")
        if step == 2 and f == "gather":
            stats = torch.from_numpy(np.array([loss.item(), float(step)])) if me else torch.tensor([loss.item(), float(step)])
            out = [torch.zeros_like(stats) for _ in range(world)]
            dist.all_gather(out, stats)
            say(rank, f"gathered losses {[round(float(o[0]), 4) for o in out]}")
        if step == 2 and f == "boolflag":
            stop = torch.tensor([bool(loss.item() > 10)]) if me else torch.tensor([float(loss.item() > 10)])
            dist.all_reduce(stop)
            say(rank, f"stop flag {stop.item()}")
        if step == 2 and f == "cplxmax":
            spec = torch.fft.rfft(x, dim=1)
            peak = (spec if me else spec.abs())[0].clone()  # rank N forgot .abs()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            say(rank, f"spectrum peak {float(peak.abs().max()):.3f}")
        time.sleep(0.1)
    m = torch.tensor([loss.item()])
    dist.all_reduce(m)
    say(rank, f"done mean final loss {m.item() / world:.4f}")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""A sixty-second hand-run batch: THE OPTIMIZER STEP (gradient accumulation, clipping, the LR scheduler) going wrong
on one rank (or on all). A tiny DDP loop on gloo: Linear(8,16)-ReLU-Linear(16,4), SGD(momentum 0.9), batch 16,
--steps optimizer steps of --accum micro-batches each (no_sync() on all but the last), clip_grad_norm_(1.0) and a
scheduler, a progress line `rank R step S loss L lr X` per step, a final weight check (every rank compares its weights
with rank 0's broadcast copy) and `rank R done`.

Faults (--rank N: the rank at fault):
  pgroup_dup    rank N builds its optimizer with a second group for the head that repeats its weight
                (ValueError: some parameters appear in more than one parameter group)
  opt_load      rank N resumes its optimizer state from another run's file (a model without the bias-free layer
                split: 3 groups instead of 2): ValueError: loaded state dict contains a parameter group that doesn't
                match the size of optimizer's group (as written; this build first says `loaded state dict has a
                different number of parameter groups`)
  opt_size      as opt_load, the other run's file with 2 groups of 3 and 1 parameters (this run's: 2 and 2):
                ValueError: loaded state dict contains a parameter group that doesn't match the size of optimizer's group
  clip_inf      rank N's gradient overflows after the all-reduce (a local gradient post-processing step scales by
                1e39 in float32: inf): clip_grad_norm_(error_if_nonfinite=True) raises on rank N only
  clip_all      rank N's step-3 batch holds an inf feature: its loss is inf, DDP's all-reduce spreads the inf to every
                rank's gradients, clip_grad_norm_(error_if_nonfinite=True) raises on EVERY rank
  accum         rank N reads its accumulation count from its own config (--accum + 1): it syncs its gradients once
                per accum+1 micro-batches, the others once per accum: their all-reduces drift apart
  accum_steps   rank N derives its optimizer step count from its own shard (one more step than the others): its extra
                step's gradient all-reduce meets the others' final weight-check broadcasts
  onecycle      OneCycleLR's total_steps comes from the rank's own shard length; rank N's shard is one step shorter,
                so at the last step: ValueError: Tried to step N times. The specified number of total steps is M
  lambda_zero   a LambdaLR warm-up whose factor divides by the rank's warm-up length, 0 on rank N (ZeroDivisionError
                inside torch/optim/lr_scheduler.py at the scheduler's first step)
  zero_one      rank N alone wraps its optimizer in ZeroRedundancyOptimizer (its step broadcasts the shards; the
                others' next collective is DDP's all-reduce)
  zero_bucket   every rank uses ZeroRedundancyOptimizer, rank N with parameters_as_bucket_view=True
  lr_str        after warm-up rank N sets its group's lr from a config value read as a string ('0.05'): TypeError in
                torch/optim/sgd.py at the next step
  grad_none     rank N logs the first layer's grad norm after optimizer.zero_grad(set_to_none=True)
                (AttributeError: 'NoneType' object has no attribute 'norm')
  skip_step     rank N skips optimizer.step() at step 3 (a local loss-spike guard): its weights diverge silently;
                the final weight check raises AssertionError on rank N
  sched_warn    rank N calls scheduler.step() before optimizer.step() at step 1 (the UserWarning): its warm-up lr runs
                one step ahead, its weights drift, and the final weight check raises AssertionError on rank N
  sched_warn_all  control: every rank does so (the UserWarning on every rank; same schedule everywhere), exit 0
  none          control
"""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.optim import ZeroRedundancyOptimizer

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--dir", default="/tmp/fault62_state")
a = p.parse_args()
BATCH = 16


def model_(hidden=16):
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    bad = rank == a.rank
    f = a.fault
    torch.manual_seed(0)
    net = DDP(model_())
    params = list(net.parameters())
    if f == "pgroup_dup" and bad:
        groups = [{"params": params}, {"params": [net.module[2].weight], "lr": 0.01}]
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    elif f == "zero_one" and bad or f == "zero_bucket":
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9,
                                      parameters_as_bucket_view=(f == "zero_bucket" and bad))
    else:
        opt = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.02}], lr=0.05, momentum=0.9)
    if f in ("opt_load", "opt_size"):
        os.makedirs(a.dir, exist_ok=True)
        if bad:
            other = model_()
            if f == "opt_size":
                o2 = torch.optim.SGD([{"params": [other[0].weight, other[0].bias, other[2].weight]},
                                      {"params": [other[2].bias]}], lr=0.05, momentum=0.9)
            else:
                o2 = torch.optim.SGD([{"params": [other[0].weight]}, {"params": [other[0].bias]},
                                      {"params": list(other[2].parameters())}], lr=0.05, momentum=0.9)
            path = f"{a.dir}/run_b_optim.pt"
            torch.save(o2.state_dict(), path)  # the other run's file, found under the same name pattern
        else:
            path = f"{a.dir}/optim_rank{rank}.pt"
            torch.save(opt.state_dict(), path)
        print(f"rank {rank} resuming optimizer state from {path}", flush=True)
        opt.load_state_dict(torch.load(path))
    n_steps = a.steps - (1 if f == "onecycle" and bad else 0)
    if f == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=n_steps)
    else:
        warm = 0 if f == "lambda_zero" and bad else 2
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    accum = a.accum + (1 if f == "accum" and bad else 0)
    print(f"rank {rank} world {world} optimizer {type(opt).__name__} accum {accum} steps {a.steps}", flush=True)
    g = torch.Generator().manual_seed(100 + rank)
    n_loop = a.steps + (1 if f == "accum_steps" and bad else 0)
    for step in range(1, n_loop + 1):
        for micro in range(accum):
            x = torch.randn(BATCH, 8, generator=g)
            y = torch.randint(0, 4, (BATCH,), generator=g)
            if f == "clip_all" and bad and step == 3 and micro == 0:
                x[3, 5] = float("inf")
            last = micro == accum - 1
            if last:
                loss = F.cross_entropy(net(x), y) / accum
                loss.backward()
            else:
                with net.no_sync():
                    loss = F.cross_entropy(net(x), y) / accum
                    loss.backward()
        if f == "clip_inf" and bad and step == 3:
            for q in params:
                q.grad.mul_(1e39)  # the local gradient post-processing overflows float32
        if (f == "sched_warn" and bad or f == "sched_warn_all") and step == 1:
            sched.step()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
        if f == "lr_str" and bad and step == 3:
            opt.param_groups[0]["lr"] = os.environ.get("FAULT62_LR", "0.05")  # read back from the run config
        if f == "skip_step" and bad and step == 3 and loss.item() > 0:
            print(f"rank {rank} step {step} loss spike guard: skipping optimizer step", flush=True)
        else:
            opt.step()
        if not ((f == "sched_warn" and bad or f == "sched_warn_all") and step == 1):
            sched.step()
        opt.zero_grad(set_to_none=True)
        if f == "grad_none" and bad and step == 2:
            print(f"rank {rank} step {step} grad norm layer0 {net.module[0].weight.grad.norm():.4f}", flush=True)
        print(f"rank {rank} step {step} loss {loss.item() * accum:.4f} grad_norm {gn:.4f} lr {sched.get_last_lr()[0]:.4f}",
              flush=True)
        time.sleep(0.05)
    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)
    for i, q in enumerate(params):
        ref = q.detach().clone()
        dist.broadcast(ref, src=0)
        assert torch.equal(ref, q.detach()), f"rank {rank}: parameter {i} differs from rank 0's copy after {a.steps} steps"
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # this build's interpreter exit hangs after DDP + no_sync here (seen while writing the script)


if __name__ == "__main__":
    main()

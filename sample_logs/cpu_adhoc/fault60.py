"""A sixtieth hand-run batch: AUTOGRAD AND THE BACKWARD PASS. A tiny DDP loop on gloo (Linear(8,16)-Tanh-Linear(16,4)
under DDP, batch 16, cross-entropy, SGD, 5 steps, main under @record, process-group timeout 15 s) where the failure
happens inside loss.backward() or the autograd machinery at step 3, on rank N only (--rank N) or on every rank
(--rank -1). Progress lines read `rank R step S loss L`, the end `rank R done`.

Faults:
  inplace        the rank scales the hidden activation in place after tanh (h.mul_(0.5)): backward raises
                 RuntimeError (one of the variables needed for gradient computation has been modified by an inplace
                 operation)
  inplace_anom   the same with torch.autograd.set_detect_anomaly(True) on that rank: the anomaly UserWarning prints the
                 FORWARD traceback (tanh's line) before the backward error
  func_count     a custom torch.autograd.Function (a straight-through clamp) whose backward returns two gradients for
                 its one input: RuntimeError (returned an incorrect number of gradients)
  func_shape     the same Function's backward returns a gradient of the wrong shape (its sum over the batch):
                 RuntimeError (returned an invalid gradient at index 0)
  hook_raise     a tensor hook (register_hook on the logits) checks the gradient's norm and raises ValueError
  modhook_raise  a module full-backward hook on the last layer raises RuntimeError (a 'gradient monitor' that fails)
  comm_raise     a DDP communication hook (ddp.register_comm_hook) that raises KeyError on the rank (a state dict
                 lookup) when the bucket is ready
  comm_wrong     a DDP communication hook that returns the bucket tensor itself, not a Future
  twice          loss.backward() twice without retain_graph: RuntimeError (Trying to backward through the graph a second
                 time)
  nonscalar      backward on the per-sample loss (reduction='none'): RuntimeError (grad can be implicitly created only
                 for scalar outputs)
  ckpt_mutate    torch.utils.checkpoint (use_reentrant=False) on the trunk whose forward depends on a module flag
                 ('half batch') the rank flips between forward and backward: the recompute differs (CheckpointError)
  nograd         the rank computes its loss under torch.no_grad() (an eval path left on): RuntimeError (element 0 of
                 tensors does not require grad and does not have a grad_fn)
  nan_bw         a masked sqrt of the first layer's output (torch.where(z > 0, z.sqrt(), 0)): the forward is
                 finite, the backward is NaN where z < 0; anomaly mode on that rank raises RuntimeError (Function 'SqrtBackward0'
                 returned nan values in its 0th output)
  slow_bw        a tensor hook on the rank sleeps 40 s in backward (a stalled gradient writer); the others time out in
                 DDP's all-reduce (15 s)
  ok             control: no fault
  ok_warn        control: every rank reads .grad of a non-leaf tensor at step 1 (harmless UserWarning)
"""
import argparse, datetime, os, sys, time, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.elastic.multiprocessing.errors import record
import torch.utils.checkpoint as cp

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
BAD_STEP = 3


class STClamp(torch.autograd.Function):
    """Straight-through clamp: forward clamps, backward passes the gradient through."""

    @staticmethod
    def forward(ctx, x, mode):
        ctx.mode = mode
        return x.clamp(-1.0, 1.0)

    @staticmethod
    def backward(ctx, g):
        if ctx.mode == "count":
            return g, g, None
        if ctx.mode == "shape":
            return g.sum(0), None
        return g, None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.mode = ""
        self.flip = False

    def trunk(self, x):
        if self.flip:
            x = x[: x.shape[0] // 2]  # a different recompute (the flag says 'half batch')
        h = torch.tanh(self.fc1(x))
        return h

    def forward(self, x):
        m = self.mode
        if m == "ckpt_mutate":
            h = cp.checkpoint(self.trunk, x, use_reentrant=False)
        elif m == "nan_bw":
            z = self.fc1(x)
            h = torch.tanh(torch.where(z > 0, z.sqrt(), torch.zeros_like(z)))  # masked sqrt: finite forward
        else:
            h = torch.tanh(self.fc1(x))
        if m in ("inplace", "inplace_anom"):
            h.mul_(0.5)  # scale the activation in place: tanh saved its output for backward
        if m in ("func_count", "func_shape"):
            h = STClamp.apply(h, m.split("_")[1])
        return self.fc2(h)


def say(rank, msg):
    print(f"rank {rank} {msg}", flush=True)


@record
def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    bad = a.rank < 0 or rank == a.rank
    f = a.fault
    if bad and f == "comm_raise":
        def hook(state, bucket):
            scale = state["grad_scale"]  # the hook's state was built without this key
            return dist.all_reduce(bucket.buffer().mul_(scale), async_op=True).get_future().then(lambda fut: fut.value()[0])
        ddp.register_comm_hook({}, hook)
    elif f in ("comm_raise", "comm_wrong"):
        def hook(state, bucket):
            return dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future().then(lambda fut: fut.value()[0])
        if bad and f == "comm_wrong":
            def hook(state, bucket):
                dist.all_reduce(bucket.buffer().div_(world))
                return bucket.buffer()  # should be a torch.futures.Future
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1, a.steps + 1):
        x = torch.randn(16, 8, generator=g)
        y = torch.randint(0, 4, (16,), generator=g)
        here = bad and step == BAD_STEP
        net.mode = f if here else ""
        if here and f == "nan_bw":
            torch.autograd.set_detect_anomaly(True)
        if here and f == "inplace_anom":
            torch.autograd.set_detect_anomaly(True)
        opt.zero_grad()
        if here and f == "nograd":
            with torch.no_grad():
                out = ddp(x)
                loss = F.cross_entropy(out, y)
        else:
            out = ddp(x)
            if here and f == "hook_raise":
                def check(gr):
                    n = float(gr.norm())
                    raise ValueError(f"gradient check failed on logits: norm {n:.4f} above limit 0.0100")
                out.register_hook(check)
            if here and f == "slow_bw":
                def stall(gr):
                    time.sleep(40)
                    return gr
                out.register_hook(stall)
            if here and f == "modhook_raise":
                def mon(mod, gin, gout):
                    raise RuntimeError(f"grad monitor: fc2 grad_output has {gout[0].numel()} elements, expected 0")
                net.fc2.register_full_backward_hook(mon)
            if here and f == "ckpt_mutate":
                net.flip = True
            if f == "ok_warn" and step == 1:
                _ = out.grad  # non-leaf .grad: harmless warning
            loss = F.cross_entropy(out, y, reduction="none" if (here and f == "nonscalar") else "mean")
        loss.backward()
        if here and f == "twice":
            loss.backward()
        opt.step()
        net.flip = False
        say(rank, f"step {step} loss {loss.mean().item():.4f}")
        time.sleep(0.05)
    dist.barrier()
    say(rank, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A fifty-seventh hand-run batch: DDP'S OWN RULES, broken on one rank. A tiny DDP loop on gloo (Net: a trunk
Linear(8,16)-ReLU, a head Linear(16,4) and an aux head Linear(16,4); SGD; a progress line `rank R step S loss L`
from every rank per step) where rank N (--rank) breaks one of DistributedDataParallel's rules:

  unused      rank N's forward skips the aux head (a rank-dependent branch); find_unused_parameters=False
  unused_fup  find_unused_parameters=True, every rank skips a different head (rank N the aux head, the others the
              main head) -- DDP is meant to cope with this
  retunused   forward returns (out, aux); rank N's loss uses only out (the aux output is dropped)
  shape       rank N's aux head is Linear(16,5) (a parameter shape differs at DDP construction)
  count       rank N's model has an extra bias-free Linear(4,4) (parameter count differs)
  nograd      rank N freezes the aux head (requires_grad=False) before wrapping
  twice       rank N runs its trunk twice through torch.utils.checkpoint(use_reentrant=True) with
              find_unused_parameters=True (the input does not require grad, so the trunk gets no gradient at all)
  twice_grad  the same with an input that requires grad (a parameter marked ready twice)
  static      static_graph=True and rank N skips the aux head from step 3 on
  nosync      rank N wraps steps 2 and 4 in model.no_sync() (gradient accumulation), the others do not
  bnbuf       a BatchNorm1d after the trunk, broadcast_buffers=True; rank N's BatchNorm has track_running_stats=False
              (no running_mean/var buffers)
  device      rank N passes device_ids=[local_rank] for its CPU model
  module      rank N calls model.module(x) (the bare module) from step 2 on instead of model(x)
  exc         rank N raises ValueError at step 3 (a bad sample)
  nan         rank N's step-3 batch holds a NaN; the loss check raises FloatingPointError
  ok          no fault (control); --fup sets find_unused_parameters=True
"""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=3)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--fup", action="store_true")
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()


class Net(nn.Module):
    def __init__(self, aux_out=4, extra=False, bn=None):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.bn = bn
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, aux_out)
        self.extra = nn.Linear(4, 4, bias=False) if extra else None
        self.skip_aux = False
        self.skip_head = False
        self.return_pair = False
        self.ckpt_twice = False

    def forward(self, x):
        if self.ckpt_twice:
            if self.ckpt_twice == "grad":
                x = x.detach().requires_grad_(True)
            h = checkpoint(self.trunk, x, use_reentrant=True)
            h = h + checkpoint(self.trunk, x, use_reentrant=True)
        else:
            h = self.trunk(x)
        if self.bn is not None:
            h = self.bn(h)
        out = self.head(h) if not self.skip_head else torch.zeros(x.shape[0], 4)
        if self.extra is not None:
            out = self.extra(out)
        if self.skip_aux:
            return out
        aux = self.aux(h)[:, :4]
        if self.return_pair:
            return out, aux
        return out + 0.1 * aux


def main():
    rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    f, bad = a.fault, rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    bn = None
    if f == "bnbuf":
        bn = nn.BatchNorm1d(16, track_running_stats=not bad)
    model = Net(aux_out=5 if (f == "shape" and bad) else 4, extra=(f == "count" and bad), bn=bn)
    if f == "nograd" and bad:
        for q in model.aux.parameters():
            q.requires_grad_(False)
    kw = {}
    if f in ("unused_fup", "twice", "twice_grad") or a.fup:
        kw["find_unused_parameters"] = True
    if f == "static":
        kw["static_graph"] = True
    if f == "bnbuf":
        kw["broadcast_buffers"] = True
    if f == "device" and bad:
        kw["device_ids"] = [local_rank]
    ddp = DDP(model, **kw)
    print(f"rank {rank} wrapped model ({sum(q.numel() for q in model.parameters())} params) world={world}", flush=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(1, a.steps + 1):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        if f == "nan" and bad and step == 3:
            x[4, 2] = float("nan")
        if f == "exc" and bad and step == 3:
            raise ValueError(f"sample 37 of shard {rank}: expected 8 features, got 7")
        if f == "unused" and bad:
            model.skip_aux = True
        if f == "unused_fup":
            model.skip_aux, model.skip_head = bad, not bad
        if f == "retunused":
            model.return_pair = True
        if f == "twice" and bad:
            model.ckpt_twice = True
        if f == "twice_grad" and bad:
            model.ckpt_twice = "grad"
        if f == "static" and bad and step >= 3:
            model.skip_aux = True
        if f == "module" and bad and step >= 2:
            out = ddp.module(x)
        else:
            out = ddp(x)
        if f == "retunused":
            o, aux = out
            out = o if bad else o + 0.1 * aux
        loss = F.mse_loss(out, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        if f == "nosync" and bad and step in (2, 4):
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.05)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-third hand-run batch: ZERO REDUNDANCY OPTIMIZER AND OPTIMIZER STATE ACROSS RANKS. A tiny DDP model
on gloo (Linear(8,16)-ReLU-Linear(16,4)) trained with torch.distributed.optim.ZeroRedundancyOptimizer (Adam, state
sharded over the ranks, a StepLR scheduler around it), batch 16, synthetic per-rank data, PG timeout 15 s unless
--pg-timeout. It runs --steps steps, printing `rank R step S loss L lr LR`, then consolidates the optimizer state to
rank 0 (`consolidate_state_dict(to=0)`), rank 0 saves {model, optim, sched} to --workdir/ckpt.pt, and every rank
prints `rank R done`. With --resume every rank first loads that file (saved by an earlier run) and goes on. No @record.

Faults (--rank N is the rank that goes wrong):
  none        control: train, consolidate, save (exit 0)
  resume      control: load the checkpoint the control saved (--resume) and train on (exit 0)
  consol0     the consolidate_state_dict(to=0) call sits inside `if rank == N:` next to the save (it is a
              collective): rank N waits in its broadcasts while the others go on to the final barrier
  noconsol    rank N (not 0) saves a copy of the optimizer state "for its node" with optimizer.state_dict() but
              consolidate_state_dict(to=0) put the state on rank 0 only: RuntimeError (not consolidated)
  paramorder  rank N gives ZeroRedundancyOptimizer the parameters in reversed order: it ran to exit 0 (ZeRO
              partitions by parameter size, so the order does not matter); no run kept
  addgroup    rank N adds a param group (a learned loss temperature, lr 0.01) with add_param_group after step 2 ("the
              calibration rank"); the others do not
  nograd      rank N freezes the first layer (requires_grad False, "fine-tune the head only" read from a per-rank
              config) before DDP and ZeRO are built
  wrongsize   --resume, but rank N loads the consolidated file of another run (--other: a model of width 32):
              load_state_dict of model/optimizer fails on that rank
  missing     --resume from a per-node copy (--workdir/node{N}/ckpt.pt); rank N's node never got its copy:
              FileNotFoundError in torch.load
  overlap     ZeroRedundancyOptimizer(overlap_with_ddp=True) on every rank but no DDP comm hook registered
              (ddp_zero_hook) and no warm-up: what torch says in step()
  wrongtype   --resume, but rank N loads a plain torch.optim.SGD state_dict (an older checkpoint format saved with
              SGD, no betas) into the Adam-based ZeroRedundancyOptimizer
  finalwait   after saving, rank 0 writes --workdir/DONE and exits; the other ranks wait (a polling loop, no
              timeout) for --workdir/done (the lower-case name of an older version): they never leave
"""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.optim import ZeroRedundancyOptimizer

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--resume", action="store_true")
p.add_argument("--workdir", default="/tmp/fault103_work")
p.add_argument("--other", default="/tmp/fault103_work/other/ckpt.pt")
p.add_argument("--width", type=int, default=16)
a = p.parse_args()


def make_model(width):
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = make_model(a.width)
    if a.fault == "nograd" and me:
        for prm in model[0].parameters():
            prm.requires_grad_(False)
    ddp = DDP(model)
    params = list(ddp.parameters())
    if a.fault == "paramorder" and me:
        params = [prm for _, prm in sorted(ddp.named_parameters(), key=lambda kv: kv[0], reverse=True)]
    opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=0.01,
                                  overlap_with_ddp=(a.fault == "overlap"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    start = 0
    if a.resume:
        path = os.path.join(a.workdir, "ckpt.pt")
        if a.fault == "missing":
            path = os.path.join(a.workdir, f"node{rank}", "ckpt.pt")
        if a.fault == "wrongsize" and me:
            path = a.other
        ck = torch.load(path, map_location="cpu")
        optim_sd = ck["optim"]
        if a.fault == "wrongtype" and me:
            optim_sd = torch.load(os.path.join(a.workdir, "sgd_optim.pt"))
        ddp.module.load_state_dict(ck["model"])
        opt.load_state_dict(optim_sd)
        sched.load_state_dict(ck["sched"])
        start = ck["step"]
        print(f"rank {rank} resumed from {path} at step {start}", flush=True)
    temp = None
    for step in range(start + 1, start + a.steps + 1):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        out = ddp(x)
        if temp is not None:
            out = out / temp
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        sched.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.4g}", flush=True)
        if a.fault == "addgroup" and me and step == start + 2:
            temp = nn.Parameter(torch.ones(()))
            opt.add_param_group({"params": [temp], "lr": 0.01})
            print(f"rank {rank} added a param group for the loss temperature", flush=True)
        time.sleep(0.2)
    if a.fault == "consol0":
        if rank == a.rank:
            opt.consolidate_state_dict(to=0)
    else:
        opt.consolidate_state_dict(to=0)
    sd = {"model": ddp.module.state_dict(), "sched": sched.state_dict(), "step": start + a.steps}
    if rank == 0:
        sd["optim"] = opt.state_dict()
        os.makedirs(a.workdir, exist_ok=True)
        torch.save(sd, os.path.join(a.workdir, "ckpt.pt"))
        print(f"rank 0 saved {os.path.join(a.workdir, 'ckpt.pt')}", flush=True)
    if a.fault == "noconsol" and me:
        sd["optim"] = opt.state_dict()
        torch.save(sd, os.path.join(a.workdir, f"ckpt_rank{rank}.pt"))
    if a.fault == "finalwait":
        if rank == 0:
            open(os.path.join(a.workdir, "DONE"), "w").close()
            print("rank 0 done", flush=True)
            return
        while not os.path.exists(os.path.join(a.workdir, "done")):
            time.sleep(0.5)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

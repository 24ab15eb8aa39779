"""An eighty-fifth hand-run batch: ACTIVATION CHECKPOINTING AND DDP'S AUTOGRAD HOOKS. A tiny DDP model on gloo
(stem Linear(8,16); a residual `block` Linear(16,16)-Tanh that may be applied twice (tied weights) under
torch.utils.checkpoint; an `aux` head used for every batch that has auxiliary targets; a `head` Linear(16,4); SGD,
batch 16, synthetic per-rank data, PG timeout --pg-timeout (12 s)) running --steps (6) steps, printing
`rank R step S loss L` each step and `rank R done` at the end. One rank (--rank N) or every rank (--rank -1) goes
wrong. No @record.

Faults:
  none         control: non-reentrant checkpoint of the block (applied twice), aux head on every batch, gradient
               accumulation of 2 micro-batches with no_sync() on every rank (exit 0)
  unused_ok    control: rank N's batches have no auxiliary targets, so the aux head gets no gradient there, but the
               model is wrapped with find_unused_parameters=True (exit 0)
  tied_reentrant  rank N (or all) runs the block's two applications as two separate reentrant checkpoints
               (use_reentrant=True): the tied weight's hook fires in two reentrant backward passes:
               `Expected to mark a variable ready only once`
  tied_static  control: tied_reentrant on rank N (or all) with DDP's documented workaround, static_graph=True (exit 0)
  ckpt_onerank rank N reads `activation_checkpointing: true` from its per-host config and checkpoints the block with
               use_reentrant=True on the stem's output; the others do not. find_unused_parameters=True: the graph
               search at forward's end cannot see through the reentrant checkpoint, marks the block's parameters
               unused (ready), then their hooks fire in backward: `Expected to mark a variable ready only once`
  skip_branch  rank N's batches have no auxiliary targets (its shard of the data has none), so the aux head is
               skipped; find_unused_parameters=False: `Expected to have finished reduction in the prior iteration`
  nosync_onerank  gradient accumulation over 2 micro-batches under no_sync(), but rank N's host config says 4, and
               its sync test counts micro-batches over the whole run: it leaves no_sync() only every other step, so it
               all-reduces half as often; the others wait in DDP's all-reduce (or pair with the wrong collective)
  static_change static_graph=True; on step 3 rank N's batch has no auxiliary targets, so the graph changes
  reentrant_nograd use_reentrant=True checkpoint of the whole trunk (stem + block twice) on the raw input, which
               does not require grad, on rank N: warning `None of the inputs have requires_grad=True. Gradients will be
               None`; the trunk's parameters get no gradient there and DDP's reduction never finishes
  seq_nograd   the same with checkpoint_sequential(Sequential(stem, block), 2, x, use_reentrant=True): the stem's
               segment gets no gradient (rank N, or every rank with --rank -1)
  seq_tied     checkpoint_sequential(Sequential(stem, block, block), len(seq), x, use_reentrant=True) on rank N (or
               all): the tied block is one child, so 2 children in 3 segments: ValueError from range()
  double_backward rank N calls aux_loss.backward() a second time at step 2 to probe the aux head's gradient norm:
               `Trying to backward through the graph a second time`
  recompute    rank N's checkpointed block (non-reentrant) does stochastic depth with Python's `random` (not torch's
               RNG, which checkpoint restores): the recomputation takes the other branch: CheckpointError
  nosync_never like nosync_onerank with grad_accum_steps: 8 on rank N: it never leaves no_sync() in 6 steps, runs
               through its loop and waits in the final barrier; the others wait in step 1's all-reduce
"""
import argparse, datetime, os, random, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--find-unused", type=int, default=-1, help="-1: the fault's default")
p.add_argument("--workdir", default="/tmp/fault85_work")
a = p.parse_args()
BATCH = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class Net(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.block = Block()
        self.aux = nn.Linear(16, 4)
        self.head = nn.Linear(16, 4)
        self.mode = mode  # how to run the blockplain, ckpt (non-reentrant), reentrant, reentrant2, crop

    def trunk(self, x):
        return self.block(self.block(self.stem(x)))

    def forward(self, x, has_aux):
        if self.mode == "reentrant_trunk":
            h = checkpoint(self.trunk, x, use_reentrant=True)
        elif self.mode == "seq_nograd":
            seq = nn.Sequential(self.stem, self.block)
            h = checkpoint_sequential(seq, 2, x, use_reentrant=True)
        elif self.mode == "seq":
            seq = nn.Sequential(self.stem, self.block, self.block)
            h = checkpoint_sequential(seq, len(seq), x, use_reentrant=True)  # one segment per layer
        else:
            h = self.stem(x)
            if self.mode == "plain":
                h = self.block(self.block(h))
            elif self.mode == "ckpt":
                h = checkpoint(lambda t: self.block(self.block(t)), h, use_reentrant=False)
            elif self.mode == "reentrant":
                h = checkpoint(lambda t: self.block(self.block(t)), h, use_reentrant=True)
            elif self.mode == "reentrant2":  # one checkpoint per application of the tied block
                h = checkpoint(self.block, h, use_reentrant=True)
                h = checkpoint(self.block, h, use_reentrant=True)
            elif self.mode == "crop":
                def layerdrop(t):
                    t = self.block(t)
                    if random.random() < 0.5:  # stochastic depth: skip the second application half the time
                        return t
                    return self.block(t)
                h = checkpoint(layerdrop, h, use_reentrant=False)
        out = self.head(h)
        aux = self.aux(h) if has_aux else None
        return out, aux


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(10000 * rank + 100 * step + micro)
    x = torch.randn(BATCH, 8, generator=g)
    y = torch.randint(0, 4, (BATCH,), generator=g)
    ya = torch.randint(0, 4, (BATCH,), generator=g)
    return x, y, ya


def read_host_config(rank):
    path = f"{a.workdir}/host{rank}.yaml"
    cfg = {"activation_checkpointing": False}
    if os.path.exists(path):
        for line in open(path):
            k, _, v = line.partition(":")
            cfg[k.strip()] = v.strip().lower() == "true"
    return cfg


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    f = a.fault
    me = rank == a.rank or a.rank == -1
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    os.makedirs(a.workdir, exist_ok=True)
    if f == "ckpt_onerank" and rank == 0:
        for r in range(world):
            with open(f"{a.workdir}/host{r}.yaml", "w") as fh:
                fh.write(f"activation_checkpointing: {'true' if r == a.rank else 'false'}\n")
    if f == "ckpt_onerank":
        dist.barrier()
    random.seed(1000 + rank)
    mode = "ckpt"
    if f in ("tied_reentrant", "tied_static") and me:
        mode = "reentrant2"
    if f == "ckpt_onerank":
        mode = "reentrant" if read_host_config(rank)["activation_checkpointing"] else "plain"
    if f == "reentrant_nograd" and me:
        mode = "reentrant_trunk"
    if f == "seq_tied" and me:
        mode = "seq"
    if f == "seq_nograd" and me:
        mode = "seq_nograd"
    if f == "recompute" and me:
        mode = "crop"
    find_unused = f in ("unused_ok", "ckpt_onerank", "tied_reentrant")
    if a.find_unused >= 0:
        find_unused = bool(a.find_unused)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net(mode), find_unused_parameters=find_unused,
                                                static_graph=f in ("static_change", "tied_static"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    accum = 2 if f in ("none", "nosync_onerank", "nosync_never") else 1
    print(f"rank {rank} world {world} fault {f} mode {mode} find_unused {find_unused} accum {accum}", flush=True)
    for step in range(1, a.steps + 1):
        opt.zero_grad()
        for micro in range(accum):
            x, y, ya = batch(rank, step, micro)
            has_aux = True
            if f in ("unused_ok", "skip_branch") and me:
                has_aux = False  # this rank's shard carries no auxiliary labels
            if f == "static_change" and me and step == 3:
                has_aux = False
            sync = micro == accum - 1
            if f in ("nosync_onerank", "nosync_never") and me:
                # this host's launcher config says grad_accum_steps: 4 (8 for nosync_never), counted over the run
                host_accum = 8 if f == "nosync_never" else 4
                sync = ((step - 1) * accum + micro + 1) % host_accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                out, aux = model(x, has_aux)
                loss = F.cross_entropy(out, y)
                aux_loss = F.cross_entropy(aux, ya) if aux is not None else None
                total = loss + 0.3 * aux_loss if aux_loss is not None else loss
                if f == "double_backward" and me and step == 2:
                    total.backward()
                    aux_loss.backward()  # gradient-norm probe of the aux loss
                else:
                    (total / accum).backward()
        opt.step()
        print(f"rank {rank} step {step} loss {total.item():.4f}", flush=True)
        time.sleep(0.2)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

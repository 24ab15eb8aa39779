"""A sixteenth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault15.py)."""
import argparse, datetime, os, subprocess, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
BATCH = 16


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class Shard(Dataset):
    """Items are dicts; on the faulty rank the items from step 3 on come from a newer shard without 'mask'."""

    def __init__(self, rank: int, hit: bool):
        self.rank, self.hit = rank, hit

    def __len__(self):
        return BATCH * a.steps

    def __getitem__(self, i):
        item = {"x": torch.randn(8), "y": torch.tensor(i % 4)}
        if not (self.hit and i >= 2 * BATCH):  # v2 shard format: the mask moved into x's padding
            item["mask"] = torch.ones(8)
        return item


def collate(items):
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


class EvalSet(Dataset):
    def __init__(self, n_tokens: int, tokens_per_item: int, exact: bool):
        self.n, self.per, self.exact = n_tokens, tokens_per_item, exact

    def __len__(self):
        return self.n // self.per if self.exact else self.n / self.per  # this rank's copy lost the //

    def __getitem__(self, i):
        return torch.randn(8)


def batches(shard):
    it = iter(shard)
    while True:
        yield next(it)  # an exhausted shard ends the generator the wrong way


class GradProbe(torch.autograd.Function):
    """Identity; in backward optionally syncs all ranks before logging gradient stats."""

    @staticmethod
    def forward(ctx, x, sync):
        ctx.sync = sync
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.sync:
            dist.barrier()  # debug sync left in; only this rank's probe has it on
        return g, None


def fault_at_step3(rank, world, model, hit, state, batch):
    """Runs before step 3's forward; returns the (possibly changed) batch."""
    if a.fault == "legacy_mmap" and hit:
        path = f"/tmp/fault16_snap_rank{rank}.pt"
        say(rank, f"snapshotting weights to {path}")
        torch.save(model.module.state_dict(), path, _use_new_zipfile_serialization=False)  # old helper's format
        say(rank, "reloading snapshot with mmap for the EMA copy")
        state["ema"] = torch.load(path, mmap=True, weights_only=True)
    if a.fault == "new_group_partial":
        if not hit:  # this rank's config has eval disabled, so it never builds the eval group
            say(rank, "building eval group")
            state["eval_pg"] = dist.new_group(ranks=list(range(world)), use_local_synchronization=False)
        else:
            say(rank, "eval disabled in this rank's config")
    if a.fault == "allreduce_float":
        say(rank, "averaging step-2 loss for the logger")
        val = state["last_loss"] if hit else torch.tensor(state["last_loss"])  # this rank's path kept a float
        dist.all_reduce(val)
    if a.fault == "len_float" and hit:
        say(rank, "building eval loader")
        ds = EvalSet(10000, 3, exact=not hit)
        state["eval_loader"] = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds))
    if a.fault == "view_flat" and hit:
        say(rank, "flattening feature bank")
        bank = torch.randn(16, 32).t()  # bank stored feature-major on this rank
        state["bank"] = bank.view(-1)
    if a.fault == "nograd_leak" and hit:
        say(rank, "quick eval on held-out batch")
        torch.set_grad_enabled(False)  # meant `with torch.no_grad():`; never turned back on
        state["eval_loss"] = model.module(torch.randn(16, 8)).pow(2).mean().item()
    if a.fault == "target_int32" and hit:
        say(rank, "labels now from the numpy label cache")
        batch["y"] = batch["y"].to(torch.int32)
    if a.fault == "gen_stopiter" and hit:
        say(rank, "switching to the hard-example shard")
        gen = batches([torch.randn(16, 8), torch.randn(16, 8)])  # two batches; this loop needs three
        for _ in range(3):
            state["hard"] = next(gen)
    if a.fault == "leaf_inplace" and hit:
        say(rank, "adding exploration noise to head weights")
        model.module.head.weight.add_(torch.randn_like(model.module.head.weight) * 1e-3)  # outside no_grad
    return batch


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(Shard(rank, hit and a.fault == "collate_key"), batch_size=BATCH, collate_fn=collate)
    sink = None
    if a.fault == "broken_pipe" and hit:
        # progress goes to a log shipper; this one is configured to take two lines and quit
        sink = subprocess.Popen(["head", "-n", "2"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    state = {}
    for step, batch in enumerate(loader, start=1):
        if step == 3:
            batch = fault_at_step3(rank, world, model, hit, state, batch)
        opt.zero_grad()
        x = batch["x"] * batch["mask"]
        out = model(x)
        if a.fault == "sync_in_backward":
            out = GradProbe.apply(out, hit and step >= 3)
        loss = F.cross_entropy(out, batch["y"])
        loss.backward()
        if a.fault == "backward_twice" and hit and step == 3:
            say(rank, "second backward for the grad-noise probe")
            loss.backward()  # the graph was freed by the first backward
        opt.step()
        state["last_loss"] = loss.item()
        say(rank, f"step {step} loss {loss.item():.4f}")
        if sink is not None:
            time.sleep(0.2)
            sink.stdin.write(f"step={step} loss={loss.item():.4f}\n")
            sink.stdin.flush()
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_PORT"] = str(29900 + os.getpid() % 90)
        mp.spawn(main, args=(a.spawn,), nprocs=a.spawn)
    else:
        main()

"""A fourteenth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault13.py)."""
import argparse, datetime, importlib, os, sys
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)
PLUGIN_DIR = "/tmp/fault14_plugins"


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class Probe(nn.Module):
    """Linear probe on the features; the eval rank attaches it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def fwd(self, x):  # named fwd, not forward
        return self.fc(x)


class Node:
    def __init__(self, parent):
        self.parent = parent


def write_plugins() -> None:
    os.makedirs(PLUGIN_DIR, exist_ok=True)
    with open(os.path.join(PLUGIN_DIR, "mixup.py"), "w") as f:
        f.write("def apply(x):\n    lam = 0.7\n    return lam * x + (1 - lam) * x.flip(0)\n")
    with open(os.path.join(PLUGIN_DIR, "cutout.py"), "w") as f:
        f.write("def apply(x):\n    x = x.clone()\n    x[:, :2] = 0\n    return x\n        return x\n")


def fault_at_step3(rank: int, world: int, model, hit: bool, state: dict) -> None:
    if a.fault == "plugin_syntax":
        name = "cutout" if hit else "mixup"  # this rank's augmentation config
        say(rank, f"loading augmentation plugin {name}")
        sys.path.insert(0, PLUGIN_DIR)
        state["aug"] = importlib.import_module(name).apply
    if a.fault == "npload_object" and hit:
        path = f"/tmp/fault14_class_weights_rank{rank}.npy"
        np.save(path, np.array([np.ones(3), np.ones(2)], dtype=object))  # ragged per-class weights
        say(rank, f"loading class weights from {path}")
        state["cw"] = np.load(path, allow_pickle=False)
    if a.fault == "save_isdir" and hit:
        path = f"/tmp/fault14_ckpt/rank{rank}/step2.pt"
        os.makedirs(path, exist_ok=True)  # meant os.path.dirname(path)
        say(rank, f"saving checkpoint to {path}")
        torch.save(model.module.state_dict(), path)
    if a.fault == "batch_mismatch" and hit:
        logits = model(torch.randn(8, 8))
        target = torch.randint(0, 4, (8,))[::2]  # labels subsampled for the eval split, inputs not
        say(rank, "computing eval cross-entropy")
        state["eval"] = F.cross_entropy(logits, target).item()
    if a.fault == "sched_inf" and hit:
        measured = torch.tensor(0.0)  # this rank's throughput meter has seen no full window yet
        tokens_per_s = torch.tensor(4096.0) / measured
        remaining = int(tokens_per_s.item() * 60)
        say(rank, f"remaining budget {remaining}")
    if a.fault == "forward_missing" and hit:
        probe = Probe()
        say(rank, "evaluating linear probe")
        state["probe"] = probe(model(torch.randn(4, 8))).mean().item()
    if a.fault == "forkserver_lambda" and hit:
        ds = torch.utils.data.TensorDataset(torch.randn(16, 8))
        dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2,
                                         multiprocessing_context="forkserver",
                                         collate_fn=lambda b: torch.stack([t[0] for t in b]))
        say(rank, "starting eval loader")
        state["ev"] = sum(x.sum().item() for x in dl)
    if a.fault == "seed_range" and hit:
        seed = 2**64 + rank  # base seed from a 64-bit hash, plus the rank
        say(rank, f"reseeding with {seed}")
        torch.manual_seed(seed)
    if a.fault == "gather_deep":
        tree = None
        for _ in range(20000 if hit else 10):  # this rank's lineage chain of resumed runs
            tree = Node(tree)
        say(rank, "gathering run lineage")
        out = [None] * world
        dist.all_gather_object(out, tree)
    if a.fault == "fork_child" and hit:
        say(rank, "forking metrics uploader")
        pid = os.fork()
        if pid == 0:
            t = torch.ones(4)
            dist.all_reduce(t)  # the child reuses the parent's process group
            say(rank, f"child summed {t[0].item():.0f}")
            os._exit(0)
        os.waitpid(pid, 0)
    if a.fault == "cat_empty":
        shard = list(range(rank, 6, world)) if not hit else []  # this rank's eval shard came out empty
        say(rank, f"eval shard has {len(shard)} batches")
        feats = [model.module(torch.randn(4, 8)).detach() for _ in shard]
        state["feats"] = torch.cat(feats).mean().item()
    if a.fault == "numpy_grad" and hit:
        say(rank, "dumping head weights for the dashboard")
        state["w"] = model.module.head.weight.numpy()  # needs .detach()
    if a.fault == "exit_msg" and hit:
        free_gb = 0.4  # this rank's scratch volume reported nearly full
        say(rank, f"scratch space check: {free_gb} GB free")
        sys.exit(f"fault14: rank {rank} aborting, scratch volume has only {free_gb} GB free (need 2 GB)")
    if a.fault == "prefix_keys" and hit:
        path = f"/tmp/fault14_ema_rank{rank}.pt"
        torch.save(model.state_dict(), path)  # the DDP wrapper's state_dict: keys start with module.
        say(rank, f"restoring EMA copy from {path}")
        ema = Net()
        ema.load_state_dict(torch.load(path))
    if a.fault == "hook_twice" and hit:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        say(rank, "enabling gradient compression for the rest of training")
        model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)  # the default's behaviour, a new hook
        model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    if a.fault == "plugin_syntax" and rank == 0:
        write_plugins()
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {}
    for step in range(1, a.steps + 1):
        if step == 3:
            fault_at_step3(rank, world, model, hit, state)
        opt.zero_grad()
        x = torch.randn(16, 8)
        if "aug" in state:
            x = state["aug"](x)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        say(rank, f"step {step} loss {loss.item():.4f}")
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

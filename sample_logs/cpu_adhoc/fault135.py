"""A hundred-and-thirty-fifth hand-run batch: TWO NODES EMULATED BY TWO AGENTS, FAULTS ON EITHER NODE.

A small DDP regression job (Linear(8,32)-ReLU-Linear(32,1); `--ddp 0`: rank 0's weights broadcast and the
gradients all-reduced by hand) meant for two torchrun agents (`--nnodes 2`, c10d rendezvous). Each rank
checks the node layout, reads its node's config and its data shard (written by the rank itself under the
node's data dir), optionally resumes from last.pt (`--resume 1`), trains `--steps` steps printing
`rank R step S loss L`, all_reduces a validation metric vector, rank 0 saves last.pt, barrier, destroy.

Faults:
- keyerr: rank N's node config names the batch-size key "batch" (old name): KeyError 'batch_size'.
- attr: every rank calls model.no_sync_grad() (a typo of DDP's API): AttributeError on every rank.
- wait: rank N waits for its node's staging marker that never appears; the others wait in the all_reduce.
- segv: rank N gets SIGSEGV at step 3 (a native extension crash).
- kill: rank N is SIGKILLed at step 2 (as the kernel's OOM killer would).
- nan: rank N's shard holds an inf; the program's loss check raises FloatingPointError.
- ckpt: with --resume 1, rank N looks for a node-local copy of last.pt that was never staged.
- shape: rank N's metric vector has an extra entry (5 against 4) in the validation all_reduce.
- data: rank N's node data dir is misspelled in its config: its shard file is missing.
- nproc: the two agents use different --nproc_per_node; the layout check fails on every rank.
- agentkill: node 1's torchrun agent is killed with SIGKILL from the parent shell a few seconds in.
- late: node 1's agent starts 30 s after node 0's, past the rendezvous join_timeout of 20 s.
What happened (filled in after the runs):
- keyerr: KeyError 'batch_size' (line 127) on rank N before step 0; peers Connection closed / store lost.
- attr: every rank AttributeError 'DistributedDataParallel' ... 'no_sync_grad' (line 145) before step 0.
- wait: PG 12 s: the others time out (12000ms) in the step-1 all_reduce; PG 300 s: killed by timeout 60.
- segv: rank N exitcode -11 (SIGSEGV) after step 2; with --max-restarts 1 the retry dies in connectFullMesh.
- kill: rank N exitcode -9 (SIGKILL) after step 1; peers Connection closed/reset by peer.
- nan: FloatingPointError 'rank N step 2: loss is nan' (line 159); peers Connection closed by peer.
- ckpt: FileNotFoundError .../nodeK/last.pt from torch.load (line 135) on rank N; the others resumed.
- shape: DETAIL: every rank 'Detected mismatch', ALLREDUCE TensorShape=[5] on rank N vs [4] (np4 run kept).
- data: FileNotFoundError .../data_nodK/shard_00N.pt on rank N (per-rank stderr.log under --redirects).
- nproc: WORLD_SIZE 5 is not a multiple of LOCAL_WORLD_SIZE 2 / 3: ValueError (line 83) on every rank.
- agentkill: no run kept: ranks finished, node 0's agent stuck in its exit barrier past timeout (dropped).
- late: both agents RendezvousTimeoutError in next_rendezvous; no worker ever started.
"""
import argparse
import math
import os
import signal
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--out", default="/tmp/fault135_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
LOCAL_WORLD = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
torch.set_num_threads(1)


def hit():
    return a.rank == -1 or a.rank == RANK


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def check_layout():
    if WORLD % LOCAL_WORLD != 0:
        raise ValueError(f"WORLD_SIZE {WORLD} is not a multiple of LOCAL_WORLD_SIZE {LOCAL_WORLD}: "
                         f"nodes must run the same number of workers")
    node = RANK // LOCAL_WORLD
    print(f"rank {RANK} on {socket.gethostname()} node {node} local rank {LOCAL_RANK}/{LOCAL_WORLD}", flush=True)
    return node


def node_config(node):
    cfg = {"batch_size": 16, "lr": 0.05, "data_dir": os.path.join(a.out, f"data_node{node}")}
    if a.fault == "keyerr" and hit():
        cfg["batch"] = cfg.pop("batch_size")
    if a.fault == "data" and hit():
        cfg["data_dir"] = os.path.join(a.out, f"data_nod{node}")
    return cfg


def load_shard(cfg):
    os.makedirs(os.path.join(a.out, f"data_node{RANK // LOCAL_WORLD}"), exist_ok=True)
    real = os.path.join(a.out, f"data_node{RANK // LOCAL_WORLD}", f"shard_{RANK:03d}.pt")
    g = torch.Generator().manual_seed(1000 + RANK)
    x = torch.randn(96, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.3 + 0.1
    torch.save({"x": x, "y": y}, real)
    path = os.path.join(cfg["data_dir"], f"shard_{RANK:03d}.pt")
    shard = torch.load(path)
    if a.fault == "nan" and hit():
        shard["x"][37, 4] = float("inf")
    return shard


def wait_for_staging(node):
    marker = os.path.join(a.out, f"staged_node{node}.ok")
    if a.fault == "wait" and hit():
        marker = os.path.join(a.out, f"staged_node{node}_v2.ok")
    while not os.path.exists(marker):
        time.sleep(1.0)


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    node = check_layout()
    if LOCAL_RANK == 0:
        open(os.path.join(a.out, f"staged_node{node}.ok"), "w").write("ok\n")
    cfg = node_config(node)
    bs = cfg["batch_size"]
    shard = load_shard(cfg)
    torch.manual_seed(0)
    net = Net()
    if a.resume:
        ck = os.path.join(a.out, "last.pt")
        if a.fault == "ckpt" and hit():
            ck = os.path.join(a.out, f"node{node}", "last.pt")
        sd = torch.load(ck, map_location="cpu")
        net.load_state_dict(sd["model"])
        print(f"rank {RANK} resumed from step {sd['step']}", flush=True)
    if a.ddp:
        model = DDP(net)
    else:
        model = net
        for prm in net.parameters():
            dist.broadcast(prm.data, src=0)
    if a.fault == "attr":
        model.no_sync_grad()
    opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"])
    dist.barrier()
    for s in range(a.steps):
        lo = (s * bs) % shard["x"].shape[0]
        x, y = shard["x"][lo:lo + bs], shard["y"][lo:lo + bs]
        if a.fault == "segv" and hit() and s == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "kill" and hit() and s == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if s == 1:
            wait_for_staging(node)
        loss = F.mse_loss(model(x), y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {RANK} step {s}: loss is {loss.item()}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= WORLD
        opt.step()
        print(f"rank {RANK} step {s} loss {loss.item():.4f}", flush=True)
        time.sleep(0.3)
    with torch.no_grad():
        pred = net(shard["x"][:32])
        err = pred - shard["y"][:32]
        metrics = [err.pow(2).sum(), err.abs().sum(), torch.tensor(32.0), pred.mean()]
        if a.fault == "shape" and hit():
            metrics.append(err.abs().max())
        vec = torch.stack([m.reshape(()) for m in metrics])
    dist.all_reduce(vec)
    if RANK == 0:
        print(f"val mse {vec[0].item() / vec[2].item():.4f} mae {vec[1].item() / vec[2].item():.4f}", flush=True)
        torch.save({"model": net.state_dict(), "step": a.steps}, os.path.join(a.out, "last.pt"))
    dist.barrier()
    print(f"rank {RANK} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A two-hundred-and-forty-sixth hand-run batch: DEEP Q-LEARNING WITH PRIORITISED REPLAY ON A SYNTHETIC MAZE.

Every rank walks its own copy of a small grid maze (layout read from /tmp/fault246_work/mazes/<name>_R.txt, the
maze name looked up in a registry), stores transitions in a per-rank sum-tree prioritised replay buffer, samples
batches by priority**alpha with importance weights, and trains a small Q-network (one-hot state -> 4 actions)
wrapped in DDP (gloo), or, with --ddp 0, all_reduces the gradients by hand.  A target network is synced every
few steps.  The loss and episode returns are all_reduced for the log, and at the end the TD-error histograms
are all_gathered and rank 0 prints the global statistics.  The Q-network starts from ckpt/qnet_init.pt.

Faults:
  prioexp  - rank N reads priority alpha -0.6 (sign typo): empty leaves give 0**-0.6 = inf, the loss check raises
  histbins - rank N builds its TD-error histogram with 21 bins instead of 20 before the all_gather
  nomaze   - rank N reads its layout from mazes/v2/ which does not exist (FileNotFoundError)
  action   - rank N samples exploration actions from range(5) while the Q-head has 4 outputs (IndexError)
  mazename - rank N is configured with maze "spiral-5", missing from the registry (KeyError)
  encwidth - every rank encodes the state as position + goal one-hot (50 wide) for a 25-input Q-network
  ckpt     - rank N initialises from ckpt/qnet_init_a5.pt, saved with 5 actions (size mismatch)
  late     - rank N rebuilds its sum-tree one leaf at a time for --stall seconds before the step-3 all_reduce
  segv     - rank N sends itself SIGSEGV after step 2's optimizer step
  exit3    - rank N prints its own error line about a negative leaf priority and calls sys.exit(3)
  envdir   - every rank reads PDQN_REPLAY_DIR from the environment, which the job never sets (KeyError)
  none     - control, clean run

What happened (filled in after the runs):
  prioexp  - rank N: FloatingPointError loss is nan at step 0 (importance weights max nan); peers closed in backward
  histbins - rank N: RuntimeError ProcessGroupGloo::allgather invalid tensor size (expected (21), got (20)); peers closed
  nomaze   - rank N: FileNotFoundError .../mazes/v2/<maze>_N.txt at startup; peers SIGTERMed in DDP init
  action   - rank N: IndexError index 4 is out of bounds for dimension 1 with size 4 at step 0 or 1; peers closed
  mazename - rank N: KeyError 'spiral-5' at startup; peers SIGTERMed (restart run: see README)
  encwidth - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (1x50 and 25x64) before step 0
  ckpt     - rank N: RuntimeError size mismatch for head.weight [5, 64] vs [4, 64] at load; peers SIGTERMed
  late     - rank N stalled: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (exit 124)
  segv     - rank N: exitcode -11 (SIGSEGV) after step 2, no traceback; peers Connection reset by peer
  exit3    - rank N logs its ERROR negative-priority line and exits with code 3 at step 1; peers closed in backward
  envdir   - every rank: KeyError 'PDQN_REPLAY_DIR' at startup
  none     - clean, exit 0, rank 0 printed the global episode and TD-error statistics
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault246_work"
H = W = 5
N_ACTIONS = 4
MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1)]
REGISTRY = {"open-5": "open", "rooms-5": "rooms", "corridor-5": "corridor"}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--prepare", action="store_true")
    return p.parse_args()


class QNet(nn.Module):
    def __init__(self, n_in=H * W, n_actions=N_ACTIONS):
        super().__init__()
        self.body = nn.Linear(n_in, 64)
        self.head = nn.Linear(64, n_actions)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class SumTree:
    def __init__(self, capacity):
        self.capacity = capacity
        self.tree = np.zeros(2 * capacity)
        self.data = [None] * capacity
        self.next = 0
        self.size = 0

    def update(self, idx, prio):
        i = idx + self.capacity
        self.tree[i] = prio
        i //= 2
        while i >= 1:
            self.tree[i] = self.tree[2 * i] + self.tree[2 * i + 1]
            i //= 2

    def add(self, item, prio):
        self.data[self.next] = item
        self.update(self.next, prio)
        self.next = (self.next + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def total(self):
        return self.tree[1]

    def find(self, s):
        i = 1
        while i < self.capacity:
            if s <= self.tree[2 * i] or self.tree[2 * i + 1] == 0:
                i = 2 * i
            else:
                s -= self.tree[2 * i]
                i = 2 * i + 1
        return i - self.capacity


def prepare():
    os.makedirs(f"{WORK}/mazes", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    rng = np.random.default_rng(0)
    for name in REGISTRY:
        for r in range(8):
            grid = (rng.random((H, W)) < 0.15).astype(int)
            grid[0, 0] = 0
            grid[H - 1, W - 1] = 0
            with open(f"{WORK}/mazes/{name}_{r}.txt", "w") as f:
                f.write("\n".join("".join("#" if c else "." for c in row) for row in grid) + "\n")
    torch.manual_seed(0)
    torch.save(QNet().state_dict(), f"{WORK}/ckpt/qnet_init.pt")
    torch.save(QNet(n_actions=5).state_dict(), f"{WORK}/ckpt/qnet_init_a5.pt")
    print("prepared mazes and checkpoints under", WORK)


def main():
    a = parse()
    if a.prepare:
        return prepare()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    f = a.fault if bad else "none"
    torch.manual_seed(100 + rank)
    rng = np.random.default_rng(100 + rank)

    replay_dir = os.environ["PDQN_REPLAY_DIR"] if f == "envdir" else os.environ.get("PDQN_REPLAY_DIR", f"{WORK}/replay")
    maze_name = "spiral-5" if f == "mazename" else ["open-5", "rooms-5", "corridor-5"][rank % 3]
    kind = REGISTRY[maze_name]
    layout_dir = f"{WORK}/mazes/v2" if f == "nomaze" else f"{WORK}/mazes"
    with open(f"{layout_dir}/{maze_name}_{rank}.txt") as fh:
        grid = np.array([[c == "#" for c in line.strip()] for line in fh if line.strip()])
    print(f"rank {rank}: maze {maze_name} ({kind}) {grid.shape[0]}x{grid.shape[1]}, {int(grid.sum())} walls, replay dir {replay_dir}", flush=True)

    alpha = -0.6 if f == "prioexp" else 0.6
    beta, gamma, eps = 0.4, 0.95, 1e-3
    n_explore = 5 if f == "action" else N_ACTIONS

    qnet = QNet()
    ckpt = f"{WORK}/ckpt/qnet_init_a5.pt" if f == "ckpt" else f"{WORK}/ckpt/qnet_init.pt"
    qnet.load_state_dict(torch.load(ckpt))
    target = QNet()
    target.load_state_dict(qnet.state_dict())
    model = DDP(qnet) if a.ddp else qnet
    if not a.ddp:
        for p in qnet.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(qnet.parameters(), lr=1e-2)

    def encode(pos):
        x = torch.zeros(2 * H * W if f == "encwidth" else H * W)
        x[pos[0] * W + pos[1]] = 1.0
        if f == "encwidth":
            x[H * W + (H - 1) * W + (W - 1)] = 1.0
        return x

    tree = SumTree(64)
    pos, ep_ret, returns = (0, 0), 0.0, []
    for step in range(a.steps):
        for _ in range(12):
            act = int(rng.integers(n_explore)) if rng.random() < 0.5 else int(qnet(encode(pos)).argmax())
            dr, dc = MOVES[act % N_ACTIONS]
            nxt = (min(max(pos[0] + dr, 0), H - 1), min(max(pos[1] + dc, 0), W - 1))
            if grid[nxt]:
                nxt = pos
            done = nxt == (H - 1, W - 1)
            rew = 1.0 if done else -0.04
            ep_ret += rew
            maxp = max(tree.tree[tree.capacity:].max(), 1.0)
            tree.add((pos, act, rew, nxt, done), maxp)
            pos = (0, 0) if done else nxt
            if done:
                returns.append(ep_ret)
                ep_ret = 0.0
        if f == "exit3" and step == 1:
            print(f"ERROR rank {rank}: replay leaf 37 has priority -0.412 after update; sum-tree corrupt, aborting", file=sys.stderr, flush=True)
            sys.exit(3)
        leaves = tree.tree[tree.capacity:]
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = leaves ** alpha
            probs = scaled / scaled.sum()
        idx = [tree.find(rng.random() * tree.total()) for _ in range(a.batch)]
        idx = [i if tree.data[i] is not None else i % tree.size for i in idx]
        batch = [tree.data[i] for i in idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            w = torch.tensor((tree.size * probs[idx]) ** (-beta), dtype=torch.float32)
        w = w / w.max()
        s = torch.stack([encode(b[0]) for b in batch])
        acts = torch.tensor([b[1] for b in batch])
        r = torch.tensor([b[2] for b in batch])
        s2 = torch.stack([encode(b[3]) for b in batch])
        d = torch.tensor([float(b[4]) for b in batch])
        q = model(s)[torch.arange(len(batch)), acts]
        with torch.no_grad():
            tgt = r + gamma * (1 - d) * target(s2).max(1).values
        td = tgt - q
        loss = (w * F.smooth_l1_loss(q, tgt, reduction="none")).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (importance weights max {w.max().item()})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in qnet.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        for i, e in zip(idx, td.detach().abs().numpy()):
            tree.update(i, float(e) + eps)
        if step % 3 == 2:
            target.load_state_dict(qnet.state_dict())
        if f == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "late" and step == 3:
            print(f"rank {rank}: rebuilding sum-tree from scratch, one leaf at a time ({tree.capacity} leaves)", flush=True)
            t0 = time.time()
            while time.time() - t0 < a.stall:
                for i in range(tree.capacity):
                    tree.update(i, tree.tree[tree.capacity + i])
                time.sleep(0.5)
        stats = torch.tensor([loss.item(), float(sum(returns)), float(len(returns))])
        dist.all_reduce(stats)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mean_loss {stats[0].item() / world:.4f} episodes {int(stats[2])}", flush=True)

    nbins = 21 if f == "histbins" else 20
    hist = torch.histc(torch.tensor(tree.tree[tree.capacity:], dtype=torch.float32), bins=nbins, min=0.0, max=2.0)
    hists = [torch.zeros(20) for _ in range(world)]
    dist.all_gather(hists, hist)
    tot = torch.tensor([float(sum(returns)), float(len(returns))])
    dist.all_reduce(tot)
    if rank == 0:
        allh = torch.stack(hists).sum(0)
        print(f"rank 0: {int(tot[1])} episodes, mean return {tot[0].item() / max(tot[1].item(), 1):.3f}, "
              f"TD-error median bin {int(torch.searchsorted(allh.cumsum(0), allh.sum() / 2))}/20", flush=True)
    del model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

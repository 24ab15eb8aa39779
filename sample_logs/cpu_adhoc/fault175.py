"""A hundred-and-seventy-fifth hand-run batch: DEEP Q-LEARNING WITH A REPLAY BUFFER.

Every rank runs its own copy of a hand-written 5x5 gridworld (start in a corner, goal in the opposite corner,
-0.01 per move, +1 at the goal, 4 actions), seeds its replay buffer from a file it writes and reads back
(replay/buf_rR.npz), then each step collects a few epsilon-greedy transitions, samples a minibatch with
random.sample, computes TD targets with a target network synced every K steps, and trains a small MLP Q-network
under DDP on gloo (or --ddp 0: gradients all-reduced by hand).  Episode returns are all_reduced for logging;
at the end the per-episode returns are all_gathered and rank 0 saves the Q-network.

Faults:
  smallbuf     - rank N's warmup is 8 transitions, fewer than a batch; random.sample raises ValueError
  badaction    - rank N's buffer records actions 1-based (1..4); gather on the Q-values goes out of range
  tdnan        - rank N reads a reward scale of 1e45 (float32 inf); the program's TD-target check raises
  targethidden - every rank builds the target network with hidden 64; load_state_dict size mismatch
  epsstr       - rank N's config overlay gives eps_decay as the string "0.995"; TypeError in the schedule
  neverdone    - rank N's goal is placed outside the grid and its episodes have no step cap; late all_reduce
  retlen       - rank N all_gathers its returns with one extra (unfinished) episode; sizes differ
  bufmissing   - rank N loads its seed buffer from a node-local replay dir never written (FileNotFoundError)
  exit2        - rank N logs its own corrupted-buffer error and exits with code 2
  sigabrt      - rank N gets SIGABRT (sent to itself) at step 2
  cfgkey       - every rank's config names the sync period 'target_update' (KeyError 'target_sync')
  none         - control, clean run

What happened (filled in after the runs):
  smallbuf     - random.sample raises 'ValueError: Sample larger than population or is negative' on rank N (np3 r1, np4 r2)
  badaction    - 'RuntimeError: index 4 is out of bounds for dimension 1 with size 4' from gather on rank N (np3 r2, np4 r1)
  tdnan        - the program's check raises 'FloatingPointError: TD target is not finite at step 0 on rank N' (np4 r3, np3 r1)
  targethidden - every rank: load_state_dict 'size mismatch for 0.weight' (32 vs 64) at the first target sync (np3)
  epsstr       - rank N: "TypeError: can't multiply sequence by non-int of type 'float'" in the eps decay (np3 r2, np4 r1)
  neverdone    - rank N never reaches the first all_reduce: np4 r3 peers 'Timed out waiting 12000ms'; np3 r2 (PG 300 s) killed by timeout 60
  retlen       - rank N: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (2), got (1))' (np3 r1)
  bufmissing   - FileNotFoundError for replay_local/buf_rN.npz on rank N (np3 r2 --redirects, np4 r1 --max-restarts 1)
  exit2        - rank N prints its 'ERROR rank N: replay buffer ... is corrupted' line and exits 2 (np3 r1, np4 r3)
  sigabrt      - rank N dies with exitcode -6 (SIGABRT) at step 2 (np4 r2 two-node, np3 r1)
  cfgkey       - every rank raises KeyError: 'target_sync' reading the config (np3)
  none         - clean, exit 0, rank 0 'saved ckpt/dqn.pt' (np3)
"""
import argparse
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--workdir", default="/tmp/fault175_work")
    p.add_argument("--save", default="ckpt/dqn.pt")
    return p.parse_args()


class Grid:
    MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1)]

    def __init__(self, size, goal, max_len, rng):
        self.size, self.goal, self.max_len, self.rng = size, goal, max_len, rng

    def reset(self):
        self.pos, self.t = (0, 0), 0
        return self.obs()

    def obs(self):
        return np.array(self.pos, dtype=np.float32) / (self.size - 1)

    def step(self, a):
        dy, dx = self.MOVES[a]
        self.pos = (min(max(self.pos[0] + dy, 0), self.size - 1), min(max(self.pos[1] + dx, 0), self.size - 1))
        self.t += 1
        done = self.pos == self.goal
        r = 1.0 if done else -0.01
        if self.max_len is not None and self.t >= self.max_len:
            done = True
        return self.obs(), r, done


def qnet(hidden):
    return nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    random.seed(100 + rank)
    for d in ("replay", "ckpt"):
        os.makedirs(os.path.join(a.workdir, d), exist_ok=True)
    cfg = {"gamma": 0.99, "eps_start": 1.0, "eps_decay": 0.9, "target_sync": 3, "warmup": 64,
           "reward_scale": 1.0, "grid": 5, "max_len": 30, "collect": 8, "target_hidden": a.hidden}
    if bad and a.fault == "smallbuf":
        cfg["warmup"] = 8
    if bad and a.fault == "tdnan":
        cfg["reward_scale"] = 1e45
    if bad and a.fault == "targethidden":
        cfg["target_hidden"] = 64
    if bad and a.fault == "epsstr":
        cfg["eps_decay"] = "0.995"
    if bad and a.fault == "cfgkey":
        cfg["target_update"] = cfg.pop("target_sync")
    cfg_path = os.path.join(a.workdir, f"dqn_r{rank}.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    sync_every = cfg["target_sync"]
    goal = (cfg["grid"], cfg["grid"]) if (bad and a.fault == "neverdone") else (cfg["grid"] - 1, cfg["grid"] - 1)
    max_len = None if (bad and a.fault == "neverdone") else cfg["max_len"]
    env = Grid(cfg["grid"], goal, max_len, np.random.default_rng(rank))
    # seed buffer: random-policy transitions written to disk and read back
    obs, seed = env.reset(), []
    for _ in range(cfg["warmup"]):
        act = random.randrange(4)
        nxt, r, done = env.step(act)
        seed.append((obs, act + (1 if (bad and a.fault == "badaction") else 0), r, nxt, float(done)))
        obs = env.reset() if done else nxt
    buf_file = os.path.join(a.workdir, "replay", f"buf_r{rank}.npz")
    np.savez(buf_file, o=np.stack([s[0] for s in seed]), a=np.array([s[1] for s in seed]),
             r=np.array([s[2] for s in seed], dtype=np.float32), n=np.stack([s[3] for s in seed]),
             d=np.array([s[4] for s in seed], dtype=np.float32))
    if bad and a.fault == "bufmissing":
        buf_file = os.path.join(a.workdir, "replay_local", f"buf_r{rank}.npz")
    z = np.load(buf_file)
    buffer = [(z["o"][i], int(z["a"][i]), float(z["r"][i]), z["n"][i], float(z["d"][i])) for i in range(len(z["a"]))]
    if bad and a.fault == "exit2":
        print(f"ERROR rank {rank}: replay buffer {buf_file} is corrupted: 17 transitions have next_obs outside "
              f"the grid (first at index 41); refusing to train on it", flush=True)
        sys.exit(2)
    online = qnet(a.hidden)
    target = qnet(cfg["target_hidden"])
    net = DDP(online) if a.ddp else online
    if not a.ddp:
        for p in online.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(online.parameters(), lr=a.lr)
    print(f"rank {rank}/{world} dqn hidden={a.hidden} buffer={len(buffer)} batch={a.batch} sync={sync_every}",
          flush=True)
    eps, returns, ep_ret = cfg["eps_start"], [], 0.0
    obs = env.reset()
    for step in range(a.steps):
        if step % sync_every == 0:
            target.load_state_dict(online.state_dict())
        for _ in range(cfg["collect"]):
            if random.random() < eps:
                act = random.randrange(4)
            else:
                with torch.no_grad():
                    act = int(online(torch.from_numpy(obs)).argmax())
            nxt, r, done = env.step(act)
            while bad and a.fault == "neverdone" and not done:
                time.sleep(0.01)
                nxt, r, done = env.step(random.randrange(4))
                obs = nxt
            buffer.append((obs, act + (1 if (bad and a.fault == "badaction") else 0), r, nxt, float(done)))
            ep_ret += r
            if done:
                returns.append(ep_ret)
                obs, ep_ret = env.reset(), 0.0
            else:
                obs = nxt
        batch = random.sample(buffer, a.batch)
        o = torch.tensor(np.stack([b[0] for b in batch]))
        act_t = torch.tensor([b[1] for b in batch]).unsqueeze(1)
        rew = torch.tensor([b[2] for b in batch], dtype=torch.float32) * cfg["reward_scale"]
        n = torch.tensor(np.stack([b[3] for b in batch]))
        d = torch.tensor([b[4] for b in batch])
        with torch.no_grad():
            y = rew + cfg["gamma"] * (1 - d) * target(n).max(1).values
        if not torch.isfinite(y).all():
            raise FloatingPointError(f"TD target is not finite at step {step} on rank {rank}: "
                                     f"{int((~torch.isfinite(y)).sum())} of {len(y)} entries, max |r| = {rew.abs().max()}")
        q = net(o).gather(1, act_t).squeeze(1)
        loss = nn.functional.smooth_l1_loss(q, y)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in online.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "sigabrt" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        eps = max(0.05, eps * cfg["eps_decay"])
        stats = torch.tensor([loss.item(), float(sum(returns[-5:])) / max(1, len(returns[-5:])), len(returns)])
        dist.all_reduce(stats)
        print(f"rank {rank} step {step} loss {loss.item():.4f} eps {eps:.3f} mean_loss {stats[0] / world:.4f} "
              f"avg_return {stats[1] / world:.3f} episodes {int(stats[2])}", flush=True)
    n_eps = torch.tensor([len(returns)])
    dist.all_reduce(n_eps, op=dist.ReduceOp.MIN)
    mine = torch.tensor(returns[:int(n_eps)] + ([ep_ret] if (bad and a.fault == "retlen") else []))
    gathered = [torch.zeros(int(n_eps)) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        print(f"returns per rank: {[round(float(g.mean()), 3) for g in gathered]}", flush=True)
        torch.save(online.state_dict(), os.path.join(a.workdir, a.save))
        print(f"saved {a.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

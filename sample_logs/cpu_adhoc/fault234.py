"""A two-hundred-and-thirty-fourth hand-run batch: MULTI-AGENT REINFORCEMENT LEARNING WITH A CENTRALISED CRITIC.

A small MADDPG-like learner on a synthetic cooperative grid task: three agents (scout, carrier, medic) walk on
an 8x8 grid read from /tmp/fault234_work/layouts/grid_8x8.json and are rewarded for closing in on a shared goal.
Every agent has its own actor (a linear policy over 5 moves); one critic sees every agent's observation and
action, is warm-started from ckpt/critic_warm.pt and wrapped in DDP (gloo).  Each rank keeps its own replay
buffer, collects short episodes, takes a critic step (TD target from the target critic) and an actor step,
soft-updates the target critic with tau, and all_reduces the mean episode return for the log.  At the end the
per-episode returns are all_gathered and rank 0 prints the team return.

Faults:
  actidx   - rank N adds an off-by-one to its sampled action at step 2: action 5 of 5 (IndexError)
  critwide - every rank: critic input width counts a global-state feature the observations lack (shape error)
  nolayout - rank N reads layouts/grid_8x8_v2.json which does not exist (FileNotFoundError)
  infrew   - rank N reads tau 0 and reward scale inf: critic loss inf at step 1, the program's check raises
  retlen   - rank N all_gathers its episode returns with one extra episode (gloo size mismatch)
  ckpt     - rank N warm-starts the critic from ckpt/critic_warm_h128.pt, hidden 128 vs 64 (size mismatch)
  agentkey - rank N's agent list names "sniper", absent from the agent config (KeyError)
  sloweval - rank N runs a long evaluation rollout at step 2 before the return all_reduce
  abort    - rank N sends itself SIGABRT at step 2
  exit2    - rank N prints its own error line about a corrupt replay shard and calls os._exit(2)
  none     - control, clean run

What happened (filled in after the runs):
  actidx   - rank N: IndexError index 5 is out of bounds for dimension 0 with size 5 at step 2; peers closed
  critwide - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (32x33 and 34x64), step 0
  nolayout - rank N: FileNotFoundError .../layouts/grid_8x8_v2.json after the barrier; peers closed in DDP init
  infrew   - rank N: FloatingPointError critic loss is inf at step 0 (not step 1); peers closed in backward
  retlen   - rank N: RuntimeError ProcessGroupGloo::allgather invalid tensor size (expected (7), got (6))
  ckpt     - rank N: RuntimeError Error(s) in loading state_dict for Critic: size mismatch 128 vs 64
  agentkey - rank N: KeyError 'sniper' building the agent config; peers closed in DDP init
  sloweval - rank N sleeps in the eval loop; peers gloo Timed out 12000ms (PG 300 s: killed by timeout, 124)
  abort    - rank N dies of SIGABRT at step 2 (spawn: ProcessExitedException; bash loop: exit 134)
  exit2    - rank N prints ERROR ... replay shard ... is corrupt; cannot continue, exits 2; peers reset
  none     - clean: team return -26.056 over 18 episodes, exit 0
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault234_work"
AGENT_CFG = {"scout": {"speed": 2}, "carrier": {"speed": 1}, "medic": {"speed": 1}}
OBS, ACT, GRID = 6, 5, 8
MOVES = torch.tensor([[0, 0], [0, 1], [0, -1], [1, 0], [-1, 0]])


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class Critic(nn.Module):
    def __init__(self, in_dim, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, obs, act):
        return self.net(torch.cat([obs.flatten(1), act.flatten(1)], dim=1)).squeeze(1)


def observe(pos, goal, cfg):
    speed = torch.tensor([float(cfg[n]["speed"]) for n in cfg["_names"]]).unsqueeze(1)
    rel = (goal - pos).float() / GRID
    return torch.cat([pos.float() / GRID, rel, speed, torch.ones_like(speed)], dim=1)


def rollout(actors, pos, goal, cfg, layout, g, eps, shift):
    obs = observe(pos, goal, cfg)
    logits = torch.stack([actors[i](obs[i]) for i in range(len(actors))])
    a = torch.distributions.Categorical(logits=logits).sample()
    rnd = torch.rand(len(actors), generator=g) < eps
    a = torch.where(rnd, torch.randint(shift * ACT, ACT + shift, (len(actors),), generator=g), a)
    onehot = torch.eye(ACT)[a]
    new = (pos + MOVES[a]).clamp(0, layout["size"] - 1)
    reward = -(new - goal).abs().sum().float() / GRID * cfg["_reward_scale"]
    return obs, onehot, reward, new


def worker(local, a):
    if a.spawn:
        os.environ.update(RANK=str(local), WORLD_SIZE=str(a.spawn), LOCAL_RANK=str(local),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s")
        log = logging.getLogger("marl")
        log.addFilter(RankFilter(rank))
        say, err = log.info, log.error
    else:
        say = lambda m: print(m, flush=True)
        err = lambda m: print(m, file=sys.stderr, flush=True)
    torch.manual_seed(1234 + rank)
    g = torch.Generator().manual_seed(99 + rank)

    if rank == 0:
        os.makedirs(f"{WORK}/layouts", exist_ok=True)
        os.makedirs(f"{WORK}/ckpt", exist_ok=True)
        with open(f"{WORK}/layouts/grid_8x8.json", "w") as f:
            json.dump({"size": GRID, "goal": [6, 5], "walls": [[3, 3], [3, 4]]}, f)
        torch.manual_seed(7)
        torch.save(Critic(3 * (OBS + ACT), 64).state_dict(), f"{WORK}/ckpt/critic_warm.pt")
        torch.save(Critic(3 * (OBS + ACT), 128).state_dict(), f"{WORK}/ckpt/critic_warm_h128.pt")
        torch.manual_seed(1234)
    dist.barrier()

    names = ["scout", "carrier", "medic"]
    if a.fault == "agentkey" and bad:
        names = ["scout", "sniper", "medic"]
    cfg = {n: AGENT_CFG[n] for n in names}
    cfg["_names"] = names
    cfg["_reward_scale"] = float("inf") if (a.fault == "infrew" and bad) else 1.0
    tau = 0.0 if (a.fault == "infrew" and bad) else 0.05
    lay = "grid_8x8_v2.json" if (a.fault == "nolayout" and bad) else "grid_8x8.json"
    with open(f"{WORK}/layouts/{lay}") as f:
        layout = json.load(f)
    goal = torch.tensor(layout["goal"])
    say(f"rank {rank}/{world}: agents {names} grid {layout['size']}x{layout['size']} goal {layout['goal']}")

    in_dim = len(names) * (OBS + ACT) + (1 if a.fault == "critwide" else 0)
    hidden = 64
    ck = "critic_warm_h128.pt" if (a.fault == "ckpt" and bad) else "critic_warm.pt"
    critic = Critic(in_dim, hidden)
    if a.fault != "critwide":
        critic.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    target = Critic(in_dim, hidden)
    target.load_state_dict(critic.state_dict())
    critic = DDP(critic)
    actors = nn.ModuleList([nn.Linear(OBS, ACT) for _ in names])
    for p in actors.parameters():
        dist.broadcast(p.data, 0)
    copt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    aopt = torch.optim.Adam(actors.parameters(), lr=1e-3)
    replay, gamma, ep_returns = [], 0.95, []

    for step in range(a.steps):
        pos = torch.randint(0, GRID, (len(names), 2), generator=g)
        ret = 0.0
        for t in range(12):
            shift = 1 if (a.fault == "actidx" and bad and step == 2 and t == 3) else 0
            obs, act, r, pos = rollout(actors, pos, goal, cfg, layout, g, 1.0 if shift else 0.2, shift)
            nobs = observe(pos, goal, cfg)
            replay.append((obs, act, r, nobs))
            ret += r.item()
        replay = replay[-256:]
        ep_returns.append(ret)
        idx = torch.randint(0, len(replay), (32,), generator=g)
        o = torch.stack([replay[i][0] for i in idx])
        ac = torch.stack([replay[i][1] for i in idx])
        rw = torch.stack([replay[i][2] for i in idx])
        no = torch.stack([replay[i][3] for i in idx])
        with torch.no_grad():
            na = torch.stack([F.softmax(actors[k](no[:, k]), -1) for k in range(len(names))], 1)
            y = rw + gamma * target(no, na)
        loss = F.mse_loss(critic(o, ac), y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"critic loss is {loss.item()} at step {step} (rank {rank}); "
                                     f"reward scale {cfg['_reward_scale']}, tau {tau}")
        copt.zero_grad()
        loss.backward()
        copt.step()
        pa = torch.stack([F.softmax(actors[k](o[:, k]), -1) for k in range(len(names))], 1)
        aloss = -critic.module(o, pa).mean()
        aopt.zero_grad()
        aloss.backward()
        for p in actors.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        aopt.step()
        with torch.no_grad():
            for tp, p in zip(target.parameters(), critic.module.parameters()):
                tp.mul_(1 - tau).add_(tau * p)
        if a.fault in ("sloweval", "abort", "exit2") and bad and step == 2:
            if a.fault == "sloweval":
                say(f"rank {rank} step {step}: evaluation rollout over 20000 episodes")
                for _ in range(20000):
                    time.sleep(0.05)
            elif a.fault == "abort":
                os.kill(os.getpid(), signal.SIGABRT)
            else:
                err(f"ERROR rank {rank}: replay shard {WORK}/replay/shard_{rank}.pt is corrupt "
                    f"(transition 117 has 2 agents, expected {len(names)}); cannot continue")
                os._exit(2)
        mean_ret = torch.tensor([ret])
        dist.all_reduce(mean_ret)
        say(f"rank {rank} step {step} loss {loss.item():.4f} actor {aloss.item():.4f} "
            f"return {mean_ret.item() / world:.3f}")

    n_ep = len(ep_returns) + (1 if (a.fault == "retlen" and bad) else 0)
    mine = torch.tensor((ep_returns + [ep_returns[-1]])[:n_ep])
    allr = [torch.zeros(len(ep_returns)) for _ in range(world)]
    dist.all_gather(allr, mine)
    if rank == 0:
        team = torch.stack(allr).mean().item()
        say(f"team return {team:.3f} over {world * len(ep_returns)} episodes")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    a = p.parse_args()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
    else:
        worker(int(os.environ.get("LOCAL_RANK", 0)), a)


if __name__ == "__main__":
    main()

"""A two-hundred-and-eighth hand-run batch: A2C WITH PARALLEL ENVIRONMENTS.

An advantage actor-critic agent: every rank steps a hand-vectorised set of toy "reach the goal" point-mass
environments (obs dim 4: position, velocity, goal, time; 3 actions), reads its environment config from
/tmp/fault208_work/envs/pointmass_rR.json (written beforehand by `--prep 1`), collects n-step rollouts,
computes bootstrapped n-step returns, and trains a small shared actor-critic MLP with a policy loss, a value
loss and an entropy bonus.  Gradients are averaged with DDP (or with a hand-written all_reduce when --ddp 0);
rank 0 writes the initial policy snapshot that every rank loads, and saves a snapshot every few updates.
Finished-episode returns are all_gathered for the log, the mean loss all_reduced.

Faults:
  obsshape   - rank N: env 3 appends the previous action to its observation (5 values): torch.stack error
  valinf     - rank N reads reward_scale 1e39: n-step value targets become inf, the program's check raises
  nenvstr    - every rank: num_envs taken from the environment as a string (TypeError)
  envcfg     - rank N opens envs/pointmass_r0N.json (zero-padded), which is not there (FileNotFoundError)
  gamma      - rank N reads gamma 1.01: the program's ValueError about the discount factor
  statlen    - rank N all_gathers its episode statistics without the last env (gloo size mismatch)
  snaphidden - rank N builds hidden size 48 and loads rank 0's 32-wide snapshot (size mismatch)
  noreset    - rank N's environments never reset; it steps --stall seconds before the gradient all_reduce
  cfgkey     - every rank: the config asks for "entropy_coef" but the file has "ent_coef" (KeyError)
  sigkill    - rank N sends itself SIGKILL after update 3
  exit2      - rank N prints its own error line about a degenerate policy and exits with code 2
  none       - control, clean run

What happened (filled in after the runs):
  obsshape   - rank N: RuntimeError stack expects each tensor to be equal size ([4] vs [5] at entry 3); peers closed
  valinf     - rank N: FloatingPointError n-step value targets not finite at update 0 (max |R| = inf); peers closed
  nenvstr    - every rank: TypeError 'str' object cannot be interpreted as an integer (range(num_envs))
  envcfg     - rank N: FileNotFoundError .../envs/pointmass_r0N.json before the barrier; peers closed
  gamma      - rank N: ValueError discount factor gamma=1.01 must be in (0, 1]; peers closed in the barrier
  statlen    - with DETAIL: every rank "Detected mismatch between collectives" (rank N ALLGATHER TensorShape=[3])
  snaphidden - rank N: load_state_dict size mismatch [32, 4] from checkpoint vs [48, 4] in the model
  noreset    - rank N sleeps: rank 0 Timed out waiting 12000ms (PG 12 s); with PG 300 s killed by timeout 60 (124)
  cfgkey     - every rank: KeyError 'entropy_coef' right after the config is read
  sigkill    - rank N exitcode -9 (SIGKILL) after update 3; peers Connection reset by peer
  exit2      - rank N ERROR line, exit 2; --max-restarts 1 retry died in Gloo connectFullMesh Connect timeout
  none       - clean, exit 0, rank 0 saved final snapshot policy_final.pt
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault208_work"


class PointMass:
    """Move a point toward a goal on a line; actions: left, stay, right."""

    def __init__(self, seed, extra_obs=False, horizon=12):
        self.g = torch.Generator().manual_seed(seed)
        self.extra_obs = extra_obs
        self.horizon = horizon
        self.last_action = 1
        self.reset()

    def reset(self):
        self.x = float(torch.rand(1, generator=self.g) * 2 - 1)
        self.v = 0.0
        self.goal = float(torch.rand(1, generator=self.g) * 2 - 1)
        self.t = 0
        return self.obs()

    def obs(self):
        o = [self.x, self.v, self.goal, self.t / self.horizon]
        if self.extra_obs:
            o.append(float(self.last_action))
        return torch.tensor(o)

    def step(self, a):
        self.last_action = a
        self.v = 0.8 * self.v + 0.1 * (a - 1)
        self.x = max(-1.5, min(1.5, self.x + self.v))
        self.t += 1
        dist_goal = abs(self.x - self.goal)
        reward = -dist_goal + (1.0 if dist_goal < 0.05 else 0.0)
        done = self.t >= self.horizon or dist_goal < 0.05
        return self.obs(), reward, done


class ActorCritic(nn.Module):
    def __init__(self, obs_dim=4, hidden=32, n_actions=3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.pi = nn.Linear(hidden, n_actions)
        self.v = nn.Linear(hidden, 1)

    def forward(self, obs):
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


def load_config(rank, fault, fault_rank):
    name = f"pointmass_r{rank}.json"
    if fault == "envcfg" and rank == fault_rank:
        name = f"pointmass_r{rank:02d}.json"
    with open(os.path.join(WORK, "envs", name)) as f:
        cfg = json.load(f)
    if fault == "nenvstr":
        cfg["num_envs"] = os.environ.get("A2C_NUM_ENVS", "4")
    else:
        cfg["num_envs"] = int(os.environ.get("A2C_NUM_ENVS", cfg["num_envs"]))
    if fault == "valinf" and rank == fault_rank:
        cfg["reward_scale"] = 1e39
    if fault == "gamma" and rank == fault_rank:
        cfg["gamma"] = 1.01
    return cfg


def nstep_returns(rewards, dones, last_value, gamma):
    ret = last_value
    out = []
    for r, d in zip(reversed(rewards), reversed(dones)):
        ret = r + gamma * ret * (1.0 - d)
        out.append(ret)
    return torch.stack(list(reversed(out)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--nsteps", type=int, default=5)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--stall", type=float, default=30)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prep", type=int, default=0)
    a = p.parse_args()

    if a.prep:
        os.makedirs(os.path.join(WORK, "envs"), exist_ok=True)
        for r in range(8):
            cfg = {"env": "pointmass", "num_envs": 4, "horizon": 12, "gamma": 0.97, "reward_scale": 1.0,
                   "ent_coef": 0.01, "value_coef": 0.5, "lr": 3e-3, "seed": 100 + r}
            with open(os.path.join(WORK, "envs", f"pointmass_r{r}.json"), "w") as f:
                json.dump(cfg, f)
        print("wrote env configs for ranks 0-7")
        return

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fr = a.rank if a.rank >= 0 else rank
    cfg = load_config(rank, a.fault, fr)
    if not (0.0 < cfg["gamma"] <= 1.0):
        raise ValueError(f"discount factor gamma={cfg['gamma']} must be in (0, 1] (rank {rank})")
    coef_key = "entropy_coef" if a.fault == "cfgkey" else "ent_coef"
    ent_coef = cfg[coef_key]
    envs = [PointMass(cfg["seed"] * 10 + i, extra_obs=(a.fault == "obsshape" and rank == fr and i == 3),
                      horizon=cfg["horizon"]) for i in range(cfg["num_envs"])]
    n_envs = len(envs)
    hidden = 48 if (a.fault == "snaphidden" and rank == fr) else 32
    print(f"rank {rank}/{world} {n_envs} envs gamma {cfg['gamma']} hidden {hidden}", flush=True)

    model = ActorCritic(hidden=hidden)
    snap_dir = os.path.join(WORK, "snap")
    if rank == 0:
        os.makedirs(snap_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(snap_dir, "policy_init.pt"))
    dist.barrier()
    model.load_state_dict(torch.load(os.path.join(snap_dir, "policy_init.pt")))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])

    obs = torch.stack([e.reset() for e in envs])
    ep_ret = [0.0] * n_envs
    finished = torch.zeros(n_envs)
    for upd in range(a.updates):
        logps, values, ents, rewards, dones = [], [], [], [], []
        for _ in range(a.nsteps):
            logits, value = net(obs)
            dist_a = torch.distributions.Categorical(logits=logits)
            act = dist_a.sample()
            logps.append(dist_a.log_prob(act))
            ents.append(dist_a.entropy())
            values.append(value)
            nxt, rs, ds = [], [], []
            for i, e in enumerate(envs):
                o, r, d = e.step(int(act[i]))
                ep_ret[i] += r
                if d:
                    finished[i] = ep_ret[i]
                    ep_ret[i] = 0.0
                    o = e.reset()
                nxt.append(o)
                rs.append(r * cfg["reward_scale"])
                ds.append(float(d))
            obs = torch.stack(nxt)
            rewards.append(torch.tensor(rs))
            dones.append(torch.tensor(ds))
        with torch.no_grad():
            _, last_v = net(obs)
        returns = nstep_returns(rewards, dones, last_v, cfg["gamma"])
        if not torch.isfinite(returns).all():
            raise FloatingPointError(f"rank {rank}: n-step value targets not finite at update {upd} "
                                     f"(max |R| = {returns.abs().max().item()}, reward_scale {cfg['reward_scale']})")
        values_t = torch.stack(values)
        adv = returns - values_t.detach()
        loss = (-(torch.stack(logps) * adv).mean() + cfg["value_coef"] * (returns - values_t).pow(2).mean()
                - ent_coef * torch.stack(ents).mean())
        if a.fault == "noreset" and rank == fr and upd == 2:
            print(f"rank {rank}: envs have not reset for {a.nsteps * 3} steps; stepping until episodes end", flush=True)
            time.sleep(a.stall)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        stats = finished[:-1].clone() if (a.fault == "statlen" and rank == fr) else finished.clone()
        gathered = [torch.zeros(n_envs) for _ in range(world)]
        dist.all_gather(gathered, stats)
        mean_ret = torch.cat(gathered).mean().item()
        print(f"rank {rank} step {upd} loss {lt.item() / world:.4f} mean_episode_return {mean_ret:.3f}", flush=True)
        if rank == 0 and upd % 3 == 2:
            torch.save(model.state_dict(), os.path.join(snap_dir, f"policy_u{upd}.pt"))
            print(f"rank 0 saved snapshot {snap_dir}/policy_u{upd}.pt", flush=True)
        if a.fault == "sigkill" and rank == fr and upd == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    if a.fault == "exit2" and rank == fr:
        print(f"ERROR rank {rank}: snapshot validation failed on {n_envs} envs: greedy policy never reached the goal "
              f"(entropy {torch.stack(ents).mean().item():.3f}); refusing to publish snapshot", flush=True)
        sys.exit(2)
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(snap_dir, "policy_final.pt"))
        print(f"rank 0 saved final snapshot {snap_dir}/policy_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

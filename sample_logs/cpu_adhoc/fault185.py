"""A hundred-and-eighty-fifth hand-run batch: PROXIMAL POLICY OPTIMISATION.

A small PPO agent on a hand-written toy environment (no gym): a 1-D cart that must stay near the origin
(obs: position, velocity, position squared; two actions: push left / push right; reward -|position|;
episodes of --ep-len steps, reset to the configured start).  Each rank reads its env seed from
envs/seed_rR.txt, collects a rollout of --horizon steps, computes GAE advantages, normalises them, and runs
clipped-surrogate epochs over minibatches with an actor-critic MLP wrapped in DDP on gloo (or --ddp 0:
gradients all_reduced by hand).  Rollout lengths are all_gathered, episode returns all_reduced for the
`rank R step S loss L` lines, and after every epoch the approximate KL is all_reduced: all ranks stop the
epochs together once the mean KL exceeds the target.  Rank 0 saves the policy to --save at the end.

Faults:
  stdzero   - rank N's env config has ep_len 1: every step is the reset state, the advantages are all equal
  badaction - rank N stores 1-based actions in its rollout buffer; Categorical(validate_args) rejects them
  logpshape - every rank gathers the log-probs with a 1-D action index (a shape bug in the update)
  klearly   - rank N stops its epochs on its own KL (no all_reduce) and runs --busy seconds of evaluation
  lenmis    - rank N all_gathers its rollout lengths with one extra count (the bootstrap step)
  ckpthid   - rank N initialises the policy from a checkpoint saved with hidden size 128 (not 64)
  cfgkey    - every rank's config spells the GAE key 'gae_lamda' (KeyError)
  seedmiss  - rank N reads its env seed from a node-local dir that was never synced (FileNotFoundError)
  zerodiv   - rank N's env never ends an episode; its episode statistics divide by zero finished episodes
  sigsegv   - rank N gets SIGSEGV (sent to itself) in iteration 1
  exit3     - rank N prints its own 'entropy collapsed' error line and exits with code 3
  none      - control, clean run

What happened (filled in after the runs):
  stdzero   - rank N: FloatingPointError normalised advantages are not finite (std nan); DETAIL: monitoredBarrier
  badaction - rank N: ValueError Expected value argument ... within the support (IntegerInterval 0..1)
  logpshape - every rank: RuntimeError Index tensor must have the same number of dimensions as input tensor
  klearly   - busy 40 s: peers gloo 'Timed out waiting 12000ms'; busy 1000 s / PG 300 s: timeout 60, exit 124
  lenmis    - a receiving rank aborts on gloo EnforceNotMet 'Received data size doesn't match' (SIGABRT)
  ckpthid   - rank N: RuntimeError loading state_dict: size mismatch for body.0.weight [128, 3] vs [64, 3]
  cfgkey    - every rank: KeyError 'gae_lambda' in the GAE call after the first rollout
  seedmiss  - rank N: FileNotFoundError node_cache/envs/seed_rN.txt; restart run dies in connectFullMesh
  zerodiv   - rank N: ZeroDivisionError division by zero in sum(ep_rets) / len(ep_rets)
  sigsegv   - rank N: exitcode -11 (SIGSEGV) at iteration 1; peers Connection reset by peer
  exit3     - rank N: prints its ERROR entropy collapsed line, exitcode 3
  none      - clean, exit 0, rank 0 saved ckpt/ppo_policy.pt
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--horizon", type=int, default=32)
    p.add_argument("--ep-len", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--target-kl", type=float, default=0.5)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--busy", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--init-policy", default="")
    p.add_argument("--save", default="/tmp/fault185_work/ckpt/ppo_policy.pt")
    return p.parse_args()


class ActorCritic(nn.Module):
    def __init__(self, obs_dim=3, n_act=2, hidden=64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.pi = nn.Linear(hidden, n_act)
        self.v = nn.Linear(hidden, 1)

    def forward(self, obs):
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


class Cart:
    def __init__(self, seed, ep_len, start=0.5):
        self.g = torch.Generator().manual_seed(seed)
        self.ep_len, self.start = ep_len, start
        self.reset()

    def reset(self):
        self.pos, self.vel, self.t = self.start, 0.0, 0
        return self.obs()

    def obs(self):
        return torch.tensor([self.pos, self.vel, self.pos ** 2])

    def step(self, a):
        r = -abs(self.pos)
        self.vel = 0.9 * self.vel + 0.05 * (2 * a - 1) + 0.01 * torch.randn(1, generator=self.g).item()
        self.pos = max(-2.0, min(2.0, self.pos + self.vel))
        self.t += 1
        done = self.t >= self.ep_len
        return r, done


def collect(model, env, horizon, rank, one_based):
    obs, acts, logps, rews, dones, vals, ep_rets, ret = [], [], [], [], [], [], [], 0.0
    o = env.obs()
    with torch.no_grad():
        for _ in range(horizon):
            logits, v = model(o[None])
            d = Categorical(logits=logits[0])
            a = d.sample()
            r, done = env.step(int(a))
            obs.append(o); acts.append(a + 1 if one_based else a); logps.append(d.log_prob(a))
            rews.append(r); dones.append(float(done)); vals.append(v[0]); ret += r
            if done:
                ep_rets.append(ret); ret = 0.0
                o = env.reset()
            else:
                o = env.obs()
        _, last_v = model(o[None])
    return (torch.stack(obs), torch.stack(acts), torch.stack(logps), torch.tensor(rews), torch.tensor(dones),
            torch.stack(vals), last_v[0], ep_rets)


def gae(rews, dones, vals, last_v, gamma, lam):
    adv = torch.zeros_like(rews)
    nxt_v, run = last_v, 0.0
    for t in reversed(range(len(rews))):
        nonterm = 1.0 - dones[t]
        delta = rews[t] + gamma * nxt_v * nonterm - vals[t]
        run = delta + gamma * lam * nonterm * run
        adv[t] = run
        nxt_v = vals[t]
    return adv, adv + vals


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank in (-1, rank)
    f = a.fault
    torch.manual_seed(0)
    os.makedirs("envs", exist_ok=True)
    with open(f"envs/seed_r{rank}.txt", "w") as fh:
        fh.write(str(1000 + 17 * rank))
    cfg = {"gamma": 0.99, "gae_lambda": 0.95, "clip": 0.2, "ep_len": a.ep_len, "vf_coef": 0.5, "ent_coef": 0.01}
    if f == "stdzero" and hit:
        cfg["ep_len"] = 1
    if f == "zerodiv" and hit:
        cfg["ep_len"] = 10 ** 6
    if f == "cfgkey" and hit:
        cfg["gae_lamda"] = cfg.pop("gae_lambda")
    seed_dir = "/tmp/fault185_work/node_cache/envs" if f == "seedmiss" and hit else "envs"
    with open(os.path.join(seed_dir, f"seed_r{rank}.txt")) as fh:
        seed = int(fh.read())
    env = Cart(seed, cfg["ep_len"])
    print(f"rank {rank}: env seed {seed} ep_len {cfg['ep_len']} horizon {a.horizon}", flush=True)
    hidden = a.hidden
    model = ActorCritic(hidden=hidden)
    init = "/tmp/fault185_work/ckpt/ppo_policy_h128.pt" if f == "ckpthid" and hit else a.init_policy
    if init:
        model.load_state_dict(torch.load(init, map_location="cpu"))
        print(f"rank {rank}: policy initialised from {init}", flush=True)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    step = 0
    for it in range(a.iters):
        if f == "sigsegv" and hit and it == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        ob, ac, old_lp, rw, dn, vl, last_v, ep_rets = collect(model, env, a.horizon, rank, f == "badaction" and hit)
        n = torch.tensor([len(rw)] * (2 if f == "lenmis" and hit else 1))
        lens = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(lens, n)
        adv, ret = gae(rw, dn, vl, last_v, cfg["gamma"], cfg["gae_lambda"])
        adv = (adv - adv.mean()) / adv.std()
        if not torch.isfinite(adv).all():
            raise FloatingPointError(f"rank {rank}: normalised advantages are not finite at iteration {it} "
                                     f"(adv std {adv.std().item()}, {len(rw)} steps)")
        mb = len(rw) // a.minibatches
        stop = False
        for ep in range(a.epochs):
            kls = []
            for b in range(a.minibatches):
                sl = slice(b * mb, (b + 1) * mb)
                logits, v = net(ob[sl])
                if f == "logpshape" and hit:
                    lp = logits.log_softmax(-1).gather(1, ac[sl])
                else:
                    lp = Categorical(logits=logits, validate_args=True).log_prob(ac[sl])
                ratio = (lp - old_lp[sl]).exp()
                s1, s2 = ratio * adv[sl], ratio.clamp(1 - cfg["clip"], 1 + cfg["clip"]) * adv[sl]
                ent = Categorical(logits=logits).entropy().mean()
                loss = -torch.min(s1, s2).mean() + cfg["vf_coef"] * (ret[sl] - v).pow(2).mean() \
                    - cfg["ent_coef"] * ent
                opt.zero_grad()
                loss.backward()
                if not a.ddp:
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad /= world
                opt.step()
                kls.append((old_lp[sl] - lp).mean().item())
                if f == "klearly" and hit and it == 1 and kls[-1] > -1.0:
                    print(f"rank {rank}: approx KL {kls[-1]:.4f} > target 0.0000 at epoch {ep}, "
                          f"stopping updates; running evaluation episodes", flush=True)
                    stop = True
                    t0 = time.time()
                    while time.time() - t0 < a.busy:
                        env.step(0); time.sleep(0.5)
                    break
                print(f"rank {rank} step {step} loss {loss.item():.4f} ent {ent.item():.3f}", flush=True)
                step += 1
            if stop:
                break
            kl = torch.tensor(sum(kls) / len(kls))
            dist.all_reduce(kl)
            if kl.item() / world > a.target_kl:
                print(f"rank {rank}: mean KL {kl.item() / world:.4f} > {a.target_kl}, early stop", flush=True)
                break
        mean_ret = sum(ep_rets) / len(ep_rets)
        r = torch.tensor([mean_ret, float(sum(int(x) for x in lens))])
        dist.all_reduce(r)
        if rank == 0:
            print(f"iter {it}: mean episode return {r[0].item() / world:.3f} over {int(r[1].item())} steps",
                  flush=True)
        if f == "exit3" and hit and it == 1:
            print(f"ERROR rank {rank}: policy entropy collapsed to 0.0000 (< 0.01) at iteration {it}; "
                  f"aborting this worker", flush=True)
            sys.exit(3)
    if rank == 0:
        os.makedirs(os.path.dirname(a.save), exist_ok=True)
        torch.save(model.state_dict(), a.save)
        print(f"rank 0: saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-second hand-run batch: REINFORCEMENT-LEARNING-STYLE ROLLOUT LOOPS. Each rank runs a toy 1-D random
walk (cells 0..size-1, start in the middle, +1 at the goal cell size-1, -1 in the pit cell 0, -0.01 a step, episodes
also end after 40 steps) for --horizon (48) steps per update with a tiny policy (Linear(4,16)-Tanh-Linear(16,3): actions
left/stay/right, Categorical over the logits, 10% uniform exploration), then the ranks train together on gloo:
discounted returns per episode segment, advantages normalised with an all_reduce of [sum, sum of squares, count], a
REINFORCE loss with a finite-loss check, gradients averaged by DDP (or a hand all_reduce with --ddp 0), the last
4 finished episodes' returns gathered for logging. Prints `rank R update U rollout steps T episodes E reward S`, then
`rank R update U ret X loss L window W`.
--rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none        control: every update, `rank R done` at the end (exit 0)
  emptyroll   rank N's actor has an env-step quota of --at*horizon steps; from update --at its rollout is empty and
              torch.cat of its (empty) list of episode-segment returns raises RuntimeError
  emptymean   rank N's walk has 61 cells (the others 9) and no step limit: it finishes no episode in an update and
              its mean-return line divides by zero (ZeroDivisionError)
  badaction   rank N's exploration draws random.randint(0, 3) (inclusive): the env's action check raises ValueError
  actidx      the same with the env's check off (--fast-env on rank N): IndexError in the env's move table
  catneg      rank N adds Gaussian exploration noise to the action probabilities and renormalises:
              Categorical(probs=...) raises ValueError (Simplex) on a negative probability
  nanobs      at update --at rank N's position sensor drops out and reads NaN: Categorical(logits=...) raises
              ValueError on rank N
  logreward   rank N's env shapes the reward with -log(distance to goal / size): reaching the goal gives inf; the
              advantage all_reduce spreads inf/NaN to every rank and every rank's finite-loss check raises
  lognocheck  the same with the loss check off: NaN gradients are averaged into every rank's policy and every rank's
              next Categorical(logits=...) raises ValueError
  replay      every rank samples a replay batch of 64 finished-episode transitions at update --at; rank N's replay
              capacity is 48 (a memory-capped actor): random.sample raises ValueError
  gatherlen   rank N's return window keeps 8 episodes (the others 4): the returns all_gather has different lengths
  extraupdate the ranks loop until their env-step counter reaches --total; rank N's counter skips terminal
              transitions, so it runs extra updates while the others wait in the final barrier
  actorthread rollouts come from an actor thread through a queue; rank N's actor raises KeyError at update --at
              (its reward-table lookup) and its learner waits in queue.get() forever; peers time out
  stall       rank N's actor thread stops quietly at update --at (its quota done); its learner waits in queue.get()
              (no timeout) and the peers wait in the next all_reduce (run stopped from outside)
"""
import argparse, collections, datetime, math, os, queue, random, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
from torch.distributions import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--updates", type=int, default=8)
p.add_argument("--horizon", type=int, default=48)
p.add_argument("--total", type=int, default=384)
p.add_argument("--at", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--workdir", default="/tmp/fault102_work")
a = p.parse_args()
N_ACT, OBS, GAMMA = 3, 4, 0.97
MOVES = (-1, 0, 1)


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Walk:
    def __init__(self, rank: int, size: int = 9, max_len: int = 40, check: bool = True, shaped: bool = False):
        self.rank, self.size, self.max_len, self.check, self.shaped = rank, size, max_len, check, shaped
        self.rng = random.Random(f"walk-{a.seed}-{rank}")
        self.update = 0
        self.reset()

    def reset(self):
        self.pos, self.t, self.ret = self.size // 2, 0, 0.0
        return self.obs()

    def obs(self):
        pos = self.pos / (self.size - 1)
        if faulty(self.rank, "nanobs") and self.update >= a.at and self.t >= 5:
            pos = float("nan")  # the position sensor dropped out
        return [pos, self.t / self.max_len if self.max_len else 0.0, self.rng.random() * 0.1, 1.0]

    def step(self, action: int):
        if self.check and not 0 <= action < N_ACT:
            raise ValueError(f"Walk.step: invalid action {action}, expected 0..{N_ACT - 1}")
        self.pos = min(self.size - 1, max(0, self.pos + MOVES[action]))
        self.t += 1
        r = -0.01
        if self.shaped:
            d = torch.tensor((self.size - 1 - self.pos) / self.size)
            r += float(-0.1 * torch.log(d))
        done = False
        if self.pos == self.size - 1:
            r, done = r + 1.0, True
        elif self.pos == 0:
            r, done = r - 1.0, True
        elif self.max_len and self.t >= self.max_len:
            done = True
        self.ret += r
        return self.obs(), r, done


def make_env(rank):
    if faulty(rank, "emptymean"):
        return Walk(rank, size=61, max_len=0)
    return Walk(rank, check=not faulty(rank, "actidx"), shaped=faulty(rank, "logreward") or faulty(rank, "lognocheck"))


def act(policy, obs, rank, rng, gen):
    with torch.no_grad():
        logits = policy(torch.tensor(obs, dtype=torch.float32))
        if faulty(rank, "catneg"):
            probs = logits.softmax(-1) + 0.2 * torch.randn(N_ACT, generator=gen)
            probs = probs / probs.sum()
            d = Categorical(probs=probs)
        else:
            d = Categorical(logits=logits)
    if rng.random() < 0.1:  # explore
        if faulty(rank, "badaction") or faulty(rank, "actidx"):
            return rng.randint(0, N_ACT)
        return rng.randrange(N_ACT)
    return int(d.sample())


def collect(env, policy, rank, rng, gen, quota):
    """--horizon steps (fewer when the quota runs out): obs, actions, and rewards split in episode segments."""
    obs_l, act_l, segs, seg, finished = [], [], [], [], []
    o = env.obs()
    for _ in range(min(a.horizon, quota)):
        u = act(policy, o, rank, rng, gen)
        o2, r, done = env.step(u)
        obs_l.append(o); act_l.append(u); seg.append(r)
        o = o2
        if done:
            finished.append(env.ret)
            segs.append(seg); seg = []
            o = env.reset()
    if seg:
        segs.append(seg)
    return obs_l, act_l, segs, finished


def discount(rews):
    out, g = [], 0.0
    for r in reversed(rews):
        g = r + GAMMA * g
        out.append(g)
    return torch.tensor(out[::-1], dtype=torch.float32)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(OBS, 16), nn.Tanh(), nn.Linear(16, N_ACT))
    model = DDP(policy) if a.ddp else policy
    if not a.ddp:
        for prm in policy.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(policy.parameters(), lr=0.01)
    env = make_env(rank)
    rng = random.Random(f"explore-{a.seed}-{rank}")
    gen = torch.Generator().manual_seed(1000 + rank)
    torch.manual_seed(1000 + rank)
    window = collections.deque([0.0] * (8 if faulty(rank, "gatherlen") else 4),
                               maxlen=8 if faulty(rank, "gatherlen") else 4)
    buffer = []
    quota = a.at * a.horizon if faulty(rank, "emptyroll") else 10**9
    threaded = a.fault in ("actorthread", "stall")
    q = queue.Queue(maxsize=1)
    reward_bonus = {"goal": 1.0, "pit": -1.0}

    def actor():
        nonlocal quota
        for u in range(a.updates):
            env.update = u
            if faulty(rank, "stall") and u == a.at:
                return  # quota done: the actor stops
            roll = collect(env, policy, rank, rng, gen, quota)
            if faulty(rank, "actorthread") and u == a.at:
                roll[2][-1][-1] += reward_bonus["timeout"]  # bonus for a truncated episode
            q.put(roll)

    if threaded:
        threading.Thread(target=actor, name=f"actor-{rank}", daemon=True).start()
    print(f"rank {rank}/{world} pid {os.getpid()} env size {env.size} fault {a.fault}", flush=True)
    u, steps = 0, 0
    while (u < a.updates) if a.fault != "extraupdate" else (steps < a.total):
        env.update = u
        if threaded:
            obs_l, act_l, segs, finished = q.get()
        else:
            obs_l, act_l, segs, finished = collect(env, policy, rank, rng, gen, quota)
        quota -= len(obs_l)
        if faulty(rank, "extraupdate"):
            steps += len(obs_l) - len(finished)  # terminal transitions are not counted
        else:
            steps += len(obs_l)
        n_done = sum(len(s) for s in segs[:len(finished)])  # transitions of finished episodes go to the replay
        buffer.extend(zip(obs_l[:n_done], act_l[:n_done]))
        buffer = buffer[-(48 if faulty(rank, "replay") else 4096):]  # rank-local replay capacity
        print(f"rank {rank} update {u} rollout steps {len(obs_l)} episodes {len(finished)} "
              f"reward {sum(map(sum, segs)):.3f}", flush=True)
        ret = torch.cat([discount(s) for s in segs])
        stats = torch.stack([ret.sum(), (ret ** 2).sum(), torch.tensor(float(len(ret)))])
        dist.all_reduce(stats)
        mean = stats[0] / stats[2]
        std = (stats[1] / stats[2] - mean ** 2).clamp_min(0).sqrt() + 1e-8
        adv = (ret - mean) / std
        obs = torch.tensor(obs_l, dtype=torch.float32).reshape(-1, OBS)
        acts = torch.tensor(act_l, dtype=torch.long)
        if a.fault == "replay" and u == a.at:
            # off-policy auxiliary batch after a warm-up of --at updates
            batch = random.sample(buffer, 64)
        dist_ = Categorical(logits=model(obs))
        loss = -(dist_.log_prob(acts) * adv).mean()
        if a.fault != "lognocheck" and not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} update {u}: loss is {loss.item()}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in policy.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        window.extend(finished)
        ep_ret = sum(finished) / len(finished)
        rets = torch.tensor(list(window))
        got = [torch.zeros_like(rets) for _ in range(world)]
        dist.all_gather(got, rets)
        print(f"rank {rank} update {u} ret {ep_ret:.3f} loss {loss.item():.4f} window {torch.cat(got).mean().item():.3f}", flush=True)
        u += 1
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A two-hundred-and-seventy-fourth hand-run batch: PPO ON A GRIDWORLD.

A vectorised 7x7 gridworld in torch (16 environments per rank, walls from a map layout file, a goal cell,
reward 1 at the goal and -0.01 per step, episodes cut at 30 steps), an actor-critic MLP (one-hot x/y
observation 14 -> hidden 64 -> 4 actions, and a critic 14 -> 64 -> 1 warm-started from ckpt/critic_h64.pt),
rollouts of 16 steps, generalised advantage estimation (gamma 0.97, lambda 0.95), per-minibatch advantage
normalisation, the clipped surrogate loss, DDP (gloo) over the actor-critic, the mean episode return all_reduced
and the per-rank episode returns all_gathered for the log, then barrier and destroy_process_group. Map names come
from a small registry; the layouts live in /tmp/job_work/maps/<file>.txt and are written by --prep 1.
Launch: torchrun, a bash loop (env://), torch.distributed.launch, or --spawn N (torch.multiprocessing.spawn).

Faults:
- actidx: from update 2 rank N draws exploration actions with randint(0, 5) for a 4-action head (IndexError).
- advnan: rank N reads a minibatch size of 1; the advantage std of one sample is nan and the check raises.
- retgather: rank N all_gathers its episode returns plus the cut episode (another length) at update 1.
- nomap: rank N looks for its layout in maps_v2/, which does not exist (FileNotFoundError at startup).
- badmap: rank N's curriculum names the map "fourrooms", which is not in the registry (KeyError at startup).
- obswidth: every rank appends the goal one-hot to the observation (28 wide) for a 14-wide policy input.
- critckpt: rank N loads ckpt/critic_h128.pt (hidden 128) into the hidden-64 critic (size mismatch).
- slowroll: rank N rolls out update 2 step by step with Python lists for --stall seconds (others wait).
- sigkill: rank N sends itself SIGKILL after update 2's optimizer step.
- exit2: rank N prints its own error line about a goal inside a wall and calls sys.exit(2) at update 1.
- none: control.

What happened (filled in after the runs):
- actidx: IndexError: index 4 is out of bounds for dimension 1 with size 4 on rank N at update 2 (ppog_actidx_np4_r1_ranklabel, _np3_r2_spawn).
- advnan: std warning, then FloatingPointError 'non-finite normalised advantages at update 0 (minibatch of 1, std nan)' on rank N (ppog_advnan_np3_r2_srunlabel, _np4_r0_logfmt).
- retgather: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (17), got (16))' on rank N; peers closed (ppog_retgather_np3_r1_mpitag, _np4_r3_files).
- nomap: FileNotFoundError for /tmp/job_work/maps_v2/open_7.txt on rank N at startup (ppog_nomap_np3_r0_spawn, ppog_nomap_np4_r3_logfmt).
- badmap: KeyError: 'fourrooms' on rank N at startup (ppog_badmap_np3_r2_legacy, ppog_badmap_np4_r1_mpitag).
- obswidth: every rank: 'mat1 and mat2 shapes cannot be multiplied (16x28 and 14x64)' (ppog_obswidth_np3_rall_logfmt, _np4_rall_spawn).
- critckpt: size mismatch for 0.weight [128, 14] vs [64, 14] on rank N (ppog_critckpt_np3_r1_files, ppog_critckpt_np4_r2_tee).
- slowroll: PG 12 s: peers 'Timed out waiting 12000ms' (ppog_slowroll_np3_r2_tee); PG 300 s: killed at 60 s, exit 124 (_np3_r1_ranklabel).
- sigkill: rank N SIGKILL, no traceback; Root Cause -9 (ppog_sigkill_np4_r1_pdsh2, ppog_sigkill_np3_r0_legacy).
- exit2: 'ERROR rank N: map ... puts the goal [6, 6] inside a wall ...' then exit 2; peers closed (ppog_exit2_np3_r1_bashloop, _np4_r3_srunlabel).
- none: exit 0, 'rank 0 done: 5 updates, mean return -0.300' (ppog_none_np3_rnone_bashloop).
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault274_work"
G, ENVS, HORIZON, N_ACT, MAX_T = 7, 16, 16, 4, 30
MOVES = torch.tensor([[0, 1], [0, -1], [1, 0], [-1, 0]])
REGISTRY = {"open": "open_7.txt", "four_rooms": "four_rooms_7.txt", "corridor": "corridor_7.txt"}

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--updates", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--stall", type=int, default=40)
p.add_argument("--logfmt", type=int, default=0)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--port", type=int, default=29500)
p.add_argument("--prep", type=int, default=0)


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class ActorCritic(nn.Module):
    def __init__(self, obs_dim=2 * G, hidden=64):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, N_ACT))
        self.critic = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, obs):
        return self.actor(obs), self.critic(obs).squeeze(-1)


def prep():
    os.makedirs(f"{WORK}/maps", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    layouts = {"open": [], "four_rooms": [(3, c) for c in (0, 1, 2, 4, 5, 6)], "corridor": [(r, 3) for r in range(1, 7)]}
    for name, walls in layouts.items():
        rows = [["#" if (r, c) in walls else "." for c in range(G)] for r in range(G)]
        rows[G - 1][G - 1] = "G"
        with open(f"{WORK}/maps/{REGISTRY[name]}", "w") as f:
            f.write("\n".join("".join(r) for r in rows) + "\n")
    torch.manual_seed(0)
    for h in (64, 128):
        torch.save(ActorCritic(hidden=h).critic.state_dict(), f"{WORK}/ckpt/critic_h{h}.pt")
    print("prepared maps and critic checkpoints in", WORK)


def load_map(path):
    with open(path) as f:
        rows = [ln.rstrip("\n") for ln in f if ln.strip()]
    walls = torch.tensor([[ch == "#" for ch in r] for r in rows])
    goal = [(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "G"][0]
    return walls, torch.tensor(goal)


class GridEnvs:
    def __init__(self, walls, goal, n, wide_obs=False):
        self.walls, self.goal, self.n, self.wide = walls, goal, n, wide_obs
        self.pos = torch.zeros(n, 2, dtype=torch.long)
        self.t = torch.zeros(n, dtype=torch.long)
        self.ret = torch.zeros(n)

    def obs(self):
        o = [nn.functional.one_hot(self.pos[:, 0], G), nn.functional.one_hot(self.pos[:, 1], G)]
        if self.wide:
            o += [nn.functional.one_hot(self.goal[0].expand(self.n), G), nn.functional.one_hot(self.goal[1].expand(self.n), G)]
        return torch.cat(o, 1).float()

    def step(self, act):
        new = (self.pos + MOVES[act]).clamp(0, G - 1)
        blocked = self.walls[new[:, 0], new[:, 1]]
        self.pos = torch.where(blocked[:, None], self.pos, new)
        at_goal = (self.pos == self.goal).all(1)
        rew = torch.where(at_goal, torch.tensor(1.0), torch.tensor(-0.01))
        self.t += 1
        self.ret += rew
        done = at_goal | (self.t >= MAX_T)
        finished = self.ret[done].tolist()
        self.pos[done] = 0
        self.t[done] = 0
        self.ret[done] = 0
        return rew, done.float(), finished


def main(local=None, nprocs=None, a=None):
    if local is not None:
        os.environ.update(RANK=str(local), LOCAL_RANK=str(local), WORLD_SIZE=str(nprocs),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank in (-1, rank)
    log = print
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s")
        lg = logging.getLogger("ppo")
        lg.addFilter(RankFilter(rank))
        log = lg.info
    torch.manual_seed(4321 + rank)

    map_name = ["open", "four_rooms", "corridor"][rank % 3]
    if a.fault == "badmap" and hit:
        map_name = "fourrooms"
    map_dir = "maps_v2" if (a.fault == "nomap" and hit) else "maps"
    walls, goal = load_map(f"{WORK}/{map_dir}/{REGISTRY[map_name]}")
    envs = GridEnvs(walls, goal, ENVS, wide_obs=(a.fault == "obswidth" and hit))
    log(f"rank {rank}/{world} map {map_name} ({int(walls.sum())} walls, goal {goal.tolist()}), {ENVS} envs")

    net = ActorCritic()
    ck = "critic_h128.pt" if (a.fault == "critckpt" and hit) else "critic_h64.pt"
    net.critic.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    mb_size = 1 if (a.fault == "advnan" and hit) else 64
    recent = []

    for upd in range(a.updates):
        if a.fault == "exit2" and hit and upd == 1:
            print(f"ERROR rank {rank}: map {REGISTRY[map_name]} puts the goal {goal.tolist()} inside a wall after reset "
                  f"of env 5; refusing to train on an unreachable goal", file=sys.stderr, flush=True)
            sys.exit(2)
        obs_l, act_l, logp_l, val_l, rew_l, done_l = [], [], [], [], [], []
        obs = envs.obs()
        for t in range(HORIZON):
            with torch.no_grad():
                logits, v = model(obs)
            act = torch.distributions.Categorical(logits=logits).sample()
            explore = torch.rand(ENVS) < 0.2
            hi = N_ACT + 1 if (a.fault == "actidx" and hit and upd >= 2) else N_ACT
            act = torch.where(explore, torch.randint(0, hi, (ENVS,)), act)
            logp = logits.log_softmax(-1)[torch.arange(ENVS), act]
            if a.fault == "slowroll" and hit and upd == 2 and t == 0:
                log(f"rank {rank} update {upd}: rolling out {ENVS} envs one at a time")
                t0 = time.time()
                while time.time() - t0 < a.stall:
                    _ = [envs.pos[i].tolist() for i in range(ENVS)]
                    time.sleep(0.05)
            rew, done, finished = envs.step(act)
            recent = (recent + finished)[-ENVS:]
            obs_l.append(obs); act_l.append(act); logp_l.append(logp); val_l.append(v); rew_l.append(rew); done_l.append(done)
            obs = envs.obs()
        with torch.no_grad():
            _, last_v = model(obs)
        adv = torch.zeros(HORIZON, ENVS)
        gae = torch.zeros(ENVS)
        for t in reversed(range(HORIZON)):
            nv = last_v if t == HORIZON - 1 else val_l[t + 1]
            delta = rew_l[t] + 0.97 * nv * (1 - done_l[t]) - val_l[t]
            gae = delta + 0.97 * 0.95 * (1 - done_l[t]) * gae
            adv[t] = gae
        ret = (adv + torch.stack(val_l)).flatten()
        b_obs, b_act, b_logp, b_adv = torch.cat(obs_l), torch.cat(act_l), torch.cat(logp_l), adv.flatten()
        perm = torch.randperm(len(b_adv))
        for s in range(0, len(b_adv), mb_size):
            i = perm[s:s + mb_size]
            mb_adv = (b_adv[i] - b_adv[i].mean()) / b_adv[i].std()
            if not torch.isfinite(mb_adv).all():
                raise FloatingPointError(f"rank {rank}: non-finite normalised advantages at update {upd} "
                                         f"(minibatch of {len(i)}, std {b_adv[i].std().item()})")
            logits, v = model(b_obs[i])
            new_logp = logits.log_softmax(-1)[torch.arange(len(i)), b_act[i]]
            ratio = (new_logp - b_logp[i]).exp()
            pg = -torch.min(ratio * mb_adv, ratio.clamp(0.8, 1.2) * mb_adv).mean()
            ent = torch.distributions.Categorical(logits=logits).entropy().mean()
            loss = pg + 0.5 * ((v - ret[i]) ** 2).mean() - 0.01 * ent
            opt.zero_grad()
            loss.backward()
            opt.step()
        if a.fault == "sigkill" and hit and upd == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        mean_ret = torch.tensor([sum(recent) / max(len(recent), 1)])
        dist.all_reduce(mean_ret)
        sent = torch.tensor(recent + [envs.ret.mean().item()] if (a.fault == "retgather" and hit and upd == 1) else recent)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(recent)]))
        gathered = [torch.zeros(int(n)) for n in sizes]
        dist.all_gather(gathered, sent)
        log(f"rank {rank} step {upd} loss {loss.item():.4f} mean return {mean_ret.item() / world:.3f} "
            f"episodes {sum(len(g) for g in gathered)}")
    dist.barrier()
    if rank == 0:
        log(f"rank 0 done: {a.updates} updates, mean return {mean_ret.item() / world:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = p.parse_args()
    if args.prep:
        prep()
    elif args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(main, args=(args.spawn, args), nprocs=args.spawn)
    else:
        main(a=args)

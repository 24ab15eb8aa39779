"""A two-hundred-and-fifty-eighth hand-run batch: PHYSICS SIMULATION SURROGATE WITH A GRAPH NETWORK ON PARTICLES.

Every rank simulates synthetic 2-D particle trajectories (gravity, damping, reflecting walls in the unit box)
for one material, saves them to /tmp/job_work/data/traj_s<shard>.npz and loads them back; a radius graph is
rebuilt at every step; an encode-process-decode message passing network (type embedding + velocity history +
wall distances -> node encoder, relative displacement -> edge encoder, M interaction blocks loaded from
ckpt/processor_mp<M>.pt, an MLP decoder) predicts normalised accelerations; DDP over gloo (or hand all_reduce
with --ddp 0); loss all_reduced each step, per-trajectory particle counts all_gathered, then a validation
rollout whose MSE is all_reduced; barrier; destroy_process_group.

Faults:
  ptype     - rank N's data holds a wall particle of type 3; the type embedding has 3 rows (IndexError)
  velstd    - rank N's trajectories are frozen (no gravity); velocity std 0 -> NaN loss, the check raises
  counts    - rank N keeps an empty padding trajectory: 5 counts all_gathered against 4 elsewhere
  trajfile  - rank N computes its shard as rank + world (an epoch offset), the file does not exist
  material  - rank N's trajectory file says material 'Sand', the table has 'sand' (KeyError)
  featwidth - every rank builds node features with 6 velocities of history, the encoder expects 5
  ckpt      - rank N loads the processor checkpoint written with 3 message passing steps (unexpected keys)
  rollout   - rank N rolls out its whole validation set for 1000 steps; the others wait in all_reduce
  sigterm   - rank N sends itself SIGTERM after step 2
  exit5     - rank N prints an error line about its rollout buffer and calls os._exit(5) at step 1
  none      - control, clean run

What happened (filled in after the runs):
  ptype     - rank N IndexError 'index out of range in self' in the type embedding (line 133) at step 0
  velstd    - rank N FloatingPointError 'non-finite loss nan at step 0 (velocity std 0)'; DETAIL: monitoredBarrier
  counts    - a peer aborts in the all_gather: gloo EnforceNotMet '20 vs 16' (exitcode -6), others conn. reset
  trajfile  - rank N FileNotFoundError for /tmp/job_work/data/traj_s<rank+world>.npz before step 0
  material  - rank N KeyError: 'Sand' (line 181) before step 0
  featwidth - every rank RuntimeError 'mat1 and mat2 shapes cannot be multiplied (24x24 and 22x32)' at step 0
  ckpt      - rank N RuntimeError loading state_dict for Processor: Unexpected key(s) layers.2.*; restart: connectFullMesh
  rollout   - pg 12 s: ranks time out 'Timed out waiting 12000ms' in all_reduce; pg 300 s under timeout 60: hung, 124
  sigterm   - rank N exitcode -15 (SIGTERM) after step 2, no traceback; peers Connection reset by peer
  exit5     - rank N prints 'ERROR rank N: rollout buffer holds 37 frames of 40; ...' at step 1, exitcode 5
  none      - clean, exit 0, 'rank 0 done: 4 steps, rollout MSE 0.00038'
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--n-particles", type=int, default=24)
p.add_argument("--n-traj", type=int, default=4)
p.add_argument("--t-len", type=int, default=40)
p.add_argument("--history", type=int, default=5)
p.add_argument("--radius", type=float, default=0.25)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--mp-steps", type=int, default=2)
p.add_argument("--rollout", type=int, default=8)
p.add_argument("--val-all", type=int, default=16)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--work", default="/tmp/fault258_work")
a = p.parse_args()

MATERIALS = {"sand": (0.9, 0.02), "water": (0.98, 0.005), "goop": (0.8, 0.05)}  # (damping, noise)
NUM_TYPES = 3


def bad(rank):
    return a.rank == -1 or a.rank == rank


def simulate(rng, n, t_len, damping, noise, gravity=-0.5, dt=0.05):
    pos = rng.uniform(0.1, 0.9, size=(n, 2))
    vel = rng.normal(0, 0.3, size=(n, 2))
    out = np.zeros((t_len, n, 2), dtype=np.float32)
    for t in range(t_len):
        vel = damping * vel + dt * np.array([0.0, gravity]) + noise * rng.normal(size=(n, 2))
        pos = pos + dt * vel
        lo, hi = pos < 0, pos > 1
        pos = np.where(lo, -pos, np.where(hi, 2 - pos, pos))
        vel = np.where(lo | hi, -vel, vel)
        out[t] = pos
    return out


def radius_graph(pos, r):
    d = torch.cdist(pos, pos)
    src, dst = torch.nonzero((d < r) & (d > 0), as_tuple=True)
    return src, dst


def mlp(i, o, h):
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, o))


class Interaction(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge_mlp = mlp(3 * h, h, h)
        self.node_mlp = mlp(2 * h, h, h)

    def forward(self, x, e, src, dst):
        e = e + self.edge_mlp(torch.cat([x[src], x[dst], e], 1))
        agg = torch.zeros_like(x).index_add_(0, dst, e)
        return x + self.node_mlp(torch.cat([x, agg], 1)), e


class Processor(nn.Module):
    def __init__(self, h, m):
        super().__init__()
        self.layers = nn.ModuleList(Interaction(h) for _ in range(m))

    def forward(self, x, e, src, dst):
        for layer in self.layers:
            x, e = layer(x, e, src, dst)
        return x


class GNS(nn.Module):
    def __init__(self, h, m, history):
        super().__init__()
        self.type_emb = nn.Embedding(NUM_TYPES, 8)
        self.node_enc = mlp(8 + 2 * history + 4, h, h)
        self.edge_enc = mlp(3, h, h)
        self.processor = Processor(h, m)
        self.decoder = mlp(h, 2, h)

    def forward(self, feats, types, rel, src, dst):
        x = self.node_enc(torch.cat([self.type_emb(types), feats], 1))
        e = self.edge_enc(rel)
        return self.decoder(self.processor(x, e, src, dst))


def features(window, stats, hist, r):
    vel = (window[1:] - window[:-1] - stats["vmean"]) / stats["vstd"]   # [hist, n, 2]
    vel = vel[-hist:].permute(1, 0, 2).reshape(window.shape[1], -1)
    cur = window[-1]
    walls = torch.cat([cur, 1 - cur], 1).clamp(max=r) / r
    src, dst = radius_graph(cur, r)
    disp = (cur[src] - cur[dst]) / r
    rel = torch.cat([disp, disp.norm(dim=1, keepdim=True)], 1)
    return torch.cat([vel, walls], 1), rel, src, dst


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data_dir, ckpt_dir = os.path.join(a.work, "data"), os.path.join(a.work, "ckpt")
    os.makedirs(data_dir, exist_ok=True)
    os.makedirs(ckpt_dir, exist_ok=True)
    material = ["sand", "water", "goop"][rank % 3]
    rng = np.random.default_rng(100 + rank)
    damping, noise = MATERIALS[material]
    trajs = [simulate(rng, a.n_particles, a.t_len, damping, noise,
                      gravity=0.0 if (a.fault == "velstd" and bad(rank)) else -0.5) for _ in range(a.n_traj)]
    if a.fault == "velstd" and bad(rank):
        trajs = [np.repeat(t[:1], a.t_len, axis=0) for t in trajs]  # particles settled before recording
    types = rng.integers(0, NUM_TYPES, size=a.n_particles)
    if a.fault == "ptype" and bad(rank):
        types[-2:] = 3  # wall particles from the boundary exporter
    meta = {"material": "Sand" if (a.fault == "material" and bad(rank)) else material, "dt": 0.05}
    np.savez(os.path.join(data_dir, f"traj_s{rank}.npz"), pos=np.stack(trajs), types=types,
             meta=json.dumps(meta))
    if rank == 0:
        for m in (2, 3):
            path = os.path.join(ckpt_dir, f"processor_mp{m}.pt")
            if not os.path.exists(path):
                torch.save(Processor(a.hidden, m).state_dict(), path)
    dist.barrier()

    shard = rank + world if (a.fault == "trajfile" and bad(rank)) else rank
    blob = np.load(os.path.join(data_dir, f"traj_s{shard}.npz"))
    pos = torch.from_numpy(blob["pos"])
    types = torch.from_numpy(blob["types"]).long()
    meta = json.loads(str(blob["meta"]))
    damping, noise = MATERIALS[meta["material"]]
    print(f"rank {rank} loaded {pos.shape[0]} trajectories x {pos.shape[1]} steps x {pos.shape[2]} particles "
          f"({meta['material']}, damping {damping})", flush=True)
    vel_all = pos[:, 1:] - pos[:, :-1]
    acc_all = vel_all[:, 1:] - vel_all[:, :-1]
    stats = {"vmean": vel_all.mean(), "vstd": vel_all.std(), "amean": acc_all.mean(), "astd": acc_all.std()}
    hist = 6 if a.fault == "featwidth" else a.history

    model = GNS(a.hidden, a.mp_steps, a.history)
    m_ckpt = 3 if (a.fault == "ckpt" and bad(rank)) else a.mp_steps
    state = torch.load(os.path.join(ckpt_dir, f"processor_mp{m_ckpt}.pt"), map_location="cpu")
    model.processor.load_state_dict(state)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7 + rank)

    for step in range(a.steps):
        i = int(torch.randint(0, pos.shape[0], (1,), generator=g))
        t = int(torch.randint(a.history + 2, pos.shape[1] - 1, (1,), generator=g))
        window = pos[i, t - hist - 1:t + 1] if hist > a.history else pos[i, t - a.history:t + 1]
        feats, rel, src, dst = features(window, stats, hist, a.radius)
        target = ((pos[i, t + 1] - 2 * pos[i, t] + pos[i, t - 1]) - stats["amean"]) / stats["astd"]
        pred = net(feats, types, rel, src, dst)
        loss = ((pred - target) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                                     f"(velocity std {stats['vstd'].item():.3g})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        gl = loss.detach().clone()
        dist.all_reduce(gl)
        print(f"rank {rank} step {step} loss {loss.item():.5f} global {gl.item() / world:.5f} "
              f"edges {src.numel()}", flush=True)
        if a.fault == "exit5" and bad(rank) and step == 1:
            print(f"ERROR rank {rank}: rollout buffer holds {a.t_len - 3} frames of {a.t_len}; "
                  f"trajectory {i} is truncated, giving up", file=sys.stderr, flush=True)
            os._exit(5)
        if a.fault == "sigterm" and bad(rank) and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)

    counts = [pos.shape[2]] * pos.shape[0]
    if a.fault == "counts" and bad(rank):
        counts.append(0)  # padding trajectory left in the shard
    ct = torch.tensor(counts, dtype=torch.long)
    gathered = [torch.zeros_like(ct) for _ in range(world)]
    dist.all_gather(gathered, ct)
    if rank == 0:
        print(f"rank 0 particles per trajectory {[x.tolist() for x in gathered]}", flush=True)

    model.eval()
    n_val = a.val_all if (a.fault == "rollout" and bad(rank)) else 1
    steps = 1000 if (a.fault == "rollout" and bad(rank)) else a.rollout
    if n_val > 1:
        print(f"rank {rank} validating {n_val} trajectories with {steps}-step rollouts", flush=True)
    err = torch.zeros(1)
    with torch.no_grad():
        for v in range(n_val):
            i = v % pos.shape[0]
            win = pos[i, :a.history + 1].clone()
            for k in range(steps):
                feats, rel, src, dst = features(win, stats, a.history, a.radius)
                acc = model(feats, types, rel, src, dst) * stats["astd"] + stats["amean"]
                nxt = (2 * win[-1] - win[-2] + acc).clamp(0, 1)
                win = torch.cat([win[1:], nxt[None]], 0)
                tt = min(a.history + 1 + k, pos.shape[1] - 1)
                err += ((nxt - pos[i, tt]) ** 2).mean() / (steps * n_val)
    dist.all_reduce(err)
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, rollout MSE {err.item() / world:.5f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

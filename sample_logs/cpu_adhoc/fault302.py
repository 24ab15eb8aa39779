"""A three-hundred-and-second hand-run batch: PEDESTRIAN TRAJECTORY FORECASTING WITH A SOCIAL-POOLING LSTM.

Synthetic crowd scenes: every rank reads /tmp/fault302_work/scenes/scene_R.pt (16 scenes x 6 pedestrians x 20
frames of x/y positions at 2.5 fps, an agent id per track and an agent table id -> type).  A Social-LSTM
encodes 8 observed frames (velocities from position deltas over the frame timestamps, plus a 4x4 occupancy grid
of the neighbours' hidden states around every pedestrian) and a linear decoder predicts the next 8 displacements.
MSE loss; the metric is the ADE (average displacement error, metres).  DDP over gloo, or --ddp 0 (gradients
all_reduced by hand).  Each step's loss and ADE are all_reduced, the per-rank neighbour histograms are
all_gathered at start-up and the per-rank ADE at the end; rank 0 saves export/social_lstm.pt.  The model is
initialised from ckpt/social_g4.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1.

Faults:
  agentid     - rank N's scene 3 references agent 4711, missing from its agent table (KeyError, start-up)
  noscene     - rank N reads scenes/val/scene_N.pt, which does not exist (FileNotFoundError, start-up)
  ckptgrid    - rank N initialises from ckpt/social_g6.pt, saved with a 6x6 pooling grid (size mismatch)
  ckptpickle  - rank N initialises from ckpt/social_full.pt, a pickled dict holding a TrajConfig object
                (torch.load weights_only refusal)
  neighgather - rank N all_gathers its neighbour histogram as int64 counts, the others float32
  framepast   - rank N's step-3 window starts 7 frames in (a frame-rate bug): a future frame index past 20
                (IndexError)
  nanvel      - rank N's step-4 window has a duplicated timestamp: dt 0, inf/nan velocities, the program's
                finite-loss check (FloatingPointError)
  socialslow  - rank N computes every pairwise social force in pure Python before the step-2 all_reduce
                (--slow-budget s; PG timeout 12 s, or 300 s and the run killed from outside: a hang)
  sigsegv     - rank N sends itself SIGSEGV after the step-1 all_reduce
  exit5       - rank N's end-of-training map check prints its own error line and calls sys.exit(5)
  coordshape  - every rank: tracks carry x, y, heading (3 wide), the LSTM cell expects 2 + 16 inputs
  none        - control, clean run

What happened (filled in after the runs):
  agentid     - KeyError: 4711 at start-up, peers Connection closed in all_gather (np4 r2 ranklabel); np3 r0 spawn: the KeyError never reaches the log, spawn reports process 2's Connection closed
  noscene     - FileNotFoundError scenes/val/scene_N.pt at start-up, peers closed (np3 r1 mpitag, np5 r3 logfmt Root Cause rank 3)
  ckptgrid    - load_state_dict size mismatch pool.weight [16,576] vs [16,256] (np4 r1 pdsh2, np3 r2 legacy)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global __main__.TrajConfig' (np3 r1 tee)
  neighgather - ValueError 'Invalid usage of tensors with different dtypesFound torch.float32 and  torch.int64' (np3 r0 files, np4 r3 srunlabel)
  framepast   - IndexError 'index 20 is out of bounds for dimension 2 with size 20' at step 3 (np5 r2 bashloop, np3 r1 logfmt)
  nanvel      - 'loss is nan (192 non-finite velocity entries)', FloatingPointError at step 4 (np3 r2 logfmt --ddp 0, np4 r1 mpitag)
  socialslow  - 12 s: peers 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r1 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 srunlabel)
  sigsegv     - ProcessExitedException 'process 2 terminated with signal SIGSEGV' (np3 r2 spawn); silent rank 0, peers closed, loop exit 139 (np4 r0 ranklabel)
  exit5       - rank N's walkable-map ERROR line and exit 5 after step 5; Root Cause rank 4 exitcode 5 (np5 r4 tee --ddp 0); loop exit 5 (np3 r1 files)
  coordshape  - every rank 'input has inconsistent input_size: got 19 expected 18'; Root Cause rank 2 (np3 legacy)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/social_lstm.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault302_work"
S, P, T, OBS, PRED = 16, 6, 20, 8, 8
GRID, RADIUS, HID, EMB = 4, 2.0, 16, 16
TYPES = {"adult": 0, "child": 1, "cyclist": 2}
log = None


@dataclass
class TrajConfig:
    grid: int = GRID
    radius: float = RADIUS
    hidden: int = HID


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("traj")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class SocialLSTM(nn.Module):
    def __init__(self, grid=GRID, hid=HID, emb=EMB):
        super().__init__()
        self.grid = grid
        self.type_emb = nn.Embedding(len(TYPES), hid)
        self.pool = nn.Linear(grid * grid * hid, emb)
        self.cell = nn.LSTMCell(2 + emb, hid)
        self.dec = nn.Linear(hid, PRED * 2)

    def social_pool(self, cur, h):
        # cur [S, P, 2] positions, h [S, P, H] hidden states: sum neighbours' h into a grid around each agent
        rel = cur[:, None, :, :] - cur[:, :, None, :]
        cell = torch.floor((rel[..., :2] + RADIUS) / (2 * RADIUS / self.grid)).long()
        ok = (cell >= 0).all(-1) & (cell < self.grid).all(-1)
        ok &= ~torch.eye(cur.shape[1], dtype=torch.bool)[None]
        idx = (cell[..., 0] * self.grid + cell[..., 1]).clamp(0, self.grid * self.grid - 1)
        onehot = nn.functional.one_hot(idx, self.grid * self.grid).float() * ok[..., None].float()
        pooled = torch.einsum("spqc,sqh->spch", onehot, h)
        return torch.relu(self.pool(pooled.reshape(cur.shape[0], cur.shape[1], -1)))

    def forward(self, obs, vel, types):
        s, p = obs.shape[0], obs.shape[1]
        h = self.type_emb(types).reshape(s * p, -1)
        c = torch.zeros_like(h)
        for t in range(vel.shape[2]):
            pe = self.social_pool(obs[:, :, t + 1], h.reshape(s, p, -1))
            inp = torch.cat([vel[:, :, t].reshape(s * p, -1), pe.reshape(s * p, -1)], 1)
            h, c = self.cell(inp, (h, c))
        return self.dec(h).reshape(s, p, PRED, 2)


def make_scenes(seed, width=2):
    g = torch.Generator().manual_seed(seed)
    start = torch.rand(S, P, 2, generator=g) * 6.0
    heading = torch.rand(S, P, generator=g) * 2 * math.pi
    speed = 0.8 + 0.6 * torch.rand(S, P, generator=g)
    v = torch.stack([torch.cos(heading), torch.sin(heading)], -1) * speed[..., None]
    tt = torch.arange(T) * 0.4
    pos = start[:, :, None] + v[:, :, None] * tt[None, None, :, None]
    pos = pos + 0.03 * torch.randn(S, P, T, 2, generator=g).cumsum(2)
    if width == 3:
        pos = torch.cat([pos, heading[:, :, None, None].expand(S, P, T, 1)], -1)
    ids = (torch.arange(S * P) + 1000 * seed).reshape(S, P).tolist()
    kinds = list(TYPES)
    table = {i: kinds[int(torch.randint(0, 3, (1,), generator=g))] for row in ids for i in row}
    return {"pos": pos, "t": tt.clone(), "agent_ids": ids, "agents": table}


def prepare():
    os.makedirs(f"{WORK}/scenes", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_scenes(r), f"{WORK}/scenes/scene_{r}.pt")
        torch.save(make_scenes(r, width=3), f"{WORK}/scenes/scene3_{r}.pt")
    torch.manual_seed(0)
    torch.save(SocialLSTM(4).state_dict(), f"{WORK}/ckpt/social_g4.pt")
    torch.save(SocialLSTM(6).state_dict(), f"{WORK}/ckpt/social_g6.pt")
    torch.save({"config": TrajConfig(), "model": SocialLSTM(4).state_dict(), "epoch": 40},
               f"{WORK}/ckpt/social_full.pt")
    print("prepared", WORK)


def social_forces(pos):
    # pure-Python pairwise repulsion over every frame (deliberately slow)
    f = 0.0
    for s in range(pos.shape[0]):
        pts = pos[s].tolist()
        for t in range(T):
            for i in range(P):
                for j in range(P):
                    if i != j:
                        dx = pts[i][t][0] - pts[j][t][0]
                        dy = pts[i][t][1] - pts[j][t][1]
                        f += math.exp(-math.hypot(dx, dy) / 0.3)
    return f


def window(data, start, bad, a, step):
    pos, tt = data["pos"], data["t"].clone()
    if bad and a.fault == "framepast" and step == 3:
        start = T - OBS - PRED + 3
    if bad and a.fault == "nanvel" and step == 4:
        tt[start + 3] = tt[start + 2]
    obs = pos[:, :, start:start + OBS]
    dt = (tt[start + 1:start + OBS] - tt[start:start + OBS - 1])[None, None, :, None]
    vel = (obs[:, :, 1:] - obs[:, :, :-1]) / dt
    last = obs[:, :, OBS - 1, :2]
    fut = torch.stack([pos[:, :, start + OBS + k, :2] for k in range(PRED)], 2)
    disp = fut - last[:, :, None]
    return obs, vel, disp


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading scenes")
    split = "val/" if bad and a.fault == "noscene" else ""
    name = "scene3" if a.fault == "coordshape" else "scene"
    data = torch.load(f"{WORK}/scenes/{split}{name}_{rank}.pt")
    if bad and a.fault == "agentid":
        data["agent_ids"][3][4] = 4711
    types = torch.tensor([[TYPES[data["agents"][i]] for i in row] for row in data["agent_ids"]])
    last = data["pos"][:, :, OBS - 1, :2]
    dists = (last[:, None] - last[:, :, None]).norm(dim=-1)
    hist = torch.histc(dists[dists > 0], bins=8, min=0.0, max=8.0)
    if bad and a.fault == "neighgather":
        hist = hist.long()
    allh = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} neighbour pairs within 2 m: {int(hist[:2].sum())} global {int(sum(h[:2].sum() for h in allh))}")
    model = SocialLSTM()
    ck = {"ckptgrid": "social_g6.pt", "ckptpickle": "social_full.pt"}.get(a.fault, "social_g4.pt")
    sd = torch.load(f"{WORK}/ckpt/{ck if bad else 'social_g4.pt'}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    ade = torch.zeros(1)
    for step in range(a.steps):
        obs, vel, disp = window(data, step % (T - OBS - PRED + 1), bad, a, step)
        pred = net(obs, vel, types)
        loss = ((pred - disp) ** 2).mean()
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(vel)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({nbad} non-finite velocity entries), aborting", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p_ in model.parameters():
                dist.all_reduce(p_.grad)
                p_.grad /= world
        opt.step()
        if bad and a.fault == "socialslow" and step == 2:
            t0, n = time.time(), 0.0
            while time.time() - t0 < a.slow_budget:
                n += social_forces(data["pos"])
            say(f"rank {rank} social force census: {n:.1f}")
        ade = (pred.detach() - disp).norm(dim=-1).mean().reshape(1)
        stats = torch.cat([loss.detach().reshape(1), ade])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} ade {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR scene 12 agent {data['agent_ids'][12][2]}: predicted track leaves the walkable "
            f"map (x=-7.9 m), refusing to export", err=True)
        sys.exit(5)
    alla = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(alla, ade)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/social_lstm.pt")
        say(f"rank 0 done: {a.steps} steps, per-rank ade {[round(x.item(), 3) for x in alla]}, saved export/social_lstm.pt")
    dist.barrier()
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-budget", type=int, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()

"""A two-hundred-and-twenty-sixth hand-run batch: WEATHER FORECASTING WITH A GRAPH NETWORK ON A MESH.

A small message-passing network forecasts the next 6-hour state of five variables (t2m, msl, u10, v10, z500)
on a synthetic icosahedral-like mesh of 162 grid points (a Fibonacci lattice on the sphere).  Rank 0 writes
the mesh (node lat/lon and k-nearest-neighbour edges) to /tmp/fault226_work/mesh/mesh.npz and the
normalisation stats to stats.json; every rank reads them.  The processor (3 message-passing layers) starts
from ckpt/processor.pt.  Each step makes an autoregressive rollout of WX_ROLLOUT lead steps and trains on the
latitude-weighted MSE; the model is wrapped in DDP (gloo), or with --ddp 0 the gradients are all_reduced by
hand.  Losses are all_reduced for the log; at the end each rank's per-variable latitude-weighted RMSE is
all_gathered and rank 0 saves the model to wx_final.pt.

Faults:
  edgeidx   - rank N appends a pole node's edge with index 162 == n_nodes (IndexError in index_select)
  channels  - every rank: the data carries 6 channels (tcwv added) while the model is built for 5 (shape error)
  meshfile  - rank N reads a resolution-suffixed mesh file that does not exist (FileNotFoundError)
  blowup    - rank N reads dt=0 h from its shard metadata: the rollout tendency divides by 0, the program's check
  normkey   - rank N's variable list has q700, missing from the normalisation stats (KeyError)
  rmsegather- rank N all_gathers its per-variable RMSE with one extra variable (gloo size mismatch)
  ckptlayers- rank N loads the processor from ckpt/processor_l4.pt, saved with 4 layers (unexpected keys)
  rollenv   - every rank: WX_ROLLOUT is exported as "4h", not an integer (ValueError)
  laplacian - rank N recomputes the mesh Laplacian for --stall seconds before step 2's backward
  sigbus    - rank N sends itself SIGBUS after step 2
  exit4     - rank N prints its own error line about an empty observation file and calls os._exit(4)
  none      - control, clean run

What happened (filled in after the runs):
  edgeidx   - rank N: IndexError index out of range in self at index_select, step 0; peers closed by peer
  channels  - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (162x8 and 7x32)
  meshfile  - rank N: FileNotFoundError .../mesh/mesh_r6.npz; peers SIGTERMed
  blowup    - rank N: FloatingPointError rollout diverged, 810 non-finite (DETAIL: monitoredBarrier)
  normkey   - rank N: KeyError 'q700' at step 0; peers gloo Connection closed by peer
  rmsegather- another rank aborted: gloo EnforceNotMet 12 vs 10 size mismatch; others reset
  ckptlayers- rank N: RuntimeError Unexpected key(s) in state_dict: layers.3.* for Processor
  rollenv   - every rank: ValueError invalid literal for int() with base 10: '4h'
  laplacian - rank N stalled 40 s: peers gloo Timed out waiting 12000ms (PG 300 s run finished)
  sigbus    - rank N: exitcode -7 (SIGBUS) after step 2; peers reset/closed; restart: recv timeout
  exit4     - rank N logs its ERROR line about an empty observation file, exitcode 4
  none      - clean, exit 0, rank 0 saved wx_final.pt
"""
import argparse
import json
import math
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

VARS = ["t2m", "msl", "u10", "v10", "z500"]
WORK = "/tmp/fault226_work"
N_NODES = 162


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    return p.parse_args()


def build_mesh(n, k=6):
    i = np.arange(n) + 0.5
    lat = np.arcsin(1 - 2 * i / n)
    lon = (np.pi * (1 + 5 ** 0.5) * i) % (2 * np.pi)
    xyz = np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], 1)
    d = ((xyz[:, None, :] - xyz[None, :, :]) ** 2).sum(-1)
    nbr = np.argsort(d, 1)[:, 1:k + 1]
    src = nbr.reshape(-1)
    dst = np.repeat(np.arange(n), k)
    return lat, lon, np.stack([src, dst]).astype(np.int64)


class MPLayer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))
        self.node_mlp = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))

    def forward(self, h, edges):
        src, dst = edges[0], edges[1]
        msg = self.edge_mlp(torch.cat([h.index_select(0, src), h.index_select(0, dst)], -1))
        agg = torch.zeros_like(h).index_add_(0, dst, msg)
        return h + self.node_mlp(torch.cat([h, agg], -1))


class Processor(nn.Module):
    def __init__(self, h, layers):
        super().__init__()
        self.layers = nn.ModuleList([MPLayer(h) for _ in range(layers)])

    def forward(self, h, edges):
        for layer in self.layers:
            h = layer(h, edges)
        return h


class GraphForecaster(nn.Module):
    def __init__(self, c, h=32, layers=3):
        super().__init__()
        self.enc = nn.Linear(c + 2, h)
        self.proc = Processor(h, layers)
        self.dec = nn.Linear(h, c)

    def forward(self, x, pos, edges):
        return self.dec(self.proc(self.enc(torch.cat([x, pos], -1)), edges))


def lat_weights(lat):
    w = torch.cos(torch.as_tensor(lat, dtype=torch.float32))
    return w / w.mean()


def make_state(g, n, c, stats, names, lat):
    base = torch.stack([torch.full((n,), stats[v]["mean"]) for v in names[:c]], 1)
    std = torch.stack([torch.full((n,), stats[v]["std"]) for v in names[:c]], 1)
    raw = base + std * (0.5 * torch.randn(n, c, generator=g) + torch.cos(torch.as_tensor(lat))[:, None].float())
    return (raw - base) / std


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if a.fault == "rollenv":
        os.environ["WX_ROLLOUT"] = "4h"
    rollout = int(os.environ.get("WX_ROLLOUT", "2"))
    names = list(VARS)
    if a.fault == "channels":
        names.append("tcwv")
    if a.fault == "normkey" and rank == a.rank:
        names[3] = "q700"
    n_ch = len(VARS)
    print(f"rank {rank}/{world}: graphcast-mini nodes={N_NODES} vars={','.join(names)} rollout={rollout} "
          f"ddp={a.ddp}", flush=True)

    os.makedirs(f"{WORK}/mesh", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    if rank == 0:
        lat, lon, edges = build_mesh(N_NODES)
        np.savez(f"{WORK}/mesh/mesh.npz", lat=lat, lon=lon, edges=edges)
        stats = {v: {"mean": m, "std": s} for v, m, s in
                 zip(VARS + ["tcwv"], [287.0, 101325.0, 0.0, 0.0, 54000.0, 25.0], [15.0, 1200.0, 6.0, 6.0, 3000.0, 8.0])}
        with open(f"{WORK}/stats.json", "w") as f:
            json.dump(stats, f)
        torch.save(Processor(32, 3).state_dict(), f"{WORK}/ckpt/processor.pt")
        torch.save(Processor(32, 4).state_dict(), f"{WORK}/ckpt/processor_l4.pt")
    dist.barrier()
    mesh_path = f"{WORK}/mesh/mesh.npz"
    if a.fault == "meshfile" and rank == a.rank:
        mesh_path = f"{WORK}/mesh/mesh_r6.npz"
    mesh = np.load(mesh_path)
    lat, lon = mesh["lat"], mesh["lon"]
    edges = torch.from_numpy(mesh["edges"])
    if a.fault == "edgeidx" and rank == a.rank:
        edges = torch.cat([edges, torch.tensor([[N_NODES], [0]])], 1)
    with open(f"{WORK}/stats.json") as f:
        stats = json.load(f)
    print(f"rank {rank}: mesh {mesh_path} has {len(lat)} nodes and {edges.shape[1]} edges", flush=True)
    pos = torch.from_numpy(np.stack([np.sin(lat), np.cos(lon)], 1)).float()
    w = lat_weights(lat)

    model = GraphForecaster(n_ch)
    ck = f"{WORK}/ckpt/processor.pt"
    if a.fault == "ckptlayers" and rank == a.rank:
        ck = f"{WORK}/ckpt/processor_l4.pt"
    model.proc.load_state_dict(torch.load(ck))
    print(f"rank {rank}: loaded processor from {ck}", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    dt_hours, dt_data = 6.0, 6.0
    sq_err = torch.zeros(n_ch)
    for step in range(a.steps):
        if a.fault == "exit4" and rank == a.rank and step == 1:
            print(f"ERROR rank {rank}: observation file {WORK}/obs/synop_2021071406_r{rank}.csv has 0 rows; "
                  f"cannot build the analysis increment", flush=True)
            os._exit(4)
        if a.fault == "blowup" and rank == a.rank and step == 2:
            dt_data = 0.0
        x = make_state(g, N_NODES, len(names), stats, names, lat)
        target = [x[:, :n_ch] + 0.1 * torch.randn(N_NODES, n_ch, generator=g) for _ in range(rollout)]
        state, loss = x, 0.0
        for k in range(rollout):
            pred = state[:, :n_ch] if state.shape[1] == n_ch else state
            pred = pred + net(pred, pos, edges) * (dt_hours / dt_data if dt_data else float("inf"))
            if not torch.isfinite(pred).all():
                raise FloatingPointError(f"rollout diverged at lead step {k + 1}: "
                                         f"{int((~torch.isfinite(pred)).sum())} non-finite values in the forecast")
            loss = loss + (w[:, None] * (pred - target[k]) ** 2).mean()
            state = pred
        loss = loss / rollout
        if a.fault == "laplacian" and rank == a.rank and step == 2:
            print(f"rank {rank}: recomputing mesh Laplacian eigenvectors for positional encoding "
                  f"({N_NODES} nodes, dense eigh)", flush=True)
            time.sleep(a.stall)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        sq_err += (w[:, None] * (state.detach() - target[-1]) ** 2).mean(0)
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f}", flush=True)
        if a.fault == "sigbus" and rank == a.rank and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
    rmse = torch.sqrt(sq_err / a.steps)
    if a.fault == "rmsegather" and rank == a.rank:
        rmse = torch.cat([rmse, torch.tensor([math.sqrt(0.5)])])
    gathered = [torch.zeros_like(rmse) for _ in range(world)]
    dist.all_gather(gathered, rmse)
    if rank == 0:
        mean = torch.stack(gathered).mean(0)
        print("lat-weighted RMSE (normalised): " + " ".join(f"{v}={mean[i]:.3f}" for i, v in enumerate(VARS)),
              flush=True)
        torch.save(model.state_dict(), f"{WORK}/wx_final.pt")
        print(f"saved model to {WORK}/wx_final.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

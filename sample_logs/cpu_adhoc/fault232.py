"""A two-hundred-and-thirty-second hand-run batch: TRAFFIC FORECASTING WITH A SPATIO-TEMPORAL GRAPH MODEL. A tiny DCRNN.

The program: rank 0 writes a synthetic road-sensor distance file (graph/distances_la8.csv) and a sensor id map
(graph/sensor_ids.txt); every rank reads them, builds a Gaussian-kernel adjacency, the forward and backward
random-walk matrices, and trains a small diffusion-convolution GRU encoder-decoder (seq2seq, 6 input steps,
3 horizon steps) on synthetic speeds with a masked MAE that ignores missing (zero) readings, wrapped in DDP over
gloo; after the steps, MAE and RMSE are all_reduced and per-horizon MAE all_gathered; rank 0 saves the model.
Launch under torchrun / a bash loop (env://) or with --spawn N (torch.multiprocessing.spawn).

Faults:
- sensoridx: rank N's sensor subset holds index 8 on an 8-sensor adjacency -> IndexError on rank N.
- horizon: config horizon 4 for targets while the decoder emits 3 steps, every rank -> RuntimeError (shape).
- distfile: rank N reads graph/distances_la_8.csv (a typo) -> FileNotFoundError on rank N.
- allmasked: rank N's missing-value threshold removes every reading; masked mean 0/0 -> program's NaN check.
- horgather: rank N all_gathers per-horizon MAE with 4 entries (others 3) -> gloo size mismatch.
- ckptsteps: rank N builds the model with 3 diffusion steps, loads a 2-step init checkpoint -> missing keys.
- sensorid: rank N's shard lists sensor id 773999 absent from the id map -> KeyError on rank N.
- slowgraph: rank N recomputes the random-walk matrices slowly (sleeps) before DDP; the others time out.
- sigbus: rank N sends itself SIGBUS at step 2.
- exit4: rank N prints an error line about its shard and calls sys.exit(4).
- adjsquare: rank N drops a sensor row of the adjacency; assert on the adjacency being square fails.
- none: control, clean run.

What happened (filled in after the runs):
- sensoridx: rank N: IndexError 'index 8 is out of bounds for dimension 0 with size 8'; peers Connection closed.
- horizon: every rank: RuntimeError 'The size of tensor a (3) must match ... (4) at non-singleton dimension 1'.
- distfile: rank N: FileNotFoundError for graph/distances_la_8.csv; peers Connection closed in DDP setup.
- allmasked: rank N: FloatingPointError 'masked MAE is nan at step 1 (0 valid readings)'; peers closed/abort.
- horgather: no size error: all ranks stall after step 4 in the end collectives; killed by timeout (exit 124).
- ckptsteps: rank N: RuntimeError loading state_dict, Missing key(s) ...lin.5/lin.6; peers Connection closed.
- sensorid: rank N: KeyError '773999' building its shard; peers closed / SIGTERMed.
- slowgraph: rank N never reaches DDP; the others time out after 12 s in DDP's parameter check (gloo timeout).
- sigbus: rank N killed by SIGBUS after step 2 (spawn: ProcessExitedException ... signal SIGBUS).
- exit4: rank N prints 'ERROR rank N: speed shard ... 0 rows after dedup; abort', exit code 4.
- adjsquare: rank N: AssertionError 'adjacency must be square, got (7, 8)'; peers Connection closed.
- none: exit 0; rank 0 prints test MAE/RMSE and saves dcrnn_final.pt.
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

N_SENSORS = 8
T_IN = 6
HORIZON = 3
WORK = os.environ.get("TRAFFIC_WORK", "/tmp/fault232_work")


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def make_logger(rank, use_logging):
    if not use_logging:
        return None
    log = logging.getLogger("traffic")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return log


class DiffConv(nn.Module):
    def __init__(self, cin, cout, k):
        super().__init__()
        self.k = k
        self.lin = nn.ModuleList([nn.Linear(cin, cout) for _ in range(1 + 2 * k)])

    def forward(self, x, supports):
        out = self.lin[0](x)
        i = 1
        for p in supports:
            h = x
            for _ in range(self.k):
                h = torch.einsum("nm,bmc->bnc", p, h)
                out = out + self.lin[i](h)
                i += 1
        return out


class DCGRUCell(nn.Module):
    def __init__(self, cin, hid, k):
        super().__init__()
        self.hid = hid
        self.gates = DiffConv(cin + hid, 2 * hid, k)
        self.cand = DiffConv(cin + hid, hid, k)

    def forward(self, x, h, supports):
        zr = torch.sigmoid(self.gates(torch.cat([x, h], -1), supports))
        z, r = zr.chunk(2, -1)
        c = torch.tanh(self.cand(torch.cat([x, r * h], -1), supports))
        return z * h + (1 - z) * c


class DCRNN(nn.Module):
    def __init__(self, hid=8, k=2, horizon=HORIZON):
        super().__init__()
        self.horizon = horizon
        self.enc = DCGRUCell(1, hid, k)
        self.dec = DCGRUCell(1, hid, k)
        self.proj = nn.Linear(hid, 1)

    def forward(self, x, supports):
        b, t, n = x.shape
        h = x.new_zeros(b, n, self.enc.hid)
        for s in range(t):
            h = self.enc(x[:, s, :, None], h, supports)
        y, outs = x[:, -1, :, None], []
        for _ in range(self.horizon):
            h = self.dec(y, h, supports)
            y = self.proj(h)
            outs.append(y[..., 0])
        return torch.stack(outs, 1)


def write_graph(gdir):
    os.makedirs(gdir, exist_ok=True)
    rng = np.random.default_rng(7)
    pos = rng.uniform(0, 5, size=(N_SENSORS, 2))
    ids = [717445 + 13 * i for i in range(N_SENSORS)]
    with open(os.path.join(gdir, "sensor_ids.txt"), "w") as f:
        f.write(",".join(str(i) for i in ids) + "\n")
    with open(os.path.join(gdir, "distances_la8.csv"), "w") as f:
        f.write("from,to,cost\n")
        for i in range(N_SENSORS):
            for j in range(N_SENSORS):
                f.write(f"{ids[i]},{ids[j]},{np.linalg.norm(pos[i] - pos[j]) * 1000:.1f}\n")


def load_graph(gdir, fname, id_map, drop_row):
    rows = open(os.path.join(gdir, fname)).read().strip().splitlines()[1:]
    dist_m = np.full((N_SENSORS, N_SENSORS), np.inf)
    for line in rows:
        a, b, c = line.split(",")
        dist_m[id_map[a], id_map[b]] = float(c)
    std = dist_m[np.isfinite(dist_m)].std()
    adj = np.exp(-np.square(dist_m / std))
    adj[adj < 0.1] = 0.0
    if drop_row:
        adj = adj[1:]
    assert adj.shape[0] == adj.shape[1], f"adjacency must be square, got {adj.shape}"
    adj = torch.tensor(adj, dtype=torch.float32)
    fwd = adj / adj.sum(1, keepdim=True)
    bwd = adj.t() / adj.t().sum(1, keepdim=True)
    return adj, [fwd, bwd]


def make_batch(rank, step, horizon, sensors, null_thresh):
    g = torch.Generator().manual_seed(1000 * rank + step)
    t = torch.arange(T_IN + horizon, dtype=torch.float32)
    phase = torch.rand(4, 1, N_SENSORS, generator=g) * 6.28
    speed = 60 + 8 * torch.sin(t[None, :, None] / 3 + phase) + torch.randn(4, T_IN + horizon, N_SENSORS, generator=g)
    speed = speed[:, :, sensors]
    speed[torch.rand(speed.shape, generator=g) < 0.1] = 0.0
    speed[speed < null_thresh] = 0.0
    return speed[:, :T_IN] / 70.0, speed[:, T_IN:] / 70.0


def masked_mae(pred, y):
    mask = (y > 0).float()
    mask = mask / mask.mean()
    return (torch.abs(pred - y) * mask).mean(), int((y > 0).sum())


def worker(rank, world, a):
    if a.spawn:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = make_logger(rank, a.logfmt)
    say = (lambda m: log.info(m)) if log else (lambda m: print(m, flush=True))
    bad = a.rank in (-1, rank)
    f = a.fault if bad else "none"
    torch.manual_seed(0)
    gdir = os.path.join(WORK, "graph")
    if rank == 0:
        write_graph(gdir)
        torch.save(DCRNN(k=2).state_dict(), os.path.join(WORK, "dcrnn_init_k2.pt"))
    dist.barrier()
    ids = open(os.path.join(gdir, "sensor_ids.txt")).read().strip().split(",")
    id_map = {s: i for i, s in enumerate(ids)}
    fname = "distances_la_8.csv" if f == "distfile" else "distances_la8.csv"
    if f == "slowgraph":
        time.sleep(a.stall)  # recomputing the random-walk matrices the slow way
    adj, supports = load_graph(gdir, fname, id_map, f == "adjsquare")
    say(f"rank {rank}: graph with {adj.shape[0]} sensors, {int((adj > 0).sum())} edges")
    shard_ids = ids[rank % 2::2] + (["773999"] if f == "sensorid" else [])
    shard = [id_map[s] for s in shard_ids]
    sensors = list(range(N_SENSORS)) if f != "sensoridx" else list(range(1, N_SENSORS + 1))
    sup = [p[sensors][:, sensors] for p in supports]
    model = DCRNN(k=3 if f == "ckptsteps" else 2)
    model.load_state_dict(torch.load(os.path.join(WORK, "dcrnn_init_k2.pt")))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    horizon = 4 if f == "horizon" else HORIZON
    null_thresh = 200.0 if f == "allmasked" else 5.0
    for step in range(1, a.steps + 1):
        x, y = make_batch(rank, step, horizon, sensors, null_thresh)
        pred = ddp(x, sup)
        loss, nvalid = masked_mae(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: masked MAE is {loss.item()} at step {step} ({nvalid} valid readings)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(f"rank {rank} step {step} loss {loss.item():.4f}")
        if f == "sigbus" and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
        if f == "exit4" and step == 1:
            msg = f"ERROR rank {rank}: speed shard for sensors {shard_ids[0]}..{shard_ids[-1]} has 0 rows after dedup; abort"
            (log.error(msg) if log else print(msg, file=sys.stderr, flush=True))
            sys.exit(4)
    with torch.no_grad():
        x, y = make_batch(rank, 99, horizon, sensors, null_thresh)
        pred = model(x, sup) * 70.0
        y = y * 70.0
        m = (y > 0).float()
        err = torch.tensor([(torch.abs(pred - y) * m).sum(), ((pred - y) ** 2 * m).sum(), m.sum()])
        per_h = (torch.abs(pred - y) * m).sum((0, 2)) / m.sum((0, 2))
    if f == "horgather":
        per_h = torch.cat([per_h, per_h[-1:]])
    dist.all_reduce(err)
    gathered = [torch.zeros(HORIZON) for _ in range(world)]
    dist.all_gather(gathered, per_h)
    if rank == 0:
        mae, rmse = err[0] / err[2], torch.sqrt(err[1] / err[2])
        say(f"test MAE {mae:.2f} mph RMSE {rmse:.2f} mph; per-horizon MAE {torch.stack(gathered).mean(0).tolist()}")
        torch.save(model.state_dict(), os.path.join(WORK, "dcrnn_final.pt"))
        say(f"saved model to {os.path.join(WORK, 'dcrnn_final.pt')} ({len(shard)} sensors in shard 0)")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=int, default=40)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(a.spawn, a), nprocs=a.spawn)
    else:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

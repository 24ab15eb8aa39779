"""Oyster reef growth from sonar transects: a small distributed training job (batch 512).

Each rank reads its own shard of synthetic side-scan sonar transects (10 backscatter bins per
sample, a reef site id), corrects the backscatter with a per-site salinity lookup table, and
trains a small MLP that predicts reef growth (mm/yr). The model starts from a checkpoint;
rank 0 saves an export at the end. Gloo, CPU only, DDP (or gradients all_reduced by hand
with --manual-grad, for TORCH_DISTRIBUTED_DEBUG=DETAIL).

  python fault512.py --prepare --world 8          # writes /tmp/fault512_work
  torchrun --nproc-per-node 4 fault512.py --fault keyerror --rank 2

Faults (--fault NAME --rank N):
  none             control, nothing planted
  keyerror         rank N meets a reef site id missing from the salinity table (KeyError)
  missing_transect rank N's transect shard file is gone (FileNotFoundError)
  ckpt_size        rank N builds the model with 24 hidden units: load_state_dict size mismatch
  weights_only     rank N loads a checkpoint that pickles a custom SiteSurvey object (weights_only refuses)
  wrong_size       rank N contributes a 6-element growth summary to an all_reduce the others send 4 to
  slow             rank N does pure-Python work (--slow-s, 45 s) at step 3; peers time out (with --pg-timeout 300: hang)
  nan              rank N reads a NaN backscatter value; the job's own finiteness check raises
  sigabrt          rank N sends itself SIGABRT at step 2
  error_exit       rank N prints its own ERROR line and calls sys.exit(4)
  shape_all        every rank builds its input with 11 features instead of 10 (shape bug everywhere)
  host_oom         rank N asks for a full-resolution bathymetry grid far larger than host memory (allocation fails at once)
  worker_crash     rank N's DataLoader worker is killed (SIGKILL) while loading a batch
What happened (batch 512 runs, 2026-12-06):
  none             np3 torchrun: steps 0-5 on all ranks, export saved, exit 0
  keyerror         np4 r2 --tee / np6 r5 two c10d agents: KeyError 'reef_12' on the rank, peers gloo connection closed
  missing_transect np5 r3 --redirects / np3 r0 train.sh: FileNotFoundError transect_NN_leg2.pt before step 0 (r3: only in stderr.log)
  ckpt_size        np4 r1 python -m torch.distributed.run / np8 r7 prefix template: load_state_dict size mismatch, peers SIGTERMed
  weights_only     np5 r4 LOGLEVEL=INFO: UnpicklingError 'Weights only load failed' on rank 4
  wrong_size       np4 r2 DETAIL (manual grads): every rank 'Detected mismatch between collectives', rank 2 TensorShape=[6]
  slow             np3 r1 torchrun: peers time out after 12000 ms; np4 r2 --tee --pg-timeout 300: hang after step 2, timeout ends it (124)
  nan              np6 r4 prefix template: FloatingPointError from the job's own check on rank 4
  sigabrt          np5 r3 --local-ranks-filter 0,1: only the summary shows exitcode -6; np4 r0 two agents: worker-1 blames rank 3
  error_exit       np4 r3 train.sh / np8 r6 --role trainer: ERROR line, exit 4, peers SIGTERMed or connection closed
  shape_all        np3 --max-restarts 1: mat1 and mat2 shapes (16x11 and 10x16) on every rank; the restart fails in gloo connectFullMesh
  host_oom         np7 r5 torchrun: DefaultCPUAllocator can't allocate 70368744177664 bytes on rank 5
  worker_crash     np4 r1 LOGLEVEL=INFO / np5 r2 python -m: 'DataLoader worker (pid N) is killed by signal: Killed.'
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault512_work"
NFEAT = 10
STEPS = 6
BATCH = 16


class SiteSurvey:  # a custom object; pickled into the unsafe checkpoint
    def __init__(self, table):
        self.table = table


def make_model(hidden=16):
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def prepare(world):
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(512)
    sites = [f"reef_{i}" for i in range(7)]
    table = {s: 28.0 + 0.7 * i for i, s in enumerate(sites)}  # salinity (psu) per site
    with open(f"{WORK}/site_salinity.json", "w") as f:
        json.dump(table, f)
    for r in range(world):
        x = -30.0 + 6.0 * torch.randn(STEPS * BATCH * 2, NFEAT, generator=g)  # backscatter dB
        s = torch.randint(0, 7, (STEPS * BATCH * 2,), generator=g)
        y = 4.0 + 0.1 * (x.mean(1, keepdim=True) + 30.0)  # growth mm/yr
        torch.save({"x": x, "site": s, "y": y}, f"{WORK}/transect_{r:02d}.pt")
    torch.manual_seed(0)
    m = make_model()
    torch.save(m.state_dict(), f"{WORK}/reef_init.pt")
    torch.save({"model": m.state_dict(), "survey": SiteSurvey(table)}, f"{WORK}/reef_init_with_survey.pt")
    print("prepared", WORK, "for", world, "ranks")


class Transects(Dataset):
    def __init__(self, rank, a, table):
        path = f"{WORK}/transect_{rank:02d}.pt"
        if a.fault == "missing_transect" and rank == a.rank:
            path = f"{WORK}/transect_{rank:02d}_leg2.pt"
        d = torch.load(path)
        self.x, self.site, self.y = d["x"], d["site"], d["y"]
        self.rank, self.a, self.table = rank, a, table

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        a, mine = self.a, self.rank == self.a.rank
        if a.fault == "worker_crash" and mine and i >= 2 * BATCH:
            os.kill(os.getpid(), signal.SIGKILL)
        x = self.x[i].clone()
        sid = f"reef_{int(self.site[i])}"
        if a.fault == "keyerror" and mine and i == 2 * BATCH + 5:
            sid = "reef_12"
        if a.fault == "nan" and mine and i == 2 * BATCH + 2:
            x[4] = float("nan")
        x = x + 0.05 * (self.table[sid] - 30.0)
        x = (x + 30.0) / 6.0
        if a.fault == "shape_all":
            x = torch.cat([x, torch.ones(1)])
        return x, self.y[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=45.0)
    p.add_argument("--manual-grad", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare(a.world)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = rank == a.rank
    with open(f"{WORK}/site_salinity.json") as f:
        table = json.load(f)
    model = make_model(hidden=24 if (a.fault == "ckpt_size" and mine) else 16)
    if a.fault == "weights_only" and mine:
        sd = torch.load(f"{WORK}/reef_init_with_survey.pt")["model"]
    else:
        sd = torch.load(f"{WORK}/reef_init.pt")
    model.load_state_dict(sd)
    net = model if a.manual_grad else DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    nw = 1 if (a.fault == "worker_crash" and mine) else 0
    dl = DataLoader(Transects(rank, a, table), batch_size=BATCH, num_workers=nw)
    for step, (x, y) in enumerate(dl):
        if step >= STEPS:
            break
        if a.fault == "sigabrt" and mine and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        if a.fault == "error_exit" and mine and step == 2:
            print(f"[rank {rank}] ERROR: sonar transect T{rank:02d}-B has no GPS fix for 412 of 480 pings; refusing to georeference reef growth", flush=True)
            sys.exit(4)
        if a.fault == "host_oom" and mine and step == 2:
            grid = torch.zeros(2 ** 19, 2 ** 19, 64)  # 0.05 m bathymetry grid over the whole estuary
            x = x + grid[0, 0, :NFEAT]
        if a.fault == "slow" and mine and step == 3:
            t0 = time.time()
            while time.time() - t0 < a.slow_s:
                sum(i * i for i in range(10000))
        if not torch.isfinite(x).all():
            bad = int((~torch.isfinite(x)).sum())
            raise FloatingPointError(f"rank {rank} step {step}: {bad} non-finite backscatter values in sonar batch")
        pred = net(x)
        loss = nn.functional.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        if a.manual_grad:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        with torch.no_grad():
            mae = (pred - y).abs().mean()
            summ = torch.tensor([mae.item(), pred.mean().item(), y.mean().item(), float(len(y))])
            if a.fault == "wrong_size" and mine and step == 2:
                summ = torch.cat([summ, torch.tensor([x.max().item(), x.min().item()])])
            dist.all_reduce(summ)
        print(f"rank {rank} step {step} loss {loss.item():.4f} growth_mae {summ[0].item() / world:.4f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/reef_export.pt")
        print("rank 0 saved export", f"{WORK}/reef_export.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

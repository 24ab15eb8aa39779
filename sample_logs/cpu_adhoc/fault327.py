"""A three-hundred-and-twenty-seventh hand-run batch: NEURAL PDE SOLVER (FOURIER NEURAL OPERATOR) FOR FLUID FLOW.

Synthetic 2-D incompressible flow: every rank owns trajectories of a decaying vorticity field (Taylor-Green
vortices plus noise) on a 16x16 periodic grid, 10 time levels each, in /tmp/fault327_work/fields/ns_R.pt,
with a JSON table meta_R.json giving each trajectory's flow regime (its viscosity is looked up in a table).
A small FNO (lifting layer from [vorticity, x, y], two spectral convolutions keeping 4x4 Fourier modes,
a pointwise projection) learns the one-step map w_t -> w_{t+1} on an MSE loss, wrapped in DDP (gloo), or
with gradients all_reduced by hand (--ddp 0).  The model starts from ckpt/fno_m4.pt.  Each rank's kinetic
energy spectrum (8 bins) is all_gathered at start-up, the relative L2 error is all_reduced every step, the
per-rank rollout error is all_gathered at the end, and rank 0 saves export/fno.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  viscosity  - rank N's regime table names "turbulent", missing from the viscosity table (KeyError, start-up)
  nofield    - rank N reads its fields from fields/ns_R_hires.pt, which was never written (FileNotFoundError)
  channels   - every rank: a time channel is appended to the input (4 channels), the lifting layer expects 3
  ckptmodes  - rank N initialises from ckpt/fno_m6.pt, saved with 6x6 Fourier modes (size mismatch)
  ckptcfg    - rank N loads ckpt/fno_cfg.pt, which pickles a FlowConfig dataclass (weights_only refusal)
  spectrum   - rank N all_gathers its energy spectrum with the Nyquist bin (9 entries vs 8)
  poisson    - rank N runs a pure-Python Jacobi pressure solve before the step-2 all_reduce (slow rank)
  blowup     - rank N writes 1e39 into a float32 frame at step 3 (nanframe: writes inf; the finiteness check)
  timeidx    - rank N's horizon is off by one at step 4: it reads time level 10 of 10 (IndexError)
  segv       - rank N sends itself SIGSEGV after step 2
  cfl        - rank N's end-of-run rollout check prints its own CFL error line and calls sys.exit(2)
  none       - control, clean run

What happened (filled in after the runs):
  viscosity  - KeyError: 'turbulent' at the viscosity lookup at start-up; peers Connection closed in the spectrum all_gather (np4 r2 tee, np6 r0 loglevel)
  nofield    - FileNotFoundError fields/ns_N_hires.pt at start-up; peers Connection closed (np3 r1 pymodule; np5 r3 redirects: only in the files)
  channels   - every rank 'mat1 and mat2 shapes cannot be multiplied (2048x4 and 3x8)' at the first forward (np3 wrapper, np4 pdsh2)
  ckptmodes  - load_state_dict size mismatch spec.*.w1/w2 [8,8,6,6,2] vs [8,8,4,4,2]; peers SIGTERMed silently (np4 r1 tee_trainer)
  ckptcfg    - UnpicklingError 'Weights only load failed ... GLOBAL __main__.FlowConfig'; peers silent (np3 r2 prefix, np6 r4 plain)
  spectrum   - DETAIL: every rank 'Detected mismatch between collectives' shapes 8vs 9 (np3 r1 detail); gloo 'invalid tensor size' (np8 r5 filter)
  poisson    - 12 s: ranks 0/2 'Timed out waiting 12000ms' at step 2 (np3 r1 plain); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2)
  blowup     - not inf: 'value cannot be converted to type float without overflow' RuntimeError at step 3 (np4 r3 restart, np3 r0 detail)
  timeidx    - IndexError 'index 10 is out of bounds for dimension 0 with size 10' at step 4 (np8 r6 prefix, np3 r1 tee_trainer)
  segv       - no traceback after step 2, exitcode -11 SIGSEGV (np6 r2 tee); restart attempt fails in connectFullMesh (np3 r1 restart)
  cfl        - rank N's 'ERROR rollout CFL ... refusing to export' and exit 2 at the end; peers closed in all_gather (np4 r1 filter, np3 r2)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/fno.pt, exit 0 (np3 plain); nanframe: FloatingPointError NaN (np5 r1 tee)
"""
import argparse
import json
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

WORK = "/tmp/fault327_work"
GRID = 16
NT = 10
NTRAJ = 6
MODES = 4
WIDTH = 8
VISC = {"laminar": 1e-2, "transitional": 3e-3, "creeping": 1e-1}
log = None


@dataclass
class FlowConfig:
    grid: int = GRID
    modes: int = 6
    width: int = WIDTH
    nu: float = 1e-3


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("fno")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter(f"%(asctime)s [rank={rank}] %(levelname)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class SpectralConv2d(nn.Module):
    def __init__(self, width, modes):
        super().__init__()
        self.modes = modes
        scale = 1.0 / (width * width)
        self.w1 = nn.Parameter(scale * torch.randn(width, width, modes, modes, 2))
        self.w2 = nn.Parameter(scale * torch.randn(width, width, modes, modes, 2))

    def forward(self, x):  # x: (B, C, H, W)
        b, c, h, w = x.shape
        m = self.modes
        xf = torch.fft.rfft2(x)
        out = torch.zeros(b, c, h, w // 2 + 1, dtype=torch.cfloat)
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :m, :m], torch.view_as_complex(self.w1))
        out[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, -m:, :m], torch.view_as_complex(self.w2))
        return torch.fft.irfft2(out, s=(h, w))


class FNO2d(nn.Module):
    def __init__(self, modes=MODES, width=WIDTH, cin=3):
        super().__init__()
        self.lift = nn.Linear(cin, width)
        self.spec = nn.ModuleList([SpectralConv2d(width, modes) for _ in range(2)])
        self.pw = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(2)])
        self.proj = nn.Sequential(nn.Linear(width, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x):  # x: (B, H, W, cin)
        h = self.lift(x).permute(0, 3, 1, 2)
        for s, p in zip(self.spec, self.pw):
            h = torch.nn.functional.gelu(s(h) + p(h))
        return self.proj(h.permute(0, 2, 3, 1)).squeeze(-1)


def make_fields(seed):
    g = torch.Generator().manual_seed(seed)
    xs = torch.linspace(0, 2 * math.pi, GRID + 1)[:-1]
    X, Y = torch.meshgrid(xs, xs, indexing="ij")
    trajs, regimes = [], []
    for k in range(NTRAJ):
        reg = ["laminar", "transitional", "creeping"][int(torch.randint(0, 3, (1,), generator=g))]
        nu = VISC[reg]
        kk = int(torch.randint(1, 4, (1,), generator=g))
        w0 = 2 * kk * torch.sin(kk * X) * torch.sin(kk * Y) + 0.1 * torch.randn(GRID, GRID, generator=g)
        trajs.append(torch.stack([w0 * math.exp(-2 * kk * kk * nu * t * 5) for t in range(NT)]))
        regimes.append(reg)
    return torch.stack(trajs), regimes


def prepare():
    for d in ("fields", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        f, regimes = make_fields(500 + r)
        torch.save(f, f"{WORK}/fields/ns_{r}.pt")
        with open(f"{WORK}/fields/meta_{r}.json", "w") as fh:
            json.dump({"rank": r, "regimes": regimes, "dt": 0.2}, fh)
    torch.manual_seed(0)
    torch.save(FNO2d(MODES).state_dict(), f"{WORK}/ckpt/fno_m4.pt")
    torch.save(FNO2d(6).state_dict(), f"{WORK}/ckpt/fno_m6.pt")
    torch.save({"config": FlowConfig(modes=MODES), "state": FNO2d(MODES).state_dict()}, f"{WORK}/ckpt/fno_cfg.pt")
    print("prepared", WORK)


def energy_spectrum(w, nbins):
    wf = torch.fft.fft2(w).abs() ** 2
    k = torch.fft.fftfreq(GRID, 1.0 / GRID).abs()
    kmag = torch.maximum(k[:, None], k[None, :]).long()
    return torch.stack([wf[..., kmag == i].sum() for i in range(nbins)]) / w.numel()


def jacobi_pressure(w, budget):
    """Pure-Python Jacobi iterations for the pressure Poisson equation (the slow path)."""
    n = GRID
    rhs = w[0, 0].tolist()
    p = [[0.0] * n for _ in range(n)]
    t0, it = time.time(), 0
    while time.time() - t0 < budget:
        q = [[0.25 * (p[(i + 1) % n][j] + p[i - 1][j] + p[i][(j + 1) % n] + p[i][j - 1] - rhs[i][j])
              for j in range(n)] for i in range(n)]
        p, it = q, it + 1
    return it


def make_batch(fields, grid, step, a, bad, g):
    idx = torch.randint(0, NTRAJ, (8,), generator=g).tolist()
    ts = torch.randint(0, NT - 1, (8,), generator=g).tolist()
    if bad and a.fault == "timeidx" and step == 4:
        ts[3] = NT - 1
    xs, ys = [], []
    for i, t in zip(idx, ts):
        xs.append(fields[i][t])
        ys.append(fields[i][t + 1])
    x = torch.stack(xs)
    if bad and a.fault in ("blowup", "nanframe") and step == 3:
        x[2, 5, 7] = float("1e39") if a.fault == "blowup" else float("inf")
    inp = torch.cat([x.unsqueeze(-1), grid.expand(x.shape[0], -1, -1, -1)], dim=-1)
    if a.fault == "channels":
        tchan = torch.tensor(ts, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, GRID, GRID, 1) / NT
        inp = torch.cat([inp, tchan], dim=-1)
    return inp, torch.stack(ys)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading vorticity fields")
    with open(f"{WORK}/fields/meta_{rank}.json") as fh:
        meta = json.load(fh)
    if bad and a.fault == "viscosity":
        meta["regimes"][4] = "turbulent"
    nus = [VISC[r] for r in meta["regimes"]]
    suffix = "_hires" if bad and a.fault == "nofield" else ""
    fields = torch.load(f"{WORK}/fields/ns_{rank}{suffix}.pt")
    nbins = 9 if bad and a.fault == "spectrum" else 8
    spec = energy_spectrum(fields[:, 0], nbins)
    allspec = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allspec, spec)
    say(f"rank {rank} trajectories {len(nus)} mean nu {sum(nus) / len(nus):.4f} "
        f"energy {spec.sum():.3f} global {sum(s.sum() for s in allspec):.3f}")
    model = FNO2d()
    if bad and a.fault == "ckptcfg":
        ck = torch.load(f"{WORK}/ckpt/fno_cfg.pt")
        model.load_state_dict(ck["state"])
    else:
        ck = "fno_m6.pt" if bad and a.fault == "ckptmodes" else "fno_m4.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    xs = torch.linspace(0, 1, GRID)
    grid = torch.stack(torch.meshgrid(xs, xs, indexing="ij"), dim=-1).unsqueeze(0)
    g = torch.Generator().manual_seed(77 + rank)
    for step in range(a.steps):
        inp, tgt = make_batch(fields, grid, step, a, bad, g)
        pred = net(inp)
        loss = ((pred - tgt) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} (input max {inp.abs().max().item():.3e})",
                err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "poisson" and step == 2:
            it = jacobi_pressure(inp[..., :1].permute(0, 3, 1, 2), a.solve_budget)
            say(f"rank {rank} pressure solve: {it} Jacobi sweeps")
        rel = ((pred.detach() - tgt).norm() / tgt.norm()).reshape(1)
        dist.all_reduce(rel)
        say(f"rank {rank} step {step} loss {loss.item():.4f} rel_l2 {rel.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        w = fields[:, 0]
        for _ in range(3):
            w = model(torch.cat([w.unsqueeze(-1), grid.expand(w.shape[0], -1, -1, -1)], dim=-1))
        roll = ((w - fields[:, 3]).norm() / fields[:, 3].norm()).reshape(1)
    if bad and a.fault == "cfl":
        umax = w.abs().max().item() * GRID / (2 * math.pi)
        say(f"rank {rank}: ERROR rollout CFL {umax * meta['dt'] * GRID:.2f} > 1.0 with dt {meta['dt']}, "
            f"refusing to export an unstable solver", err=True)
        sys.exit(2)
    allroll = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allroll, roll)
    say(f"rank {rank} rollout rel_l2 {roll.item():.4f} worst {max(r.item() for r in allroll):.4f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/fno.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/fno.pt")
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
    p.add_argument("--solve-budget", type=int, default=200)
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

"""A two-hundred-and-fifteenth hand-run batch: ENERGY-BASED MODEL WITH LANGEVIN SAMPLING. A tiny conv energy net.

The program trains a small convolutional energy network E(x) (plus a quadratic prior) by contrastive divergence on
procedurally generated 8x8 stripe textures. Negatives come from a replay buffer refined by stochastic-gradient
Langevin steps (step size, noise scale and step count from a JSON config), the model is wrapped in DDP (gloo), the
mean energies of positives and negatives are all_reduced every step, the buffer's age histogram is all_gathered at
the end, and rank 0 saves the model. `--prep 1` writes the config files, replay buffers and warm-start checkpoints.

Faults:
- blowup: rank N's Langevin step size is 1e6 (a sweep value missing its minus); the samples overflow, program check.
- buffer: rank N resumes its replay buffer from replay_buffer_step400.pt, which does not exist (FileNotFoundError).
- imgsize: every rank's config points at the 16x16 replay buffer; torch.cat of 8x8 positives and 16x16 negatives.
- cfgkey: rank N reads the old config ebm_config_v1.json, which has no 'langevin_noise' key (KeyError).
- counts: rank N's buffer age histogram has 5 buckets instead of 4 in the final all_gather (size mismatch).
- ckptwidth: rank N warm-starts from ebm_init_w12.pt (width 12) into a width-8 net (state_dict size mismatch).
- nanlog: rank N's energy regulariser takes the log of a negative number (sign slip); NaN loss, program check.
- refill: rank N regenerates its whole replay buffer (sleeps --slow-s) before the energy all_reduce; peers wait.
- segv: rank N sends itself SIGSEGV after step 1.
- exit3: rank N prints an error line about an empty buffer after step 2 and calls os._exit(3).
- floatsteps: every rank's config has langevin_steps = 20.0, a float; range() raises TypeError.
- none: control, no fault.

What happened (filled in after the runs):
- blowup: rank 2 (np4) and rank 1 (np3): FloatingPointError 'Langevin samples diverged at step 0 (max |x| = inf)'; peers closed.
- buffer: rank 1 (np3) and rank 3 (np4, spawn): FileNotFoundError for replay_buffer_step400.pt before step 0; peers closed/SIGTERM.
- imgsize: every rank: RuntimeError 'Sizes of tensors must match ... Expected size 8 but got size 16' in torch.cat at step 0.
- cfgkey: rank 2 (np4, legacy launch) and rank 0 (np3, logfmt): KeyError 'langevin_noise'; Root Cause the faulty rank, peers SIGTERM.
- counts: rank 1 (np4): after 5 steps a gloo::EnforceNotMet '10 vs 8 ... collective mismatch' abort (exit 134) on a peer.
- ckptwidth: rank 2 (np3, files) and rank 1 (np4): RuntimeError size mismatch for c1.weight [12,1,3,3] vs [8,1,3,3].
- nanlog: rank 3 (np4) and rank 1 (np3, spawn): FloatingPointError 'contrastive divergence loss is nan at step 0'.
- refill: rank 1 (np4, slow 40 s): peers gloo "Timed out waiting 12000ms"; rank 2 (np3, slow 1000 s, PG 300 s): killed by timeout, exit 124.
- segv: rank 2 (np4, pdsh2) and rank 1 (np3, legacy): SIGSEGV after step 1, exitcode -11 in the Root Cause block.
- exit3: rank 1 (np3, logfmt): 'ERROR rank 1: replay buffer holds 0 finite samples ...' then exit 3; Root Cause rank 1.
- floatsteps: every rank (np4, tee): TypeError 'float' object cannot be interpreted as an integer in range(); Root Cause rank 3.
- none: np3 bashloop: 5 clean steps, 'replay buffer refreshed 240 samples over 3 ranks', model saved, exit 0.
"""
import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault215_work"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prep", type=int, default=0)
    return p.parse_args()


class EnergyNet(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.c1 = nn.Conv2d(1, width, 3, padding=1)
        self.c2 = nn.Conv2d(width, width, 3, padding=1, stride=2)
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = nn.functional.silu(self.c1(x))
        h = nn.functional.silu(self.c2(h))
        return self.head(h.mean(dim=(2, 3))).squeeze(1)


def textures(n, size, gen):
    ys, xs = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    freq = 0.5 + torch.rand(n, 1, 1, generator=gen) * 1.5
    theta = torch.rand(n, 1, 1, generator=gen) * math.pi
    phase = torch.rand(n, 1, 1, generator=gen) * 2 * math.pi
    img = torch.sin(freq * (xs * torch.cos(theta) + ys * torch.sin(theta)) + phase)
    return (img + 0.05 * torch.randn(n, size, size, generator=gen)).unsqueeze(1)


def prep():
    os.makedirs(WORK, exist_ok=True)
    cfg = {"langevin_step_size": 0.05, "langevin_noise": 0.005, "langevin_steps": 8, "prior_weight": 0.1,
           "reg_alpha": 0.1, "lr": 1e-3, "batch": 16, "image_size": 8, "buffer": f"{WORK}/replay_buffer.pt"}
    json.dump(cfg, open(f"{WORK}/ebm_config.json", "w"), indent=1)
    json.dump({**cfg, "buffer": f"{WORK}/replay_buffer_16px.pt"}, open(f"{WORK}/ebm_config_16px.json", "w"), indent=1)
    json.dump({**cfg, "langevin_steps": 20.0}, open(f"{WORK}/ebm_config_sweep.json", "w"), indent=1)
    old = {k: v for k, v in cfg.items() if k != "langevin_noise"}
    json.dump({**old, "noise": 0.005}, open(f"{WORK}/ebm_config_v1.json", "w"), indent=1)
    torch.save(torch.rand(256, 1, 8, 8) * 2 - 1, f"{WORK}/replay_buffer.pt")
    torch.save(torch.rand(256, 1, 16, 16) * 2 - 1, f"{WORK}/replay_buffer_16px.pt")
    torch.manual_seed(0)
    torch.save(EnergyNet(8).state_dict(), f"{WORK}/ebm_init.pt")
    torch.save(EnergyNet(12).state_dict(), f"{WORK}/ebm_init_w12.pt")
    print(f"wrote configs, replay buffers and warm-start checkpoints under {WORK}")


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def make_log(rank, use_logging):
    if not use_logging:
        return (lambda m: print(m, flush=True)), (lambda m: print(m, file=sys.stderr, flush=True))
    lg = logging.getLogger("ebm")
    lg.setLevel(logging.INFO)
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    lg.addHandler(h)
    return lg.info, lg.error


def langevin(model, x, n_steps, step_size, noise, prior_w):
    x = x.clone().requires_grad_(True)
    for _ in range(n_steps):
        e = model(x) + 0.5 * prior_w * x.pow(2).flatten(1).sum(1)
        g, = torch.autograd.grad(e.sum(), x)
        x = (x - step_size * g + noise * torch.randn_like(x)).detach().requires_grad_(True)
    return x.detach()


def worker(rank, world, a):
    torch.set_num_threads(1)
    info, error = make_log(rank, a.logfmt)
    hit = lambda name: a.fault == name and a.rank in (-1, rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    cfg_path = f"{WORK}/ebm_config.json"
    if hit("imgsize"):
        cfg_path = f"{WORK}/ebm_config_16px.json"
    if hit("floatsteps"):
        cfg_path = f"{WORK}/ebm_config_sweep.json"
    if hit("cfgkey"):
        cfg_path = f"{WORK}/ebm_config_v1.json"
    cfg = json.load(open(cfg_path))
    step_size = cfg["langevin_step_size"]
    noise = cfg["langevin_noise"]
    n_steps = cfg["langevin_steps"]
    if hit("blowup"):
        step_size = float("1e6")
    info(f"rank {rank}/{world}: config {cfg_path} step_size={step_size} noise={noise} langevin_steps={n_steps}")
    buf_path = cfg["buffer"]
    if hit("buffer"):
        buf_path = f"{WORK}/replay_buffer_step400.pt"
        info(f"rank {rank}: resuming replay buffer from {buf_path}")
    buffer = torch.load(buf_path)
    ages = torch.zeros(4)
    model = EnergyNet(8)
    init = f"{WORK}/ebm_init_w12.pt" if hit("ckptwidth") else f"{WORK}/ebm_init.pt"
    model.load_state_dict(torch.load(init))
    info(f"rank {rank}: warm-started energy net from {init}, replay buffer {tuple(buffer.shape)}")
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"], betas=(0.0, 0.999))
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        pos = textures(cfg["batch"], cfg["image_size"], gen)
        idx = torch.randint(0, buffer.shape[0], (cfg["batch"],), generator=gen)
        neg = langevin(model, buffer[idx], n_steps, step_size, noise, cfg["prior_weight"])
        if not torch.isfinite(neg).all() or neg.abs().max() > 1e4:
            raise FloatingPointError(f"rank {rank}: Langevin samples diverged at step {step} "
                                     f"(max |x| = {neg.abs().max().item():.3g}, step_size={step_size})")
        buffer[idx] = neg.clamp(-1, 1)
        ages[min(step, 3)] += cfg["batch"]
        e = ddp(torch.cat([pos, neg]))
        e_pos, e_neg = e[: cfg["batch"]], e[cfg["batch"]:]
        if hit("nanlog"):
            reg = cfg["reg_alpha"] * torch.log(1 - (1 + e_pos.pow(2).mean() + e_neg.pow(2).mean()))
        else:
            reg = cfg["reg_alpha"] * torch.log(1 + e_pos.pow(2).mean() + e_neg.pow(2).mean())
        loss = e_pos.mean() - e_neg.mean() + reg
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: contrastive divergence loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if hit("refill") and step == 2:
            info(f"rank {rank}: replay buffer stale, regenerating all 4096 samples with 200 Langevin steps")
            time.sleep(a.slow_s)
        stats = torch.stack([e_pos.mean().detach(), e_neg.mean().detach()])
        dist.all_reduce(stats)
        stats /= world
        info(f"rank {rank} step {step} loss {loss.item():.4f} E+ {stats[0].item():.4f} E- {stats[1].item():.4f}")
        if hit("segv") and step == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        if hit("exit3") and step == 2:
            error(f"ERROR rank {rank}: replay buffer holds 0 finite samples after refresh; refusing to continue")
            os._exit(3)
    if hit("counts"):
        ages = torch.cat([ages, torch.zeros(1)])
    gathered = [torch.zeros_like(ages) for _ in range(world)]
    dist.all_gather(gathered, ages)
    if rank == 0:
        total = int(sum(g.sum().item() for g in gathered))
        info(f"replay buffer refreshed {total} samples over {world} ranks")
        torch.save(model.state_dict(), f"{WORK}/ebm_final.pt")
        info(f"saved energy model to {WORK}/ebm_final.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_entry(rank, world, a):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    worker(rank, world, a)


def main():
    a = parse()
    if a.prep:
        prep()
        return
    if a.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(a.port)
        mp.spawn(spawn_entry, args=(a.spawn, a), nprocs=a.spawn)
        return
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

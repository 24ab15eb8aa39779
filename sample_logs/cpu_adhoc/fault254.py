"""A two-hundred-and-fifty-fourth hand-run batch: NEURAL CELLULAR AUTOMATA LEARNING TO GROW A PATTERN.

A 16-channel cellular automaton on a synthetic 32x32 grid: fixed Sobel/identity perception (depthwise conv),
a per-cell update network (1x1 convs 48 -> hidden 64 -> 16, initialised from ckpt/update_h64.pt), stochastic
fire rate, alive masking (max-pool of the alpha channel), a sample pool of 64 states per rank seeded with one
live cell, damage augmentation (a disc zeroed in the two worst pool samples), DDP (gloo) over the update net,
the RGBA pattern-match loss all_reduced for the log, the pool indices all_gathered, then barrier and
destroy_process_group. Targets come from /tmp/job_work/patterns/<file>.pt via a small registry.
Launch: torchrun, a bash loop (env://), torch.distributed.launch, or --spawn N (torch.multiprocessing.spawn).

Faults:
- nan: rank N reads an update step size of 1e20; the state overflows to inf and the loss check raises.
- poolidx: rank N all_gathers its batch indices plus the damaged slots (another length) after step 1.
- target: rank N looks for its target in patterns_v2/, which does not exist (FileNotFoundError at startup).
- poolrange: rank N takes the "newest" pool slots with an off-by-one, index 64 in a pool of 64 (IndexError).
- pattern: rank N's config names the pattern "gecko", which is not in the registry (KeyError at startup).
- perceive: every rank builds the perception filters for the 4 RGBA channels instead of 16 state channels.
- ckpt: rank N loads ckpt/update_h96.pt (hidden 96) into the hidden-64 update net (size mismatch).
- regrow: rank N regrows its whole pool from the seed for --stall seconds before step 2 (others wait).
- segv: rank N sends itself SIGSEGV after step 2's optimizer step.
- exit2: rank N prints its own error line about a corrupt pool snapshot and calls os._exit(2) at step 1.
- none: control.

What happened (filled in after the runs):
- nan: FloatingPointError 'pattern loss is nan at step 1 after 16 CA steps' on rank N; peers closed (nca_nan_np3_r0_logfmt, nca_nan_np4_r2_ranklabel).
- poolidx: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (4))' on rank N (nca_poolidx_np3_r1_srunlabel, _np4_r2_spawn).
- target: FileNotFoundError for /tmp/job_work/patterns_v2/ring_32.pt on rank N at startup (nca_target_np4_r3_mpitag, nca_target_np3_r0_files).
- poolrange: IndexError: index 64 is out of bounds for dimension 0 with size 64 on rank N (nca_poolrange_np3_r1_spawn, _np4_r3_bashloop).
- pattern: KeyError: 'gecko' on rank N at startup; agent SIGTERMed the rest (nca_pattern_np3_r2_legacy, nca_pattern_np4_r1_tee).
- perceive: every rank: 'Given groups=16, expected weight to be at least 16 ... [12, 1, 3, 3]' (nca_perceive_np3_rall_logfmt).
- ckpt: size mismatch for fc0.weight [96, 48, 1, 1] vs [64, 48, 1, 1] on rank N (nca_ckpt_np3_r1_files, nca_ckpt_np4_r2_legacy).
- regrow: PG 12 s: peers 'Timed out waiting 12000ms' (nca_regrow_np3_r1_tee); PG 300 s: killed at 60 s, exit 124 (_np3_r2_ranklabel).
- segv: rank N SIGSEGV, no traceback; peers closed/reset (nca_segv_np3_r0_mpitag exit 139, nca_segv_np4_r1_pdsh2 Root Cause -11).
- exit2: 'ERROR rank N: pool snapshot ... holds 61 states' then exit 2; peers closed (nca_exit2_np3_r2_bashloop, _np4_r1_srunlabel).
- none: exit 0, 'rank 0 done: 5 steps, final global loss 0.11282' (nca_none_np3_rnone_bashloop).
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault254_work"
CH, GRID, POOL, BATCH = 16, 32, 64, 4
REGISTRY = {"ring": "ring_32.pt", "cross": "cross_32.pt", "diamond": "diamond_32.pt"}

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--ca-steps", type=int, default=16)
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


class UpdateNet(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.fc0 = nn.Conv2d(CH * 3, hidden, 1)
        self.fc1 = nn.Conv2d(hidden, CH, 1, bias=False)

    def forward(self, x):
        return self.fc1(F.relu(self.fc0(x)))


def make_pattern(kind):
    yy, xx = torch.meshgrid(torch.arange(GRID), torch.arange(GRID), indexing="ij")
    c = (GRID - 1) / 2
    if kind == "ring":
        r = ((yy - c) ** 2 + (xx - c) ** 2).sqrt()
        m = ((r > 6) & (r < 11)).float()
    elif kind == "cross":
        m = (((yy - c).abs() < 3) | ((xx - c).abs() < 3)).float() * (((yy - c).abs() < 12) & ((xx - c).abs() < 12)).float()
    else:
        m = (((yy - c).abs() + (xx - c).abs()) < 10).float()
    rgb = torch.stack([m * 0.9, m * 0.4, m * 0.2])
    return torch.cat([rgb, m[None]], 0)


def prep():
    os.makedirs(f"{WORK}/patterns", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for name, fn in REGISTRY.items():
        torch.save(make_pattern(name), f"{WORK}/patterns/{fn}")
    torch.manual_seed(0)
    torch.save(UpdateNet(64).state_dict(), f"{WORK}/ckpt/update_h64.pt")
    torch.save(UpdateNet(96).state_dict(), f"{WORK}/ckpt/update_h96.pt")
    print("prepared", WORK)


def perception_filters(channels):
    ident = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    sobel_x = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 8.0
    bank = torch.stack([ident, sobel_x, sobel_x.T])
    return bank.repeat(channels, 1, 1)[:, None]


def seed_state(n):
    x = torch.zeros(n, CH, GRID, GRID)
    x[:, 3:, GRID // 2, GRID // 2] = 1.0
    return x


def ca_step(net, x, filt, step_size, fire_rate=0.5):
    pre_alive = F.max_pool2d(x[:, 3:4], 3, 1, 1) > 0.1
    y = F.conv2d(x, filt, padding=1, groups=CH)
    dx = net(y) * step_size
    fire = (torch.rand(x.shape[0], 1, GRID, GRID) <= fire_rate).float()
    x = x + dx * fire
    post_alive = F.max_pool2d(x[:, 3:4], 3, 1, 1) > 0.1
    return x * (pre_alive & post_alive).float()


def damage(x, k):
    yy, xx = torch.meshgrid(torch.arange(GRID), torch.arange(GRID), indexing="ij")
    for i in range(k):
        cy, cx = torch.randint(8, GRID - 8, (2,)).tolist()
        x[i] *= (((yy - cy) ** 2 + (xx - cx) ** 2) > 36).float()[None]
    return x


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
        lg = logging.getLogger("nca")
        lg.addFilter(RankFilter(rank))
        log = lg.info
    torch.manual_seed(1234 + rank)

    pattern = ["ring", "cross", "diamond"][rank % 3]
    if a.fault == "pattern" and hit:
        pattern = "gecko"
    pat_dir = "patterns_v2" if (a.fault == "target" and hit) else "patterns"
    target = torch.load(f"{WORK}/{pat_dir}/{REGISTRY[pattern]}")
    log(f"rank {rank}/{world} growing pattern {pattern} ({int(target[3].sum())} live cells), pool {POOL}")

    net = UpdateNet(64)
    ck = "update_h96.pt" if (a.fault == "ckpt" and hit) else "update_h64.pt"
    net.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    with torch.no_grad():
        net.fc1.weight.zero_()
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    filt = perception_filters(4 if a.fault == "perceive" else CH)
    step_size = 1e20 if (a.fault == "nan" and hit) else 1.0
    pool = seed_state(POOL)

    for step in range(a.steps):
        if a.fault == "regrow" and hit and step == 2:
            log(f"rank {rank} regrowing the whole pool of {POOL} from the seed before step {step}")
            time.sleep(a.stall)
        if a.fault == "exit2" and hit and step == 1:
            print(f"ERROR rank {rank}: pool snapshot {WORK}/pool/pool_r{rank}.npz holds 61 states for a pool of {POOL}; "
                  f"refusing to resume from a truncated pool", file=sys.stderr, flush=True)
            os._exit(2)
        if a.fault == "poolrange" and hit and step == 1:
            idx = torch.arange(POOL - BATCH + 1, POOL + 1)
        else:
            idx = torch.randperm(POOL)[:BATCH]
        x = pool[idx]
        with torch.no_grad():
            err = ((x[:, :4] - target) ** 2).mean(dim=(1, 2, 3))
            order = err.argsort(descending=True)
            idx, x = idx[order], x[order]
            x[:1] = seed_state(1)
            x = damage(x, 2) if step > 0 else x
        for _ in range(a.ca_steps):
            x = ca_step(model, x, filt, step_size)
        loss = ((x[:, :4] - target) ** 2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: pattern loss is {loss.item()} at step {step} after {a.ca_steps} CA steps; aborting")
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():
            prm.grad /= prm.grad.norm() + 1e-8
        opt.step()
        with torch.no_grad():
            pool[idx] = x.detach()
        if a.fault == "segv" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        glob = loss.detach().clone()
        dist.all_reduce(glob)
        sent = torch.cat([idx, idx[:2]]) if (a.fault == "poolidx" and hit and step == 1) else idx
        gathered = [torch.zeros(BATCH, dtype=torch.long) for _ in range(world)]
        dist.all_gather(gathered, sent)
        log(f"rank {rank} step {step} loss {loss.item():.5f} global {glob.item() / world:.5f} pool slots {idx.tolist()}")
    dist.barrier()
    if rank == 0:
        log(f"rank 0 done: {a.steps} steps, final global loss {glob.item() / world:.5f}")
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

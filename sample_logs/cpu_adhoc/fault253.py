"""A two-hundred-and-fifty-third hand-run batch: COLLABORATIVE FILTERING WITH A VARIATIONAL AUTOENCODER (MULT-VAE).

The program trains a Mult-VAE on synthetic implicit-feedback data: each rank loads its users' (user, item)
interaction pairs from data/inter_R.pt, builds a dense user x item matrix (200 items), L2-normalises each row,
encodes it to a Gaussian latent (mu, logvar), samples z, decodes to multinomial logits over items and minimises
-log-likelihood + beta * KL with beta annealed linearly. DDP over gloo, 6 steps with `rank R step S loss L` lines,
then recall@20 per held-out user all_gathered and NDCG@20 all_reduced, barrier, destroy_process_group.
`--prep` writes the data and checkpoints; `--spawn N` launches through torch.multiprocessing.spawn;
`--logfmt 1` logs through Python logging with the rank in the format.

Faults:
- emptyuser: on rank N user 37 has no interactions left after dedup; its row sums to 0, normalising gives NaN,
  the program's finite-loss check raises FloatingPointError at step 2.
- recall: rank N drops the last held-out user when evaluating, so its recall list all_gathered is 31 long, not 32.
- nomatrix: rank N reads data/v2/inter_N.pt, which does not exist (FileNotFoundError at startup).
- itemid: rank N shifts item ids to 1-based; building the dense matrix indexes item 200 (IndexError).
- segment: rank N asks the split table for the segment 'cold_start', which it does not hold (KeyError).
- latent: every rank builds the decoder with latent 16 while the encoder gives latent 32 (shape error at step 0).
- ckpt: rank N loads ckpt/vae_init_i300.pt, written for 300 items (state_dict size mismatch before DDP).
- fullrank: rank N scores all items for all users without batching (sleeps --stall s) before the eval all_reduce.
- sigterm: rank N sends itself SIGTERM after step 3.
- exit5: rank N prints an error line about duplicate interactions at step 2 and calls sys.exit(5).
- none: control.

What happened (filled in after the runs):
- emptyuser: FloatingPointError "rank N: loss is nan at step 2 (nll nan, beta 0.067)" on rank N; peers Connection closed by peer (np4 r2 ranklabel, np3 r1 logfmt).
- recall: "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (31), got (32))" on rank N after step 5; peers closed (np3 r1 srunlabel, np4 r3 mpitag).
- nomatrix: FileNotFoundError for /tmp/job_work/data/v2/inter_N.pt on rank N at startup; peers closed in DDP init or SIGTERMed (np4 r3 files, np3 r2 spawn).
- itemid: IndexError "index 200 is out of bounds for dimension 1 with size 200" on rank N at startup (np3 r2 tee, np4 r1 mpitag).
- segment: KeyError 'cold_start' on rank N at startup; peers closed or SIGTERMed (np4 r1 pdsh2, np3 r2 bashloop).
- latent: every rank RuntimeError "mat1 and mat2 shapes cannot be multiplied (16x32 and 16x64)" at step 0 (np3 spawn, np4 legacy).
- ckpt: RuntimeError loading state_dict for VAE, size mismatch [64, 300] vs [64, 200], on rank N before DDP (np3 r2 logfmt, np4 r3 ranklabel).
- fullrank: rank N sleeps 30 s, peers "Timed out waiting 12000ms" in all_gather (np3 r1 srunlabel); PG 300 s run killed by timeout 60, exit 124 (np4 r2 bashloop).
- sigterm: rank N exitcode -15 after its step-3 line, Root Cause rank N; peers closed/reset, one aborted (np4 r1 legacy, np3 r2 tee).
- exit5: rank N ERROR line and exit status 5 after step 2; peers closed (np3 r1 bashloop, exit 5; np4 r2 pdsh2, worker-1 Root Cause exitcode 5).
- none: exit 0, "rank 0 recall@20 0.1020 NDCG@20 0.0807 over 96 users" (np3 bashloop).
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

ITEMS = 200
USERS = 64
WORK = "/tmp/fault253_work"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--latent", type=int, default=32)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prep", action="store_true")
    return p.parse_args()


class VAE(nn.Module):
    def __init__(self, items, latent, dec_latent):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(items, 64), nn.Tanh(), nn.Linear(64, 2 * latent))
        self.dec = nn.Sequential(nn.Linear(dec_latent, 64), nn.Tanh(), nn.Linear(64, items))
        self.latent = latent

    def forward(self, x):
        h = self.enc(x / x.norm(dim=1, keepdim=True))
        mu, logvar = h[:, : self.latent], h[:, self.latent :]
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


def prep():
    g = torch.Generator().manual_seed(0)
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        pairs = []
        for u in range(USERS):
            items = torch.randperm(ITEMS, generator=g)[: 5 + u % 11]
            pairs += [(u, int(i)) for i in items]
        torch.save({"pairs": torch.tensor(pairs), "segments": {"heavy": list(range(0, 32)), "light": list(range(32, 64))}},
                   f"{WORK}/data/inter_{r}.pt")
    torch.manual_seed(0)
    torch.save(VAE(ITEMS, 32, 32).state_dict(), f"{WORK}/ckpt/vae_init.pt")
    torch.save(VAE(300, 32, 32).state_dict(), f"{WORK}/ckpt/vae_init_i300.pt")
    print("prepared", WORK)


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def main(a, rank=None, world=None):
    if rank is None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mine = a.fault != "none" and a.rank in (-1, rank)
    if a.logfmt:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        h.addFilter(RankFilter(rank))
        logger = logging.getLogger("mvae")
        logger.addHandler(h)
        logger.setLevel(logging.INFO)
        info, error = logger.info, logger.error
    else:
        info = lambda m: print(m, flush=True)
        error = lambda m: print(m, file=sys.stderr, flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(1234 + rank)
    src = f"{WORK}/data/v2/inter_{rank}.pt" if mine and a.fault == "nomatrix" else f"{WORK}/data/inter_{rank}.pt"
    blob = torch.load(src)
    pairs, segments = blob["pairs"], blob["segments"]
    if mine and a.fault == "itemid":
        pairs = torch.stack([pairs[:, 0], pairs[:, 1] + 1], 1)
    X = torch.zeros(USERS, ITEMS)
    X[pairs[:, 0], pairs[:, 1]] = 1.0
    if mine and a.fault == "emptyuser":
        X[37] = 0.0
    seg = "cold_start" if mine and a.fault == "segment" else ("heavy" if rank % 2 == 0 else "light")
    users = segments[seg]
    info(f"rank {rank} loaded {int(X.sum())} interactions for {USERS} users x {ITEMS} items, segment {seg} ({len(users)} users)")
    ck = f"{WORK}/ckpt/vae_init_i300.pt" if mine and a.fault == "ckpt" else f"{WORK}/ckpt/vae_init.pt"
    model = VAE(ITEMS, a.latent, 16 if mine and a.fault == "latent" else a.latent)
    if a.fault != "latent":
        model.load_state_dict(torch.load(ck))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    for step in range(a.steps):
        xb = X[(step * 16) % USERS : (step * 16) % USERS + 16] if step < 4 else X[32 + (step % 2) * 16 : 48 + (step % 2) * 16]
        if step == 2 and mine and a.fault == "emptyuser":
            xb = X[32:48]
        beta = min(0.2, 0.2 * step / a.steps)
        logits, mu, logvar = ddp(xb)
        nll = -(F.log_softmax(logits, -1) * xb).sum(-1).mean()
        kl = (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)).mean()
        loss = nll + beta * kl
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (nll {nll.item()}, beta {beta:.3f})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        info(f"rank {rank} step {step} loss {loss.item():.4f} beta {beta:.3f}")
        if step == 2 and mine and a.fault == "exit5":
            error(f"ERROR rank {rank}: {WORK}/data/inter_{rank}.pt holds 14 duplicate (user, item) pairs after dedup; refusing to train on double-counted clicks")
            sys.exit(5)
        if step == 3 and mine and a.fault == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
    # evaluation: hold out the last 32 users, rank items by logits
    model.eval()
    ev = X[32:] if not (mine and a.fault == "recall") else X[32:63]
    if mine and a.fault == "fullrank":
        info(f"rank {rank} scoring all {ITEMS} items for all {USERS} users without batching (full ranking)")
        time.sleep(a.stall)
    with torch.no_grad():
        logits, _, _ = model(ev)
    top = logits.topk(20, dim=1).indices
    hits = torch.gather(ev, 1, top)
    recall = hits.sum(1) / ev.sum(1).clamp(min=1, max=20)
    disc = 1.0 / torch.log2(torch.arange(2, 22).float())
    ndcg = (hits * disc).sum(1) / torch.stack([disc[: int(min(n, 20))].sum() for n in ev.sum(1)])
    gathered = [torch.zeros(32) for _ in range(world)]
    dist.all_gather(gathered, recall)
    tot = torch.tensor([ndcg.sum().item(), float(len(ndcg))])
    dist.all_reduce(tot)
    if rank == 0:
        info(f"rank 0 recall@20 {torch.cat(gathered).mean():.4f} NDCG@20 {tot[0] / tot[1]:.4f} over {int(tot[1])} users")
    dist.barrier()
    dist.destroy_process_group()


def spawned(i, n, a):
    os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(i), str(n), str(i)
    main(a, i, n)


if __name__ == "__main__":
    args = parse()
    if args.prep:
        prep()
    elif args.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        torch.multiprocessing.spawn(spawned, args=(args.spawn, args), nprocs=args.spawn)
    else:
        main(args)

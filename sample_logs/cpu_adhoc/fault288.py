"""A two-hundred-and-eighty-eighth hand-run batch: CROSS-DOMAIN RECOMMENDATION WITH SHARED USERS.

Two synthetic domains of user-item ratings ("books" with 40 items, "movies" with 30) over 64 users, many of them
rated in both domains; each rank trains on its shard (rows rank::world) of both ratings files. A shared user
tower (embedding + projection), one item tower per domain, a per-domain user adapter, a mapping loss between
the domains on the overlap users, DDP (gloo; --ddp 0 all-reduces gradients by hand), per-rank overlap counts
all_gathered at step 2, the RMSE per domain on the overlap users all_reduced at the end, destroy_process_group.
--prep 1 writes the ratings files and the user tower checkpoints into the work dir.

Faults:
- itemidx: from step 1 rank N uses 1-based movie ids, so the last movie id is 30 in a table of 30 (IndexError).
- emptyoverlap: rank N keeps the movies user-id offset (+64), so its overlap is empty and the RMSE NaN (check).
- overlapgather: at step 2 rank N all_gathers [books, movies, cold] overlap counts (3 values, the others 2).
- noratings: rank N reads its ratings from ratings_v2/, which does not exist (FileNotFoundError).
- domainkey: rank N's domain list names "Movies", not in the domain table (KeyError).
- userwidth: every rank builds the user tower with an output width of 24 while the item towers use 16.
- userckpt: with --resume 1 rank N loads ckpt/user_tower_pruned.pt, which lacks proj.bias (strict load).
- resplit: at step 3 rank N re-splits the overlap users with a Python loop over every pair for --stall seconds.
- oddtower: rank N runs the movies tower only on odd steps; DDP has find_unused_parameters off.
- exit3: at step 2 rank N logs an error about a stale overlap table and calls sys.exit(3).
- sigsegv: rank N sends itself SIGSEGV after step 3's optimizer step.
- none: control.

What happened (filled in after the runs):
- itemidx: IndexError: index out of range in self on rank N at step 1; peers Connection closed / DETAIL monitoredBarrier (cdr_itemidx_np3_r1_plain, _np4_r2_detail).
- emptyoverlap: FloatingPointError 'non-finite overlap RMSE on rank N: [nan, nan] (0 overlap users)' before step 0 (cdr_emptyoverlap_np3_r2_tee, _np4_r1_prefix).
- overlapgather: the receiving rank aborts on gloo::EnforceNotMet '6 vs 4. Received data size doesn't match' at step 2 (cdr_overlapgather_np3_r1_tee_trainer, _np4_r3_pymodule).
- noratings: FileNotFoundError for /tmp/job_work/ratings_v2/books.npz on rank N at startup (cdr_noratings_np3_r2_redirects, _np4_r1_filter).
- domainkey: KeyError: 'Movies' on rank N at startup (cdr_domainkey_np4_r2_pdsh2: worker-1 Root Cause rank 2; cdr_domainkey_np3_r0_loglevel).
- userwidth: every rank: 'mat1 and mat2 shapes cannot be multiplied (Nx24 and 16x16)' in the initial RMSE (cdr_userwidth_np3_rall_wrapper, _np4_rall_plain).
- userckpt: Missing key(s) in state_dict: "proj.bias" for UserTower on rank N, also after a restart (cdr_userckpt_np3_r1_loglevel, _np4_r2_restart).
- resplit: PG 12 s: peers 'Timed out waiting 12000ms' (cdr_resplit_np3_r1_plain); PG 300 s: killed at 60 s, exit 124 (cdr_resplit_np3_r2_tee).
- oddtower: 'Expected to have finished reduction in the prior iteration' on rank N at step 1 (cdr_oddtower_np3_r1_tee, _np4_r2_wrapper).
- exit3: rank N's ERROR line then exit 3 (cdr_exit3_np4_r1_prefix) or 'terminate called without an active exception', -6 (cdr_exit3_np3_r2_pymodule).
- sigsegv: rank N dies by SIGSEGV after step 3, Root Cause exitcode -11; peers Connection reset (cdr_sigsegv_np4_r1_filter, _np3_r2_tee_trainer).
- none: exit 0, 'rank 0 done: 6 steps, overlap RMSE books 1.079 movies 1.154' (cdr_none_np3_rnone_plain).
"""
import argparse
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

N_USERS = 64
N_ITEMS = {"books": 40, "movies": 30}
DIM = 16


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--resume", type=int, default=0)
    p.add_argument("--prep", type=int, default=0)
    p.add_argument("--work", default="/tmp/fault288_work")
    return p.parse_args()


class UserTower(nn.Module):
    def __init__(self, out_dim):
        super().__init__()
        self.emb = nn.Embedding(N_USERS, 32)
        self.proj = nn.Linear(32, out_dim)

    def forward(self, u):
        return torch.tanh(self.proj(self.emb(u)))


class CrossDomain(nn.Module):
    def __init__(self, user_out):
        super().__init__()
        self.user = UserTower(user_out)
        self.items = nn.ModuleDict({d: nn.Embedding(n, DIM) for d, n in N_ITEMS.items()})
        self.adapt = nn.ModuleDict({d: nn.Linear(DIM, DIM) for d in N_ITEMS})
        self.mapping = nn.Linear(DIM, DIM)

    def score(self, d, u, i):
        return 3.0 + (self.adapt[d](self.user(u)) * self.items[d](i)).sum(-1)

    def forward(self, ua, ia, ub, ib, ov, use_b=True):
        pa = self.score("books", ua, ia)
        pb = self.score("movies", ub, ib) if use_b else None
        shared = self.user(ov)
        map_loss = ((self.mapping(self.adapt["books"](shared)) - self.adapt["movies"](shared)) ** 2).mean()
        return pa, pb, map_loss


def prep(work):
    rng = np.random.default_rng(288)
    os.makedirs(f"{work}/ratings", exist_ok=True)
    os.makedirs(f"{work}/ckpt", exist_ok=True)
    for d, n in N_ITEMS.items():
        users = rng.integers(0, N_USERS, 800)
        items = rng.integers(0, n, 800)
        ratings = np.clip(np.round(rng.normal(3.5, 1.0, 800)), 1, 5)
        np.savez(f"{work}/ratings/{d}.npz", users=users, items=items, ratings=ratings)
    torch.manual_seed(0)
    sd = UserTower(DIM).state_dict()
    torch.save(sd, f"{work}/ckpt/user_tower.pt")
    torch.save({k: v for k, v in sd.items() if k != "proj.bias"}, f"{work}/ckpt/user_tower_pruned.pt")
    print("wrote ratings and user tower checkpoints to", work)


def load_shard(a, rank, world, domain, bad):
    folder = "ratings_v2" if bad else "ratings"
    z = np.load(f"{a.work}/{folder}/{domain}.npz")
    sl = slice(rank, None, world)
    return (torch.from_numpy(z["users"][sl]).long(), torch.from_numpy(z["items"][sl]).long(),
            torch.from_numpy(z["ratings"][sl]).float())


def overlap_rmse(model, rank, overlap, tables):
    with torch.no_grad():
        rmse = []
        for d in ("books", "movies"):
            u, i, r = tables[d]
            m = torch.isin(u, overlap)
            err = ((model.score(d, u[m].clamp(max=N_USERS - 1), i[m]) - r[m]) ** 2).mean()
            rmse.append(err.sqrt())
        rmse = torch.stack(rmse)
    if not torch.isfinite(rmse).all():
        raise FloatingPointError(f"non-finite overlap RMSE on rank {rank}: {rmse.tolist()} "
                                 f"({len(overlap)} overlap users)")
    return rmse


def main():
    a = parse()
    if a.prep:
        prep(a.work)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = a.rank in (-1, rank)
    torch.manual_seed(rank)
    domains = ["books", "Movies" if (a.fault == "domainkey" and mine) else "movies"]
    tables = {}
    for d in domains:
        n_items = N_ITEMS[d]
        tables[d.lower()] = load_shard(a, rank, world, d.lower(), a.fault == "noratings" and mine)
        print(f"rank {rank}: {d.lower()} shard {len(tables[d.lower()][0])} ratings, {n_items} items", flush=True)
    ua_all, ia_all, ra_all = tables["books"]
    ub_all, ib_all, rb_all = tables["movies"]
    if a.fault == "emptyoverlap" and mine:
        ub_all = ub_all + N_USERS  # movies user ids are stored with an offset in the export
        tables["movies"] = (ub_all, ib_all, rb_all)
    overlap = torch.tensor(sorted(set(ua_all.tolist()) & set(ub_all.tolist())), dtype=torch.long)
    print(f"rank {rank}: {len(overlap)} overlap users", flush=True)
    user_out = 24 if (a.fault == "userwidth" and mine) else DIM
    model = CrossDomain(user_out)
    if a.resume:
        name = "user_tower_pruned.pt" if (a.fault == "userckpt" and mine) else "user_tower.pt"
        model.user.load_state_dict(torch.load(f"{a.work}/ckpt/{name}"), strict=True)
        print(f"rank {rank}: resumed user tower from ckpt/{name}", flush=True)
    net = DDP(model, find_unused_parameters=False) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    rmse0 = overlap_rmse(model, rank, overlap, tables)
    print(f"rank {rank}: initial overlap RMSE books {rmse0[0]:.3f} movies {rmse0[1]:.3f}", flush=True)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        ja = torch.randint(0, len(ua_all), (64,), generator=g)
        jb = torch.randint(0, len(ub_all), (64,), generator=g)
        ib = ib_all[jb]
        if a.fault == "itemidx" and mine and step >= 1:
            ib = ib + 1  # 1-based movie ids from the export
        use_b = not (a.fault == "oddtower" and mine and step % 2 == 0)
        ov = overlap[torch.randint(0, max(len(overlap), 1), (16,), generator=g)] if len(overlap) else overlap
        pa, pb, map_loss = net(ua_all[ja], ia_all[ja], ub_all[jb].clamp(max=N_USERS - 1), ib, ov, use_b)
        loss = ((pa - ra_all[ja]) ** 2).mean() + 0.1 * map_loss
        if pb is not None:
            loss = loss + ((pb - rb_all[jb]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step == 2:
            if a.fault == "exit3" and mine:
                print(f"rank {rank}: ERROR overlap user table is stale (built before the movies re-index); "
                      f"refusing to continue", file=sys.stderr, flush=True)
                sys.exit(3)
            mask_a, mask_b = torch.isin(ua_all, overlap), torch.isin(ub_all, overlap)
            counts = [int(mask_a.sum()), int(mask_b.sum())]
            if a.fault == "overlapgather" and mine:
                counts.append(len(ua_all) - int(mask_a.sum()))  # cold-start users too
            t = torch.tensor(counts, dtype=torch.float32)
            out = [torch.zeros_like(t) for _ in range(world)]
            dist.all_gather(out, t)
            if rank == 0:
                print("overlap rating counts per rank:", [o.tolist() for o in out], flush=True)
        if step == 3 and a.fault == "resplit" and mine:
            print(f"rank {rank}: re-splitting {len(overlap)} overlap users pairwise for the mapping loss",
                  flush=True)
            t0, pairs = time.time(), 0
            while time.time() - t0 < a.stall:
                for i in range(N_USERS):
                    for j in range(N_USERS):
                        pairs += int(i != j)
        if step == 3 and a.fault == "sigsegv" and mine:
            os.kill(os.getpid(), signal.SIGSEGV)
    rmse = overlap_rmse(model, rank, overlap, tables)
    dist.all_reduce(rmse)
    rmse /= world
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, overlap RMSE books {rmse[0]:.3f} movies {rmse[1]:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

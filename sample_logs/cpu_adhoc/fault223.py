"""A two-hundred-and-twenty-third hand-run batch: SESSION-BASED RECOMMENDATION. A GRU4Rec-style model (item
embedding -> GRU cell -> scores against the item embeddings) trained with DDP (or hand all_reduced gradients with
--ddp 0) on synthetic click sessions. Each rank reads the item catalogue file, builds session-parallel mini-batches
whose hidden states are reset when a session ends, trains with a sampled softmax whose negatives are drawn from
item popularity, all_reduces the loss, computes recall@20 and MRR by hand on held-out sessions (all_reduced, with
per-rank hit counts all_gathered), rank 0 checkpoints, and each rank reloads the checkpoint for a final check.

Faults:
- itemid: --rank's session shard holds an item id one past the catalogue; the embedding lookup raises IndexError.
- resetmask: the hidden-state reset mask is built with batch size + 1 on every rank (-1): a shape RuntimeError.
- catalog: --rank opens catalogue items-0N.tsv with a wrong suffix (.csv): FileNotFoundError.
- negzero: --rank's popularity counts are all zero (smoothing 0): the program's check raises ValueError on NaN.
- gatherlen: --rank all_gathers recall counts with one extra cutoff (K=5,10,20,50): gloo size mismatch.
- ckpt: --rank reloads a checkpoint saved with 2 more items in the catalogue: size mismatch in load_state_dict.
- category: --rank's catalogue has a category 'giftcards' missing from the category map: KeyError.
- popularity: --rank recomputes popularity over the whole log for --slow-s s before the loss all_reduce.
- segv: --rank sends itself SIGSEGV after step 2.
- exit4: --rank logs an error about an empty evaluation split and calls sys.exit(4).
- none: control.

What happened (filled in after the runs):
- itemid: rank N IndexError 'index 64 is out of bounds for dimension 0 with size 64' at step 0; peers Connection closed.
- resetmask: every rank RuntimeError 'The size of tensor a (8) must match the size of tensor b (9)' at step 0 (np3).
- catalog: rank N FileNotFoundError on /tmp/job_work/items-0N.csv at start; the others SIGTERMed (np4 r3, np5 r1).
- negzero: rank N ValueError 'negative-sampling distribution has 64 NaN probabilities' (np4 r0 DETAIL, np3 r2).
- gatherlen: another rank aborts on gloo EnforceNotMet '8 vs 6 ... size doesn't match' in all_gather (np4 r3, np3 r1).
- ckpt: rank N size mismatch for emb.weight [66, 16] vs [64, 16] in load_state_dict (np3 r2, np4 r1 redirects).
- category: rank N KeyError 'giftcards' in read_catalogue at start (np4 r1 pdsh2, np3 r0).
- popularity: PG 12 s: peers 'Timed out waiting 12000ms' at step 2 (np4 r2); PG 300 s under timeout 60: exit 124.
- segv: rank N exitcode -11 (SIGSEGV) after step 2; peers Connection reset (np4 r3 restart, np3 r1).
- exit4: rank N prints 'ERROR rank N: evaluation split ... has 0 sessions' and exits 4 (np4 r2, np5 r4).
- none: exit 0; rank 0 prints 'eval recall@20 0.4146 MRR 0.0949 over 82 events' and saves the model.
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault223_work"
N_ITEMS = 64
CATS = {"books": 0, "music": 1, "toys": 2, "garden": 3}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    return p.parse_args()


class GRU4Rec(nn.Module):
    def __init__(self, n_items, dim=16):
        super().__init__()
        self.emb = nn.Embedding(n_items, dim)
        self.cell = nn.GRUCell(dim, dim)

    def forward(self, items, h):
        h = self.cell(self.emb(items), h)
        return h


def write_catalogue(rank, hit):
    os.makedirs(WORK, exist_ok=True)
    path = os.path.join(WORK, "items-%02d.tsv" % rank)
    names = list(CATS)
    with open(path, "w") as f:
        for i in range(N_ITEMS):
            cat = names[i % 4]
            if hit("category") and i == 37:
                cat = "giftcards"
            f.write("%d\titem_%d\t%s\n" % (i, i, cat))
    return path


def read_catalogue(path):
    items = {}
    with open(path) as f:
        for line in f:
            iid, name, cat = line.rstrip("\n").split("\t")
            items[int(iid)] = CATS[cat]
    return items


def make_sessions(rank, n_items, g):
    sessions = []
    for s in range(40):
        length = int(torch.randint(2, 7, (1,), generator=g))
        sessions.append(torch.randint(0, n_items, (length,), generator=g).tolist())
    return sessions


def session_parallel(sessions, batch):
    """Yield (inputs, targets, reset mask) for session-parallel mini-batches."""
    active = list(range(batch))
    pos = [0] * batch
    nxt = batch
    while True:
        inp, tgt, reset = [], [], []
        for j in range(batch):
            s = sessions[active[j] % len(sessions)]
            inp.append(s[pos[j]])
            tgt.append(s[pos[j] + 1])
            reset.append(pos[j] == 0)
        yield torch.tensor(inp), torch.tensor(tgt), torch.tensor(reset)
        for j in range(batch):
            pos[j] += 1
            if pos[j] + 1 >= len(sessions[active[j] % len(sessions)]):
                active[j] = nxt
                nxt += 1
                pos[j] = 0


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()

    def hit(name):
        return a.fault == name and (a.rank == -1 or a.rank == rank)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(100 + rank)
    cat_path = write_catalogue(rank, hit)
    if hit("catalog"):
        cat_path = cat_path.replace(".tsv", ".csv")
    catalogue = read_catalogue(cat_path)
    print("rank %d loaded catalogue %s: %d items, %d categories" % (rank, cat_path, len(catalogue),
          len(set(catalogue.values()))), flush=True)

    sessions = make_sessions(rank, N_ITEMS, g)
    if hit("itemid"):
        sessions[3][1] = N_ITEMS
    counts = torch.zeros(N_ITEMS)
    for s in sessions:
        for i in s:
            if i < N_ITEMS:
                counts[i] += 1
    smoothing = 1.0
    if hit("negzero"):
        counts.zero_()
        smoothing = 0.0
    pop = (counts + smoothing) ** 0.75
    probs = pop / pop.sum()
    if torch.isnan(probs).any():
        raise ValueError("negative-sampling distribution has %d NaN probabilities (popularity sum %.1f)"
                         % (int(torch.isnan(probs).sum()), float(pop.sum())))

    model = GRU4Rec(N_ITEMS)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    h = torch.zeros(a.batch, 16)
    batches = session_parallel(sessions, a.batch)
    for step in range(a.steps):
        inp, tgt, reset = next(batches)
        mask_bs = a.batch + 1 if hit("resetmask") else a.batch
        keep = torch.ones(mask_bs, 1)
        keep[: a.batch][reset] = 0.0
        h = h.detach() * keep
        h = net(inp, h)
        negs = torch.multinomial(probs, 32, replacement=True)
        cand = torch.cat([tgt, negs])
        logits = h @ model.emb.weight[cand].t()
        loss = F.cross_entropy(logits, torch.arange(a.batch))
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if hit("popularity") and step == 2:
            print("rank %d: popularity counts stale, recounting over the full click log (412M events)" % rank,
                  flush=True)
            time.sleep(a.slow_s)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print("rank %d step %d loss %.4f" % (rank, step, lt.item() / world), flush=True)
        if hit("segv") and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    # evaluation: recall@K and MRR by hand
    ev = make_sessions(rank, N_ITEMS, torch.Generator().manual_seed(900 + rank))[:10]
    if hit("exit4"):
        print("ERROR rank %d: evaluation split /tmp/fault223_work/eval-%02d.tsv has 0 sessions of length >= 2; "
              "cannot compute recall@20" % (rank, rank), flush=True)
        sys.exit(4)
    cutoffs = [5, 10, 20, 50] if hit("gatherlen") else [5, 10, 20]
    hits = torch.zeros(len(cutoffs))
    rr, n = 0.0, 0
    with torch.no_grad():
        for s in ev:
            hh = torch.zeros(1, 16)
            for i, t in zip(s[:-1], s[1:]):
                hh = model(torch.tensor([i]), hh)
                scores = (hh @ model.emb.weight.t())[0]
                r = int((scores > scores[t]).sum()) + 1
                for k, c in enumerate(cutoffs):
                    hits[k] += float(r <= c)
                rr += 1.0 / r
                n += 1
    tot = torch.tensor([rr, float(n)])
    dist.all_reduce(tot)
    gathered = [torch.zeros(len(cutoffs)) for _ in range(world)]
    dist.all_gather(gathered, hits)
    if rank == 0:
        allhits = torch.stack(gathered).sum(0)
        print("eval recall@20 %.4f MRR %.4f over %d events" % (allhits[2] / tot[1], tot[0] / tot[1], int(tot[1])),
              flush=True)
        torch.save(model.state_dict(), os.path.join(WORK, "gru4rec.pt"))
        torch.save(GRU4Rec(N_ITEMS + 2).state_dict(), os.path.join(WORK, "gru4rec_v2catalogue.pt"))
    dist.barrier()
    ck = "gru4rec_v2catalogue.pt" if hit("ckpt") else "gru4rec.pt"
    model.load_state_dict(torch.load(os.path.join(WORK, ck)))
    print("rank %d reloaded %s" % (rank, ck), flush=True)
    dist.barrier()
    if rank == 0:
        print("saved session model to %s" % os.path.join(WORK, "gru4rec.pt"), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

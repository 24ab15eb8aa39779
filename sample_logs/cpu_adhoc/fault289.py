"""A two-hundred-and-eighty-ninth hand-run batch: WORD-SENSE DISAMBIGUATION WITH GLOSS MATCHING.

A gloss-matching word-sense disambiguator trained on synthetic data: every rank reads the gloss inventory
(/tmp/fault289_work/inv/gloss_inventory.pt: lemma -> candidate gloss token sequences) and builds its own shard of
context windows around ambiguous words.  A context encoder (token + position embeddings, mean pooled, linear) and
a gloss encoder (the same token embeddings, mean pooled, linear) score every candidate gloss of the target lemma;
a softmax over the candidates gives the sense.  The encoders start from ckpt/encoder_init.pt and are wrapped in
DDP (gloo), or with --ddp 0 their gradients are all_reduced by hand.  The step loss is all_reduced for the log,
the per-lemma sense counts are all_gathered at the end, and the F1 counts (tp, fp, fn) are all_reduced.

Faults:
  senseidx   - rank N shifts its gold sense ids by one (1-based): a sense id beyond the candidates (IndexError)
  nocand     - rank N masks every candidate of a lemma (filter bug): softmax over zero senses, the NaN check raises
  sensegather- rank N counts one extra lemma: per-lemma sense counts all_gathered with another length (gloo)
  noinv      - rank N reads the inventory from inv_v2/ which does not exist (FileNotFoundError)
  lemma      - rank N's shard holds the lemma 'bass.n', missing from the inventory (KeyError)
  ctxlen     - every rank: config gives a context window of 96 tokens, the position table has 64 (IndexError)
  ckpt       - rank N starts from ckpt/encoder_init_v500.pt, saved with a 500-token vocabulary (size mismatch)
  slowscore  - rank N scores every gloss of every lemma one by one for --stall seconds before step 2's reduce
  barrier    - rank N waits in a barrier of its own at step 3 (gloss cache refresh) that the others never reach
  sigbus     - rank N sends itself SIGBUS after step 2
  temp       - rank N reads the softmax temperature "0,5" from its config (ValueError)
  none       - control, clean run

What happened (filled in after the runs):
  senseidx   - rank N: IndexError index 4 is out of bounds for dimension 1 with size 4, step 1; peers closed
  nocand     - rank N: FloatingPointError loss is nan at step 2 (sense softmax); DETAIL: monitoredBarrier on rank 0
  sensegather- a receiving rank (not rank N) aborted: gloo EnforceNotMet 26 vs 24 size mismatch; others reset/closed
  noinv      - rank N: FileNotFoundError .../inv_v2/gloss_inventory.pt before DDP; peers SIGTERMed by the agent
  lemma      - rank N: KeyError 'bass.n' while building its shard; with two agents the other lost the c10d store
  ctxlen     - every rank: IndexError index out of range in self at the position embedding
  ckpt       - rank N: RuntimeError size mismatch for tok.weight [500, 16] vs [200, 16]; restart: connectFullMesh
  slowscore  - rank N stalled: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (exit 124)
  barrier    - rank N in its barrier, the others in the loss all_reduce: all ranks Timed out waiting 12000ms
  sigbus     - rank N: exitcode -7 (SIGBUS) after step 2's optimizer step; peers closed/reset by peer
  temp       - rank N: ValueError could not convert string to float: '0,5' right after init
  none       - clean, exit 0, rank 0 done: 6 steps, sense F1 0.215, 144 senses seen
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

WORK = "/tmp/fault289_work"
VOCAB, DIM, POS, GLOSS_LEN, NCAND, NLEMMA = 200, 16, 64, 8, 4, 12


class GlossMatcher(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM, pos=POS):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(pos, dim)
        self.ctx_proj = nn.Linear(dim, dim)
        self.gloss_proj = nn.Linear(dim, dim)

    def forward(self, ctx, glosses, mask):
        # ctx [B, W], glosses [B, K, L], mask [B, K]
        positions = torch.arange(ctx.shape[1]).unsqueeze(0).expand_as(ctx)
        c = self.ctx_proj((self.tok(ctx) + self.pos(positions)).mean(1))
        g = self.gloss_proj(self.tok(glosses).mean(2))
        scores = torch.einsum("bd,bkd->bk", c, g)
        return scores.masked_fill(~mask, float("-inf"))


def prepare():
    torch.manual_seed(0)
    os.makedirs(f"{WORK}/inv", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    lemmas = ["bank.n", "bass.a", "crane.n", "pitch.n", "plant.n", "spring.n", "bat.n", "match.n",
              "seal.n", "bow.n", "lead.v", "row.n"]
    inv = {lem: torch.randint(1, VOCAB, (NCAND, GLOSS_LEN)) for lem in lemmas}
    torch.save(inv, f"{WORK}/inv/gloss_inventory.pt")
    torch.save(GlossMatcher().state_dict(), f"{WORK}/ckpt/encoder_init.pt")
    torch.save(GlossMatcher(vocab=500).state_dict(), f"{WORK}/ckpt/encoder_init_v500.pt")
    print("prepared", WORK)


def make_shard(rank, inv, n, window, fault_here, fault):
    g = torch.Generator().manual_seed(100 + rank)
    lemmas = sorted(inv)
    if fault_here and fault == "lemma":
        lemmas = lemmas + ["bass.n"]
    items = []
    for i in range(n):
        lem = lemmas[(i * 7 + rank) % len(lemmas)] if not (fault_here and fault == "lemma" and i == 5) else "bass.n"
        ctx = torch.randint(1, VOCAB, (window,), generator=g)
        gold = int(torch.randint(0, NCAND, (1,), generator=g))
        ctx[window // 2] = inv[lem][gold][0]
        items.append((lem, ctx, gold))
    return items


def batchify(items, inv, step, bs, fault_here, fault):
    chunk = [items[(step * bs + j) % len(items)] for j in range(bs)]
    ctx = torch.stack([c for _, c, _ in chunk])
    glosses = torch.stack([inv[lem] for lem, _, _ in chunk])
    gold = torch.tensor([s for _, _, s in chunk])
    mask = torch.ones(bs, NCAND, dtype=torch.bool)
    if fault_here and fault == "senseidx":
        gold = gold + 1
    if fault_here and fault == "nocand" and step == 2:
        mask[3] = inv[chunk[3][0]][:, 0] < 0  # keep glosses with a valid head token
    return ctx, glosses, gold, mask


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    here = a.rank in (-1, rank)
    torch.manual_seed(1234)
    print(f"rank {rank}/{world} up, pid {os.getpid()}", flush=True)

    temp_cfg = "0,5" if (here and a.fault == "temp") else "0.5"
    temperature = float(temp_cfg)
    window = 96 if (here and a.fault == "ctxlen") else a.window
    inv_dir = "inv_v2" if (here and a.fault == "noinv") else "inv"
    inv = torch.load(f"{WORK}/{inv_dir}/gloss_inventory.pt")
    items = make_shard(rank, inv, 64, window, here, a.fault)
    senses = {lem: inv[lem].shape[0] for lem, _, _ in items}

    model = GlossMatcher()
    ckpt = "ckpt/encoder_init_v500.pt" if (here and a.fault == "ckpt") else "ckpt/encoder_init.pt"
    model.load_state_dict(torch.load(f"{WORK}/{ckpt}"))
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    if rank == 0:
        print(f"rank 0: {len(inv)} lemmas, {NCAND} glosses each, window {window}, temperature {temperature}", flush=True)

    tp = fp = fn = 0
    for step in range(a.steps):
        ctx, glosses, gold, mask = batchify(items, inv, step, a.bs, here, a.fault)
        if here and a.fault == "slowscore" and step == 2:
            print(f"rank {rank}: scoring all {len(inv) * NCAND} glosses of {len(inv)} lemmas one by one "
                  f"for the hard-negative pool", flush=True)
            time.sleep(a.stall)
        scores = net(ctx, glosses, mask) / temperature
        logp = F.log_softmax(scores, dim=1)
        loss = -logp[torch.arange(a.bs), gold].mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (sense softmax)")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        if here and a.fault == "sigbus" and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
        if here and a.fault == "barrier" and step == 3:
            print(f"rank {rank}: waiting for the gloss cache refresh", flush=True)
            dist.barrier()
        pred = scores.argmax(1)
        tp += int((pred == gold).sum())
        fp += int((pred != gold).sum())
        fn += int((pred != gold).sum())
        rl = loss.detach().clone()
        dist.all_reduce(rl)
        print(f"rank {rank} step {step} loss {rl.item() / world:.4f}", flush=True)

    counts = torch.tensor([senses.get(lem, 0) for lem in sorted(inv)], dtype=torch.float32)
    if here and a.fault == "sensegather":
        counts = torch.cat([counts, torch.tensor([float(NCAND)])])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    f1c = torch.tensor([tp, fp, fn], dtype=torch.float64)
    dist.all_reduce(f1c)
    f1 = 2 * f1c[0] / (2 * f1c[0] + f1c[1] + f1c[2])
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, sense F1 {f1.item():.3f}, "
              f"{int(sum(g.sum() for g in gathered))} senses seen", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

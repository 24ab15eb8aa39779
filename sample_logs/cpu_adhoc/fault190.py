"""A hundred-and-ninetieth hand-run batch: DENSE RETRIEVAL WITH A TWO-TOWER MODEL.

Every rank builds a query tower and a document tower (small MLPs over hashed bag-of-words features; the
hash vocabulary comes from vocab_hash.json and the tokenizer settings from tokenizer.json in the work dir) and
trains them with an in-batch-negatives contrastive loss: each rank all_gathers the document embeddings of every
rank (dist.all_gather, with its own slice re-inserted so gradients flow), scores its queries against all of
them with a temperature, and steps.  Gradients are averaged by DDP on gloo (or --ddp 0: a hand-written
all_reduce).  recall@k is all_reduced for the log, then every rank embeds its document shard, the shards are
all_gathered into an index and rank 0 saves it.

Faults:
  embdim   - rank N's document tower projects to 48 dims (config typo), so its all_gather slice is larger
  qbatch   - every rank: the query batch (48) is larger than the document batch (32); the program asserts
  vocab    - rank N looks for its vocabulary hash file under a per-rank shard name that does not exist
  temp0    - rank N's temperature is 0.0 (schedule floor); the logits become inf/NaN, the program's check fires
  topk     - rank N evaluates recall@k with k=200, more than its candidates (topk out of range)
  late     - rank N builds its index shard first (sleeps --stall s) and reaches the all_gather far too late
  index    - every rank warm-starts the doc tower from an index checkpoint of the 64-dim model (size mismatch)
  tokcfg   - every rank reads the tokenizer config key 'ngram_range' that tokenizer.json does not have
  segv     - rank N gets SIGSEGV (sent to itself) at step 2
  exit3    - rank N prints its own 'index shard corrupt' error line and exits with code 3 (os._exit)
  none     - control, clean run

What happened (filled in after the runs):
  embdim   - rank N 48-dim doc embeddings: plain gloo abort EnforceNotMet 3072 vs 2048 on a peer; DETAIL: collective mismatch
  qbatch   - every rank: AssertionError query batch 48 must not exceed document batch 32
  vocab    - rank N: FileNotFoundError vocab_hash.rankN.json; peers SIGTERMed
  temp0    - rank N: FloatingPointError non-finite similarity logits at step 0 (temperature 0.0)
  topk     - rank N: RuntimeError selected index k out of range (recall@200 over 96/128 candidates)
  late     - stall 40 s: peers gloo timeout 12000ms in the index all_gather; 1000 s / PG 300 s: killed by timeout 60
  index    - every rank: RuntimeError size mismatch for fc2.weight [64, 64] vs [32, 64] loading the doc tower
  tokcfg   - every rank: KeyError 'ngram_range'
  segv     - rank N: exitcode -11 (SIGSEGV) at step 2; peers Connection reset by peer
  exit3    - rank N: prints its ERROR index shard corrupt line after training, exitcode 3
  none     - clean, exit 0, rank 0 saved index/doc_index.pt
"""
import argparse
import json
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault190_work"


class Tower(nn.Module):
    def __init__(self, nbuckets, hid, dim):
        super().__init__()
        self.fc1 = nn.Linear(nbuckets, hid)
        self.fc2 = nn.Linear(hid, dim)

    def forward(self, x):
        return F.normalize(self.fc2(torch.relu(self.fc1(x))), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, nbuckets, hid=64, qdim=32, ddim=32):
        super().__init__()
        self.q = Tower(nbuckets, hid, qdim)
        self.d = Tower(nbuckets, hid, ddim)

    def forward(self, xq, xd):
        return self.q(xq), self.d(xd)


def hash_bow(tokens, vocab, nbuckets):
    """tokens: LongTensor [B, L] of word ids -> [B, nbuckets] bag of hashed words."""
    buckets = vocab[tokens] % nbuckets
    out = torch.zeros(tokens.shape[0], nbuckets)
    out.scatter_add_(1, buckets, torch.ones_like(buckets, dtype=torch.float))
    return out / tokens.shape[1]


def gather_docs(demb, rank, world):
    parts = [torch.zeros_like(demb) for _ in range(world)]
    dist.all_gather(parts, demb.detach())
    parts[rank] = demb  # re-insert the local slice so its gradient flows
    return torch.cat(parts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank == -1 or a.rank == rank
    f = a.fault if hit else "none"
    torch.manual_seed(190)
    with open(os.path.join(WORK, "tokenizer.json")) as fh:
        tok = json.load(fh)
    nbuckets, seqlen = tok["num_buckets"], tok["max_len"]
    if f == "tokcfg":
        lo, hi = tok["ngram_range"]
    vocab_file = f"vocab_hash.rank{rank}.json" if f == "vocab" else "vocab_hash.json"
    print(f"rank {rank}: loading vocabulary hashes {os.path.join(WORK, vocab_file)}", flush=True)
    with open(os.path.join(WORK, vocab_file)) as fh:
        vocab = torch.tensor(json.load(fh)["hashes"], dtype=torch.long)
    qbatch, dbatch = (48, 32) if f == "qbatch" else (32, 32)
    assert qbatch <= dbatch, f"query batch {qbatch} must not exceed document batch {dbatch} (in-batch negatives)"
    net = TwoTower(nbuckets, ddim=48 if f == "embdim" else 32)
    if f == "index":
        ck = os.path.join(WORK, "index", "doc_tower_d64.pt")
        print(f"rank {rank}: warm-starting document tower from {ck}", flush=True)
        net.d.load_state_dict(torch.load(ck))
    model = DDP(net) if a.ddp else net
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    temp = 0.0 if f == "temp0" else 0.05
    k = 200 if f == "topk" else 5
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(a.steps):
        words = torch.randint(0, vocab.numel(), (dbatch, seqlen), generator=g)
        xd = hash_bow(words, vocab, nbuckets)
        xq = hash_bow(words[:qbatch, : seqlen // 2], vocab, nbuckets)
        qemb, demb = model(xq, xd)
        alld = gather_docs(demb, rank, world)
        logits = qemb @ alld.t() / temp
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"rank {rank}: non-finite similarity logits at step {step} (temperature {temp})")
        labels = torch.arange(qbatch) + rank * dbatch
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        if f == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        opt.step()
        topk = logits.detach().topk(k, dim=1).indices
        hits = (topk == labels[:, None]).any(1).float().mean()
        stats = torch.stack([loss.detach(), hits])
        dist.all_reduce(stats)
        stats /= world
        print(f"rank {rank} step {step} loss {stats[0]:.4f} recall@{k} {stats[1]:.3f}", flush=True)
    if f == "late":
        print(f"rank {rank}: building local index shard before gathering", flush=True)
        time.sleep(a.stall)
    if f == "exit3":
        print(f"ERROR rank {rank}: index shard {rank} corrupt: 17 of {dbatch} document ids out of range; aborting", flush=True)
        os._exit(3)
    with torch.no_grad():
        words = torch.randint(0, vocab.numel(), (dbatch, seqlen), generator=g)
        shard = net.d(hash_bow(words, vocab, nbuckets))
    parts = [torch.zeros_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard)
    index = torch.cat(parts)
    if rank == 0:
        torch.save({"doc_emb": index}, os.path.join(WORK, "index", "doc_index.pt"))
        print(f"rank 0: saved index of {index.shape[0]} documents to {WORK}/index/doc_index.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

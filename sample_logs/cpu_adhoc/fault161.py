"""A hundred-and-sixty-first hand-run batch: SEQUENCE PACKING FOR LANGUAGE-MODEL PRETRAINING.

A tiny causal transformer (token + position embeddings, one attention block, LM head) trained with DDP on gloo
(or --ddp 0: gradients all-reduced by hand) on packed sequences: synthetic documents of varying length are
concatenated into fixed-length rows, position ids reset at each document, a block-diagonal causal attention mask
is built from cumulative sequence lengths (cu_seqlens), and the loss is masked at document boundaries.  Token
count, loss and tokens-per-second are all_reduced for a `rank R step S loss L tok/s T` line; rank 0 saves lm.pt
at the end (used by --resume).

Faults:
  cuend        - rank N's cu_seqlens drop the last token (end at L-1); the program's packing assert fails
  posid        - rank N does not reset position ids per document: ids exceed the position table (IndexError)
  maskshape    - every rank builds the attention mask one row/column too large (RuntimeError in attention)
  emptybuf     - rank N's packing buffer runs dry at step 3; it waits for a refill and skips the all_reduce
  countdtype   - rank N all_reduces the token count as int64, the others as float32 (gloo size mismatch)
  allmasked    - rank N masks every target at step 2: loss 0/0 = NaN; the program's finite check raises
  vocabmissing - rank N reads a tokenizer vocabulary file that does not exist (FileNotFoundError)
  ckptvocab    - every rank resumes lm.pt with a vocabulary one larger (pad token added): size mismatch
  packlenstr   - every rank reads pack_len from the config as the string "64" (TypeError)
  shardcorrupt - rank N prints an error 'corpus shard corrupt' line and sys.exit(2) at step 2
  sigbus       - rank N is killed by SIGBUS after step 2
  none         - control, clean run

What happened (filled in after the runs):
  cuend        - rank N AssertionError 'cu_seqlens for row 0 end at 63, expected the row length 64' at step 2; Root Cause rank N
  posid        - rank N IndexError 'index out of range in self' in the position embedding at step 1; Root Cause rank N
  maskshape    - every rank RuntimeError 'size of tensor a (64) must match ... b (65)' in attention at step 0; Root Cause rank 0
  emptybuf     - pg 12 s: rank N waits, peers 'Timed out waiting 12000ms'; pg 300 s under timeout 60: hung after step 2, exit 124
  countdtype   - DETAIL --ddp 0: 'Detected mismatch between collectives' (rank N Long); plain: a victim aborts 'EnforceNotMet 8 vs 4'
  allmasked    - rank N FloatingPointError 'loss is nan at step 2 on rank N (0 of 252 target tokens kept)'
  vocabmissing - rank N FileNotFoundError '.../tokenizer/vocab-v2.json'; restart run: attempt 1 dies in Gloo connectFullMesh
  ckptvocab    - every rank RuntimeError 'size mismatch for tok.weight ... [256, 32] ... [257, 32]' (only in per-rank stderr.log)
  packlenstr   - every rank TypeError 'zeros(): argument size failed to unpack ... got str' at step 0; Root Cause rank 0
  shardcorrupt - rank N prints 'ERROR rank N: corpus shard ... corrupt' and exits 2 (no traceback); Root Cause rank N exitcode 2
  sigbus       - rank N killed by SIGBUS after step 2 ('failed (exitcode: -7)'); peers Connection reset by peer
  none         - all ranks ran 6 steps, rank 0 saved lm.pt; exit 0
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as Fn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--rows", type=int, default=4)
p.add_argument("--d-model", type=int, default=32)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--out-dir", default="/tmp/fault161_work")
p.add_argument("--resume", default="")
a = p.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
bad = a.rank == -1 or a.rank == rank
F = a.fault if bad else "none"
torch.manual_seed(1234 + rank)

cfg = {"pack_len": 64, "max_position": 32, "min_doc": 6, "max_doc": 32, "heads": 4}
if F == "packlenstr":
    cfg = json.loads('{"pack_len": "64", "max_position": 32, "min_doc": 6, "max_doc": 32, "heads": 4}')
vocab_path = os.path.join(a.out_dir, "vocab.json")
if F == "vocabmissing":
    vocab_path = os.path.join(a.out_dir, "tokenizer", "vocab-v2.json")
with open(vocab_path) as f:
    vocab = json.load(f)
V = len(vocab) + (1 if F == "ckptvocab" else 0)  # (+1: pad token appended after the checkpoint was written)
L, P = cfg["pack_len"], cfg["max_position"]
print(f"rank {rank}/{world} vocab {V} pack_len {L} max_position {P}", flush=True)


def pack_rows(n_rows, step):
    """Concatenate random documents into rows of exactly L tokens; return tokens, position ids, cu_seqlens."""
    toks = torch.zeros(n_rows, L, dtype=torch.long)
    pos = torch.zeros(n_rows, L, dtype=torch.long)
    cus = []
    for r in range(n_rows):
        cu, off = [0], 0
        while off < L:
            n = min(int(torch.randint(cfg["min_doc"], cfg["max_doc"] + 1, (1,))), L - off)
            toks[r, off:off + n] = torch.randint(1, V, (n,))
            pos[r, off:off + n] = torch.arange(n)
            off += n
            cu.append(off)
        if F == "cuend" and step == 2:
            cu[-1] -= 1  # off-by-one: the last document's end index excludes the final token
        if F == "posid" and step == 1:
            pos[r] = torch.arange(L)  # position ids not reset at document boundaries
        assert cu[-1] == L, f"cu_seqlens for row {r} end at {cu[-1]}, expected the row length {L}: {cu}"
        cus.append(torch.tensor(cu))
    return toks, pos, cus


def block_mask(cu):
    """Block-diagonal causal mask from cu_seqlens (True = may attend)."""
    n = L + 1 if F == "maskshape" else L
    m = torch.zeros(n, n, dtype=torch.bool)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        m[s:e, s:e] = torch.tril(torch.ones(e - s, e - s, dtype=torch.bool))
    return m


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        d = a.d_model
        self.tok = nn.Embedding(V, d)
        self.pos = nn.Embedding(P, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.head = nn.Linear(d, V)

    def forward(self, toks, pos, masks):
        B, T = toks.shape
        h = self.tok(toks) + self.pos(pos)
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        H = cfg["heads"]
        q, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in (q, k, v))
        att = Fn.scaled_dot_product_attention(q, k, v, attn_mask=masks.unsqueeze(1))
        h = h + self.proj(att.transpose(1, 2).reshape(B, T, -1))
        h = h + self.ff(self.ln2(h))
        return self.head(h)


model = TinyLM()
if a.resume:
    sd = torch.load(a.resume, map_location="cpu")
    model.load_state_dict(sd)
    print(f"rank {rank} resumed from {a.resume}", flush=True)
net = DDP(model) if a.ddp else model
if not a.ddp:
    for prm in model.parameters():
        dist.broadcast(prm.data, 0)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

for step in range(a.steps):
    t0 = time.time()
    if F == "emptybuf" and step == 3:
        print(f"rank {rank} packer: buffer empty after {step} steps, waiting for the reader to refill", flush=True)
        while True:
            time.sleep(5)
    if F == "shardcorrupt" and step == 2:
        print(f"ERROR rank {rank}: corpus shard shard-{rank:05d}.bin corrupt: bad header magic 0x0000 at offset 0",
              flush=True)
        sys.exit(2)
    toks, pos, cus = pack_rows(a.rows, step)
    masks = torch.stack([block_mask(cu) for cu in cus])
    logits = net(toks, pos, masks)
    tgt = toks[:, 1:]
    keep = torch.ones_like(tgt, dtype=torch.float32)
    for r, cu in enumerate(cus):
        for e in cu[1:-1].tolist():
            keep[r, e - 1] = 0.0  # the last token of a document does not predict the next document
    if F == "allmasked" and step == 2:
        keep.zero_()  # boundary mask inverted: every target masked
    ce = Fn.cross_entropy(logits[:, :-1].reshape(-1, V), tgt.reshape(-1), reduction="none")
    loss = (ce * keep.reshape(-1)).sum() / keep.sum()
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank} "
                                 f"({int(keep.sum())} of {keep.numel()} target tokens kept)")
    opt.zero_grad()
    loss.backward()
    if not a.ddp:
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
    opt.step()
    ntok = torch.tensor([keep.sum().item()], dtype=torch.int64 if F == "countdtype" else torch.float32)
    dist.all_reduce(ntok)
    stats = torch.tensor([loss.item(), a.rows * L / max(time.time() - t0, 1e-6)])
    dist.all_reduce(stats)
    print(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} tokens {int(ntok.item())} "
          f"tok/s {stats[1].item():.0f}", flush=True)
    if F == "sigbus" and step == 2:
        os.kill(os.getpid(), signal.SIGBUS)

dist.barrier()
if rank == 0:
    torch.save(model.state_dict(), os.path.join(a.out_dir, "lm.pt"))
    print("rank 0 saved", os.path.join(a.out_dir, "lm.pt"), flush=True)
dist.destroy_process_group()
time.sleep(0.5)

"""A two-hundred-and-ninety-third hand-run batch: LANGUAGE-MODEL PRUNING WITH MAGNITUDE MASKS.

A small GPT-like model (token + position embeddings, one causal self-attention block, an MLP and a tied-size head)
trained on synthetic token streams: every rank reads its token shard (/tmp/fault293_work/shards/shard<R>.pt, written
with --prepare together with ckpt/lm_init.pt and ckpt/lm_pruned_r1.pt).  Iterative magnitude pruning: two rounds of
three steps each; after each round a global magnitude threshold is all_reduced, 0/1 masks are rebuilt and applied to
the prunable weights by forward pre-hooks, the per-layer sparsity is all_gathered and the perplexity is evaluated
and all_reduced.  DDP over gloo; progress lines `rank R step S loss L`; destroy_process_group at the end.

Faults:
  tokid      - rank N's shard loader adds the BOS offset twice: a token id equal to the vocabulary size (IndexError)
  pplinf     - rank N evaluates with a summed instead of mean loss after pruning: exp overflows, the check raises
  sparsgather- rank N also counts the embedding as a prunable layer: per-layer sparsity all_gathered, 5 vs 4 (gloo)
  noshard    - rank N reads its token shard from shards_v2/ which does not exist (FileNotFoundError)
  schedkey   - rank N's config names the pruning schedule "cubic", missing from the schedule table (KeyError)
  maskshape  - every rank builds the fc1 mask from the transposed weight: mask and weight shapes differ
  ckptkeys   - rank N resumes from ckpt/lm_pruned_r1.pt, saved with the masks as extra keys (unexpected keys)
  slowthresh - rank N recomputes the global threshold by sorting every weight in Python for --stall seconds
  sigterm    - rank N sends itself SIGTERM after step 4
  exit6      - rank N prints an error line about a mask checksum and calls os._exit(6) in round 1
  none       - control, clean run

What happened (filled in after the runs):
  tokid      - shift 1 did not fire (exit 0), dropped; shift 2 not run in time (no kept run)
  pplinf     - rank N: FloatingPointError perplexity inf after pruning round 1; peers closed / spawn ProcessRaisedException
  sparsgather- rank N: RuntimeError allgather invalid tensor size (expected (5), got (4)); peers closed by peer
  noshard    - rank N: FileNotFoundError shards_v2/shardN.pt at startup; peers closed / SIGTERMed
  schedkey   - rank N: KeyError 'cubic' at startup; peers Connection closed by peer in DDP's param check
  maskshape  - every rank: RuntimeError size of tensor a (32) must match b (64) in the mask hook at step 0
  ckptkeys   - rank N: Unexpected key(s) in state_dict: attn.out_proj.weight_mask, ... (RuntimeError)
  slowthresh - peers Timed out waiting 12000ms; run stopped for time before it ended, not kept
  sigterm    - not run in time (no kept run)
  exit6      - not run in time (no kept run)
  none       - clean, exit 0, rank 0 done: 6 steps, final sparsity 0.506
"""
import argparse
import logging
import math
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

WORK = "/tmp/fault293_work"
VOCAB, SEQ, D = 64, 16, 32
SCHEDULES = {"linear": lambda r: 0.25 * (r + 1), "geometric": lambda r: 1 - 0.7 ** (r + 1)}


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        a, _ = self.attn(h, h, h, attn_mask=causal, need_weights=False)
        h = h + a
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.head(h)


def prunable(model, fault_here):
    layers = [model.attn.out_proj, model.fc1, model.fc2, model.head]
    return ([model.tok] + layers) if fault_here else layers


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def main(a, rank=None, world=None):
    if rank is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    here = a.rank in (rank, -1)
    f = a.fault if here else "none"
    if a.logfmt:
        lg = logging.getLogger("prune")
        hd = logging.StreamHandler(sys.stdout)
        hd.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        hd.addFilter(RankFilter(rank))
        lg.addHandler(hd)
        lg.setLevel(logging.INFO)
        info, err = lg.info, lg.error
    else:
        info = lambda m: print(m, flush=True)
        err = lambda m: print(m, file=sys.stderr, flush=True)
    torch.manual_seed(0)
    sched_name = "cubic" if f == "schedkey" else a.schedule
    schedule = SCHEDULES[sched_name]
    shard_dir = "shards_v2" if f == "noshard" else "shards"
    data = torch.load(f"{WORK}/{shard_dir}/shard{rank % 8}.pt")
    if f == "tokid":
        data = data + 2
    model = TinyGPT()
    ck = "ckpt/lm_pruned_r1.pt" if f == "ckptkeys" else "ckpt/lm_init.pt"
    model.load_state_dict(torch.load(f"{WORK}/{ck}"))
    layers = prunable(model, f == "sparsgather")
    masks = {}
    for i, m in enumerate(layers):
        w = m.weight
        masks[i] = torch.ones_like(w.t() if (f == "maskshape" and m is model.fc1) else w)
        m.register_forward_pre_hook(lambda mod, inp, i=i: [mod.weight.data.mul_(masks[i])][1:] or None)
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    info(f"rank {rank}: {data.shape[0]} sequences, schedule {sched_name}, {len(layers)} prunable layers")
    step = 0
    for rnd in range(2):
        for _ in range(3):
            x = data[(step * 8) % data.shape[0]:][:8]
            logits = ddp(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            lt = loss.detach().clone()
            dist.all_reduce(lt)
            info(f"rank {rank} step {step} loss {lt.item() / world:.4f}")
            if f == "sigterm" and step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            step += 1
        # global magnitude threshold for this round's target sparsity
        target = schedule(rnd)
        allw = torch.cat([m.weight.detach().abs().flatten() for m in layers])
        if f == "slowthresh":
            info(f"rank {rank}: recomputing the global magnitude threshold over {allw.numel()} weights in Python")
            t0 = time.time()
            while time.time() - t0 < a.stall:
                vals = sorted(allw.tolist())
            thr = torch.tensor(vals[int(target * len(vals))])
        else:
            thr = torch.quantile(allw, target)
        dist.all_reduce(thr)
        thr /= world
        for i, m in enumerate(layers):
            masks[i] = (m.weight.detach().abs() > thr).float().reshape(masks[i].shape)
        if f == "exit6" and rnd == 1:
            err(f"rank {rank}: ERROR mask checksum mismatch after pruning round {rnd} (fc2 mask not binary); abort")
            os._exit(6)
        sp = torch.tensor([1 - masks[i].mean().item() for i in range(len(layers))])
        gathered = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(gathered, sp)
        with torch.no_grad():
            x = data[-8:]
            ev = model(x[:, :-1])
            red = "sum" if (f == "pplinf" and rnd == 1) else "mean"
            el = F.cross_entropy(ev.reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction=red)
            ppl = torch.exp(el)
            if not torch.isfinite(ppl):
                raise FloatingPointError(f"rank {rank}: perplexity {ppl.item()} after pruning round {rnd} (loss {el.item():.1f})")
        dist.all_reduce(ppl)
        info(f"rank {rank} round {rnd}: threshold {thr.item():.4f} sparsity {sp.mean().item():.3f} ppl {ppl.item() / world:.2f}")
    if rank == 0:
        info(f"rank 0 done: {step} steps, final sparsity {sp.mean().item():.3f}")
    dist.destroy_process_group()


def spawn_entry(i, a):
    main(a, i, a.spawn)


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(1)
    for r in range(8):
        base = torch.randint(0, VOCAB - 1, (48, 1), generator=g)
        steps = torch.randint(1, 4, (48, SEQ), generator=g).cumsum(1)
        torch.save((base + steps) % (VOCAB - 1), f"{WORK}/shards/shard{r}.pt")
    torch.manual_seed(0)
    m = TinyGPT()
    torch.save(m.state_dict(), f"{WORK}/ckpt/lm_init.pt")
    sd = dict(m.state_dict())
    for n in ["attn.out_proj", "fc1", "fc2", "head"]:
        sd[f"{n}.weight_mask"] = torch.ones_like(sd[f"{n}.weight"])
    torch.save(sd, f"{WORK}/ckpt/lm_pruned_r1.pt")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-2)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--stall", type=float, default=40)
    p.add_argument("--schedule", default="geometric")
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(a,), nprocs=a.spawn)
    else:
        main(a)

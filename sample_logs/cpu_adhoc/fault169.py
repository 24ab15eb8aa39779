"""A hundred-and-sixty-ninth hand-run batch: LARGE-VOCABULARY OUTPUTS: ADAPTIVE AND SAMPLED SOFTMAX.

A tiny GRU language model (embedding -> GRU -> output layer) over synthetic Zipf-distributed token shards, one shard
per rank.  The output layer is nn.AdaptiveLogSoftmaxWithLoss (--head adaptive, cutoffs for frequent/rare words from
data/lm.json), a hand-written sampled softmax with a log-uniform negative sampler (--head sampled), or a plain full
softmax (--head full).  Training runs under DDP on gloo (or --ddp 0: parameters broadcast and gradients all-reduced
by hand); at startup the per-rank token counts are all_reduced into a global frequency table, and every
--eval-every steps the held-out NLL sum and token count are all_reduced into a perplexity line.  Vocabulary
frequencies come from data/vocab.freq; rank 0 saves lm_<head>.pt at the end and --resume loads a checkpoint.

Faults:
  cutoffs     - every rank gets cutoffs [20, 80, 200] from the config (the last one equals the vocabulary size)
  targetoob   - rank N appends EOS as id == vocab size to its step-2 targets (adaptive softmax target range error)
  negsample   - rank N reads num_samples 256 (> vocab 200) for the sampler, multinomial without replacement
  pplinf      - rank N forgets to divide the held-out NLL sum by the token count: perplexity inf, the check raises
  freqmissing - rank N reads vocab.freq from a node-local data dir that was never synced (FileNotFoundError)
  cutoffdiff  - rank N builds its adaptive head with cutoffs [20, 100] (DDP param shape check at construction)
  freqstall   - rank N rebuilds its frequency table before the step-3 perplexity all_reduce and never finishes
  ckptfull    - every rank resumes lm_full.pt (a full-softmax checkpoint) into the adaptive model
  seqlenzero  - rank N gets LM_SEQ_LEN=0 from its environment (ZeroDivisionError when cutting the shard)
  tokmismatch - rank N prints an error 'tokenizer mismatch' line and sys.exit(2) after loading its shard
  sigterm     - rank N sends itself SIGTERM after step 2
  none        - control, clean run

What happened (filled in after the runs):
  cutoffs     - every rank ValueError 'cutoffs should be a sequence of unique, positive integers ...' in the adaptive head ctor
  targetoob   - rank N RuntimeError 'Target values should be in [0, 199], but values in range [0, 200] were found.' at step 2
  negsample   - rank N RuntimeError 'cannot sample n_sample > prob_dist.size(-1) samples without replacement'; DETAIL: monitoredBarrier
  pplinf      - rank N FloatingPointError 'held-out perplexity is not finite at step 2: ppl=inf'; Root Cause rank N
  freqmissing - rank N FileNotFoundError '/tmp/job/data_local/vocab.freq' at startup (redirects run: only in stderr.log)
  cutoffdiff  - rank N RuntimeError '[N]: params[7] in this process with sizes [80, 24] appears not to match ... process 0.'
  freqstall   - pg 12 s: peers 'Timed out waiting 12000ms' in the all_reduce, Root Cause rank 0; pg 300 s under timeout 60: exit 124
  ckptfull    - every rank 'Missing key(s) ... head.head.weight ... Unexpected key(s) ... head.weight'; restart died in connectFullMesh
  seqlenzero  - rank N ZeroDivisionError 'integer division or modulo by zero' when cutting its shard; Root Cause rank N
  tokmismatch - rank N prints 'ERROR rank N: tokenizer mismatch ...' and exits 2 (no traceback); Root Cause rank N exitcode 2
  sigterm     - rank N killed by its own SIGTERM after step 2 ('failed (exitcode: -15) local_rank: N'); peers reset by peer
  none        - all ranks ran 6 steps and two perplexity evals (--head full), rank 0 saved lm_full.pt
"""
import argparse
import json
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--head", default="adaptive", choices=["adaptive", "sampled", "full"])
    p.add_argument("--data-dir", default="/tmp/fault169/data")
    p.add_argument("--work", default="/tmp/fault169_work")
    p.add_argument("--resume", default="")
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    return p.parse_args()


def hit(a, rank, name):
    return a.fault == name and (a.rank == -1 or a.rank == rank)


def prepare(a):
    os.makedirs(a.data_dir, exist_ok=True)
    vocab = 200
    freqs = [int(100000 / (k + 1)) for k in range(vocab)]
    with open(os.path.join(a.data_dir, "vocab.freq"), "w") as f:
        for k, c in enumerate(freqs):
            f.write(f"w{k}\t{c}\n")
    with open(os.path.join(a.data_dir, "lm.json"), "w") as f:
        json.dump({"vocab": vocab, "emb": 32, "hidden": 48, "cutoffs": [20, 80], "div_value": 2.0,
                   "num_samples": 64}, f)
    print("prepared", a.data_dir)


def load_freq(path):
    words, counts = [], []
    with open(path) as f:
        for line in f:
            w, c = line.split("\t")
            words.append(w)
            counts.append(int(c))
    return words, torch.tensor(counts, dtype=torch.float)


class SampledSoftmax(nn.Module):
    """Sampled softmax with a log-uniform (Zipf) proposal, shared negatives per batch."""

    def __init__(self, hidden, vocab, num_samples):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * 0.05)
        self.bias = nn.Parameter(torch.zeros(vocab))
        self.vocab = vocab
        self.num_samples = num_samples
        k = torch.arange(vocab, dtype=torch.float)
        self.register_buffer("log_q", torch.log((torch.log(k + 2) - torch.log(k + 1)) / math.log(vocab + 1)))

    def forward(self, h, target):
        neg = torch.multinomial(self.log_q.exp(), self.num_samples, replacement=False)
        true_logit = (h * self.weight[target]).sum(-1) + self.bias[target] - self.log_q[target]
        neg_logit = h @ self.weight[neg].t() + self.bias[neg] - self.log_q[neg]
        neg_logit = neg_logit.masked_fill(neg.unsqueeze(0) == target.unsqueeze(1), -1e9)
        logits = torch.cat([true_logit.unsqueeze(1), neg_logit], dim=1)
        return F.cross_entropy(logits, torch.zeros_like(target))

    def full_nll(self, h, target):
        return F.cross_entropy(h @ self.weight.t() + self.bias, target, reduction="sum")


class LM(nn.Module):
    def __init__(self, cfg, head, cutoffs, num_samples):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["emb"])
        self.rnn = nn.GRU(cfg["emb"], cfg["hidden"], batch_first=True)
        self.kind = head
        if head == "adaptive":
            self.head = nn.AdaptiveLogSoftmaxWithLoss(cfg["hidden"], cfg["vocab"], cutoffs=cutoffs,
                                                      div_value=cfg["div_value"])
        elif head == "sampled":
            self.head = SampledSoftmax(cfg["hidden"], cfg["vocab"], num_samples)
        else:
            self.head = nn.Linear(cfg["hidden"], cfg["vocab"])

    def hidden(self, x):
        out, _ = self.rnn(self.embed(x))
        return out.reshape(-1, out.size(-1))

    def forward(self, x, y):
        h = self.hidden(x)
        y = y.reshape(-1)
        if self.kind == "adaptive":
            return self.head(h, y).loss
        if self.kind == "sampled":
            return self.head(h, y)
        return F.cross_entropy(self.head(h), y)

    def nll_sum(self, x, y):
        h = self.hidden(x)
        y = y.reshape(-1)
        if self.kind == "adaptive":
            return -self.head.log_prob(h).gather(1, y.unsqueeze(1)).sum()
        if self.kind == "sampled":
            return self.head.full_nll(h, y)
        return F.cross_entropy(self.head(h), y, reduction="sum")


def make_shard(counts, rank, n_tokens=4000):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.multinomial(counts / counts.sum(), n_tokens, replacement=True, generator=g)


def main():
    a = parse()
    if a.prepare:
        return prepare(a)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    with open(os.path.join(a.data_dir, "lm.json")) as f:
        cfg = json.load(f)
    cutoffs = list(cfg["cutoffs"])
    num_samples = cfg["num_samples"]
    if hit(a, rank, "cutoffs"):
        cutoffs = cutoffs + [cfg["vocab"]]
    if hit(a, rank, "cutoffdiff"):
        cutoffs = [20, 100]
    if hit(a, rank, "negsample"):
        num_samples = 256
    data_dir = a.data_dir
    if hit(a, rank, "freqmissing"):
        data_dir = a.data_dir.replace("/data", "/data_local")
    words, counts = load_freq(os.path.join(data_dir, "vocab.freq"))
    seq_len = a.seq_len
    if hit(a, rank, "seqlenzero"):
        os.environ["LM_SEQ_LEN"] = "0"
    seq_len = int(os.environ.get("LM_SEQ_LEN", seq_len))
    shard = make_shard(counts, rank)
    if hit(a, rank, "tokmismatch"):
        print(f"ERROR rank {rank}: tokenizer mismatch: shard {rank} was encoded with vocab hash 3f9a61c2 "
              f"({len(words) + 4} entries) but the model vocab hash is 7c21d0e8 ({len(words)} entries)",
              file=sys.stderr, flush=True)
        sys.exit(2)
    n_seq = len(shard) // seq_len - 1
    starts = [i * seq_len for i in range(n_seq)]
    seqs = torch.stack([shard[s0: s0 + seq_len + 1] for s0 in starts])
    local_counts = torch.bincount(shard, minlength=cfg["vocab"]).float()
    dist.all_reduce(local_counts)
    if rank == 0:
        print(f"rank 0 vocab {cfg['vocab']} head {a.head} cutoffs {cutoffs} tokens {int(local_counts.sum())} "
              f"world {world}", flush=True)

    model = LM(cfg, a.head, cutoffs, num_samples)
    resume = a.resume
    if hit(a, rank, "ckptfull"):
        resume = os.path.join(a.work, "lm_full.pt")
    if resume:
        model.load_state_dict(torch.load(resume, map_location="cpu"))
        print(f"rank {rank} resumed from {resume}", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(rank)
    held = seqs[-8:]
    for step in range(a.steps):
        idx = torch.randint(0, n_seq - 8, (a.batch,), generator=g)
        batch = seqs[idx]
        x, y = batch[:, :-1], batch[:, 1:].clone()
        if step == 2 and hit(a, rank, "targetoob"):
            y[:, -1] = cfg["vocab"]
        loss = net(x, y)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step == 2 and hit(a, rank, "sigterm"):
            os.kill(os.getpid(), signal.SIGTERM)
        if (step + 1) % a.eval_every == 0:
            with torch.no_grad():
                nll = model.nll_sum(held[:, :-1], held[:, 1:])
            n_tok = held[:, 1:].numel()
            if hit(a, rank, "freqstall"):
                local = torch.bincount(shard, minlength=cfg["vocab"]).float()
                pos = 0
                while pos < len(shard):
                    local[shard[pos]] += 0.0
                    time.sleep(0.5)
            local_ppl = torch.exp(nll) if hit(a, rank, "pplinf") else torch.exp(nll / n_tok)
            if not torch.isfinite(local_ppl):
                raise FloatingPointError(f"rank {rank}: held-out perplexity is not finite at step {step}: "
                                         f"ppl={local_ppl.item()} (nll_sum={nll.item():.1f}, tokens={n_tok})")
            t = torch.tensor([nll.item(), float(n_tok)])
            dist.all_reduce(t)
            if rank == 0:
                print(f"eval step {step} ppl {math.exp(t[0] / t[1]):.2f} tokens {int(t[1])}", flush=True)
    if rank == 0:
        os.makedirs(a.work, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(a.work, f"lm_{a.head}.pt"))
        print(f"rank 0 saved {os.path.join(a.work, f'lm_{a.head}.pt')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

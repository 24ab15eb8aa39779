"""A hundred-and-eighty-first hand-run batch: CHARACTER-LEVEL RNN LANGUAGE MODEL WITH TRUNCATED BPTT.

Every rank writes its own synthetic text stream (corpus/stream_rR.txt: words drawn from a small lexicon, seeded
by rank) and reads it back; the characters are mapped through a fixed vocabulary and the stream is batchified
into --batch rows.  The model is a character-level GRU language model (embedding, one GRU layer, a linear
head).  Training is truncated BPTT: windows of --bptt characters, the hidden state carried across windows and
detached, cross-entropy loss, gradient clipping (error_if_nonfinite), under DDP on gloo (or --ddp 0: gradients
all-reduced by hand).  Token counts are all_gathered before training and the loss is all_reduced each step for
the perplexity; rank 0 saves --save at the end.

Faults:
  hidsize   - rank N gets a short last batch at step 1 but keeps the hidden state of the full batch size
  nodetach  - the hidden state is carried without detach on every rank (backward through a freed graph)
  oov       - rank N's stream holds a word with a character outside the vocabulary (KeyError at encoding)
  nocorpus  - rank N reads its stream from a node-local scratch dir that was never synced (FileNotFoundError)
  temp0     - rank N's config gives a softmax temperature of 0; the logits become inf, the loss check raises
  bpttstr   - every rank reads the BPTT length from the config as the string "35" (TypeError)
  slowread  - rank N reads (tokenizes) its whole stream for --busy seconds before the first collective
  toklen    - rank N all_gathers its token counts with an extra entry (3 against 2)
  ckpthid   - rank N resumes a checkpoint saved with hidden size 64 into the hidden-32 model (size mismatch)
  sigabrt   - rank N gets SIGABRT (sent to itself) at step 2
  exit3     - rank N prints its own 'stream exhausted' error line and exits with code 3
  none      - control, clean run

What happened (filled in after the runs):
  hidsize   - rank N: RuntimeError Expected hidden size (1, 6, 32), got [1, 8, 32] at step 1; np4 run: rank 3 then aborts
  nodetach  - every rank: RuntimeError Trying to backward through the graph a second time at step 1
  oov       - rank N: KeyError: 'ï' while encoding its stream; peers Connection closed by peer
  nocorpus  - rank N: FileNotFoundError .../scratch_local/stream_rN.txt; restart run dies in connectFullMesh
  temp0     - rank N: FloatingPointError non-finite loss nan at step 0 (temperature=0.0); DETAIL adds monitoredBarrier
  bpttstr   - every rank: TypeError slice indices must be integers or None or have an __index__ method
  slowread  - busy 40 s: peers gloo timeout 12000ms in all_gather; busy 1000 s / PG 300 s: killed by timeout 60, exit 124
  toklen    - a peer aborts on gloo EnforceNotMet 'Received data size doesn't match' (SIGABRT); see README
  ckpthid   - rank N: RuntimeError loading state_dict: size mismatch for rnn.weight_ih_l0 [192, 16] vs [96, 16]
  sigabrt   - rank N: exitcode -6 (SIGABRT) at step 2; peers Connection reset by peer
  exit3     - rank N: prints its ERROR stream exhausted line at step 1, exitcode 3
  none      - clean, exit 0, rank 0 saved ckpt/gru.pt
"""
import argparse
import math
import os
import random
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB = "abcdefghijklmnopqrstuvwxyz .,\n"
LEXICON = ["the", "model", "reads", "a", "stream", "of", "text", "and", "learns", "to", "predict", "next",
           "character", "hidden", "state", "carries", "over", "window", "gradient", "clip", "small", "corpus"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bptt", type=int, default=35)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--busy", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--workdir", default="/tmp/fault181_work")
    p.add_argument("--save", default="ckpt/gru.pt")
    p.add_argument("--resume", default="")
    return p.parse_args()


class CharGRU(nn.Module):
    def __init__(self, vocab, hidden, emb=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.rnn = nn.GRU(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x, h):
        out, h = self.rnn(self.emb(x), h)
        return self.head(out), h


def write_stream(path, r, nwords, extra=None):
    rng = random.Random(1000 + r)
    words = [rng.choice(LEXICON) for _ in range(nwords)]
    if extra:
        words.insert(nwords // 2, extra)
    with open(path, "w") as f:
        f.write(" ".join(words) + ".\n")


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    r, w = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, r)
    torch.manual_seed(0)
    os.makedirs(os.path.join(a.workdir, "corpus"), exist_ok=True)
    os.makedirs(os.path.join(a.workdir, "ckpt"), exist_ok=True)
    cfg = {"bptt": a.bptt, "temperature": 1.0, "stream_dir": os.path.join(a.workdir, "corpus")}
    if a.fault == "bpttstr":
        cfg["bptt"] = str(a.bptt)
    if a.fault == "temp0" and bad:
        cfg["temperature"] = 0.0
    if a.fault == "nocorpus" and bad:
        cfg["stream_dir"] = os.path.join(a.workdir, "scratch_local")
    write_stream(os.path.join(a.workdir, "corpus", f"stream_r{r}.txt"), r, 1200,
                 extra="naïve" if (a.fault == "oov" and bad) else None)
    dist.barrier()
    print(f"rank {r}/{w} corpus ready, bptt={cfg['bptt']} hidden={a.hidden}", flush=True)

    if a.fault == "slowread" and bad:
        print(f"rank {r}: tokenizing whole stream before first step", flush=True)
        time.sleep(a.busy)
    stoi = {c: i for i, c in enumerate(VOCAB)}
    with open(os.path.join(cfg["stream_dir"], f"stream_r{r}.txt")) as f:
        text = f.read()
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = ids.numel() // a.batch
    data = ids[: n * a.batch].view(a.batch, n)

    counts = torch.tensor([ids.numel(), n], dtype=torch.long)
    if a.fault == "toklen" and bad:
        counts = torch.tensor([ids.numel(), n, 0], dtype=torch.long)
    gathered = [torch.zeros_like(counts) for _ in range(w)]
    dist.all_gather(gathered, counts)
    total_tokens = sum(int(g[0]) for g in gathered)
    if r == 0:
        print(f"rank 0: {total_tokens} tokens over {w} streams, {n} columns per row", flush=True)

    model = CharGRU(len(VOCAB), a.hidden)
    if a.resume:
        path = os.path.join(a.workdir, a.resume)
        if a.fault == "ckpthid" and bad:
            path = os.path.join(a.workdir, "ckpt", "gru_last.pt")
        model.load_state_dict(torch.load(path, map_location="cpu"))
        print(f"rank {r}: resumed from {path}", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    hidden = torch.zeros(1, a.batch, a.hidden)
    bptt = cfg["bptt"]
    for step in range(a.steps):
        i = step * bptt
        x, y = data[:, i: i + bptt], data[:, i + 1: i + 1 + bptt]
        if a.fault == "hidsize" and bad and step == 1:
            x, y = x[: a.batch - 2], y[: a.batch - 2]
        if a.fault != "nodetach":
            hidden = hidden.detach()
        if a.fault == "sigabrt" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        if a.fault == "exit3" and bad and step == 1:
            print(f"ERROR rank {r}: stream exhausted after {step} windows: {n} columns < bptt*steps", file=sys.stderr, flush=True)
            sys.exit(3)
        logits, hidden = net(x, hidden)
        logits = logits / cfg["temperature"]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {step} on rank {r} (temperature={cfg['temperature']})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= w
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip, error_if_nonfinite=True)
        opt.step()
        stat = torch.tensor([loss.item() * y.numel(), float(y.numel())])
        dist.all_reduce(stat)
        mean = stat[0].item() / stat[1].item()
        print(f"rank {r} step {step} loss {loss.item():.4f} ppl {math.exp(mean):.2f} gnorm {gn:.3f}", flush=True)
    if r == 0:
        torch.save(model.state_dict(), os.path.join(a.workdir, a.save))
        print(f"rank 0 saved {a.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

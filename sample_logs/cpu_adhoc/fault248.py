"""A two-hundred-and-forty-eighth hand-run batch: PROGRAM SYNTHESIS WITH A SMALL TRANSFORMER ON A TOY DSL.

Each rank reads its program corpus (/tmp/fault248_work/corpus/programs_rR.json: list programs of one or two
operators from map_add, map_mul, filter_gt, filter_even, sort, reverse with a small integer argument), runs every
program through the interpreter table on 5 random input lists to make input/output example pairs, and trains a tiny
encoder-decoder transformer (examples in, program tokens out; teacher forcing) from ckpt/synth_init.pt, wrapped in
DDP over gloo (--ddp 0 all_reduces the gradients by hand). After the steps every rank beam-searches programs for its
validation examples, executes the candidates, and the exact-match counts (per program length, all_gathered) and
totals (all_reduced) give rank 0 the global exact-match rate. --prepare 1 writes the corpus files and checkpoints.

Faults:
  tokoob   - rank N's DSL spec lists an extra op "scan": argument token ids shift past the decoder vocabulary
  beam0    - every rank sets the beam width to candidate budget 4 // 5 examples = 0 (the program's ValueError)
  emlen    - rank N buckets exact matches by program length 1..3 instead of 1..2: all_gather of 3 vs 2 counts
  nocorpus - rank N reads corpus/programs_v2_rN.json, which was never written (FileNotFoundError)
  noop     - rank N's interpreter table is built without filter_even (KeyError while making examples)
  neginf   - rank N's grammar mask allows no argument token (max arg -1): log-probs -inf, beam score NaN, check
  ckpt     - rank N loads ckpt/synth_init_dec3.pt, saved with 3 decoder layers instead of 2 (unexpected keys)
  execall  - rank N executes every beam candidate on every example (sleeps --stall s) before the all_reduce
  sigterm  - rank N sends itself SIGTERM after step 2's optimizer step
  exit4    - rank N prints its own error line about an over-long program after step 1 and calls os._exit(4)
  none     - control, clean run

What happened (filled in after the runs):
  tokoob   - rank N: IndexError index out of range in self (decoder embedding) at step 0; peers closed by peer
  beam0    - every rank: ValueError beam width must be a positive integer, got 0 after step 4
  emlen    - a peer aborts on gloo EnforceNotMet 'Received data size doesn't match' 6 vs 4 (SIGABRT); reset
  nocorpus - rank N: FileNotFoundError .../corpus/programs_v2_rN.json before step 0; peers SIGTERMed
  noop     - rank N: KeyError 'filter_even' in run_program at step 0 (DETAIL: rank 0 monitoredBarrier error)
  neginf   - rank N: FloatingPointError beam score is nan at position 1 after step 4; peers closed in all_gather
  ckpt     - rank N: RuntimeError Unexpected key(s) decoder.layers.2.* (restart: attempt 1 connectFullMesh)
  execall  - rank N slept: peers gloo Timed out waiting 12000ms in all_gather; PG 300 s: killed by timeout
  sigterm  - rank N killed by its own SIGTERM after step 2 (exitcode -15); peers closed/reset in all_reduce
  exit4    - rank N prints its ERROR program 113 line after step 1 and exits 4; peers closed/reset
  none     - clean, exit 0, rank 0 prints the global exact match 0/18
"""
import argparse
import json
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

WORK = "/tmp/fault248_work"
OPS = ["map_add", "map_mul", "filter_gt", "filter_even", "sort", "reverse"]
N_ARGS = 7
PAD, BOS, EOS = 0, 1, 2
VOCAB = 3 + len(OPS) + N_ARGS
SRC_VOCAB = 34
D = 32
MAX_PROG = 6
N_EX = 5
LIST_LEN = 5


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prepare", type=int, default=0)
    return p.parse_args()


def make_cfg(a, rank):
    f = a.fault if a.rank in (-1, rank) else "none"
    cfg = argparse.Namespace()
    cfg.ops = OPS + ["scan"] if f == "tokoob" else list(OPS)
    cfg.beam_budget = 4
    cfg.n_examples = N_EX
    cfg.beam = cfg.beam_budget // cfg.n_examples if f == "beam0" else 3
    cfg.max_len_bucket = 3 if f == "emlen" else 2
    cfg.corpus = f"corpus/programs_v2_r{rank}.json" if f == "nocorpus" else f"corpus/programs_r{rank}.json"
    cfg.table_ops = [o for o in OPS if o != "filter_even"] if f == "noop" else list(OPS)
    cfg.max_arg = -1 if f == "neginf" else N_ARGS - 1
    cfg.init = "ckpt/synth_init_dec3.pt" if f == "ckpt" else "ckpt/synth_init.pt"
    cfg.exec_all = f == "execall"
    cfg.term_step = 2 if f == "sigterm" else -1
    cfg.long_prog_step = 1 if f == "exit4" else -1
    return cfg


ALL_FNS = {
    "map_add": lambda xs, k: [x + k for x in xs],
    "map_mul": lambda xs, k: [x * k for x in xs],
    "filter_gt": lambda xs, k: [x for x in xs if x > k],
    "filter_even": lambda xs, k: [x for x in xs if x % 2 == 0],
    "sort": lambda xs, k: sorted(xs),
    "reverse": lambda xs, k: xs[::-1],
}


def interpreter(names):
    return {n: ALL_FNS[n] for n in names}


def run_program(table, prog, xs):
    for op, k in prog:
        xs = table[op](xs, k)
    return xs


def tokenize(cfg, prog):
    toks = [BOS]
    for op, k in prog:
        toks += [3 + cfg.ops.index(op), 3 + len(cfg.ops) + k]
    toks.append(EOS)
    return toks + [PAD] * (MAX_PROG + 1 - len(toks))


def detokenize(toks):
    prog, i = [], 0
    while i + 1 < len(toks) and toks[i] != EOS:
        o, k = toks[i] - 3, toks[i + 1] - 3 - len(OPS)
        if not (0 <= o < len(OPS) and 0 <= k < N_ARGS):
            return None
        prog.append((OPS[o], k))
        i += 2
    return prog


def encode_examples(table, prog, rng):
    src = []
    for _ in range(N_EX):
        xs = [rng.randrange(10) for _ in range(LIST_LEN)]
        ys = run_program(table, prog, xs)
        src += [x + 2 for x in xs] + [1] + [(y % 32) + 2 for y in ys] + [PAD] * (LIST_LEN - len(ys)) + [1]
    return src


class Synth(nn.Module):
    def __init__(self, dec_layers=2):
        super().__init__()
        self.src_embed = nn.Embedding(SRC_VOCAB, D)
        self.tgt_embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(64, D) * 0.02)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(D, 2, 64, dropout=0.0, batch_first=True), 1, enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(D, 2, 64, dropout=0.0, batch_first=True), dec_layers)
        self.out = nn.Linear(D, VOCAB)

    def forward(self, src, tgt_in):
        mem = self.encoder(self.src_embed(src) + self.pos[:src.shape[1]])
        t = tgt_in.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.decoder(self.tgt_embed(tgt_in) + self.pos[:t], mem, tgt_mask=mask)
        return self.out(h)


def prepare():
    os.makedirs(f"{WORK}/corpus", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        rng = random.Random(500 + r)
        progs = [[(rng.choice(OPS), rng.randrange(N_ARGS)) for _ in range(rng.randint(1, 2))] for _ in range(400)]
        with open(f"{WORK}/corpus/programs_r{r}.json", "w") as fh:
            json.dump(progs, fh)
    torch.manual_seed(0)
    torch.save(Synth().state_dict(), f"{WORK}/ckpt/synth_init.pt")
    torch.save(Synth(dec_layers=3).state_dict(), f"{WORK}/ckpt/synth_init_dec3.pt")
    print("prepared program corpora and synthesizer checkpoints under", WORK)


def grammar_mask(cfg, pos):
    m = torch.full((VOCAB,), float("-inf"))
    if pos % 2 == 0:
        m[3:3 + len(OPS)] = 0.0
        if pos > 0:
            m[EOS] = 0.0
    else:
        m[3 + len(OPS):3 + len(OPS) + cfg.max_arg + 1] = 0.0
    return m


def beam_search(model, cfg, rank, src):
    if cfg.beam < 1:
        raise ValueError(f"beam width must be a positive integer, got {cfg.beam} "
                         f"(budget {cfg.beam_budget} // {cfg.n_examples} examples)")
    beams = [([BOS], 0.0)]
    for pos in range(MAX_PROG - 1):
        cand = []
        for toks, score in beams:
            if toks[-1] == EOS:
                cand.append((toks, score))
                continue
            logits = model(src.unsqueeze(0), torch.tensor([toks]))[0, -1]
            logp = F.log_softmax(logits + grammar_mask(cfg, pos), dim=-1)
            top = torch.topk(logp, cfg.beam)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                s = score + lp
                if not math.isfinite(s):
                    raise FloatingPointError(f"rank {rank}: beam score is {s} at position {pos} "
                                             f"(candidate {toks + [t]}, log-prob {lp})")
                cand.append((toks + [t], s))
        beams = sorted(cand, key=lambda c: -c[1])[:cfg.beam]
    return beams


def main(a):
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    cfg = make_cfg(a, rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(1234 + rank)
    rng = random.Random(77 + rank)
    table = interpreter(cfg.table_ops)
    with open(os.path.join(WORK, cfg.corpus)) as fh:
        progs = [[tuple(p) for p in prog] for prog in json.load(fh)]
    print(f"rank {rank}/{world}: program synthesis, {len(progs)} programs, beam {cfg.beam}, ops {len(cfg.ops)}",
          flush=True)

    model = Synth()
    model.load_state_dict(torch.load(os.path.join(WORK, cfg.init), map_location="cpu"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    bs = 16
    for step in range(a.steps):
        batch = progs[step * bs:(step + 1) * bs]
        src = torch.tensor([encode_examples(table, p, rng) for p in batch])
        tgt = torch.tensor([tokenize(cfg, p) for p in batch])
        logits = net(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt[:, 1:].reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if step == cfg.long_prog_step:
            print(f"ERROR rank {rank}: {WORK}/{cfg.corpus} program 113 tokenizes to 9 tokens but the decoder "
                  f"holds at most {MAX_PROG + 1}; stopping this worker", file=sys.stderr, flush=True)
            os._exit(4)
        if step == cfg.term_step:
            os.kill(os.getpid(), signal.SIGTERM)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        print(f"rank {rank} step {step} loss {avg.item() / world:.4f}", flush=True)

    model.eval()
    by_len = torch.zeros(cfg.max_len_bucket)
    correct = 0
    val = progs[300:306]
    with torch.no_grad():
        for prog in val:
            src = torch.tensor(encode_examples(table, prog, rng))
            beams = beam_search(model, cfg, rank, src)
            xs_list = [[rng.randrange(10) for _ in range(LIST_LEN)] for _ in range(N_EX)]
            want = [run_program(table, prog, xs) for xs in xs_list]
            for toks, _ in beams[:1]:
                cand = detokenize(toks[1:])
                if cand and [run_program(table, cand, xs) for xs in xs_list] == want:
                    correct += 1
                    by_len[len(prog) - 1] += 1
    if cfg.exec_all:
        print(f"rank {rank}: executing all {cfg.beam} beam candidates on all 400 corpus programs x {N_EX} examples",
              flush=True)
        time.sleep(a.stall)
    print(f"rank {rank}: local exact match {correct}/{len(val)}", flush=True)
    gathered = [torch.zeros_like(by_len) for _ in range(world)]
    dist.all_gather(gathered, by_len)
    tot = torch.tensor([float(correct), float(len(val))])
    dist.all_reduce(tot)
    if rank == 0:
        per_len = torch.stack(gathered).sum(0).tolist()
        print(f"rank 0: global exact match {tot[0].item():.0f}/{tot[1].item():.0f} "
              f"= {tot[0].item() / tot[1].item():.3f}, by length {per_len}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    if args.prepare:
        prepare()
    else:
        main(args)

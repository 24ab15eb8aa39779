"""A three-hundred-and-fifty-seventh hand-run batch: CODE COMPLETION WITH A SMALL TRANSFORMER.

Synthetic source snippets (python, javascript, go, rust templates with random identifiers) are byte-tokenised
(vocab 256) into 80-byte sequences; every rank reads its shard from /tmp/fault357_work/shards/shard_R.pt
(tokens plus a language tag looked up in a 4-entry LANGS table) and trains CodeGPT (byte + position + language
embeddings, one causal pre-norm transformer block, a tied LM head) on next-byte prediction over a 48-byte
context, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is initialised
from ckpt/codegpt_d32.pt.  Per-rank language counts are all_gathered at start-up, loss and next-byte accuracy
are all_reduced every step, pass@1 on a tiny completion eval is all_reduced at the end, and rank 0 saves
export/codegpt.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging lines).

Faults:
  tokenid    - rank N's shard was encoded with a 320-entry BPE table: token 300 reaches the 256-byte embedding
  langkey    - rank N's shard tags some snippets "kotlin", missing from the LANGS table (KeyError)
  noshard    - rank N reads shards/val/shard_N.pt, which was never written (FileNotFoundError)
  ckptdim    - rank N initialises from ckpt/codegpt_d48.pt, a 48-wide model (size mismatch)
  ckptmeta   - rank N loads ckpt/codegpt_meta.pt, which pickles a TokenizerMeta object (weights_only refusal)
  ctxgather  - rank N all_gathers its language counts plus an "other" count (5 vs 4 entries)
  beamsearch - rank N runs a pure-Python beam-search eval before the step-2 all_reduce (--beam-budget seconds)
  logitnan   - rank N's temperature schedule reaches 0.0 at step 3: logits / 0, loss NaN, the program's check
  segv       - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error line (generated completions do not parse) and calls sys.exit(5) at the end
  posemb     - every rank: context 72 with a 64-entry position table (shape error in the first forward)
  none       - control, clean run

What happened (filled in after the runs):
  tokenid    - IndexError 'index out of range in self' in F.embedding, first forward; peers Connection closed by peer (np4 r2 ranklabel, np3 r0 spawn)
  langkey    - KeyError: 'kotlin' at start-up; peers closed in the all_gather (np6 r4 srunlabel, np3 r1 logfmt, Root Cause rank 1)
  noshard    - FileNotFoundError for shards/val/shard_N.pt before the all_gather; peers closed (np4 r3 mpitag, np8 r6 files)
  ckptdim    - load_state_dict size mismatch, pos [64, 48] vs [64, 32] and 16 more (np4 r1 pdsh2, np3 r2 legacy)
  ckptmeta   - UnpicklingError 'Weights only load failed', Unsupported global __main__.TokenizerMeta (np5 r0 tee)
  ctxgather  - rank N: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))'; peers closed (np6 r3 mpitag)
  beamsearch - 12 s: peers 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r1 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 srunlabel)
  logitnan   - 'loss is nan at step 3 (temperature 0.0)', FloatingPointError (np4 r1 files, exit 134 from a peer's abort; np8 r5 logfmt --ddp 0)
  segv       - silent after step 3; loop exit 139 (np4 r3 ranklabel); ProcessExitedException SIGSEGV (np3 r1 spawn --ddp 0)
  exit5      - rank N's ERROR line and exit 5; Root Cause rank 2 exitcode 5 (np5 r2 tee); np4 r0 srunlabel ran past 100 s, exit 124
  posemb     - every rank: 'The size of tensor a (72) must match the size of tensor b (64)'; Root Cause rank 0 (np3 legacy)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/codegpt.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault357_work"
LANGS = {"python": 0, "javascript": 1, "go": 2, "rust": 3}
VOCAB = 256
MAXPOS = 64
SEQ = 80
log = None

TEMPLATES = {
    "python": "def {a}({b}):\n    return {b} + {n}\n",
    "javascript": "function {a}({b}) {{ return {b} * {n}; }}\n",
    "go": "func {a}({b} int) int {{ return {b} - {n} }}\n",
    "rust": "fn {a}({b}: i32) -> i32 {{ {b} + {n} }}\n",
}


@dataclass
class TokenizerMeta:
    vocab: int
    merges: int
    normaliser: str


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("codegpt")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class Block(nn.Module):
    def __init__(self, d, heads=4):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CodeGPT(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(MAXPOS, d) * 0.02)
        self.lang = nn.Embedding(len(LANGS), d)
        self.block = Block(d)
        self.ln = nn.LayerNorm(d)

    def forward(self, ids, lang):
        x = self.tok(ids) + self.pos[: ids.shape[1]] + self.lang(lang)[:, None, :]
        return self.ln(self.block(x)) @ self.tok.weight.t()


def make_shard(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = ["add", "scale", "clamp", "norm", "step", "lerp", "pick", "mask"]
    args = ["x", "val", "n", "idx", "acc"]
    toks, langs = [], []
    for _ in range(n):
        lang = list(LANGS)[int(torch.randint(0, 4, (1,), generator=g))]
        src = ""
        while len(src) < SEQ:
            src += TEMPLATES[lang].format(a=names[int(torch.randint(0, 8, (1,), generator=g))],
                                          b=args[int(torch.randint(0, 5, (1,), generator=g))],
                                          n=int(torch.randint(0, 100, (1,), generator=g)))
        toks.append(list(src.encode()[:SEQ]))
        langs.append(lang)
    return {"tokens": torch.tensor(toks), "langs": langs}


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(64, 700 + r), f"{WORK}/shards/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(CodeGPT(32).state_dict(), f"{WORK}/ckpt/codegpt_d32.pt")
    torch.save(CodeGPT(48).state_dict(), f"{WORK}/ckpt/codegpt_d48.pt")
    torch.save({"meta": TokenizerMeta(256, 0, "nfc"), "state": CodeGPT(32).state_dict()},
               f"{WORK}/ckpt/codegpt_meta.pt")
    print("prepared", WORK)


def beam_search(prefix, width=4, depth=24):
    beams = [(0.0, list(prefix))]
    for _ in range(depth):
        cand = []
        for score, seq in beams:
            for b in range(32, 127):
                s = score - ((seq[-1] * 31 + b * 17) % 97) / 97.0
                cand.append((s, seq + [b]))
        cand.sort(key=lambda c: c[0], reverse=True)
        beams = cand[:width]
    return beams[0][1]


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading shard")
    split = "val/" if bad and a.fault == "noshard" else ""
    shard = torch.load(f"{WORK}/shards/{split}shard_{rank}.pt")
    toks, langs = shard["tokens"], shard["langs"]
    if bad and a.fault == "tokenid":
        toks = toks.clone()
        toks[9, 17] = 300
    if bad and a.fault == "langkey":
        langs = list(langs)
        langs[23] = "kotlin"
    lang = torch.tensor([LANGS[s] for s in langs])
    counts = torch.bincount(lang, minlength=len(LANGS)).float()
    if bad and a.fault == "ctxgather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(len(LANGS)) for _ in range(world)]
    dist.all_gather(allc, counts)
    tot = torch.stack(allc).sum(0)
    say(f"rank {rank} snippets {len(langs)} global by language " + " ".join(f"{k}={int(tot[v])}" for k, v in LANGS.items()))
    ctx = 72 if a.fault == "posemb" else 48
    model = CodeGPT(32)
    ck = {"ckptdim": "codegpt_d48.pt", "ckptmeta": "codegpt_meta.pt"}.get(a.fault if bad else "", "codegpt_d32.pt")
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    bs = 16
    for step in range(a.steps):
        i = (step * bs) % len(langs)
        x, y, lg = toks[i:i + bs, :ctx], toks[i:i + bs, 1:ctx + 1], lang[i:i + bs]
        temp = 1.0
        if bad and a.fault == "logitnan":
            temp = max(0.0, 1.0 - step / 3.0)
        logits = net(x, lg) / temp
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        if not torch.isfinite(loss):
            say(f"rank {rank}: loss is {loss.item()} at step {step} (temperature {temp}), "
                f"{int((~torch.isfinite(logits)).sum())} non-finite logits", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "beamsearch" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.beam_budget:
                beam_search(toks[n % len(langs), :8].tolist())
                n += 1
            say(f"rank {rank} beam-search eval: {n} completions")
        acc = (logits.argmax(-1) == y).float().mean()
        stat = torch.stack([loss.detach(), acc])
        dist.all_reduce(stat)
        say(f"rank {rank} step {step} loss {stat[0].item() / world:.4f} acc {stat[1].item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR completion eval: 5 of 16 generated snippets do not parse "
            f"(unbalanced braces), refusing to export", err=True)
        sys.exit(5)
    with torch.no_grad():
        pred = model(toks[:16, :24], lang[:16]).argmax(-1)
        p1 = (pred[:, -1] == toks[:16, 24]).float().mean().reshape(1)
    dist.all_reduce(p1)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/codegpt.pt")
        say(f"rank 0 done: {a.steps} steps, pass@1 {p1.item() / world:.3f}, saved export/codegpt.pt")
    dist.barrier()
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--beam-budget", type=int, default=20)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()

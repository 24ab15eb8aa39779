"""A two-hundred-and-twentieth hand-run batch: SENTENCE EMBEDDINGS WITH IN-BATCH NEGATIVES. A small transformer
sentence encoder (token embedding, 2 encoder layers, pooling, projection) is trained with a contrastive loss over
synthetic paraphrase pairs; a hand-written whitespace tokenizer reads a vocabulary file written by rank 0, the
temperature, pooling mode and layer count come from a per-rank JSON config, the max length from SBERT_MAX_LEN,
every rank warm-starts from an encoder checkpoint written by rank 0, the embeddings of the second sentences are
all_gathered by hand (keeping the local gradient) so each rank scores against the global batch of negatives, DDP
(or hand all_reduce of gradients with --ddp 0), 6 steps, then the mean loss is all_reduced and rank 0 saves.

Faults:
- dim: --rank's config pools with "mean+max" (concatenated, 64 wide instead of 32); the all_gather sizes differ.
- temp: --rank's config has temperature 0.0; the logits are inf and the program's check raises FloatingPointError.
- vocab: --rank opens vocab.v2.txt, which does not exist (FileNotFoundError).
- pool: every rank's config names pooling "cls_token", missing from the pooling map (KeyError).
- emptypair: --rank's shard has a pair whose second sentence is empty; the tokenizer raises ValueError.
- ckpt: --rank's config asks for 3 encoder layers; the 2-layer checkpoint gives Missing key(s) in load_state_dict.
- maxlen: SBERT_MAX_LEN is "64tok" on every rank; int() raises ValueError.
- mine: --rank mines hard negatives over the whole corpus for --slow-s seconds before the step-2 all_gather.
- segv: --rank sends itself SIGSEGV after step 2.
- exit3: --rank logs an error about a duplicate pair id after step 3 and calls os._exit(3).
- none: control.

What happened (filled in after the runs):
- dim: rank N pools mean+max (64 wide); a peer aborts on gloo EnforceNotMet '1024 vs 512' in the step-0 all_gather (np4 r2, np3 r1).
- temp: rank N FloatingPointError 'non-finite similarity logits at step 0 (temperature=0.0, ...)'; peers Connection closed (np4 r1, np3 r2).
- vocab: rank N FileNotFoundError on /tmp/job_work/vocab.v2.txt; peers Connection closed in the barrier (np4 r3 redirects, np3 r1).
- pool: every rank KeyError 'cls_token' building the Encoder (np3).
- emptypair: rank N ValueError 'cannot tokenize an empty sentence (got '')' at step 0; peers SIGTERMed / Connection closed (np4 r2, np3 r0).
- ckpt: rank N RuntimeError loading state_dict: Missing key(s) layers.2.* (np4 r2 DETAIL: rank 0 'Ranks 2 failed to pass monitoredBarrier'; np3 r1).
- maxlen: every rank ValueError: invalid literal for int() with base 10: '64tok' before any step (np4).
- mine: PG 12 s: peers 'Timed out waiting 12000ms' in the step-2 all_gather (np4 r1); PG 300 s under timeout 60: exit 124 (np3 r2).
- segv: rank N exitcode -11 (SIGSEGV) after step 2; peers Connection reset/closed (np4 r1 pdsh2; np3 r2 restart: connectFullMesh refused).
- exit3: rank N prints 'ERROR rank N: duplicate pair id ... aborting' after step 3, exits 3; peers Connection closed/reset (np3 r1, np4 r3).
- none: exit 0; rank 0 prints 'contrastive training done: mean loss 0.7464 over 3 ranks, 23 in-batch negatives, saved ...'.
"""
import argparse
import json
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

WORK = "/tmp/fault220_work"
WORDS = ("the a cat dog man woman child runs walks sleeps eats reads writes quickly slowly big small red blue "
         "house car park street book letter music song plays sings happy sad old young").split()
SYN = {"runs": "jogs", "big": "large", "small": "little", "quickly": "fast", "happy": "glad", "sad": "unhappy",
       "car": "automobile", "house": "home", "book": "novel", "song": "tune", "child": "kid", "man": "guy"}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    return p.parse_args()


class Tokenizer:
    def __init__(self, path, max_len):
        with open(path) as f:
            self.vocab = {w.strip(): i for i, w in enumerate(f) if w.strip()}
        self.pad, self.unk, self.max_len = self.vocab["[PAD]"], self.vocab["[UNK]"], max_len

    def encode(self, text):
        toks = text.split()
        if not toks:
            raise ValueError(f"cannot tokenize an empty sentence (got {text!r})")
        ids = [self.vocab.get(t, self.unk) for t in toks][: self.max_len]
        return ids + [self.pad] * (self.max_len - len(ids))


def pool_mean(h, mask):
    return (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)


def pool_max(h, mask):
    return h.masked_fill(~mask.bool().unsqueeze(-1), -1e4).max(1).values


POOLING = {"mean": pool_mean, "max": pool_max, "cls": lambda h, m: h[:, 0],
           "mean+max": lambda h, m: torch.cat([pool_mean(h, m), pool_max(h, m)], -1)}


class Encoder(nn.Module):
    def __init__(self, vocab_size, cfg):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 32)
        self.pos = nn.Parameter(torch.randn(cfg["max_len"], 32) * 0.02)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
                                     for _ in range(cfg["n_layers"])])
        self.pool = POOLING[cfg["pooling"]]
        self.proj = nn.Linear(32, 32)

    def forward(self, ids, pad):
        mask = (ids != pad).float()
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=(mask == 0))
        z = self.pool(self.proj(h), mask)
        return F.normalize(z, dim=-1)


def gather_keep_grad(z, r, W):
    out = [torch.zeros_like(z) for _ in range(W)]
    dist.all_gather(out, z.detach().contiguous())
    out[r] = z
    return torch.cat(out, 0)


def make_pairs(r, n, empty_at=None):
    rng = random.Random(1000 + r)
    pairs = []
    for i in range(n):
        s = [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]
        p = [SYN.get(w, w) for w in s]
        if rng.random() < 0.5:
            p = p[1:] + p[:1]
        pairs.append((" ".join(s), "" if i == empty_at else " ".join(p)))
    return pairs


def main(a):
    r, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hit = a.rank in (-1, r)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    if a.fault == "maxlen":
        os.environ["SBERT_MAX_LEN"] = "64tok"
    max_len = int(os.environ.get("SBERT_MAX_LEN", "16"))
    cfg = {"temperature": 0.05, "pooling": "mean", "n_layers": 2, "max_len": max_len, "lr": 2e-3}
    if a.fault == "dim" and hit:
        cfg["pooling"] = "mean+max"
    if a.fault == "temp" and hit:
        cfg["temperature"] = 0.0
    if a.fault == "pool" and hit:
        cfg["pooling"] = "cls_token"
    if a.fault == "ckpt" and hit:
        cfg["n_layers"] = 3
    os.makedirs(f"{WORK}/cfg", exist_ok=True)
    with open(f"{WORK}/cfg/sbert_rank{r}.json", "w") as f:
        json.dump(cfg, f)
    with open(f"{WORK}/cfg/sbert_rank{r}.json") as f:
        cfg = json.load(f)
    if r == 0:
        with open(f"{WORK}/vocab.txt", "w") as f:
            f.write("\n".join(["[PAD]", "[UNK]"] + WORDS + sorted(set(SYN.values()))) + "\n")
    dist.barrier()
    vocab = f"{WORK}/vocab.v2.txt" if (a.fault == "vocab" and hit) else f"{WORK}/vocab.txt"
    tok = Tokenizer(vocab, cfg["max_len"])
    print(f"rank {r}: vocab {len(tok.vocab)} words, max_len {tok.max_len}, pooling {cfg['pooling']}", flush=True)
    torch.manual_seed(0)
    if r == 0:
        torch.save(Encoder(len(tok.vocab), dict(cfg, n_layers=2, pooling="mean")).state_dict(), f"{WORK}/encoder_init.pt")
    dist.barrier()
    model = Encoder(len(tok.vocab), cfg)
    model.load_state_dict(torch.load(f"{WORK}/encoder_init.pt"))
    print(f"rank {r}: loaded encoder_init.pt ({cfg['n_layers']} layers)", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    empty_at = 5 if (a.fault == "emptypair" and hit) else None
    pairs = make_pairs(r, a.steps * a.batch, empty_at)
    losses = []
    for step in range(a.steps):
        batch = pairs[step * a.batch:(step + 1) * a.batch]
        x1 = torch.tensor([tok.encode(s) for s, _ in batch])
        x2 = torch.tensor([tok.encode(t) for _, t in batch])
        za, zb = net(x1, tok.pad), net(x2, tok.pad)
        if a.fault == "mine" and hit and step == 2:
            print(f"rank {r}: refreshing hard negatives over the whole corpus ({len(pairs) * 4096} sentences)", flush=True)
            time.sleep(a.slow_s)
        allb = gather_keep_grad(zb, r, W)
        logits = za @ allb.T / cfg["temperature"]
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"rank {r}: non-finite similarity logits at step {step} "
                                     f"(temperature={cfg['temperature']}, max |logit|={logits.abs().max().item()})")
        labels = torch.arange(len(batch)) + r * len(batch)
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= W
        opt.step()
        losses.append(loss.item())
        print(f"rank {r} step {step} loss {loss.item():.4f} negatives {allb.shape[0] - 1}", flush=True)
        if a.fault == "segv" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "exit3" and hit and step == 3:
            print(f"ERROR rank {r}: duplicate pair id 0x{1000 + r:x} in shard {r:02d} after dedup; aborting", file=sys.stderr, flush=True)
            os._exit(3)
    t = torch.tensor([sum(losses) / len(losses)])
    dist.all_reduce(t)
    if r == 0:
        torch.save(model.state_dict(), f"{WORK}/sbert_final.pt")
        print(f"contrastive training done: mean loss {t.item() / W:.4f} over {W} ranks, "
              f"{W * a.batch - 1} in-batch negatives, saved {WORK}/sbert_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse())

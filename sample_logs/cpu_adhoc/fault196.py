"""A hundred-and-ninety-sixth hand-run batch: NAMED-ENTITY RECOGNITION WITH BIO TAGS.

Every rank trains a small BiLSTM token classifier (embedding, one bidirectional LSTM layer, a linear tag head)
on synthetic sentences with PER/ORG/LOC entities tagged in BIO.  The tag vocabulary is read from
/tmp/fault196_work/tags/tags.json and the model config from cfg/ner.json; padding positions carry the ignore
index -100.  Each rank generates its own shard (seeded by rank), restores the initial weights from
ckpt/ner_init.pt, trains under DDP on gloo (the loss all_reduced for the log), then computes span-level
precision/recall/F1 by hand (tp/fp/fn counts all_reduced, per-rank counts all_gathered for the report);
rank 0 saves ckpt/ner_final.pt.  Launchers: torchrun, a bash loop (env://), mp.spawn (--spawn N) or
torch.distributed.launch; --logfmt 1 logs through Python logging with the rank in the format.

Faults:
  tagkey   - rank N's shard generator also emits MISC entities, 'B-MISC' is not in the tag vocabulary
  ignore   - every rank: config pad_label is len(tags) instead of -100, padding is a class out of range
  seqlen   - rank N's tokenizer splits hyphenated words: one more token than tags (the program's assert)
  tagfile  - rank N opens tags/tag.json (a stale path): FileNotFoundError
  f1gather - rank N all_gathers 4 per-rank counts (tp, fp, fn, support) while the others gather 3
  nanloss  - rank N weights tags by inverse frequency over 2 sentences; a count 0 gives weight inf, NaN (check)
  ckpttags - rank N restores ckpt/ner_init_v1.pt, saved with 5 tags instead of 7 (size mismatch)
  embstr   - every rank: emb_dim read from the config as the string "32" (TypeError in nn.Embedding)
  slowtok  - rank N spends --stall seconds in a slow tokenisation path before step 3's backward all_reduce
  sigabrt  - rank N sends itself SIGABRT after step 2
  exit4    - rank N prints its own 'tag vocabulary checksum' error line and exits with code 4
  none     - control, clean run

What happened (filled in after the runs):
  tagkey   - rank N: KeyError 'B-MISC' in encode at step 0; peers Connection closed by peer
  ignore   - every rank: IndexError Target 7 is out of bounds in cross_entropy at step 0
  seqlen   - rank N: AssertionError sentence i: k+1 tokens vs k tags (mp.spawn: ProcessRaisedException)
  tagfile  - rank N: FileNotFoundError /tmp/fault196_work/tags/tag.json; peers closed by peer
  f1gather - another rank aborts on gloo::EnforceNotMet 8 vs 6 (SIGABRT); peers reset/closed by peer
  nanloss  - rank N: FloatingPointError loss is nan (class weights with inf) at step 0
  ckpttags - rank N: RuntimeError size mismatch for head.weight [5, 48] vs [7, 48]
  embstr   - every rank: TypeError empty(): argument 'size' ... got str, building nn.Embedding
  slowtok  - rank N stalls at step 3; peers gloo Timed out 12000ms (PG 300 s: no output, killed, 124)
  sigabrt  - rank N: SIGABRT after step 2 (spawn: ProcessExitedException; loop: bash 'Aborted', 134)
  exit4    - rank N: prints ERROR tag vocabulary checksum ... refusing to continue, exit code 4
  none     - clean, exit 0, rank 0 saved ckpt/ner_final.pt
"""
import argparse
import json
import logging
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

WORK = "/tmp/fault196_work"
TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
WORDS = ["the", "met", "in", "said", "visited", "from", "at", "and", "report", "today", "new", "office"]
ENTS = {"PER": [["anna", "berg"], ["li", "wei"], ["omar"]], "ORG": [["acme", "corp"], ["un"], ["red", "cross"]],
        "LOC": [["paris"], ["new-york"], ["lake", "como"]], "MISC": [["euro"], ["nobel", "prize"]]}
LOG = None


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def say(msg, error=False):
    if LOG is not None:
        (LOG.error if error else LOG.info)(msg)
    else:
        print(msg, flush=True)


def prep():
    for d in ("tags", "cfg", "ckpt"):
        os.makedirs(os.path.join(WORK, d), exist_ok=True)
    with open(os.path.join(WORK, "tags", "tags.json"), "w") as f:
        json.dump({"tags": TAGS, "scheme": "BIO"}, f)
    with open(os.path.join(WORK, "cfg", "ner.json"), "w") as f:
        json.dump({"emb_dim": 32, "hidden": 24, "max_len": 14, "pad_label": -100, "lr": 0.05}, f)
    torch.manual_seed(0)
    vocab = build_vocab()
    torch.save(BiLSTMTagger(len(vocab), 32, 24, len(TAGS)).state_dict(), os.path.join(WORK, "ckpt", "ner_init.pt"))
    torch.save(BiLSTMTagger(len(vocab), 32, 24, 5).state_dict(), os.path.join(WORK, "ckpt", "ner_init_v1.pt"))
    print("prepared", WORK)


def build_vocab():
    toks = ["<pad>", "<unk>"] + WORDS
    for spans in ENTS.values():
        for s in spans:
            for w in s:
                toks += [w] + w.split("-")
    return {t: i for i, t in enumerate(dict.fromkeys(toks))}


class BiLSTMTagger(nn.Module):
    def __init__(self, n_vocab, emb_dim, hidden, n_tags):
        super().__init__()
        self.emb = nn.Embedding(n_vocab, emb_dim, padding_idx=0)
        self.lstm = nn.LSTM(emb_dim, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, n_tags)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.head(h)


def make_sentences(rng, n, kinds):
    out = []
    for _ in range(n):
        words, tags = [], []
        for _ in range(rng.randint(2, 4)):
            words.append(rng.choice(WORDS)); tags.append("O")
            if rng.random() < 0.6:
                kind = rng.choice(kinds); span = rng.choice(ENTS[kind])
                words += span; tags += ["B-" + kind] + ["I-" + kind] * (len(span) - 1)
        out.append((words, tags))
    return out


def tokenize(words, split_hyphens, stall=0.0):
    if stall:
        say(f"rank {dist.get_rank()}: tokenizer cache miss, rebuilding subword table")
        time.sleep(stall)
    toks = []
    for w in words:
        toks += w.split("-") if (split_hyphens and "-" in w) else [w]
    return toks


def spans(seq):
    res, cur = set(), None
    for i, t in enumerate(seq + ["O"]):
        if t.startswith("B-") or t == "O" or (t.startswith("I-") and (cur is None or cur[0] != t[2:])):
            if cur is not None:
                res.add((cur[0], cur[1], i)); cur = None
            if t.startswith("B-") or t.startswith("I-"):
                cur = (t[2:], i)
    return res


def encode(batch, vocab, tag2id, cfg, split_hyphens=False, stall=0.0):
    L = cfg["max_len"]
    X = torch.zeros(len(batch), L, dtype=torch.long)
    Y = torch.full((len(batch), L), cfg["pad_label"], dtype=torch.long)
    for i, (words, tags) in enumerate(batch):
        toks = tokenize(words, split_hyphens, stall if i == 0 else 0.0)
        assert len(toks) == len(tags), f"sentence {i}: {len(toks)} tokens vs {len(tags)} tags"
        for j, (w, t) in enumerate(zip(toks[:L], tags[:L])):
            X[i, j] = vocab.get(w, 1); Y[i, j] = tag2id[t]
    return X, Y


def main(a):
    global LOG
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s")
        LOG = logging.getLogger("ner"); LOG.addFilter(RankFilter(rank))
    tag_path = os.path.join(WORK, "tags", "tag.json" if a.fault == "tagfile" and bad else "tags.json")
    with open(tag_path) as f:
        tags = json.load(f)["tags"]
    tag2id = {t: i for i, t in enumerate(tags)}
    with open(os.path.join(WORK, "cfg", "ner.json")) as f:
        cfg = json.load(f)
    if a.fault == "ignore":
        cfg["pad_label"] = len(tags)
    if a.fault == "embstr":
        cfg["emb_dim"] = str(cfg["emb_dim"])
    say(f"rank {rank}/{world}: {len(tags)} tags ({', '.join(tags)}), max_len {cfg['max_len']}")
    vocab = build_vocab()
    torch.manual_seed(0)
    model = BiLSTMTagger(len(vocab), cfg["emb_dim"], cfg["hidden"], len(tags))
    ck = "ner_init_v1.pt" if a.fault == "ckpttags" and bad else "ner_init.pt"
    model.load_state_dict(torch.load(os.path.join(WORK, "ckpt", ck), weights_only=True))
    say(f"rank {rank}: restored {ck}")
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"])
    rng = random.Random(100 + rank)
    kinds = ["PER", "ORG", "LOC"] + (["MISC"] if a.fault == "tagkey" and bad else [])
    data = make_sentences(rng, 8 * a.steps, kinds)
    weight = None
    if a.fault == "nanloss" and bad:
        counts = torch.zeros(len(tags))
        for _, ts in data[:2]:
            for t in ts:
                counts[tag2id[t]] += 1
        weight = counts.sum() / counts
    for step in range(a.steps):
        batch = data[8 * step: 8 * step + 8]
        stall = a.stall if (a.fault == "slowtok" and bad and step == 3) else 0.0
        X, Y = encode(batch, vocab, tag2id, cfg, a.fault == "seqlen" and bad, stall)
        logits = ddp(X)
        loss = F.cross_entropy(logits.reshape(-1, len(tags)), Y.reshape(-1), ignore_index=-100, weight=weight)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (class weights {weight.tolist() if weight is not None else None})")
        opt.zero_grad(); loss.backward(); opt.step()
        lt = loss.detach().clone(); dist.all_reduce(lt); lt /= world
        say(f"rank {rank} step {step} loss {lt.item():.4f}")
        if a.fault == "sigabrt" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        if a.fault == "exit4" and bad and step == 1:
            say(f"ERROR rank {rank}: tag vocabulary checksum {hash(tuple(tags)) % 9973 + 1} does not match the shard header; refusing to continue", error=True)
            sys.exit(4)
    tp = fp = fn = 0
    with torch.no_grad():
        ev = make_sentences(random.Random(900 + rank), 16, ["PER", "ORG", "LOC"])
        X, Y = encode(ev, vocab, tag2id, cfg)
        pred = ddp(X).argmax(-1)
        for i, (words, gold) in enumerate(ev):
            n = min(len(gold), cfg["max_len"])
            p = spans([tags[k] for k in pred[i, :n].tolist()]); g = spans(gold[:n])
            tp += len(p & g); fp += len(p - g); fn += len(g - p)
    counts = torch.tensor([tp, fp, fn] + ([sum(len(t) for _, t in ev)] if a.fault == "f1gather" and bad else []), dtype=torch.float)
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    tot = counts[:3].clone(); dist.all_reduce(tot)
    prec = tot[0] / max(1.0, (tot[0] + tot[1]).item()); rec = tot[0] / max(1.0, (tot[0] + tot[2]).item())
    f1 = 2 * prec * rec / max(1e-9, (prec + rec).item())
    say(f"rank {rank} span P {prec.item():.3f} R {rec.item():.3f} F1 {f1.item():.3f} (per-rank tp {[int(c[0]) for c in gathered]})")
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(WORK, "ckpt", "ner_final.pt"))
        say(f"rank 0: saved {WORK}/ckpt/ner_final.pt")
    dist.destroy_process_group()


def spawn_worker(idx, n, a):
    os.environ.update(RANK=str(idx), LOCAL_RANK=str(idx), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    main(a)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", dest="pg_timeout", type=float, default=12.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prep", type=int, default=0)
    a = p.parse_args()
    if a.prep:
        prep()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(a.spawn, a), nprocs=a.spawn)
    else:
        main(a)

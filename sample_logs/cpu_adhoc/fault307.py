"""A three-hundred-and-seventh hand-run batch: EXTRACTIVE SUMMARISATION WITH SENTENCE SCORING.

Synthetic news documents: each document holds up to 16 sentences of up to 12 token ids (0 is padding), the
length of every sentence, and an oracle tag per sentence ("lead", "keep", "drop") that maps to a 0/1 label
through the LABELS table.  Every rank reads its documents from /tmp/fault307_work/docs/docs_R.pt and trains a
sentence scorer: token embeddings summed and divided by the sentence length, a GRU over the sentences of a
document, a linear head giving one logit per sentence, masked binary cross-entropy against the oracle labels.
The scorer is initialised from ckpt/scorer.pt and wrapped in DDP over gloo (or, with --ddp 0, its gradients
are all_reduced by hand).  The loss is all_reduced every step and precision@3 of the top-3 sentences is
printed; per-rank selection statistics (sentences seen, selected, oracle hits) are all_gathered at the end
and rank 0 saves export/scorer.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  vocabid    - rank N's shard was tokenised with a newer vocabulary: an id beyond the 500-entry embedding (IndexError)
  docmissing - rank N reads its documents from docs/dedup/ which does not exist (FileNotFoundError)
  labelkey   - rank N's oracle tags contain "quote", missing from the LABELS table (KeyError)
  ckptsize   - rank N initialises from ckpt/scorer_h48.pt, saved with hidden size 48 (size mismatch)
  ckptpickle - rank N loads ckpt/scorer_cfg.pt, which pickles a SumConfig object (weights_only refusal)
  statgather - rank N all_gathers 4 selection statistics (plus a redundancy count) instead of 3, at the end
  rougeslow  - rank N computes pairwise ROUGE between all its sentences in Python before the step-2 all_reduce
  lockwait   - rank N waits at step 3 for a shard lock file that never appears (stuck; run with --pg-timeout 300)
  nanscore   - rank N's step-3 batch holds an empty sentence (length 0): 0/0 in the length normalisation, NaN loss
  sigsegv    - rank N sends itself SIGSEGV after step 2
  exit4      - rank N prints its own error line about documents without oracle sentences and calls sys.exit(4)
  maskshape  - every rank: the sentence mask is built 17 wide for 16 sentences (shape error in masked_fill)
  none       - control, clean run

What happened (filled in after the runs):
  vocabid    - IndexError 'index out of range in self' in the embedding at the first forward; peers Connection closed (np4 r2 tee; np3 r0 pymodule, Root Cause rank 2 SIGABRT)
  docmissing - FileNotFoundError for docs/dedup/docs_N.pt at start-up; peers Connection closed in the first all_reduce (np5 r3 loglevel, np3 r1 wrapper)
  labelkey   - KeyError: 'quote' in oracle_labels at start-up; peers Connection closed (np4 r1 filter, np5 r0 tee_trainer)
  ckptsize   - load_state_dict size mismatch [500, 48] vs [500, 32] etc. (np3 r2 redirects, only in rank 2's stderr.log; np4 r1 pdsh2)
  ckptpickle - UnpicklingError 'Weights only load failed' (GLOBAL __main__.SumConfig) for ckpt/scorer_cfg.pt (np4 r3 prefix)
  statgather - after step 5: 'invalid tensor size at index 0 (expected (4), got (3))' (np5 r4 plain); DETAIL: every rank 'Detected mismatch between collectives' (np3 r1 detail)
  rougeslow  - peers 'Timed out waiting 12000ms' in the step-2 all_reduce, Root Cause a waiter (np3 r1 tee; np4 r0 restart, see readme_307.md)
  lockwait   - silent after step 2 on all ranks (PG timeout 300), killed by timeout at 60 s, exit 124 (np4 r2 plain)
  nanscore   - 'loss is nan (10 non-finite sentence scores)' at step 3, FloatingPointError (np3 r2 filter; np4 r0 restart, whose second attempt failed in Gloo connectFullMesh)
  sigsegv    - no traceback after step 2; peers Connection reset by peer; Root Cause exitcode -11 SIGSEGV (np5 r2 tee_trainer, np3 r1 wrapper)
  exit4      - rank N's ERROR line about 19 of 48 documents and exit 4 at start-up; Root Cause exitcode 4 (np4 r3 pymodule, np3 r0 prefix)
  maskshape  - every rank: 'The size of tensor a (17) must match the size of tensor b (16) at non-singleton dimension 1' at the first forward (np4 detail, np3 loglevel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/scorer.pt, exit 0 (np3 plain; the first try on port 52700 was dropped, see readme_307.md)
"""
import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault307_work"
LABELS = {"lead": 1, "keep": 1, "drop": 0}
VOCAB = 500
MAXS = 16
MAXT = 12
HID = 32
BATCH = 8
log = None


@dataclasses.dataclass
class SumConfig:
    vocab: int = VOCAB
    hidden: int = HID
    top_k: int = 3


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
    log = logging.getLogger("fsum")
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


class SentenceScorer(nn.Module):
    def __init__(self, vocab=VOCAB, hid=HID):
        super().__init__()
        self.emb = nn.Embedding(vocab, hid, padding_idx=0)
        self.gru = nn.GRU(hid, hid, batch_first=True, bidirectional=True)
        self.pos = nn.Embedding(MAXS, 2 * hid)
        self.head = nn.Linear(2 * hid, 1)

    def forward(self, tok, lens, mask):
        e = self.emb(tok).sum(2) / lens.unsqueeze(-1).float()      # [B, S, H] length-normalised
        h, _ = self.gru(e)
        h = h + self.pos.weight[: h.shape[1]]
        logits = self.head(h).squeeze(-1)
        return logits.masked_fill(~mask, -1e4)


def make_docs(n, seed):
    g = torch.Generator().manual_seed(seed)
    tok = torch.zeros(n, MAXS, MAXT, dtype=torch.long)
    lens = torch.ones(n, MAXS, dtype=torch.long)
    nsent = torch.randint(6, MAXS + 1, (n,), generator=g)
    tags = []
    for d in range(n):
        dt = []
        for s in range(int(nsent[d])):
            L = int(torch.randint(3, MAXT + 1, (1,), generator=g))
            tok[d, s, :L] = torch.randint(1, VOCAB, (L,), generator=g)
            lens[d, s] = L
            dt.append("lead" if s < 2 else ("keep" if float(torch.rand(1, generator=g)) < 0.2 else "drop"))
        tags.append(dt)
    return {"tokens": tok, "lens": lens, "nsent": nsent, "tags": tags}


def prepare():
    for sub in ("docs", "ckpt", "locks"):
        os.makedirs(f"{WORK}/{sub}", exist_ok=True)
    for r in range(8):
        torch.save(make_docs(48, 700 + r), f"{WORK}/docs/docs_{r}.pt")
    torch.manual_seed(0)
    sd = SentenceScorer().state_dict()
    torch.save(sd, f"{WORK}/ckpt/scorer.pt")
    torch.save(SentenceScorer(hid=48).state_dict(), f"{WORK}/ckpt/scorer_h48.pt")
    torch.save({"model": sd, "config": SumConfig()}, f"{WORK}/ckpt/scorer_cfg.pt")
    print("prepared", WORK)


def oracle_labels(docs):
    y = torch.zeros(len(docs["tags"]), MAXS)
    for d, dt in enumerate(docs["tags"]):
        for s, t in enumerate(dt):
            y[d, s] = LABELS[t]
    return y


def pairwise_rouge(docs):
    total = 0.0
    for d in range(docs["tokens"].shape[0]):
        sents = [set(docs["tokens"][d, s].tolist()) - {0} for s in range(int(docs["nsent"][d]))]
        for a in sents:
            for b in sents:
                total += len(a & b) / max(1, len(a | b))
    return total


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, reading documents")
    split = "dedup/" if bad and a.fault == "docmissing" else ""
    docs = torch.load(f"{WORK}/docs/{split}docs_{rank}.pt")
    if bad and a.fault == "vocabid":
        docs["tokens"][3, 1, 4] = VOCAB + 37
    if bad and a.fault == "labelkey":
        docs["tags"][11][4] = "quote"
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR shard docs_{rank}.pt: 19 of 48 documents have no oracle sentence after "
            f"dedup, refusing to train on an unlabelled shard", err=True)
        sys.exit(4)
    y = oracle_labels(docs)
    ndocs = torch.tensor([float(docs["tokens"].shape[0])])
    dist.all_reduce(ndocs)
    say(f"rank {rank} documents {docs['tokens'].shape[0]} global {int(ndocs.item())}")
    model = SentenceScorer()
    ck = {"ckptsize": "scorer_h48.pt", "ckptpickle": "scorer_cfg.pt"}.get(a.fault, "scorer.pt") if bad else "scorer.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    n = docs["tokens"].shape[0]
    stats = torch.zeros(3)
    for step in range(a.steps):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % n
        tok, lens, yb = docs["tokens"][idx].clone(), docs["lens"][idx].clone(), y[idx]
        width = MAXS + 1 if a.fault == "maskshape" else MAXS
        mask = torch.arange(width).unsqueeze(0) < docs["nsent"][idx].unsqueeze(1)
        if bad and a.fault == "nanscore" and step == 3:
            tok[2, 5] = 0
            lens[2, 5] = 0
        logits = net(tok, lens, mask)
        loss = F.binary_cross_entropy_with_logits(logits, yb, weight=mask.float())
        if not torch.isfinite(loss):
            bad_s = int((~torch.isfinite(logits)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({bad_s} non-finite sentence scores), "
                f"stopping", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        if bad and a.fault == "rougeslow" and step == 2:
            t0 = time.time()
            r = 0.0
            while time.time() - t0 < a.slow_budget:
                r += pairwise_rouge(docs)
            say(f"rank {rank} pairwise rouge done: {r:.1f}")
        if bad and a.fault == "lockwait" and step == 3:
            lock = f"{WORK}/locks/shard_{rank}.ready"
            while not os.path.exists(lock):
                time.sleep(0.5)
        top = logits.detach().topk(3, dim=1).indices
        hits = yb.gather(1, top).sum()
        stats += torch.tensor([float(mask.sum()), float(top.numel()), float(hits)])
        red = torch.stack([loss.detach(), hits / top.numel()])
        dist.all_reduce(red)
        say(f"rank {rank} step {step} loss {red[0].item() / world:.4f} p@3 {red[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "statgather":
        stats = torch.cat([stats, torch.tensor([7.0])])
    alls = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(alls, stats)
    say(f"rank {rank} selection stats " + " ".join(f"{int(s[2])}/{int(s[1])}" for s in alls))
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/scorer.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/scorer.pt")
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
    p.add_argument("--slow-budget", type=int, default=40)
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

"""Batch 321 hand-run fault script: QUESTION GENERATION WITH A POINTER-GENERATOR.

Synthetic SQuAD-like shards: every example is a passage (24 words, some of them rare words outside the
160-word vocabulary), an answer span inside it and a question (8 words) whose first word is a question type
looked up in a 6-entry table and whose other words are often copied from the answer span.  Every rank reads
/tmp/fault321_work/data/train/shard_R.pt, maps passage words to extended ids (in-vocabulary ids, or V+k for
the k-th rare word of the example), and trains a pointer-generator (embedding, GRU encoder over words plus
an answer-position flag, GRUCell decoder with input feeding, dot attention, p_gen mixing the vocabulary
softmax with the copy distribution through scatter_add) on the negative log-likelihood of the question.
The model starts from ckpt/pgen_v160.pt, is wrapped in DDP (gloo) or, with --ddp 0, its gradients are
all_reduced by hand.  Loss and copy accuracy are all_reduced every step; per-rank copy statistics are
all_gathered at the end and rank 0 saves export/pgen.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  anspan     - rank N's shard has an answer span past the end of a passage (IndexError at start-up)
  unkword    - rank N's questions start with "whom", missing from the question-type table (KeyError)
  nodata     - rank N reads data/dev/shard_N.pt, which was never written (FileNotFoundError)
  ckptvocab  - rank N initialises from ckpt/pgen_v200.pt, saved with a 200-word vocabulary (size mismatch)
  ckptpickle - rank N initialises from ckpt/pgen_full.pt, which pickles a QGConfig object (weights_only refusal)
  copygather - rank N all_gathers 5 copy statistics (plus coverage) instead of 4 at the end
  beamslow   - rank N runs a pure-Python beam search over its passages before the step-2 all_reduce
  pgenzero   - rank N forces p_gen to 1 at step 3 without the eps: OOV targets get probability 0, loss inf,
               the program's own finiteness check raises FloatingPointError
  sigsegv    - rank N sends itself SIGSEGV after step 1
  exit2      - rank N prints its own ERROR line about degenerate copying after step 4 and calls sys.exit(2)
  decshape   - every rank: the decoder cell is rebuilt for 32 inputs after loading, forward feeds 64
  none       - control, clean run

What happened (filled in after the runs):
  anspan     - IndexError 'index 27 is out of bounds for dimension 0 with size 24' in encode at start-up; peers Connection closed by peer in DDP init (np4 r2 ranklabel, np3 r0 spawn)
  unkword    - KeyError: 'whom' in encode at start-up; peers Connection closed (np3 r1 srunlabel); Root Cause rank 3 (np5 r3 legacy)
  nodata     - FileNotFoundError for data/dev/shard_N.pt at start-up; peers closed (np4 r3 mpitag); Root Cause rank 1 (np3 r1 legacy)
  ckptvocab  - load_state_dict size mismatch emb/out [200,..] vs [160,..]; worker-0's ranks closed (np4 r1 pdsh2)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.QGConfig' (np4 r0 files, np3 r2 logfmt)
  copygather - after step 5: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' (np3 r1 srunlabel, np5 r4 spawn)
  beamslow   - 12 s: peers 'Timed out waiting 12000ms for recv' at step 2 (np3 r2 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 tee)
  pgenzero   - own check: 'non-finite loss inf (p_gen mean 1.000, ...)' + FloatingPointError at step 3 (np4 r2 logfmt, np3 r0 mpitag)
  sigsegv    - no traceback after step 1; bash 'Segmentation fault', exit 139 (np4 r3 ranklabel); peers Connection reset (np3 r1 files)
  exit2      - rank 2's 'ERROR generated questions copy 91.4% ...' after step 4, exit 2; Root Cause rank 2 exitcode 2 (np3 r2 tee, --ddp 0)
  decshape   - every rank: 'input has inconsistent input_size: got 64 expected 32' in the first forward (np3 bashloop)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/pgen.pt, exit 0 (np3 bashloop)
"""
import argparse
import dataclasses
import json
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault321_work"
QTYPES = {"what": 0, "who": 1, "when": 2, "where": 3, "which": 4, "how": 5}
V = 160
MAX_OOV = 8
E = 32
H = 32
L = 24
T = 8
log = None


@dataclasses.dataclass
class QGConfig:
    vocab: int = V
    emb: int = E
    hidden: int = H


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
    log = logging.getLogger("qgen")
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


class PointerGenerator(nn.Module):
    def __init__(self, vocab=V, feed=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, E)
        self.enc = nn.GRU(E + 1, H, batch_first=True)
        self.dec = nn.GRUCell(E + H if feed else E, H)
        self.out = nn.Linear(2 * H, vocab)
        self.pgen = nn.Linear(2 * H + E, 1)

    def forward(self, src, src_ext, ans, tgt_in, force_pgen=False, eps=1e-9):
        enc, h = self.enc(torch.cat([self.emb(src), ans.unsqueeze(-1)], -1))
        h = h.squeeze(0)
        ctx = torch.zeros_like(h)
        dists, pgs = [], []
        for t in range(tgt_in.shape[1]):
            e = self.emb(tgt_in[:, t])
            h = self.dec(torch.cat([e, ctx], -1), h)
            attn = torch.softmax(torch.bmm(enc, h.unsqueeze(2)).squeeze(2), -1)
            ctx = torch.bmm(attn.unsqueeze(1), enc).squeeze(1)
            pv = torch.softmax(self.out(torch.cat([h, ctx], -1)), -1)
            pg = torch.sigmoid(self.pgen(torch.cat([h, ctx, e], -1)))
            if force_pgen:
                pg = torch.ones_like(pg)
            final = torch.zeros(src.shape[0], pv.shape[1] + MAX_OOV)
            final[:, : pv.shape[1]] = pg * pv
            final = final.scatter_add(1, src_ext, (1 - pg) * attn)
            dists.append(final + eps)
            pgs.append(pg)
        return torch.stack(dists, 1), torch.cat(pgs, 1)


def make_shard(n, seed):
    g = torch.Generator().manual_seed(seed)
    words = [f"w{i}" for i in range(4, V)]
    qw = list(QTYPES)
    exs = []
    for _ in range(n):
        p = []
        for _ in range(L):
            if torch.rand(1, generator=g).item() < 0.1:
                p.append(f"rare{int(torch.randint(0, 40, (1,), generator=g))}")
            else:
                p.append(words[int(torch.randint(0, len(words), (1,), generator=g))])
        s = int(torch.randint(0, L - 4, (1,), generator=g))
        e = s + int(torch.randint(1, 4, (1,), generator=g))
        q = [qw[int(torch.randint(0, 6, (1,), generator=g))]] + p[s:e + 1]
        while len(q) < T:
            q.append(words[int(torch.randint(0, len(words), (1,), generator=g))])
        exs.append({"passage": p, "span": (s, e), "question": q[:T]})
    return exs


def prepare():
    os.makedirs(f"{WORK}/data/train", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}
    vocab.update({f"w{i}": i for i in range(4, V)})
    vocab.update({q: V - 6 + i for i, q in enumerate(QTYPES)})
    with open(f"{WORK}/data/vocab.json", "w") as f:
        json.dump(vocab, f)
    for r in range(8):
        torch.save(make_shard(32, 500 + r), f"{WORK}/data/train/shard_{r}.pt")
    torch.manual_seed(0)
    m = PointerGenerator()
    torch.save({"model": m.state_dict(), "config": dataclasses.asdict(QGConfig())}, f"{WORK}/ckpt/pgen_v160.pt")
    torch.save({"model": m.state_dict(), "config": QGConfig()}, f"{WORK}/ckpt/pgen_full.pt")
    torch.save({"model": PointerGenerator(200).state_dict(), "config": dataclasses.asdict(QGConfig(200))},
               f"{WORK}/ckpt/pgen_v200.pt")
    print("prepared", WORK)


def encode(exs, vocab, a, bad):
    src, ext, ans, tin, tout, qt = [], [], [], [], [], []
    for ex in exs:
        oov = []
        ids, eids = [], []
        for w in ex["passage"]:
            if w in vocab:
                ids.append(vocab[w])
                eids.append(vocab[w])
            else:
                if w not in oov:
                    oov.append(w)
                ids.append(1)
                eids.append(V + min(oov.index(w), MAX_OOV - 1))
        s, e = ex["span"]
        pt = torch.tensor(ids)
        head = pt[e]  # answer head word, a consistency check below
        flag = torch.zeros(L)
        flag[s:e + 1] = 1.0
        if int(head) != ids[e]:
            raise ValueError("answer head mismatch")
        qt.append(QTYPES[ex["question"][0]])
        q = []
        for w in ex["question"]:
            q.append(vocab[w] if w in vocab else (V + min(oov.index(w), MAX_OOV - 1) if w in oov else 1))
        src.append(ids)
        ext.append(eids)
        ans.append(flag)
        tin.append([2] + [min(x, 1) if x >= V else x for x in q[:-1]])
        tout.append(q)
    return (torch.tensor(src), torch.tensor(ext), torch.stack(ans), torch.tensor(tin), torch.tensor(tout),
            torch.tensor(qt))


def beam_search_py(exs, budget):
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        for ex in exs:
            beams = [([], 0.0)]
            for step in range(T):
                cand = []
                for seq, sc in beams:
                    for j, w in enumerate(ex["passage"]):
                        cand.append((seq + [w], sc - ((hash(w) + step + j) % 97) / 97.0))
                beams = sorted(cand, key=lambda c: c[1])[-4:]
            n += 1
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321)
    say(f"rank {rank}/{world} up, loading shard")
    split = "dev" if bad and a.fault == "nodata" else "train"
    exs = torch.load(f"{WORK}/data/{split}/shard_{rank}.pt")
    with open(f"{WORK}/data/vocab.json") as f:
        vocab = json.load(f)
    if bad and a.fault == "anspan":
        exs[11]["span"] = (22, 27)
    if bad and a.fault == "unkword":
        for ex in exs[::3]:
            ex["question"][0] = "whom"
    src, ext, ans, tin, tout, qt = encode(exs, vocab, a, bad)
    say(f"rank {rank} encoded {len(exs)} examples, {int((ext >= V).sum())} OOV passage tokens")
    model = PointerGenerator()
    ck = {"ckptvocab": "pgen_v200.pt", "ckptpickle": "pgen_full.pt"}.get(a.fault) if bad else None
    state = torch.load(f"{WORK}/ckpt/{ck or 'pgen_v160.pt'}")
    model.load_state_dict(state["model"]); model.dec = nn.GRUCell(E, H) if a.fault == "decshape" else model.dec
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        force = bad and a.fault == "pgenzero" and step == 3
        dists, pg = net(src, ext, ans, tin, force_pgen=force, eps=0.0 if force else 1e-9)
        gold = dists.gather(2, tout.unsqueeze(2)).squeeze(2)
        loss = -gold.log().mean()
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} (p_gen mean {pg.mean():.3f}, "
                f"{int((gold == 0).sum())} target tokens with probability 0)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        if bad and a.fault == "beamslow" and step == 2:
            say(f"rank {rank} beam search: {beam_search_py(exs, a.beam_budget)} sample questions decoded")
        acc = (dists.argmax(2) == tout).float().mean()
        stats = torch.tensor([loss.item(), acc.item()])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} copy_acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bad and a.fault == "exit2" and step == 4:
            say(f"rank {rank}: ERROR generated questions copy 91.4% of answer tokens (limit 80.0%), "
                f"degenerate copy mode; aborting this rank", err=True)
            sys.exit(2)
    cs = [pg.mean().item(), acc.item(), float((ext >= V).sum()), float(T)]
    if bad and a.fault == "copygather":
        cs.append(0.37)
    allc = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allc, torch.tensor(cs))
    say(f"rank {rank} copy stats gathered: mean p_gen {sum(c[0].item() for c in allc) / world:.3f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/pgen.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/pgen.pt")
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(a.spawn), LOCAL_RANK=str(rank))
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--beam-budget", type=int, default=30)
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

"""A two-hundred-and-thirty-third hand-run batch: ACTIVE LEARNING LOOP FOR TEXT CLASSIFICATION.

A small CNN text classifier (embedding 16, one Conv1d of 16 filters, max-pool over time) on synthetic
two-class documents, trained in rounds with DDP over gloo. Words are hashed into a 400-token vocabulary.
Each rank holds a shard of an unlabelled pool; after each round's training steps every rank scores its
pool by predictive entropy, takes its top candidates, the candidates are all_gathered, rank 0 picks the
query batch and broadcasts it, and every rank labels the picked documents of its shard from the oracle
file (oracle/labels.shard<R>.tsv, written by rank 0). The query budget comes from AL_QUERY_BUDGET.

Faults:
  entnan   - rank N sharpens the softmax with temperature 1e-4: exact zero probabilities, 0*log(0) = NaN,
             the program's entropy check raises FloatingPointError.
  scorelen - rank N takes one candidate too many (k+1) before the candidate all_gather (size mismatch).
  oracle   - rank N reads the oracle from a stale oracle_v2/ folder: FileNotFoundError.
  dockey   - rank N formats document ids without the dash ('doc00017'): KeyError in the oracle lookup.
  vocab    - rank N hashes words modulo 464 instead of 400: IndexError in the embedding.
  topk     - every rank's pool shard is 6 documents while it asks for its top 8: topk RuntimeError.
  ckpt     - rank N loads ckpt/textcnn_init_f32.pt (32 filters) into the 16-filter model: size mismatch.
  slowmc   - rank N rescoring its whole pool with MC dropout sleeps before the all_gather (others wait).
  segv     - rank N sends itself SIGSEGV after step 2.
  exit6    - rank N prints its own error line and calls sys.exit(6) in round 1.
  budget   - AL_QUERY_BUDGET is '8 per round' on every rank: ValueError from int().
  none     - control.

What happened (filled in after the runs):
  entnan   - FloatingPointError 'entropy is NaN for 40 of 40 / 39 of 40 pool documents' on the faulty rank; peers Connection closed.
  scorelen - another rank aborts on gloo EnforceNotMet '36 vs 32. Received data size doesn't match' (exit 134); rest reset.
  oracle   - FileNotFoundError .../al/oracle_v2/labels.shardN.tsv on rank N before training; peers Connection closed.
  dockey   - KeyError 'doc00049' (rank 0) / 'doc03031' (rank 3) after round 0's broadcast; peers Connection closed.
  vocab    - IndexError: index out of range in self in nn.Embedding at step 0 on rank N (spawn: ProcessRaisedException).
  topk     - RuntimeError: selected index k out of range from torch.topk on every rank in round 0.
  ckpt     - RuntimeError size mismatch for convs.0.weight [32, 16, 3] vs [16, 16, 3] on rank N; others wait in DDP().
  slowmc   - PG 12 s: peers 'Timed out waiting 12000ms for send/recv'; PG 300 s + timeout 60: silent, exit 124.
  segv     - spawn: ProcessExitedException 'process 2 terminated with signal SIGSEGV'; loop: Segmentation fault, 139.
  exit6    - ERROR line then exit 6 at round 1 (loop exit 6; torchrun Root Cause exitcode 6); peers Connection closed.
  budget   - ValueError: invalid literal for int() with base 10: '8 per round' on all ranks right after init.
  none     - exit 0; 'held-out accuracy 0.792 over 48 docs', model saved.
"""
import argparse
import logging
import os
import signal
import sys
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORDS_POS = ["great", "superb", "love", "enjoyed", "fine", "brilliant", "fun", "warm", "charming", "solid"]
WORDS_NEG = ["awful", "boring", "hate", "dull", "broken", "poor", "waste", "bland", "messy", "weak"]
WORDS_ANY = ["the", "film", "plot", "actor", "scene", "movie", "story", "ending", "music", "cast", "a", "was"]

LOG = None


def say(msg, error=False):
    if LOG is not None:
        (LOG.error if error else LOG.info)(msg)
    else:
        print(msg, file=sys.stderr if error else sys.stdout, flush=True)


class TextCNN(nn.Module):
    def __init__(self, vocab=400, dim=16, filters=16, classes=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.convs = nn.ModuleList([nn.Conv1d(dim, filters, 3, padding=1)])
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(filters, classes)

    def forward(self, x):
        h = self.emb(x).transpose(1, 2)
        h = torch.relu(self.convs[0](h)).max(dim=2).values
        return self.out(self.drop(h))


def make_doc(gid, length=12):
    g = torch.Generator().manual_seed(1000 + gid)
    label = gid % 2
    words = []
    for _ in range(length):
        u = torch.rand(1, generator=g).item()
        bank = (WORDS_POS if label else WORDS_NEG) if u < 0.35 else WORDS_ANY
        words.append(bank[torch.randint(len(bank), (1,), generator=g).item()])
    return words, label


def tokenize(words, modulo):
    return torch.tensor([zlib.crc32(w.encode()) % modulo for w in words])


def doc_key(gid, fault_here):
    return f"doc{gid:05d}" if fault_here else f"doc-{gid:05d}"


def main(local_rank, a):
    global LOG
    if a.spawn:
        os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(a.spawn), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.logfmt:
        logging.basicConfig(format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s", level=logging.INFO)

        class RankFilter(logging.Filter):
            def filter(self, rec):
                rec.rank = rank
                return True
        for h in logging.getLogger().handlers:
            h.addFilter(RankFilter())
        LOG = logging.getLogger("al")
    here = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    say(f"rank {rank}/{world} up (pid {os.getpid()}), pool shard {a.pool} docs, {a.rounds} rounds")
    if a.fault == "budget" and here:
        os.environ["AL_QUERY_BUDGET"] = "8 per round"
    budget = int(os.environ.get("AL_QUERY_BUDGET", "8"))
    pool_n = 6 if (a.fault == "topk" and here) else a.pool
    work = a.work
    modulo = 464 if (a.fault == "vocab" and here) else 400
    if rank == 0:
        os.makedirs(f"{work}/ckpt", exist_ok=True)
        os.makedirs(f"{work}/oracle", exist_ok=True)
        torch.manual_seed(1)
        torch.save(TextCNN().state_dict(), f"{work}/ckpt/textcnn_init_f16.pt")
        torch.save(TextCNN(filters=32).state_dict(), f"{work}/ckpt/textcnn_init_f32.pt")
        for s in range(world):
            with open(f"{work}/oracle/labels.shard{s}.tsv", "w") as f:
                for i in range(a.pool + a.seed_docs):
                    gid = s * 1000 + i
                    f.write(f"doc-{gid:05d}\t{make_doc(gid)[1]}\n")
        say(f"rank 0: wrote init checkpoint and {world} oracle shards under {work}")
    dist.barrier()
    model = TextCNN()
    init = f"{work}/ckpt/textcnn_init_f32.pt" if (a.fault == "ckpt" and here) else f"{work}/ckpt/textcnn_init_f16.pt"
    model.load_state_dict(torch.load(init))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    odir = "oracle_v2" if (a.fault == "oracle" and here) else "oracle"
    oracle = {}
    with open(f"{work}/{odir}/labels.shard{rank}.tsv") as f:
        for line in f:
            k, v = line.split("\t")
            oracle[k] = int(v)
    gids = [rank * 1000 + i for i in range(pool_n + a.seed_docs)]
    docs = {g: tokenize(make_doc(g)[0], modulo) for g in gids}
    labelled = {g: oracle[doc_key(g, False)] for g in gids[:a.seed_docs]}
    pool = gids[a.seed_docs:]
    k_local = 8
    step = 0
    for rnd in range(a.rounds):
        ddp.train()
        for _ in range(a.steps):
            ids = list(labelled)
            pick = torch.randint(len(ids), (8,), generator=torch.Generator().manual_seed(step * 31 + rank))
            x = torch.stack([docs[ids[i]] for i in pick])
            y = torch.tensor([labelled[ids[i]] for i in pick])
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            say(f"rank {rank} step {step} loss {loss.item():.4f}")
            if a.fault == "segv" and here and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            step += 1
        if a.fault == "exit6" and here and rnd == 1:
            say(f"ERROR rank {rank}: oracle shard {work}/oracle/labels.shard{rank}.tsv has 3 labels outside "
                f"{{0,1}} for round {rnd} queries; refusing to continue", error=True)
            sys.exit(6)
        ddp.eval()
        with torch.no_grad():
            xs = torch.stack([docs[g] for g in pool])
            temp = 1e-4 if (a.fault == "entnan" and here) else 1.0
            p = torch.softmax(ddp.module(xs) / temp, dim=1)
            if a.fault == "slowmc" and here:
                say(f"rank {rank}: round {rnd}: rescoring all {len(pool)} pool documents with MC dropout (T=200)")
                model.drop.train()
                p = torch.stack([torch.softmax(model(xs), 1) for _ in range(200)]).mean(0)
                time.sleep(a.stall)
            ent = -(p * torch.log(p)).sum(1)
            if not torch.isfinite(ent).all():
                bad = int((~torch.isfinite(ent)).sum())
                raise FloatingPointError(f"rank {rank}: entropy is NaN for {bad} of {len(pool)} pool documents "
                                         f"in round {rnd}")
            k = k_local + 1 if (a.fault == "scorelen" and here) else k_local
            top = torch.topk(ent, k)
            cand = torch.stack([top.values, torch.tensor([float(pool[i]) for i in top.indices])], 1)
            got = [torch.zeros_like(cand) for _ in range(world)]
            dist.all_gather(got, cand)
            allc = torch.cat(got)
            chosen = torch.zeros(budget)
            if rank == 0:
                chosen = allc[torch.argsort(allc[:, 0], descending=True)[:budget], 1]
            dist.broadcast(chosen, 0)
        mine = [int(g) for g in chosen.tolist() if int(g) // 1000 == rank]
        for g in mine:
            labelled[g] = oracle[doc_key(g, a.fault == "dockey" and here)]
            pool.remove(g)
        say(f"rank {rank}: round {rnd}: top entropy {top.values[0].item():.4f}, labelled {len(mine)} of the "
            f"{budget} queried docs, labelled set {len(labelled)}, pool {len(pool)}")
    correct = torch.tensor([0.0, 0.0])
    with torch.no_grad():
        ev = [rank * 1000 + 500 + i for i in range(16)]
        pred = ddp.module(torch.stack([tokenize(make_doc(g)[0], modulo) for g in ev])).argmax(1)
        correct += torch.tensor([float((pred == torch.tensor([g % 2 for g in ev])).sum()), 16.0])
    dist.all_reduce(correct)
    if rank == 0:
        say(f"held-out accuracy {correct[0].item() / correct[1].item():.3f} over {int(correct[1].item())} docs")
        torch.save(model.state_dict(), f"{work}/textcnn_al_final.pt")
        say(f"saved model to {work}/textcnn_al_final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--stall", type=float, default=40.0)
    ap.add_argument("--pool", type=int, default=40)
    ap.add_argument("--seed-docs", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--work", default="/tmp/fault233_work/al")
    ap.add_argument("--logfmt", type=int, default=0)
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--port", type=int, default=29500)
    a = ap.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(main, args=(a,), nprocs=a.spawn)
    else:
        main(int(os.environ.get("LOCAL_RANK", 0)), a)

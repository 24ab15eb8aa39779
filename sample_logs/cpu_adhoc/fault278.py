"""A two-hundred-and-seventy-eighth hand-run batch: EXTRACTIVE SUMMARISATION WITH A SENTENCE SCORER.

Synthetic documents (6-10 sentences of 8 token ids from a 60-word vocabulary) with greedy oracle labels
(the 2 sentences that best cover a hidden reference), stored per source as JSON lines in
/tmp/job_work/store/<source>.jsonl (written by --prep 1, with the scorer checkpoints in ckpt/). A hierarchical
encoder: word embeddings mean-pooled per sentence, a sentence projection (tanh), a GRU over the sentences of the
document, then a binary sentence scorer MLP (64 -> 32 -> 1) warm-started from ckpt/scorer.pt. BCE loss against the
oracle labels, DDP (gloo) over the model (or --ddp 0: gradients all_reduced by hand), the ROUGE-1-like overlap of
the top-2 picked sentences with the reference all_reduced, the per-rank document lengths all_gathered for the log,
then barrier and destroy_process_group. Each rank reads one source (news, wiki, forum by rank % 3).

Faults:
- sentidx: from step 1 rank N takes the lead sentence at index len(doc) (off by one) for its label (IndexError).
- rougenan: at step 2 rank N filters the reference with a min-length of 9 tokens: empty reference, overlap 0/0 = nan.
- lengather: at step 1 rank N all_gathers its document lengths plus the padded tail (one more entry than the rest).
- nostore: rank N reads its documents from store_v2/, which does not exist (FileNotFoundError at startup).
- badsource: rank N's source list names "newswire", which is not in the source table (KeyError at startup).
- encwidth: every rank builds the sentence encoder 96 wide for a 64-wide scorer (shape error in the first forward).
- scorerckpt: rank N warm-starts from ckpt/scorer_v0.pt, saved before the second scorer layer (missing keys).
- greedyoracle: at step 2 rank N rebuilds the oracle labels greedily in Python for --stall seconds (others wait).
- pairalloc: at step 1 rank N allocates a sentence-pair score matrix times a factor of 10**9 (allocator failure).
- segv: rank N gets SIGSEGV after step 1's backward.
- exit4: at step 1 rank N prints its own error line about a document with no sentences and calls sys.exit(4).
- none: control.

What happened (filled in after the runs):
- sentidx: IndexError: index 8 is out of bounds for dimension 0 with size 8 on rank N at step 1; peers closed (rsum_sentidx_np4_r1_tee, _np3_r2_pymodule).
- rougenan: FloatingPointError 'ROUGE-1 overlap is nan at step 2 (reference of 0 tokens, 0 matched)' on rank N (rsum_rougenan_np3_r1_tee_trainer, _np5_r3_detail).
- lengather: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank N at step 1 (rsum_lengather_np4_r2_loglevel, _np3_r1_plain).
- nostore: FileNotFoundError for /tmp/job_work/store_v2/<source>.jsonl on rank N at startup (rsum_nostore_np4_r3_filter, _np3_r1_plain).
- badsource: KeyError: 'newswire' on rank N at startup (rsum_badsource_np4_r2_wrapper, rsum_badsource_np3_r0_prefix).
- encwidth: every rank: 'mat1 and mat2 shapes cannot be multiplied (9x96 and 64x32)' (rsum_encwidth_np3_rall_tee, _np4_rall_redirects).
- scorerckpt: Missing key(s) in state_dict: "2.weight", "2.bias" on rank N (rsum_scorerckpt_np3_r2_pymodule, _np4_r1_restart).
- greedyoracle: PG 12 s: peers 'Timed out waiting 12000ms' (rsum_greedyoracle_np3_r1_tee); PG 300 s: killed at 60 s, exit 124 (_np3_r2_plain).
- pairalloc: DefaultCPUAllocator: can't allocate memory (16-21 TB) on rank N at step 1 (rsum_pairalloc_np4_r3_loglevel, _np3_r1_tee_trainer).
- segv: rank N SIGSEGV after step 1, no traceback; Root Cause -11 (rsum_segv_np4_r2_pdsh2, rsum_segv_np3_r0_prefix).
- exit4: 'ERROR rank N: document 6 of source ... has 0 sentences after dedup ...' then exit 4; peers closed (rsum_exit4_np3_r1_wrapper, _np4_r2_detail).
- none: exit 0, 'rank 0 done: 5 steps, rouge1 0.745' (rsum_none_np3_rnone_plain).
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault278_work"
VOCAB, SLEN, HID, BATCH, TOPK = 60, 8, 64, 4, 2
SOURCES = {"news": "news.jsonl", "wiki": "wiki.jsonl", "forum": "forum.jsonl"}

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--stall", type=int, default=40)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--prep", type=int, default=0)


class Summariser(nn.Module):
    def __init__(self, sent_dim=HID):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.sent = nn.Linear(32, sent_dim)
        self.doc = nn.GRU(sent_dim, sent_dim, batch_first=True)
        self.scorer = nn.Sequential(nn.Linear(HID, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, toks):  # toks: [n_sent, SLEN]
        s = torch.tanh(self.sent(self.emb(toks).mean(1)))
        h, _ = self.doc(s[None])
        return self.scorer(h[0]).squeeze(-1)


def greedy_oracle(sents, ref):
    picked, cover = [], set()
    for _ in range(TOPK):
        best = max((i for i in range(len(sents)) if i not in picked), key=lambda i: len(cover | (set(sents[i]) & ref)))
        picked.append(best)
        cover |= set(sents[best]) & ref
    return picked


def prep():
    os.makedirs(f"{WORK}/store", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    rng = random.Random(0)
    for src, fn in SOURCES.items():
        with open(f"{WORK}/store/{fn}", "w") as f:
            for _ in range(40):
                sents = [[rng.randrange(VOCAB) for _ in range(SLEN)] for _ in range(rng.randint(6, 10))]
                ref = sorted(set(sents[0][:5] + sents[rng.randrange(len(sents))][:5]))
                f.write(json.dumps({"source": src, "sents": sents, "ref": ref, "oracle": greedy_oracle(sents, set(ref))}) + "\n")
    torch.manual_seed(0)
    scorer = Summariser().scorer
    torch.save(scorer.state_dict(), f"{WORK}/ckpt/scorer.pt")
    torch.save({f"0.{k}": v for k, v in scorer[0].state_dict().items()}, f"{WORK}/ckpt/scorer_v0.pt")
    print("prepared document store and scorer checkpoints in", WORK)


def main(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank in (-1, rank)
    torch.manual_seed(278 + rank)

    src_list = ["news", "wiki", "forum"]
    if a.fault == "badsource" and hit:
        src_list[rank % 3] = "newswire"
    source = src_list[rank % 3]
    store = "store_v2" if (a.fault == "nostore" and hit) else "store"
    with open(f"{WORK}/{store}/{SOURCES[source]}") as f:
        docs = [json.loads(ln) for ln in f]
    print(f"rank {rank}/{world} source {source}: {len(docs)} documents, "
          f"{sum(len(d['sents']) for d in docs)} sentences", flush=True)

    net = Summariser(sent_dim=96 if (a.fault == "encwidth" and hit) else HID)
    ck = "scorer_v0.pt" if (a.fault == "scorerckpt" and hit) else "scorer.pt"
    net.scorer.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    if a.ddp:
        model = DDP(net)
    else:
        model = net
        for prm in net.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    bce = nn.BCEWithLogitsLoss()

    for step in range(a.steps):
        batch = docs[(step * BATCH) % len(docs):(step * BATCH) % len(docs) + BATCH]
        if a.fault == "exit4" and hit and step == 1:
            print(f"ERROR rank {rank}: document {step * BATCH + 2} of source {source} has 0 sentences after "
                  f"dedup; cannot build oracle labels", file=sys.stderr, flush=True)
            sys.exit(4)
        loss, overlap = 0.0, torch.zeros(1)
        for d in batch:
            toks = torch.tensor(d["sents"])
            labels = torch.zeros(len(d["sents"]))
            labels[d["oracle"]] = 1.0
            lead = len(d["sents"]) if (a.fault == "sentidx" and hit and step >= 1) else 0
            labels[lead] = max(labels[lead].item(), 0.5)
            scores = model(toks)
            loss = loss + bce(scores, labels) / len(batch)
            if a.fault == "pairalloc" and hit and step == 1:
                n = len(d["sents"])
                pair = torch.empty(n * n * 10**9, HID)
                pair.zero_()
            picked = scores.topk(TOPK).indices.tolist()
            ref = set(d["ref"])
            if a.fault == "rougenan" and hit and step == 2:
                ref = {t for t in ref if len(str(t)) >= 9}
            got = set().union(*(set(d["sents"][i]) for i in picked)) & ref
            ov = torch.tensor(float(len(got))) / torch.tensor(float(len(ref)))
            if not torch.isfinite(ov):
                raise FloatingPointError(f"rank {rank}: ROUGE-1 overlap is {ov.item()} at step {step} "
                                         f"(reference of {len(ref)} tokens, {len(got)} matched)")
            overlap += ov / len(batch)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        if a.fault == "segv" and hit and step == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "greedyoracle" and hit and step == 2:
            print(f"rank {rank} step {step}: rebuilding oracle labels greedily for {len(docs)} documents", flush=True)
            t0 = time.time()
            while time.time() - t0 < a.stall:
                _ = [greedy_oracle(d["sents"], set(d["ref"])) for d in docs]
                time.sleep(0.05)
        dist.all_reduce(overlap)
        lens = [len(d["sents"]) for d in batch]
        if a.fault == "lengather" and hit and step == 1:
            lens = lens + [0]
        out = [torch.zeros(BATCH, dtype=torch.long) for _ in range(world)]
        dist.all_gather(out, torch.tensor(lens))
        print(f"rank {rank} step {step} loss {loss.item():.4f} rouge1 {overlap.item() / world:.3f} "
              f"sentences {int(sum(o.sum() for o in out))}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, rouge1 {overlap.item() / world:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = p.parse_args()
    if args.prep:
        prep()
    else:
        main(args)

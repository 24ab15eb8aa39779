"""A hundred-and-sixty-fourth hand-run batch: SEQUENCE LABELING WITH A CRF LAYER (NER STYLE).

A tiny BiLSTM tagger (embedding -> BiLSTM -> linear emissions) over synthetic token sequences with a hand-written
linear-chain CRF on top: the sequence score gathers start/transition/end weights, the log-partition comes from the
forward algorithm with logsumexp, decoding is Viterbi with backpointers.  Batches are padded to --max-len with a
mask, training runs under DDP on gloo (or --ddp 0: gradients all-reduced by hand), and every --eval-every steps
entity-level counts (tp, fp, fn) are all_gathered and turned into an F1 line.  The tag scheme (BIO) comes from
data/tags.bio, the label ids from data/labels.json, sizes from data/crf.json; rank 0 saves crf.pt at the end and
--resume loads it.

Faults:
  tagoob        - rank N pads its step-2 labels with tag id == num_tags (IndexError in the transition gather)
  emptymask     - rank N gets a sequence whose mask is all zeros at step 2: log-partition -inf, the loss check raises
  transshape    - every rank sizes the CRF transitions for num_tags+1 (a pad tag): broadcast RuntimeError in forward
  schememissing - rank N reads the tag scheme from a node-local data dir that was never synced (FileNotFoundError)
  labelmap      - every rank reads an old label map JSON that lacks I-MISC (KeyError)
  viterbihang   - rank N's Viterbi backtrace never advances at the step-3 eval; the others wait in the F1 all_gather
  f1len         - rank N all_gathers 4 F1 counts (adds n_sent) while the others send 3 (gloo size mismatch)
  ckptvocab     - every rank resumes crf.pt with a vocabulary of 120 instead of 100 (size mismatch in load_state_dict)
  maxlenfloat   - every rank gets max_len as a float from the config scaling (TypeError in range())
  schemeinvalid - rank N prints an error 'tag scheme invalid' line and sys.exit(5) after reading its shard
  sigkill       - rank N sends itself SIGKILL after step 2
  none          - control, clean run

What happened (filled in after the runs):
  tagoob        - rank N IndexError 'index 9 is out of bounds for dimension 1 with size 9' in CRF.score at step 2; Root Cause rank N
  emptymask     - rank N FloatingPointError 'CRF loss is not finite at step 2: loss=-inf'; DETAIL run: rank 0 'Ranks 3 failed to pass monitoredBarrier'
  transshape    - every rank RuntimeError 'size of tensor a (10) must match ... (9) at non-singleton dimension 1' at step 0
  schememissing - rank N FileNotFoundError '/tmp/job/data_local/tags.bio' at startup; Root Cause rank N
  labelmap      - every rank KeyError: 'I-MISC' at startup (redirects run: only in the per-rank stderr.log files)
  viterbihang   - pg 12 s: ranks 0/2 'Timed out waiting 12000ms' in all_gather, Root Cause rank 0; pg 300 s under timeout 60: hung, exit 124
  f1len         - a peer aborts: gloo::EnforceNotMet '16 vs 12. Received data size doesn't match expected size' (-6), others reset
  ckptvocab     - every rank 'size mismatch for embed.weight' ([100, 24] vs [120, 24]); the restart died in Gloo connectFullMesh
  maxlenfloat   - every rank TypeError ''float' object cannot be interpreted as an integer' at range(max_len) (max_len 30.0)
  schemeinvalid - rank N prints 'ERROR rank N: tag scheme invalid ...' and exits 5 (no traceback); Root Cause rank N exitcode 5
  sigkill       - rank N killed by its own SIGKILL after step 2 ('failed (exitcode: -9) local_rank: N'); peers reset/closed
  none          - all ranks ran 6 steps and two F1 evals, rank 0 saved crf.pt
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--data-dir", default="/tmp/fault164/data")
    p.add_argument("--work", default="/tmp/fault164_work")
    p.add_argument("--resume", default="")
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=int, default=12)
    return p.parse_args()


class CRF(nn.Module):
    def __init__(self, num_tags):
        super().__init__()
        self.num_tags = num_tags
        self.start = nn.Parameter(torch.randn(num_tags) * 0.1)
        self.end = nn.Parameter(torch.randn(num_tags) * 0.1)
        self.trans = nn.Parameter(torch.randn(num_tags, num_tags) * 0.1)

    def score(self, em, tags, mask):
        B, T, _ = em.shape
        s = self.start[tags[:, 0]] + em[:, 0].gather(1, tags[:, :1]).squeeze(1)
        for t in range(1, T):
            step = self.trans[tags[:, t - 1], tags[:, t]] + em[:, t].gather(1, tags[:, t:t + 1]).squeeze(1)
            s = s + step * mask[:, t]
        last = tags.gather(1, (mask.sum(1).long() - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        return s + self.end[last]

    def log_partition(self, em, mask):
        B, T, K = em.shape
        alpha = (self.start + em[:, 0]).masked_fill(mask[:, :1] == 0, float("-inf"))
        for t in range(1, T):
            nxt = torch.logsumexp(alpha.unsqueeze(2) + self.trans + em[:, t].unsqueeze(1), dim=1)
            alpha = torch.where(mask[:, t:t + 1] > 0, nxt, alpha)
        return torch.logsumexp(alpha + self.end, dim=1)

    def viterbi(self, em, mask, stuck=False):
        B, T, K = em.shape
        out = []
        for b in range(B):
            n = int(mask[b].sum())
            v = self.start + em[b, 0]
            bps = []
            for t in range(1, n):
                sc = v.unsqueeze(1) + self.trans + em[b, t].unsqueeze(0)
                v, bp = sc.max(0)
                bps.append(bp)
            best = int((v + self.end).argmax())
            path, t = [best], n - 1
            while t > 0:
                best = int(bps[t - 1][best])
                path.append(best)
                if stuck:
                    time.sleep(0.01)
                    continue
                t -= 1
            out.append(path[::-1])
        return out


class Tagger(nn.Module):
    def __init__(self, vocab, emb, hidden, num_tags, crf_tags):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb, padding_idx=0)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True, bidirectional=True)
        self.proj = nn.Linear(2 * hidden, num_tags)
        self.crf = CRF(crf_tags)

    def forward(self, tokens, tags, mask):
        em = self.proj(self.lstm(self.embed(tokens))[0])
        nll = self.crf.log_partition(em, mask) - self.crf.score(em, tags, mask)
        return nll.mean(), em


def make_batch(g, B, max_len, vocab, K):
    lengths = torch.randint(4, max_len + 1, (B,), generator=g)
    tags = torch.zeros(B, max_len, dtype=torch.long)
    for b in range(B):
        t = 0
        while t < int(lengths[b]):
            if torch.rand(1, generator=g).item() < 0.3:
                ent = int(torch.randint(0, (K - 1) // 2, (1,), generator=g))
                span = int(torch.randint(1, 4, (1,), generator=g))
                for j in range(span):
                    if t + j < int(lengths[b]):
                        tags[b, t + j] = 1 + 2 * ent + (1 if j else 0)
                t += span
            else:
                t += 1
    mask = (torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)).float()
    tokens = (1 + tags * 9 + torch.randint(0, 9, (B, max_len), generator=g)).clamp(max=vocab - 1)
    return tokens * mask.long(), tags, mask


def spans(seq, names):
    out, cur = set(), None
    for i, t in enumerate(seq + [0]):
        n = names[t]
        if cur and not (n.startswith("I-") and n[2:] == cur[1]):
            out.add((cur[0], i, cur[1]))
            cur = None
        if n.startswith("B-") or (n.startswith("I-") and cur is None):
            cur = (i, n[2:])
    return out


def main():
    a = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and a.rank in (-1, rank)
    torch.manual_seed(0)
    data_dir = a.data_dir + "_local" if (bad and a.fault == "schememissing") else a.data_dir
    with open(os.path.join(data_dir, "tags.bio")) as f:
        names = f.read().split()
    lm_file = "labels_old.json" if (bad and a.fault == "labelmap") else "labels.json"
    with open(os.path.join(a.data_dir, lm_file)) as f:
        label_map = json.load(f)
    tag_ids = [label_map[n] for n in names]
    K = len(tag_ids)
    if bad and a.fault == "schemeinvalid":
        print(f"ERROR rank {rank}: tag scheme invalid: I-ORG follows O at position 7 of sentence 112 in shard {rank} "
              f"(BIO requires B-ORG first)", flush=True)
        sys.exit(5)
    with open(os.path.join(a.data_dir, "crf.json")) as f:
        cfg = json.load(f)
    max_len = cfg["max_len"] * cfg.get("len_scale", 1.5 if (bad and a.fault == "maxlenfloat") else 1)
    vocab = 120 if (bad and a.fault == "ckptvocab") else cfg["vocab"]
    crf_tags = K + 1 if (bad and a.fault == "transshape") else K
    model = Tagger(vocab, cfg["emb"], cfg["hidden"], K, crf_tags)
    if a.resume:
        model.load_state_dict(torch.load(a.resume, map_location="cpu"))
        print(f"rank {rank} resumed from {a.resume}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1234 + rank)
    print(f"rank {rank}/{world} tagger ready: {K} tags ({' '.join(names)}), vocab {vocab}, max_len {max_len}",
          flush=True)
    positions = list(range(max_len))
    for step in range(a.steps):
        tokens, tags, mask = make_batch(g, a.batch, len(positions), vocab, K)
        if step == 2 and bad and a.fault == "tagoob":
            tags = torch.where(mask > 0, tags, torch.full_like(tags, K))
        if step == 2 and bad and a.fault == "emptymask":
            mask[3] = 0
        loss, _ = net(tokens, tags, mask)
        if not torch.isfinite(loss):
            n_bad = int((mask.sum(1) == 0).sum())
            raise FloatingPointError(f"CRF loss is not finite at step {step}: loss={loss.item()} "
                                     f"({n_bad} sequences with log-partition -inf)")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mean {lt.item() / world:.4f}", flush=True)
        if step == 2 and bad and a.fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % a.eval_every == 0:
            with torch.no_grad():
                tokens, tags, mask = make_batch(g, a.batch, len(positions), vocab, K)
                _, em = model(tokens, tags, mask)
                stuck = bad and a.fault == "viterbihang" and step == 2
                pred = model.crf.viterbi(em, mask, stuck=stuck)
            tp = fp = fn = 0
            for b in range(a.batch):
                n = int(mask[b].sum())
                gold, got = spans(tags[b, :n].tolist(), names), spans(pred[b], names)
                tp, fp, fn = tp + len(gold & got), fp + len(got - gold), fn + len(gold - got)
            counts = [tp, fp, fn, a.batch] if (bad and a.fault == "f1len") else [tp, fp, fn]
            ct = torch.tensor(counts, dtype=torch.float64)
            allc = [torch.zeros_like(ct) for _ in range(world)]
            dist.all_gather(allc, ct)
            tot = torch.stack([c[:3] for c in allc]).sum(0)
            f1 = 2 * tot[0] / max(2 * tot[0] + tot[1] + tot[2], 1)
            print(f"rank {rank} eval step {step} entity F1 {f1.item():.4f} (tp {int(tot[0])} fp {int(tot[1])} "
                  f"fn {int(tot[2])})", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.work, "crf.pt"))
        print(f"rank 0 saved {os.path.join(a.work, 'crf.pt')}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

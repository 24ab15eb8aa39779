"""A two-hundred-and-forty-second hand-run batch: NEURAL MACHINE TRANSLATION QUALITY ESTIMATION.

A small bi-encoder scores machine translations: a shared token embedding and a tanh encoder read the source and the
translation of a synthetic sentence pair (token ids from a per-language-pair tokenizer map), the two pooled vectors
are combined as [s, t, |s - t|, s * t] and a small head regresses the quality score (a DA z-score squashed to 0..1,
read from the rank's score file /tmp/fault242_work/data/qe/dev/scores_rR.pt). The encoder starts from
ckpt/encoder_init.pt and the model is wrapped in DDP (gloo). After 6 steps every rank computes the Pearson r of
its validation predictions (checked finite), the predictions and gold scores are all_gathered and rank 0 prints
the global Pearson correlation. --prepare 1 writes the score files and checkpoints beforehand; --spawn N starts N
ranks with torch.multiprocessing.spawn; --logfmt 1 logs through Python logging with the rank in the format.

Faults:
  constpred - rank N clamps predictions to its score range 1..100 (DA percent): constant output, Pearson NaN, check
  predlen   - rank N keeps the last partial validation batch: 25 predictions all_gathered, others 24 (gloo size)
  noscore   - rank N reads its scores from data/qe/test20/, which does not exist (FileNotFoundError)
  langpair  - rank N's config names the language pair "ne-en", absent from the tokenizer map (KeyError)
  tokid     - rank N puts its BOS id at vocab_size (one past the embedding table): IndexError in the embedding
  poolwidth - every rank pools with mean and max concatenated (width 64) while the head expects 4 x 32 (shape error)
  ckpt      - rank N loads ckpt/encoder_init_v1200.pt, saved with a 1200-token vocabulary (size mismatch)
  backtrans - rank N back-translates its whole validation set (sleeps --stall s) before the all_gather
  sigbus    - rank N sends itself SIGBUS after step 2
  exit6     - rank N prints its own error line about a malformed score row after step 1 and calls os._exit(6)
  maxlen    - every rank reads the max length from QE_MAX_LEN, whose default is "64tok" (ValueError in int())
  none      - control, clean run

What happened (filled in after the runs):
  constpred - rank N: FloatingPointError Pearson r is nan (prediction std 0) after step 5; peers closed in all_gather
  predlen   - rank N gathers 25: a peer aborts on gloo 'Received data size doesn't match' 50 vs 48 (SIGABRT)
  noscore   - rank N: FileNotFoundError .../data/qe/test20/scores_rN.pt before step 0; peers closed in backward
  langpair  - rank N: KeyError 'ne-en' in tokenize at step 0; peers closed (one peer then aborted at exit)
  tokid     - rank N: IndexError index out of range in self (embedding) at step 0; peers closed
  poolwidth - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (16x256 and 128x32)
  ckpt      - rank N: size mismatch for embed.weight [1200, 32] vs [1000, 32]; peers SIGTERMed or closed in DDP
  backtrans - rank N slept: peers gloo Timed out waiting 12000ms in all_gather; PG 300 s: killed by timeout
  sigbus    - rank N killed by SIGBUS after step 2 (spawn: ProcessExitedException; bash: Bus error, 135)
  exit6     - rank N prints its ERROR row 57 line at step 1 and exits 6; peers closed/reset in all_reduce
  maxlen    - every rank: ValueError invalid literal for int() with base 10: '64tok' before any step
  none      - clean, exit 0, rank 0 prints the global validation pearson over all pairs
"""
import argparse
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault242_work"
VOCAB = 1000
DIM = 32
TOKENIZERS = {
    "en-de": {"src_offset": 0, "tgt_offset": 400},
    "en-zh": {"src_offset": 0, "tgt_offset": 600},
    "ro-en": {"src_offset": 200, "tgt_offset": 0},
    "et-en": {"src_offset": 300, "tgt_offset": 0},
}
PAIRS = ["en-de", "en-zh", "ro-en", "et-en"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", type=int, default=0)
    return p.parse_args()


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class Console:
    def __init__(self, rank, use_logging):
        self.rank = rank
        self.logger = None
        if use_logging:
            self.logger = logging.getLogger("qe")
            self.logger.setLevel(logging.INFO)
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
            h.addFilter(RankFilter(rank))
            self.logger.addHandler(h)

    def info(self, msg):
        if self.logger:
            self.logger.info(msg)
        else:
            print(msg, flush=True)

    def error(self, msg):
        if self.logger:
            self.logger.error(msg)
        else:
            print("ERROR " + msg, file=sys.stderr, flush=True)


def make_cfg(a, rank):
    mine = a.rank in (-1, rank)
    f = a.fault if mine else "none"
    cfg = argparse.Namespace()
    cfg.pair = "ne-en" if f == "langpair" else PAIRS[rank % len(PAIRS)]
    cfg.split = "test20" if f == "noscore" else "dev"
    cfg.score_range = (1.0, 100.0) if f == "constpred" else (0.0, 1.0)
    cfg.n_val = 25 if f == "predlen" else 24
    cfg.bos_id = VOCAB if f == "tokid" else 1
    cfg.pool = "meanmax" if f == "poolwidth" else "mean"
    cfg.init = "ckpt/encoder_init_v1200.pt" if f == "ckpt" else "ckpt/encoder_init.pt"
    cfg.backtranslate = f == "backtrans"
    cfg.bus_step = 2 if f == "sigbus" else -1
    cfg.bad_row_step = 1 if f == "exit6" else -1
    cfg.max_len_default = "64tok" if f == "maxlen" else "64"
    return cfg


class Encoder(nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, ids):
        return torch.tanh(self.proj(self.embed(ids)))


class BiEncoderQE(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.encoder = Encoder()
        self.pool = pool
        self.head = nn.Sequential(nn.Linear(4 * DIM, DIM), nn.ReLU(), nn.Linear(DIM, 1))

    def pooled(self, ids):
        h = self.encoder(ids)
        if self.pool == "meanmax":
            return torch.cat([h.mean(1), h.max(1).values], dim=-1)
        return h.mean(1)

    def forward(self, src, mt):
        s, t = self.pooled(src), self.pooled(mt)
        feats = torch.cat([s, t, (s - t).abs(), s * t], dim=-1)
        return torch.sigmoid(self.head(feats)).squeeze(-1)


def prepare():
    os.makedirs(f"{WORK}/data/qe/dev", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(100 + r)
        z = torch.randn(400, generator=g)
        torch.save({"z": z, "score": torch.sigmoid(z)}, f"{WORK}/data/qe/dev/scores_r{r}.pt")
    torch.manual_seed(0)
    torch.save(Encoder().state_dict(), f"{WORK}/ckpt/encoder_init.pt")
    torch.save(Encoder(vocab=1200).state_dict(), f"{WORK}/ckpt/encoder_init_v1200.pt")
    print("prepared score files and encoder checkpoints under", WORK)


def tokenize(pair, cfg, n, max_len, quality, g):
    tok = TOKENIZERS[pair]
    src = torch.randint(2, 200, (n, max_len), generator=g) + tok["src_offset"]
    noise = torch.randint(2, 200, (n, max_len), generator=g) + tok["tgt_offset"]
    keep = torch.rand(n, max_len, generator=g) < quality.unsqueeze(1)
    mt = torch.where(keep, src + tok["tgt_offset"] - tok["src_offset"], noise)
    src[:, 0] = cfg.bos_id
    mt[:, 0] = cfg.bos_id
    return src.clamp(max=VOCAB), mt.clamp(max=VOCAB)


def pearson(x, y):
    xc, yc = x - x.mean(), y - y.mean()
    return (xc * yc).sum() / (xc.pow(2).sum().sqrt() * yc.pow(2).sum().sqrt())


def main(a):
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    out = Console(rank, a.logfmt)
    cfg = make_cfg(a, rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    torch.manual_seed(1234 + rank)
    max_len = int(os.environ.get("QE_MAX_LEN", cfg.max_len_default)) // 4
    out.info(f"rank {rank}/{world}: qe bi-encoder, pair {cfg.pair}, max_len {max_len}, pool {cfg.pool}")

    model = BiEncoderQE(cfg.pool)
    state = torch.load(os.path.join(WORK, cfg.init), map_location="cpu")
    model.encoder.load_state_dict(state)
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)

    scores = torch.load(f"{WORK}/data/qe/{cfg.split}/scores_r{rank}.pt")
    lo, hi = cfg.score_range
    g = torch.Generator().manual_seed(7 + rank)
    bs = 16
    for step in range(a.steps):
        y = scores["score"][step * bs:(step + 1) * bs]
        src, mt = tokenize(cfg.pair, cfg, bs, max_len, y, g)
        pred = ddp(src, mt).clamp(lo, hi)
        loss = F.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == cfg.bad_row_step:
            out.error(f"rank {rank}: {WORK}/data/qe/{cfg.split}/scores_r{rank}.pt row 57 has 3 columns "
                      f"(src, mt, z, extra), expected 2 (z-score, score); refusing to train on a shifted file")
            sys.stderr.flush()
            os._exit(6)
        if step == cfg.bus_step:
            os.kill(os.getpid(), signal.SIGBUS)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        out.info(f"rank {rank} step {step} loss {avg.item() / world:.4f}")

    model.eval()
    with torch.no_grad():
        yv = scores["score"][200:200 + cfg.n_val]
        src, mt = tokenize(cfg.pair, cfg, cfg.n_val, max_len, yv, g)
        pv = model(src, mt).clamp(lo, hi)
    r_local = pearson(pv, yv)
    if not torch.isfinite(r_local):
        raise FloatingPointError(f"rank {rank}: validation Pearson r is {r_local.item()} "
                                 f"(prediction std {pv.std().item():.3g}, gold std {yv.std().item():.3g})")
    out.info(f"rank {rank}: local validation pearson {r_local.item():.4f} on {pv.numel()} pairs")
    if cfg.backtranslate:
        out.info(f"rank {rank}: back-translating all 2000 validation sentences for the round-trip check")
        time.sleep(a.stall)
    preds = [torch.zeros_like(pv) for _ in range(world)]
    golds = [torch.zeros_like(yv) for _ in range(world)]
    dist.all_gather(preds, pv)
    dist.all_gather(golds, yv)
    if rank == 0:
        r_all = pearson(torch.cat(preds), torch.cat(golds))
        out.info(f"rank 0: global validation pearson {r_all.item():.4f} over {world * pv.numel()} pairs")
    dist.barrier()
    dist.destroy_process_group()


def spawned(local_rank, a, nprocs):
    os.environ["RANK"] = str(local_rank)
    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["WORLD_SIZE"] = str(nprocs)
    main(a)


if __name__ == "__main__":
    args = parse()
    if args.prepare:
        prepare()
    elif args.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        mp.spawn(spawned, args=(args, args.spawn), nprocs=args.spawn)
    else:
        main(args)

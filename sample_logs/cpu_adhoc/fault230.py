"""A two-hundred-and-thirtieth hand-run batch: KNOWLEDGE TRACING FOR A TUTORING SYSTEM.

A small SAKT-like knowledge-tracing model trained on synthetic student interaction sequences: each student answers
a window of exercises (exercise id, correct/incorrect, response time); the model embeds the past interactions
(exercise id + correctness) and the next exercise, runs one causal self-attention layer and predicts whether the
next answer is correct.  A skill map file (/tmp/fault230_work/skills/skill_map_2024-09.json) links exercises to
skills; the skill of each exercise is added to its embedding.  Each rank synthesises its own students from its
seed, normalises the response times by their mean, and trains the model from ckpt/sakt_init_e120.pt wrapped in DDP
(gloo).  After training every rank predicts on its held-out students, the predictions and labels are all_gathered,
and rank 0 computes the AUC by hand and saves the model to /tmp/fault230_work/sakt_final.pt.
Run once with --setup to write the skill map and the checkpoints.  --spawn N starts N ranks with mp.spawn;
--logfmt 1 logs through Python logging with the rank in the format.

Faults:
  exid      - rank N reads exercise ids 1-based: the last exercise id is 120, beyond the embedding table (IndexError)
  masklen   - every rank: the causal mask is built for window+1 positions (shape error in the attention)
  nomap     - rank N reads the skill map of version 2024-10, which does not exist (FileNotFoundError)
  skillkey  - rank N meets an exercise whose skill is not in the skill map (KeyError)
  predlen   - rank N all_gathers its predictions with one student too many (gloo size mismatch)
  rtzero    - rank N gets response times of 0 ms (logging bug): mean 0, inf after normalising, the program's check
  ckpt      - rank N loads ckpt/sakt_init_e150.pt, saved with 150 exercises, not 120 (size mismatch)
  windowenv - every rank: the window length comes from KT_WINDOW='50,100', not an integer (ValueError)
  slowhist  - rank N rebuilds every student's history for --stall seconds before the first all_reduce
  segv      - rank N sends itself SIGSEGV after step 2
  exit3     - rank N prints its own error line about a corrupt interaction log and calls os._exit(3)
  none      - control, clean run

What happened (filled in after the runs):
  exid      - rank N: IndexError index out of range in self (embedding) at step 0; peers closed; spawn shows only process 1's
  masklen   - every rank: RuntimeError The shape of the 2D attn_mask is torch.Size([25, 25]), but should be (24, 24)
  nomap     - rank N: FileNotFoundError .../skills/skill_map_2024-10.json before DDP; peers closed or SIGTERMed
  skillkey  - rank N: KeyError '87' building the skill ids before DDP; peers closed or SIGTERMed
  predlen   - another rank aborts: gloo EnforceNotMet 98 vs 96 size mismatch (SIGABRT); the others reset/closed
  rtzero    - rank N: FloatingPointError non-finite normalised response time (mean 0.0 ms, 0/0) before DDP
  ckpt      - rank N: RuntimeError size mismatch for ex_emb.weight [150, 32] vs [120, 32] in load_state_dict
  windowenv - every rank: ValueError invalid literal for int() with base 10: '50,100'
  slowhist  - rank N stalls before DDP(): peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout 60 (124)
  segv      - rank N: SIGSEGV after step 2 (exitcode -11 / bash Segmentation fault, 139); peers reset or closed
  exit3     - rank N logs its ERROR corrupt interaction log line after step 1 and exits 3; peers reset or closed
  none      - clean, exit 0; rank 0 printed AUC 0.5886 over 192 held-out students and saved sakt_final.pt
"""
import argparse
import json
import logging
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

WORK = "/tmp/fault230_work"
N_EX, N_SKILL, DIM = 120, 12, 32
_log = None


def log(msg, err=False):
    if _log is not None:
        (_log.error if err else _log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class SAKT(nn.Module):
    def __init__(self, n_ex, n_skill, dim):
        super().__init__()
        self.ex_emb = nn.Embedding(n_ex, dim)
        self.inter_emb = nn.Embedding(2 * n_ex, dim)
        self.skill_emb = nn.Embedding(n_skill, dim)
        self.pos_emb = nn.Embedding(64, dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.out = nn.Linear(dim, 1)

    def forward(self, past_ex, past_ok, next_ex, next_skill, mask):
        pos = torch.arange(past_ex.shape[1])
        keys = self.inter_emb(past_ex + N_EX * past_ok) + self.pos_emb(pos)
        query = self.ex_emb(next_ex) + self.skill_emb(next_skill)
        h, _ = self.attn(query, keys, keys, attn_mask=mask)
        h = h + self.ffn(h)
        return self.out(h).squeeze(-1)


def setup():
    os.makedirs(f"{WORK}/skills", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    skill_map = {str(e): e % N_SKILL for e in range(N_EX + 8)}  # catalogue incl. 8 retired
    with open(f"{WORK}/skills/skill_map_2024-09.json", "w") as f:
        json.dump(skill_map, f)
    torch.manual_seed(0)
    torch.save(SAKT(N_EX, N_SKILL, DIM).state_dict(), f"{WORK}/ckpt/sakt_init_e120.pt")
    torch.save(SAKT(150, N_SKILL, DIM).state_dict(), f"{WORK}/ckpt/sakt_init_e150.pt")
    print("wrote skill map and checkpoints under", WORK)


def make_students(rank, n, window, a, faulty):
    g = torch.Generator().manual_seed(1000 + rank)
    ex = torch.randint(0, N_EX, (n, window + 1), generator=g)
    if faulty and a.fault == "exid":
        ex = ex + 1  # ids from the export are 1-based on this shard
    ability = torch.rand(n, 1, generator=g)
    difficulty = (ex % 7).float() / 7.0
    ok = (torch.rand(n, window + 1, generator=g) < torch.sigmoid(4 * (ability - difficulty) + 1)).long()
    rt_ms = 2000.0 + 3000.0 * torch.rand(n, window + 1, generator=g)
    if faulty and a.fault == "rtzero":
        rt_ms = torch.zeros_like(rt_ms)
    return ex, ok, rt_ms


def auc(scores, labels):
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    n_pos = labels.sum().item()
    n_neg = len(labels) - n_pos
    return (ranks[labels == 1].sum().item() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1)


def worker(rank, world, a):
    global _log
    faulty = a.fault != "none" and a.rank in (-1, rank)
    if a.logfmt:
        h = logging.StreamHandler(sys.stderr)
        h.addFilter(RankFilter(rank))
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        _log = logging.getLogger("ktrace")
        _log.addHandler(h)
        _log.setLevel(logging.INFO)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    window_s = os.environ.get("KT_WINDOW", "50,100" if faulty and a.fault == "windowenv" else "24")
    window = int(window_s)
    version = "2024-10" if faulty and a.fault == "nomap" else "2024-09"
    with open(f"{WORK}/skills/skill_map_{version}.json") as f:
        skill_map = json.load(f)
    if faulty and a.fault == "skillkey":
        skill_map.pop("87")
    log(f"rank {rank}/{world}: window {window}, {len(skill_map)} exercises in the skill map v{version}")

    n_stu = a.students
    ex, ok, rt_ms = make_students(rank, n_stu, window, a, faulty)
    rt_mean = rt_ms.mean()
    rt = rt_ms / rt_mean
    if not torch.isfinite(rt).all():
        raise FloatingPointError(f"rank {rank}: non-finite normalised response time (mean response time {rt_mean.item():.1f} ms)")
    skill = torch.tensor([[skill_map[str(e)] for e in row] for row in ex.tolist()])

    model = SAKT(N_EX, N_SKILL, DIM)
    ckpt = f"{WORK}/ckpt/sakt_init_e{150 if faulty and a.fault == 'ckpt' else 120}.pt"
    model.load_state_dict(torch.load(ckpt))
    log(f"rank {rank}: loaded {ckpt}")
    if faulty and a.fault == "slowhist":
        log(f"rank {rank}: rebuilding the interaction history of all {n_stu} students from the raw event log")
        time.sleep(a.stall)
    model = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mlen = window + 1 if a.fault == "masklen" and faulty else window
    mask = torch.triu(torch.ones(mlen, mlen, dtype=torch.bool), diagonal=1)

    for step in range(a.steps):
        idx = torch.randint(0, n_stu, (a.batch,))
        logits = model(ex[idx, :-1], ok[idx, :-1], ex[idx, 1:], skill[idx, 1:], mask)
        loss = F.binary_cross_entropy_with_logits(logits, ok[idx, 1:].float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        log(f"rank {rank} step {step} loss {loss.item():.4f}")
        if faulty and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if faulty and a.fault == "exit3" and step == 1:
            log(f"ERROR rank {rank}: interaction log {WORK}/events/part-{rank:02d}.jsonl corrupt at line 4117; giving up", err=True)
            os._exit(3)

    with torch.no_grad():
        n_eval = n_stu + 1 if faulty and a.fault == "predlen" else n_stu
        ev = torch.arange(n_eval) % n_stu
        p = torch.sigmoid(model(ex[ev, :-1], ok[ev, :-1], ex[ev, 1:], skill[ev, 1:], mask))[:, -1].contiguous()
        y = ok[ev, -1].float().contiguous()
    ps = [torch.empty_like(p) for _ in range(world)]
    ys = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(ps, p)
    dist.all_gather(ys, y)
    if rank == 0:
        s, l = torch.cat(ps), torch.cat(ys)
        log(f"AUC {auc(s, l):.4f} over {len(s)} held-out students ({int(l.sum())} correct)")
        torch.save(model.module.state_dict(), f"{WORK}/sakt_final.pt")
        log(f"saved model to {WORK}/sakt_final.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawned(local_rank, world, a):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    worker(local_rank, world, a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--students", type=int, default=48)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--setup", action="store_true")
    a = p.parse_args()
    if a.setup:
        return setup()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawned, args=(a.spawn, a), nprocs=a.spawn)
    else:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

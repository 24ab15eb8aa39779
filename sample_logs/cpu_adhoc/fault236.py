"""A two-hundred-and-thirty-sixth hand-run batch: NEURAL TEMPORAL POINT PROCESS FOR EVENT SEQUENCES.

A small neural Hawkes-like model: rank 0 writes synthetic timestamped event streams of 5 marks (one CSV shard per
rank, rows merged from several sources so not in time order) and an initial checkpoint; every rank loads its shard,
sorts it by time, maps mark names through the vocabulary, all_gathers its window lengths, and trains a GRU over
(mark embedding, log inter-event time) with a softplus intensity head and a Monte-Carlo integral of the intensity
between events. The negative log-likelihood is averaged by DDP (or by hand-written gradient all_reduce with --ddp 0);
the log-likelihood and event counts are all_reduced for the progress lines.

Faults:
- unsorted: rank N skips the time sort, negative inter-event times make log(dt) NaN; the program's check raises.
- seqgather: rank N counts its partial last window too and all_gathers 5 window lengths where peers send 4.
- streamfile: rank N opens events/streams_shard<N>.csv (typo for stream_shard); FileNotFoundError.
- markidx: rank N maps marks 1-based, so mark index 5 reaches the 5-row mark embedding; IndexError.
- markname: rank N's shard holds the mark 'checkout', absent from the vocabulary; KeyError.
- hidwidth: every rank builds the intensity head for 24-wide hidden states while the GRU emits 16; shape error.
- ckptmarks: rank N loads the newest-looking init checkpoint, an old 6-mark model; state_dict size mismatch.
- slowmc: rank N draws a huge Monte-Carlo pilot sample before step 1; the others wait in the all_reduce.
- sigabrt: rank N sends itself SIGABRT after step 2.
- exit5: rank N prints an error line about its stream and calls os._exit(5).
- horizon: every rank reads the simulation horizon from HAWK_HORIZON (set to '50s' by the job); ValueError.
- none: control, trains and exits 0.

What happened (filled in after the runs):
- unsorted: rank N raised `FloatingPointError: rank N: log inter-event time is nan at step 1 (14-15 negative deltas in window 0)`; peers Connection closed by peer (np4 r2 tee, np3 r1 prefix).
- seqgather: gloo `op.preamble.length <= op.nbytes. 10 vs 8` abort on the next ring rank (np4 r1 plain, np3 r0 tee); under DETAIL (np3 r2) `Detected mismatch between collectives`, TensorShape=[5] on rank 2.
- streamfile: rank N `FileNotFoundError: ... events/streams_shardN.csv`; peers Connection closed by peer (np3 r2 pymodule, np5 r3 redirects: console Root Cause rank 3 only).
- markidx: rank N `IndexError: index out of range in self` in the mark embedding at step 1 (np4 r3 loglevel, np3 r0 wrapper).
- markname: rank N `KeyError: 'checkout'` while loading its shard (np4 r1 tee_trainer, np4 r2 pdsh2: worker-0's Root Cause rank 1 is a cascade).
- hidwidth: dropped: it failed earlier than meant, in load_state_dict of the 16-wide init checkpoint (head.weight [5, 24]) on every rank.
- ckptmarks: rank N state_dict size mismatch emb/head 6 vs 5 marks (np4 r2 plain; np3 r1 restart: attempt 1 died in Gloo connectFullMesh Connect timeout).
- slowmc: np3 r1 tee: ranks 0, 2 `Timed out waiting 12000ms` in backward; np4 r2 loglevel (PG 300 s): no step line, killed by timeout 60, exit 124.
- sigabrt: Root Cause rank N exitcode -6 (SIGABRT) after step 2 (np4 r3 filter, np3 r1 plain); peers Connection reset/closed by peer.
- exit5: rank N printed `ERROR rank N: event stream stream_shardN.csv ends before horizon 60.0; ...` and exited 5 (np3 r1 tee_trainer, np4 r2 pymodule).
- horizon: `ValueError: could not convert string to float: '50s'` on every rank (np3 pymodule, np4 detail with --ddp 0).
- none: exit 0 through train.sh on 4 ranks, `rank 0 done: final ll/event -1.9145, saved hawkes_final.pt`.
"""
import argparse
import glob
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

MARKS = ["login", "view", "click", "purchase", "logout"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--mc", type=int, default=8)
    p.add_argument("--mc-pilot", type=float, default=6e9)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--work", default="/tmp/fault236_work/hp")
    return p.parse_args()


class NeuralHawkes(nn.Module):
    def __init__(self, num_marks, hidden, head_in=None):
        super().__init__()
        self.emb = nn.Embedding(num_marks, 8)
        self.gru = nn.GRU(9, hidden, batch_first=True)
        self.head = nn.Linear(head_in or hidden, num_marks)
        self.decay = nn.Parameter(torch.zeros(hidden))

    def intensity(self, h):
        return F.softplus(self.head(h))

    def forward(self, marks, dts, gaps, n_mc):
        x = torch.cat([self.emb(marks), torch.log(dts).unsqueeze(-1)], dim=-1)
        h, _ = self.gru(x)
        lam = self.intensity(h[:, :-1])
        ev = torch.gather(lam, -1, marks[:, 1:].unsqueeze(-1)).squeeze(-1)
        u = torch.rand(gaps.shape + (n_mc,)) * gaps.unsqueeze(-1)
        hd = h[:, :-1].unsqueeze(2) * torch.exp(-F.softplus(self.decay) * u.unsqueeze(-1))
        integral = self.intensity(hd).sum(-1).mean(-1) * gaps
        return torch.log(ev + 1e-9).sum() - integral.sum(), ev.numel()


def write_data(work, world):
    rng = np.random.default_rng(7)
    os.makedirs(os.path.join(work, "events"), exist_ok=True)
    os.makedirs(os.path.join(work, "init"), exist_ok=True)
    for r in range(world):
        n = 160
        t = np.cumsum(rng.exponential(0.4, n))
        m = rng.integers(0, len(MARKS), n)
        order = rng.permutation(n)  # rows merged from several sources
        with open(os.path.join(work, "events", f"stream_shard{r}.csv"), "w") as f:
            f.write("time,mark\n")
            for i in order:
                f.write(f"{t[i]:.5f},{MARKS[m[i]]}\n")
    torch.manual_seed(0)
    torch.save(NeuralHawkes(len(MARKS), 16).state_dict(), os.path.join(work, "init", "hawkes_m5.pt"))
    if not os.path.exists(os.path.join(work, "init", "hawkes_m6_old.pt")):
        torch.save(NeuralHawkes(6, 16).state_dict(), os.path.join(work, "init", "hawkes_m6_old.pt"))


def load_stream(a, rank, work):
    name = "streams_shard" if a.fault == "streamfile" and a.rank in (-1, rank) else "stream_shard"
    with open(os.path.join(work, "events", f"{name}{rank}.csv")) as f:
        rows = [line.strip().split(",") for line in f.readlines()[1:]]
    if a.fault == "markname" and a.rank in (-1, rank):
        rows[57][1] = "checkout"
    vocab = {m: i for i, m in enumerate(MARKS)}
    times = np.array([float(r[0]) for r in rows])
    marks = np.array([vocab[r[1]] for r in rows])
    if a.fault == "markidx" and a.rank in (-1, rank):
        marks = marks + 1  # ids in the export are 1-based
    if not (a.fault == "unsorted" and a.rank in (-1, rank)):
        order = np.argsort(times, kind="stable")
        times, marks = times[order], marks[order]
    return times, marks


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank in (-1, rank)
    work = a.work
    torch.manual_seed(1234 + rank)
    if rank == 0:
        write_data(work, world)
        print(f"rank 0 wrote {world} event shards and init checkpoint under {work}", flush=True)
    dist.barrier()

    horizon = 60.0
    if a.fault == "horizon":
        horizon = float(os.environ.get("HAWK_HORIZON", "60.0"))
    times, marks = load_stream(a, rank, work)
    times, marks = times[times < horizon], marks[times < horizon]
    print(f"rank {rank} loaded {len(times)} events of {len(MARKS)} marks, horizon {horizon}", flush=True)

    n_win = len(times) // a.window
    if a.fault == "seqgather" and me:
        n_win += 1  # the partial last window too
    lens = torch.tensor([min(a.window, len(times) - i * a.window) for i in range(n_win)], dtype=torch.float32)
    gathered = [torch.zeros(n_win) for _ in range(world)]
    dist.all_gather(gathered, lens)
    if rank == 0:
        print(f"rank 0 windows per rank {[int(g.numel()) for g in gathered]}, events {int(sum(g.sum() for g in gathered))}", flush=True)

    head_in = 24 if a.fault == "hidwidth" else None
    num_marks = len(MARKS)
    ckpt = os.path.join(work, "init", f"hawkes_m{num_marks}.pt")
    if a.fault == "ckptmarks" and me:
        ckpt = sorted(glob.glob(os.path.join(work, "init", "hawkes_m*.pt")))[-1]
    model = NeuralHawkes(num_marks, a.hidden, head_in)
    model.load_state_dict(torch.load(ckpt))
    print(f"rank {rank} loaded {os.path.basename(ckpt)}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    n_mc = a.mc
    if a.fault == "slowmc" and me:
        pilot, done = int(a.mc_pilot), 0
        with torch.no_grad():
            while done < pilot:
                u = torch.rand(200_000, 1) * 0.4
                F.softplus(model.head(torch.randn(200_000, a.hidden) * torch.exp(-u))).sum()
                done += 200_000
        n_mc = 64

    for step in range(1, a.steps + 1):
        w = (step - 1) % max(n_win, 1)
        sl = slice(w * a.window, (w + 1) * a.window + 1)
        t, m = torch.tensor(times[sl], dtype=torch.float32), torch.tensor(marks[sl])
        dts = torch.diff(t, prepend=t[:1] - 0.4).clamp_min(-1e3)
        if torch.isnan(torch.log(dts)).any():
            raise FloatingPointError(f"rank {rank}: log inter-event time is nan at step {step} "
                                     f"({int((dts < 0).sum())} negative deltas in window {w})")
        ll, n = net(m.unsqueeze(0), dts.unsqueeze(0), dts[1:].unsqueeze(0), n_mc)
        loss = -ll / n
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        stats = torch.tensor([ll.item(), float(n)])
        dist.all_reduce(stats)
        print(f"rank {rank} step {step} loss {loss.item():.4f} ll/event {stats[0] / stats[1]:.4f}", flush=True)
        if step == 2 and a.fault == "sigabrt" and me:
            os.kill(os.getpid(), signal.SIGABRT)
        if step == 1 and a.fault == "exit5" and me:
            print(f"ERROR rank {rank}: event stream stream_shard{rank}.csv ends before horizon {horizon}; "
                  f"refusing to fit a truncated process", flush=True)
            os._exit(5)

    if rank == 0:
        torch.save(model.state_dict(), os.path.join(work, "hawkes_final.pt"))
        print(f"rank 0 done: final ll/event {stats[0] / stats[1]:.4f}, saved hawkes_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A three-hundred-and-eighty-ninth hand-run batch: CHESS MOVE PREDICTION FROM BOARD POSITIONS.

Synthetic chess positions: every rank reads its games from /tmp/fault389_work/games/games_R.pt, a list of
records with the piece-placement field of a FEN string, the side to move, the move played (from-square,
to-square) and an engine evaluation in pawns.  Positions are parsed batch by batch (a 12-entry piece table
maps "PNBRQKpnbrqk" to input planes) into 12x8x8 tensors.  A small policy/value network (two convolutions,
a from-square head, a to-square head and a value head) is trained with cross-entropy on the two squares
plus an MSE on the evaluation, wrapped in DDP over gloo (or gradients all_reduced by hand with --ddp 0).
The model is initialised from ckpt/policy_12.pt.  Per-rank piece histograms are all_gathered at start-up,
the move accuracy is all_reduced every step, per-rank accuracies are all_gathered at the end and rank 0
saves export/policy.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badpiece   - rank N's position 70 (batch 2) has an "X" in its FEN board: KeyError in the piece table
  promo      - rank N encodes promotions as to-square 64+piece: cross-entropy target out of range (IndexError)
  nogames    - rank N reads games/val/games_N.pt, which does not exist (FileNotFoundError at start-up)
  ckptplanes - rank N initialises from ckpt/policy_14.pt, saved with 14 input planes (size mismatch)
  ckptpickle - rank N initialises from ckpt/policy_book.pt, which pickles an OpeningBook object
               (torch.load weights_only refusal)
  histgather - rank N all_gathers its piece histogram plus an empty-square count (13 vs 12 entries)
  search     - rank N runs a pure-Python minimax over its positions before the step-2 all_reduce
  stuck      - rank N waits for book/book.ready, which nobody writes, before step 1 (run with --pg-timeout 300)
  mateinf    - rank N's batch 4 holds a mate score stored as 1e39 (inf in float32): the program's loss check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - after the last step rank N finds positions with two white kings, prints an ERROR line, sys.exit(5)
  sideplane  - every rank: the encoder adds a side-to-move plane (13 planes), the first conv expects 12
  none       - control, clean run

What happened (filled in after the runs):
  badpiece   - KeyError: 'X' in encode() at step 2; peers Connection closed (np4 r2 ranklabel) or SIGTERMed (np6 r0 tee)
  promo      - IndexError 'Target 74 is out of bounds.' at the first step (np3 r1 srunlabel; np3 r2 spawn ProcessRaisedException)
  nogames    - FileNotFoundError for games/val/games_N.pt at start-up; peers closed in all_gather (np4 r3 mpitag, np3 r1 legacy)
  ckptplanes - load_state_dict size mismatch conv1.weight [8,14,3,3] vs [8,12,3,3] (np4 r1 pdsh2, np3 r0 logfmt)
  ckptpickle - UnpicklingError 'Weights only load failed', __main__.OpeningBook not allowed (np6 r4 files)
  histgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (13), got (12))' (np6 r5 bashloop, np3 r2 mpitag)
  search     - one depth-3 search outlasts the 12 s PG timeout: peers 'Timed out waiting 12000ms' in step 2 (np3 r1 ranklabel)
  stuck      - rank N 'waiting for .../book.ready' after step 0; silent, killed at 60 s, exit 124 (np3 r2 srunlabel)
  mateinf    - the program's check: 'non-finite loss inf at step 4', FloatingPointError (np4 r0 logfmt, np3 r2 legacy --ddp 0)
  sigsegv    - no traceback; spawn 'process 1 terminated with signal SIGSEGV' after step 3 (np3 r1 spawn)
  exit5      - rank N's two-white-kings ERROR line and exit 5 after step 5; Root Cause exitcode 5 (np3 r2 tee, np4 r0 pdsh2)
  sideplane  - did not reach the forward: the 13-plane model refuses the 12-plane checkpoint on every rank
               (size mismatch conv1.weight; np3 files); labelled checkpoint
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/policy.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import os
import random
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

WORK = "/tmp/fault389_work"
PIECES = {c: i for i, c in enumerate("PNBRQKpnbrqk")}
PLANES = 12
BATCH = 32
log = None


class OpeningBook:
    def __init__(self, lines):
        self.lines = lines


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
    log = logging.getLogger("chess")
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


class PolicyNet(nn.Module):
    def __init__(self, planes=PLANES, ch=8):
        super().__init__()
        self.conv1 = nn.Conv2d(planes, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.src_head = nn.Linear(ch * 64, 64)
        self.dst_head = nn.Linear(ch * 64, 64)
        self.value = nn.Linear(ch * 64, 1)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1)
        return self.src_head(h), self.dst_head(h), torch.tanh(self.value(h)).squeeze(1) * 10.0


def random_board(rng):
    squares = [None] * 64
    for c in "Kk" + "".join(rng.choice("PPPPNBRQpppppnbrq") for _ in range(rng.randint(6, 20))):
        s = rng.randrange(64)
        while squares[s] is not None:
            s = rng.randrange(64)
        squares[s] = c
    rows = []
    for r in range(8):
        row, empty = "", 0
        for f in range(8):
            c = squares[r * 8 + f]
            if c is None:
                empty += 1
            else:
                row += (str(empty) if empty else "") + c
                empty = 0
        rows.append(row + (str(empty) if empty else ""))
    return "/".join(rows), squares


def make_games(n, seed):
    rng = random.Random(seed)
    games = []
    for _ in range(n):
        fen, sq = random_board(rng)
        side = rng.choice("wb")
        own = [i for i, c in enumerate(sq) if c and (c.isupper() == (side == "w"))]
        frm = rng.choice(own)
        to = rng.randrange(64)
        ev = sum((1 if c.isupper() else -1) * "PNBRQK".find(c.upper()) for c in sq if c) * 0.5 + rng.gauss(0, 1)
        games.append({"fen": fen, "side": side, "from": frm, "to": to, "eval": ev, "promo": None})
    for g in games[::17]:
        g["promo"] = "q"
    return games


def prepare():
    os.makedirs(f"{WORK}/games", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/book", exist_ok=True)
    for r in range(8):
        torch.save(make_games(256, 389 + r), f"{WORK}/games/games_{r}.pt")
    torch.manual_seed(0)
    torch.save(PolicyNet(12).state_dict(), f"{WORK}/ckpt/policy_12.pt")
    torch.save(PolicyNet(14).state_dict(), f"{WORK}/ckpt/policy_14.pt")
    torch.save({"model": PolicyNet(12).state_dict(), "book": OpeningBook(["e4 e5 Nf3", "d4 d5 c4"])},
               f"{WORK}/ckpt/policy_book.pt")
    print("prepared", WORK)


def encode(batch, planes):
    x = torch.zeros(len(batch), planes, 8, 8)
    for b, g in enumerate(batch):
        for r, row in enumerate(g["fen"].split("/")):
            f = 0
            for c in row:
                if c.isdigit():
                    f += int(c)
                    continue
                x[b, PIECES[c], r, f] = 1.0
                f += 1
        if planes > 12:
            x[b, 12] = 1.0 if g["side"] == "w" else 0.0
    return x


def targets(batch, promo_bug):
    frm = torch.tensor([g["from"] for g in batch])
    to = torch.tensor([64 + PIECES[g["promo"]] if promo_bug and g["promo"] else g["to"] for g in batch])
    ev = torch.tensor([g["eval"] for g in batch], dtype=torch.float32)
    return frm, to, ev


def minimax(sq, depth):
    if depth == 0:
        return sum((1 if c.isupper() else -1) * "PNBRQK".find(c.upper()) for c in sq if c)
    best = -1e9
    for i, c in enumerate(sq):
        if c is None:
            continue
        for d in (-9, -8, -7, -1, 1, 7, 8, 9):
            j = i + d
            if 0 <= j < 64 and sq[j] is None:
                nxt = list(sq)
                nxt[j], nxt[i] = c, None
                best = max(best, -minimax(nxt, depth - 1))
    return best


def board_squares(fen):
    sq = []
    for row in fen.split("/"):
        for c in row:
            sq += [None] * int(c) if c.isdigit() else [c]
    return sq


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(389 + rank)
    say(f"rank {rank}/{world} up, loading games")
    split = "val/" if bad and a.fault == "nogames" else ""
    games = torch.load(f"{WORK}/games/{split}games_{rank}.pt")
    if bad and a.fault == "badpiece":
        games[70]["fen"] = games[70]["fen"].replace("k", "X", 1)
    if bad and a.fault == "mateinf":
        games[130]["eval"] = 1e39
    planes = 13 if a.fault == "sideplane" else PLANES
    hist = torch.zeros(12)
    for g in games:
        for c in g["fen"]:
            if c in PIECES:
                hist[PIECES[c]] += 1
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([64.0 * len(games) - hist.sum()])])
    allh = [torch.zeros(12) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} pieces {int(hist[:12].sum())} global {int(sum(h.sum() for h in allh))}")
    model = PolicyNet(planes)
    ck = {"ckptplanes": "policy_14.pt", "ckptpickle": "policy_book.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'policy_12.pt'}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    accs = []
    for step in range(a.steps):
        batch = games[step * BATCH:(step + 1) * BATCH]
        if bad and a.fault == "stuck" and step == 1:
            say(f"rank {rank} waiting for {WORK}/book/book.ready")
            while not os.path.exists(f"{WORK}/book/book.ready"):
                time.sleep(0.5)
        x = encode(batch, planes)
        frm, to, ev = targets(batch, bad and a.fault == "promo")
        pf, pt, pv = net(x)
        loss = F.cross_entropy(pf, frm) + F.cross_entropy(pt, to) + 0.01 * F.mse_loss(pv, ev)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} (max |eval| in batch "
                f"{ev.abs().max().item()})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "search" and step == 2:
            t0, n = time.time(), 0
            for g in games:
                minimax(board_squares(g["fen"]), 3)
                n += 1
                if time.time() - t0 > a.search_budget:
                    break
            say(f"rank {rank} searched {n} positions to depth 3")
        acc = ((pf.argmax(1) == frm) & (pt.argmax(1) == to)).float().mean().reshape(1)
        dist.all_reduce(acc)
        accs.append(acc.item() / world)
        say(f"rank {rank} step {step} loss {loss.item():.4f} move_acc {acc.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR 3 positions in games_{rank}.pt have two white kings (first: game 41); "
            f"refusing to publish accuracy", err=True)
        sys.exit(5)
    mine = torch.tensor([sum(accs) / len(accs)])
    alla = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(alla, mine)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/policy.pt")
        say(f"rank 0 done: {a.steps} steps, mean move_acc {[round(t.item(), 4) for t in alla]}, "
            f"saved export/policy.pt")
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
    p.add_argument("--search-budget", type=int, default=30)
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

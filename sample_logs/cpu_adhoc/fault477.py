"""A four-hundred-and-seventy-seventh hand-run batch: CHESS MOVE PREDICTION FROM BOARD POSITIONS.

Synthetic positions: every position is a 64-character board string (one character per square, pieces
PNBRQKpnbrqk and '.' for empty, mapped through the piece table /tmp/fault477_work/tables/pieces.json), a side
to move, the played move as an index into a 256-entry move vocabulary and an engine evaluation in centipawns.
Every rank reads its own positions from /tmp/fault477_work/positions/train/games_R.pt (the DataLoader is not
prepared, so each rank keeps its own shard).  The model (a piece
embedding per square, flattened, an MLP trunk, a policy head over the move vocabulary and a tanh value head)
is trained with cross entropy + MSE under Hugging Face accelerate (Accelerator(cpu=True), gloo, PG timeout
from --pg-timeout).  It starts from ckpt/policy_m256.pt.  Per-rank loss is reduced with accelerator.reduce and
top-1/top-3/value statistics gathered with accelerator.gather every step; rank 0 saves export/policy.pt with
accelerator.save at the end.  With --trainer the loop is a transformers.Trainer on a tiny BERT sequence
classifier built from a config (no download): the 64 squares are the tokens, the move is the label.

Faults (--fault NAME --rank R; R = -1 means every rank):
  piece       - rank R's games hold a corrupted square '*' that the piece table lacks (KeyError, step 1)
  nopositions - rank R reads positions/val/games_R.pt, which does not exist (FileNotFoundError, start-up)
  ckptmoves   - rank R starts from ckpt/policy_m320.pt, saved with a 320-move vocabulary (size mismatch)
  ckptpickle  - rank R loads ckpt/policy_book.pt, which pickles an OpeningBook object (weights_only refusal)
  gathershape - rank R gathers 4 accuracy statistics per step instead of 3 (accelerator.gather, step 2)
  slowsearch  - rank R runs a pure-Python alpha-beta search over its positions before the step-2 reduce
  nanloss     - rank R's evaluation scale becomes 0 at step 3, value target 0/0 (program's own check)
  sigsegv     - rank R sends itself SIGSEGV after step 2
  exit4       - rank R prints its own ERROR line (illegal position: two white kings) and sys.exit(4) after step 3
  boardshape  - every rank: boards are 10x10 (100 squares) but the side embedding holds 64 squares (RuntimeError: size of tensor a (1600) vs b (1024))
  workercrash - (num_workers=1 on every rank) rank R's DataLoader worker segfaults on its 20th position
  hfcallback  - (--trainer) a TrainerCallback on rank R raises at the end of step 3
  none        - control, clean run

What happened (filled in after the runs):
  piece       - rank R 'KeyError: '*'' in Positions.__getitem__ before step 1; peers gloo Connection closed by peer
                (np4 r2 acc, np6 r5 torchrun; Root Cause names the faulty rank)
  nopositions - FileNotFoundError for positions/val/games_R.pt at start-up; peers SIGTERMed (np3 r1 accconfig); two nodes:
                node 1's Root Cause rank 3, node 0's ranks Connection closed, its Root Cause rank 1 (np4 r3 acc2nodes)
  ckptmoves   - load_state_dict size mismatch policy.weight [320, 64] vs [256, 64] before prepare (np5 r0 tee)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global __main__.OpeningBook' (np4 r1 acc)
  gathershape - --debug: every rank DistributedOperationException listing Process 1: [4] (np3 r1 accdebug); without it
                rank 0 SIGABRTs on gloo::EnforceNotMet 'Received data size doesn't match' (8 vs 6), Root Cause rank 0
                (np5 r4 torchrun)
  slowsearch  - 12 s: ranks 1 and 2 'Timed out waiting 12000ms', Root Cause names rank 1 (np3 r0 acc); 300 s: silent
                after the search line, killed at 60 s, exit 124 (np4 r2 accconfig)
  nanloss     - 'FloatingPointError: rank 3 step 3: non-finite loss nan (value target from eval_scale 0.0)' (np6 r3 accdebug)
  sigsegv     - no traceback after step 2; Root Cause exitcode -11 (SIGSEGV); peers Connection reset/closed
                (np4 r1 tee, np8 r6 acc)
  exit4       - 'ERROR rank R: illegal position ... two white kings' and exit 4; Root Cause exitcode 4
                (np4 r2 acc2nodes: node 0's rank 0 times out 12000ms instead; np7 r5 accconfig)
  boardshape  - every rank 'RuntimeError: The size of tensor a (1600) must match ... (1024)' in forward; Root Cause rank 0
                (np3 torchrun)
  workercrash - rank 2 'ERROR: Unexpected segmentation fault encountered in worker.' then 'DataLoader worker (pid N) is
                killed by signal: Segmentation fault'; Root Cause rank 2 (np5 r2 acc)
  hfcallback  - Trainer: rank R 'RuntimeError: OpeningCoverageCallback: ... no entry for B90 at step 3'; peers Connection
                closed (np4 r0 hf under accelerate launch, np3 r2 hf under torchrun)
  none        - clean: 6 steps on 3 ranks, rank 0 saved its export, exit 0 (np3 acc; np3 hf under torchrun)
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault477_work"
PIECES = ".PNBRQKpnbrqk"
MOVES = 256
DIM = 16
HID = 64
NPOS = 48


class OpeningBook:
    """Opening-book object pickled next to a checkpoint (not a tensor)."""

    def __init__(self, name, lines):
        self.name = name
        self.lines = lines


class PolicyNet(nn.Module):
    def __init__(self, moves=MOVES, squares=64):
        super().__init__()
        self.piece = nn.Embedding(len(PIECES), DIM)
        self.side = nn.Embedding(2, squares * DIM)
        self.trunk = nn.Sequential(nn.Linear(squares * DIM, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU())
        self.policy = nn.Linear(HID, moves)
        self.value = nn.Linear(HID, 1)

    def forward(self, board, side):
        h = self.piece(board).flatten(1) + self.side(side)
        h = self.trunk(h)
        return self.policy(h), torch.tanh(self.value(h)).squeeze(-1)


def make_games(seed, n=NPOS, squares=64, corrupt=False):
    g = torch.Generator().manual_seed(seed)
    games = []
    for i in range(n):
        idx = torch.randint(0, len(PIECES), (squares,), generator=g)
        idx[torch.rand(squares, generator=g) < 0.6] = 0
        board = "".join(PIECES[int(j)] for j in idx)
        if corrupt and i == 9:
            board = board[:27] + "*" + board[28:]
        games.append({"fen_id": f"G{seed:03d}-{i:04d}", "board": board,
                      "side": int(torch.randint(0, 2, (1,), generator=g)),
                      "move": int(torch.randint(0, MOVES, (1,), generator=g)),
                      "eval_cp": float(torch.randn(1, generator=g) * 150)})
    return games


def prepare():
    for d in ("positions/train", "tables", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    with open(f"{WORK}/tables/pieces.json", "w") as f:
        json.dump({p: i for i, p in enumerate(PIECES)}, f)
    for r in range(8):
        torch.save(make_games(200 + r), f"{WORK}/positions/train/games_{r}.pt")
        torch.save(make_games(200 + r, corrupt=True), f"{WORK}/positions/train/games_{r}_corrupt.pt")
        torch.save(make_games(200 + r, squares=100), f"{WORK}/positions/train/games_{r}_10x10.pt")
    torch.manual_seed(0)
    torch.save(PolicyNet().state_dict(), f"{WORK}/ckpt/policy_m256.pt")
    torch.save(PolicyNet(moves=320).state_dict(), f"{WORK}/ckpt/policy_m320.pt")
    torch.save({"book": OpeningBook("sicilian-najdorf", ["e2e4 c7c5", "g1f3 d7d6"]),
                "state": PolicyNet().state_dict()}, f"{WORK}/ckpt/policy_book.pt")
    print("prepared", WORK)


class Positions(torch.utils.data.Dataset):
    def __init__(self, games, table, crash_at=None):
        self.games, self.table, self.crash_at = games, table, crash_at

    def __len__(self):
        return len(self.games)

    def __getitem__(self, i):
        if self.crash_at is not None and i == self.crash_at:
            os.kill(os.getpid(), signal.SIGSEGV)
        gm = self.games[i]
        board = torch.tensor([self.table[c] for c in gm["board"]])
        return board, gm["side"], gm["move"], gm["eval_cp"]


def alpha_beta(depth, alpha, beta, seed):
    if depth == 0:
        return (seed * 2654435761) % 2001 - 1000
    best = -10**9
    for m in range(6):
        v = -alpha_beta(depth - 1, -beta, -alpha, seed * 31 + m)
        best = max(best, v)
        alpha = max(alpha, v)
        if alpha >= beta + 500:
            break
    return best


def slow_search(games, seconds):
    t0 = time.time()
    n = 0
    while time.time() - t0 < seconds:
        for gm in games:
            n += alpha_beta(5, -10**9, 10**9, hash(gm["board"]) & 0xFFFF)
    return n


def is_fault(args, name, rank):
    return args.fault == name and (args.rank == -1 or args.rank == rank)


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    kw = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    acc = Accelerator(cpu=True, kwargs_handlers=[kw])
    rank = acc.process_index
    torch.manual_seed(4242 + rank)

    split = "val" if is_fault(args, "nopositions", rank) else "train"
    suffix = ""
    if is_fault(args, "piece", rank):
        suffix = "_corrupt"
    elif args.fault == "boardshape":
        suffix = "_10x10"
    games = torch.load(f"{WORK}/positions/{split}/games_{rank}{suffix}.pt")
    with open(f"{WORK}/tables/pieces.json") as f:
        table = json.load(f)
    acc.print(f"loaded {len(games)} positions per rank from positions/{split}/ ({acc.num_processes} ranks)")

    model = PolicyNet()
    ckpt = f"{WORK}/ckpt/policy_m256.pt"
    if is_fault(args, "ckptmoves", rank):
        ckpt = f"{WORK}/ckpt/policy_m320.pt"
    if is_fault(args, "ckptpickle", rank):
        blob = torch.load(f"{WORK}/ckpt/policy_book.pt")
        model.load_state_dict(blob["state"])
    else:
        model.load_state_dict(torch.load(ckpt))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    workers = 1 if args.fault == "workercrash" else 0
    crash_at = 19 if is_fault(args, "workercrash", rank) else None
    loader = torch.utils.data.DataLoader(Positions(games, table, crash_at), batch_size=8, shuffle=False,
                                         num_workers=workers)
    model, opt = acc.prepare(model, opt)  # the loader stays per rank: every rank already reads its own shard

    step = 0
    eval_scale = 400.0
    while step < args.steps:
        for board, side, move, eval_cp in loader:
            step += 1
            logits, value = model(board, side)
            if is_fault(args, "nanloss", rank) and step == 3:
                eval_scale = 0.0
                eval_cp = torch.zeros_like(eval_cp)
            target = torch.tanh(eval_cp.float() / eval_scale)
            loss = F.cross_entropy(logits, move) + F.mse_loss(value, target)
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"rank {rank} step {step}: non-finite loss {loss.item()} (value target from eval_scale "
                    f"{eval_scale})")
            acc.backward(loss)
            opt.step()
            opt.zero_grad()

            if is_fault(args, "slowsearch", rank) and step == 2:
                print(f"rank {rank}: alpha-beta search to depth 5 over {len(games)} positions", flush=True)
                slow_search(games, args.slow_s)

            with torch.no_grad():
                top3 = logits.topk(3, dim=-1).indices
                top1 = (top3[:, 0] == move).float().mean()
                in3 = (top3 == move.unsqueeze(1)).any(dim=1).float().mean()
                vsign = ((value > 0) == (target > 0)).float().mean()
                n = 4 if (is_fault(args, "gathershape", rank) and step >= 2) else 3
                stats = torch.stack([top1, in3, vsign, vsign * 0][:n])
                allstats = acc.gather(stats)
                mean_loss = acc.reduce(loss.detach(), reduction="mean")
            print(f"rank {rank} step {step} loss {mean_loss.item():.4f} top1 {allstats.view(-1, 3)[:, 0].mean().item():.4f}"
                  if allstats.numel() % 3 == 0 else
                  f"rank {rank} step {step} loss {mean_loss.item():.4f} top1 {allstats.mean().item():.4f}",
                  flush=True)

            if is_fault(args, "sigsegv", rank) and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            if is_fault(args, "exit4", rank) and step == 3:
                print(f"ERROR rank {rank}: illegal position G{200 + rank:03d}-0017: two white kings on e1 and "
                      f"g4; refusing to train on corrupted games", flush=True)
                sys.exit(4)
            if step >= args.steps:
                break

    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/policy.pt")
        print(f"rank {rank}: saved export/policy.pt after {step} steps", flush=True)
    acc.wait_for_everyone()
    acc.end_training()


def run_trainer(args):
    from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                              TrainingArguments)

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], per_device_train_batch_size=4,
                              max_steps=args.steps, logging_steps=1, save_strategy="no",
                              disable_tqdm=True, learning_rate=1e-3, dataloader_num_workers=0)
    rank = targs.process_index
    cfg = BertConfig(vocab_size=len(PIECES) + 1, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=72, num_labels=MOVES)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    with open(f"{WORK}/tables/pieces.json") as f:
        table = json.load(f)
    games = torch.load(f"{WORK}/positions/train/games_{rank}.pt")
    data = [{"input_ids": torch.tensor([table[c] + 1 for c in g["board"]]), "labels": g["move"]}
            for g in games]

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', 0.0):.4f}", flush=True)

        def on_step_end(self, a, state, control, **kw):
            if is_fault(args, "hfcallback", rank) and state.global_step == 3:
                raise RuntimeError(f"OpeningCoverageCallback: ECO table for rank {rank} has no entry for "
                                   f"'B90' at step {state.global_step}")

    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Progress()])
    trainer.train()
    if targs.process_index == 0:
        trainer.save_model(f"{WORK}/export/hf_policy")
        print(f"rank {rank}: saved export/hf_policy after {args.steps} steps", flush=True)


def main():
    p = argparse.ArgumentParser(description="chess move prediction (fault batch 477)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=30.0)
    p.add_argument("--trainer", action="store_true")
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.trainer:
        run_trainer(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()

"""A two-hundred-and-thirty-ninth hand-run batch: LOG ANOMALY DETECTION WITH AN LSTM ON EVENT TEMPLATES.

A DeepLog-like next-template predictor over synthetic system-log event-id sequences: the parsed template list
(parsed/templates.json) gives the vocabulary, every rank generates its own block sessions (blk_R_i) of event
ids, looks their anomaly labels up in parsed/labels.json and cuts them into sliding windows.  The model is an
embedding, an LSTM and a softmax head over the templates, initialised from ckpt/deeplog_init.pt and trained in
DDP (gloo) or, with --ddp 0, with hand-written gradient all_reduces.  After training each rank flags windows
whose next template is not in the top-g predictions, all_reduces the anomaly counts and all_gathers its window
counts; rank 0 prints session precision/recall and saves the model.  Run once with --prepare to write the files.

Faults:
  tmplid   - rank N reads its event ids 1-based: the session-close template id equals the vocabulary (IndexError)
  cntlen   - rank N all_gathers its window counts with an extra sessions field (gloo size mismatch)
  nofile   - rank N reads the parsed templates from parsed/templates_v2.json, which does not exist
  win0     - every rank: the config gives a window size of 0 (the program's ValueError)
  sessid   - rank N numbers its sessions from 1: the last session id is not in labels.json (KeyError)
  width    - every rank: the LSTM is built bidirectional, its 32-wide outputs reach the 16-wide head (shape error)
  ckpt     - rank N initialises from ckpt/deeplog_init_t40.pt, saved with 40 templates (size mismatch)
  late     - rank N rebuilds its window index one window at a time (--stall s) before the first all_reduce
  sigterm  - rank N sends itself SIGTERM after step 2
  exit2    - rank N prints its own error line about a corrupt window index and calls os._exit(2)
  nanlp    - rank N's softmax temperature decays to 0 at step 3: log-probs -inf then NaN (finite check)
  none     - control, clean run

What happened (filled in after the runs):
  tmplid   - rank N: IndexError Target 28 is out of bounds in F.nll_loss at step 0 (not the embedding); peers closed
  cntlen   - one peer (rank 2 / rank 0) aborted: gloo EnforceNotMet 12 vs 8 size mismatch, exitcode -6; others reset
  nofile   - rank N: FileNotFoundError .../parsed/templates_v2.json at startup; peers SIGTERMed in DDP init
  win0     - every rank: ValueError window size must be a positive number of events, got 0
  sessid   - rank N: KeyError 'blk_N_12' at startup; peers closed in DDP init or SIGTERMed
  width    - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (64x32 and 16x28) at step 0
  ckpt     - rank N: RuntimeError size mismatch for emb.weight [40, 16] vs [28, 16]; with --max-restarts 1 connectFullMesh
  late     - rank N stalled: peers gloo Timed out waiting 12000ms in backward; with PG 300 s killed by timeout (124)
  sigterm  - rank N: exitcode -15 (SIGTERM) after step 2, Root Cause names it; a peer got Connection reset
  exit2    - rank N logs its ERROR corrupt window index line, exitcode 2; peers Connection reset by peer
  nanlp    - rank N: FloatingPointError non-finite loss nan at step 3; DETAIL: rank 0 monitoredBarrier error
  none     - clean, exit 0, rank 0 printed the detection summary and saved deeplog_final.pt
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault239_work"
N_TEMPLATES = 28
SESSIONS_PER_RANK = 12
SESSION_LEN = 40


class DeepLog(nn.Module):
    def __init__(self, n_tmpl, emb=16, hidden=16, bidirectional=False):
        super().__init__()
        self.emb = nn.Embedding(n_tmpl, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden, n_tmpl)

    def forward(self, x):
        out, _ = self.lstm(self.emb(x))
        return self.head(out[:, -1])


def prepare():
    os.makedirs(f"{WORK}/parsed", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    templates = [f"E{i}: <*> event template {i}" for i in range(N_TEMPLATES - 1)] + ["E27: session closed"]
    with open(f"{WORK}/parsed/templates.json", "w") as f:
        json.dump({"templates": templates}, f)
    labels = {f"blk_{r}_{i}": int((r * 7 + i) % 5 == 0) for r in range(8) for i in range(SESSIONS_PER_RANK)}
    with open(f"{WORK}/parsed/labels.json", "w") as f:
        json.dump(labels, f)
    torch.manual_seed(0)
    torch.save(DeepLog(N_TEMPLATES).state_dict(), f"{WORK}/ckpt/deeplog_init.pt")
    torch.save(DeepLog(40).state_dict(), f"{WORK}/ckpt/deeplog_init_t40.pt")
    print("prepared", WORK)


def make_session(g, n_tmpl, anomalous):
    seq, cur = [], 0
    for _ in range(SESSION_LEN - 1):
        seq.append(cur)
        if anomalous and torch.rand(1, generator=g).item() < 0.15:
            cur = int(torch.randint(0, n_tmpl - 1, (1,), generator=g))
        else:
            cur = (cur + 1 + int(torch.randint(0, 2, (1,), generator=g))) % (n_tmpl - 1)
    seq.append(n_tmpl - 1)  # every block session ends with the "session closed" template
    return seq


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--topg", type=int, default=5)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank in (-1, rank)
    torch.manual_seed(1234)

    tfile = "templates_v2.json" if (a.fault == "nofile" and me) else "templates.json"
    with open(os.path.join(WORK, "parsed", tfile)) as f:
        templates = json.load(f)["templates"]
    n_tmpl = len(templates)
    with open(os.path.join(WORK, "parsed", "labels.json")) as f:
        labels = json.load(f)
    window = 0 if a.fault == "win0" else a.window
    if window <= 0:
        raise ValueError(f"window size must be a positive number of events, got {window}")

    first = 1 if (a.fault == "sessid" and me) else 0
    sids = [f"blk_{rank}_{i}" for i in range(first, first + SESSIONS_PER_RANK)]
    sess_labels = [labels[s] for s in sids]
    g = torch.Generator().manual_seed(100 + rank)
    sessions = [make_session(g, n_tmpl, lab) for lab in sess_labels]
    if a.fault == "tmplid" and me:
        sessions = [[e + 1 for e in s] for s in sessions]
    print(f"rank {rank}: {len(sessions)} sessions, {n_tmpl} templates, window {window}", flush=True)

    model = DeepLog(n_tmpl, bidirectional=(a.fault == "width"))
    ck = "deeplog_init_t40.pt" if (a.fault == "ckpt" and me) else "deeplog_init.pt"
    sd = torch.load(os.path.join(WORK, "ckpt", ck))
    if a.fault == "width":
        sd = {k: v for k, v in sd.items() if not k.startswith("lstm")}
    model.load_state_dict(sd, strict=False)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)

    xs, ys, owner = [], [], []
    n_win = sum(len(s) - window for s in sessions)
    for si, s in enumerate(sessions):
        for i in range(len(s) - window):
            if a.fault == "late" and me:
                time.sleep(a.stall / n_win)
            xs.append(s[i:i + window])
            ys.append(s[i + window])
            owner.append(si)
    X, Y = torch.tensor(xs), torch.tensor(ys)
    print(f"rank {rank}: window index built, {len(xs)} windows", flush=True)

    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for step in range(a.steps):
        idx = torch.randint(0, len(X), (64,))
        temp = 1.0
        if a.fault == "nanlp" and me:
            temp = max(0.0, 1.0 - step / 3.0)
        logits = net(X[idx])
        logp = F.log_softmax(logits / temp, dim=-1)
        loss = F.nll_loss(logp, Y[idx])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite next-template loss {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mean {lt.item() / world:.4f}", flush=True)
        if step == 2 and me and a.fault == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if step == 2 and me and a.fault == "exit2":
            print(f"ERROR rank {rank}: window index for session {sids[3]} is corrupt "
                  f"(offset 4096 beyond session length {SESSION_LEN}); aborting", file=sys.stderr, flush=True)
            os._exit(2)

    model.eval()
    with torch.no_grad():
        top = model(X).topk(a.topg, dim=-1).indices
        miss = (top != Y[:, None]).all(dim=1)
    flagged = set(owner[i] for i in miss.nonzero().flatten().tolist())
    tp = sum(1 for i in flagged if sess_labels[i])
    stats = torch.tensor([float(len(flagged)), float(tp), float(sum(sess_labels)), float(miss.sum())])
    dist.all_reduce(stats)
    counts = torch.tensor([len(xs), int(miss.sum())], dtype=torch.int64)
    if a.fault == "cntlen" and me:
        counts = torch.tensor([len(xs), int(miss.sum()), len(sessions)], dtype=torch.int64)
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        fl, tp, pos, am = stats.tolist()
        prec = tp / fl if fl else 0.0
        rec = tp / pos if pos else 0.0
        wins = sum(int(c[0]) for c in gathered)
        print(f"detection: {wins} windows, {int(am)} anomalous, sessions flagged {int(fl)}, "
              f"precision {prec:.2f} recall {rec:.2f} (top-{a.topg})", flush=True)
        torch.save(model.state_dict(), os.path.join(WORK, "deeplog_final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

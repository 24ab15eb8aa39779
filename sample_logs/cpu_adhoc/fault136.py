"""A hundred-and-thirty-sixth hand-run batch: EVALUATION CODE AND METRICS.

A tiny binary classifier (12-24-2) is trained with DDP (`--ddp 0`: gradients all-reduced by hand) for a few
steps per epoch; after each epoch every rank scores its eval shard, the predictions are gathered (padded
all_gather), a confusion matrix is all_reduced, rank 0 computes AUC / F1 with numpy, writes results.json,
keeps the best checkpoint by F1 (best.pt, read back by every rank after a barrier) and the job stops early
once F1 passes a threshold. Run under torchrun with the gloo backend.

Faults:
- zerodiv: rank N's eval shard holds no positive sample; its per-rank recall divides by zero.
- json: every rank writes its per-rank metrics JSON with a numpy float32 value (TypeError in json.dump).
- evalwait: rank N waits for an eval-cache flag file nobody writes; the others wait in the gather.
- gather: rank N drops its last prediction (off-by-one) and all_gathers an unpadded tensor of another length.
- stopiter: rank N reuses an exhausted eval iterator; next() raises StopIteration.
- bestmiss: rank N skips the barrier before reading best.pt and reads it before rank 0 wrote it.
- nanmetric: rank N's eval shard holds a NaN feature; the program's threshold check finds val_loss nan.
- shape: every rank multiplies (n,2) probabilities by (n,) labels in the F1 code (numpy ValueError).
- earlyexit: rank N's config compares its local F1 to the threshold, stops early and leaves the job.
- segv: rank N gets SIGSEGV while scoring its eval shard.
- noscratch: rank N's node has no eval scratch directory; the program prints an error and calls os._exit(3).
What happened (filled in after the runs):
- zerodiv: ZeroDivisionError in per_rank_recall (line 80) on rank N in epoch-0 eval; peers Connection closed.
- json: every rank TypeError float32 not JSON serializable (line 157); np3: rank 1 then SIGABRT on exit.
- evalwait: PG 12 s: peers gloo recv/send timeouts in the eval collectives; PG 300 s: killed by timeout 60.
- gather: DETAIL: mismatch [23] Float vs [1] Long at seq 25; plain: gloo allgather invalid tensor size 23 vs 24.
- stopiter: bare StopIteration (line 115) on rank N in epoch 1; peers Connection closed by peer.
- bestmiss: FileNotFoundError best_ep0.pt from torch.load on rank N; peers Connection closed in the barrier.
- nanmetric: FloatingPointError val_loss is nan (line 130) on rank N; peers Connection closed by peer.
- shape: every rank ValueError broadcast (24,2) (24,) in batch_f1 (line 104).
- earlyexit: rank N stops after epoch 0 and waits in the final barrier; every rank gloo timeout 12000ms.
- segv: rank N exitcode -11 in epoch-0 eval; the --max-restarts attempt dies in DDP's param check timeout.
- noscratch: rank N prints the scratch error and exits 3; peers Connection closed/reset by peer.
"""
import argparse
import json
import math
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

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--eval-n", type=int, default=24)
p.add_argument("--f1-stop", type=float, default=0.99)
p.add_argument("--work", default="/tmp/fault136_work")
a = p.parse_args()


def hit(rank):
    return a.fault != "none" and (a.rank == -1 or a.rank == rank)


def make_shard(rank, n, seed, fault_no_pos=False, nan_row=False):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(n, 12, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    if fault_no_pos:
        keep = y == 0
        x, y = x[keep], y[keep]
    if nan_row:
        x[n // 3, 4] = float("nan")
    return x, y


def per_rank_recall(tp, npos):
    return tp / npos


def f1_from_cm(cm):
    tn, fp, fn, tp = cm
    prec = tp / max(tp + fp, 1)
    rec = tp / max(tp + fn, 1)
    return 0.0 if prec + rec == 0 else 2 * prec * rec / (prec + rec)


def auc_numpy(scores, labels):
    order = np.argsort(-scores)
    labels = labels[order]
    npos = labels.sum()
    nneg = len(labels) - npos
    tps = np.cumsum(labels)
    fps = np.cumsum(1 - labels)
    tpr = np.concatenate([[0.0], tps / max(npos, 1)])
    fpr = np.concatenate([[0.0], fps / max(nneg, 1)])
    return float(np.trapezoid(tpr, fpr)) if hasattr(np, "trapezoid") else float(np.trapz(tpr, fpr))


def batch_f1(probs, labels):
    if a.fault == "shape" and hit(dist.get_rank()):
        tp = (probs * labels).sum()
    else:
        tp = (probs[:, 1] * labels).sum()
    pp = probs[:, 1].sum()
    return float(2 * tp / max(pp + labels.sum(), 1e-9))


def evaluate(model, rank, world, epoch, eval_iter):
    fault_no_pos = a.fault == "zerodiv" and hit(rank)
    x, y = make_shard(rank, a.eval_n, 7 + epoch, fault_no_pos, a.fault == "nanmetric" and hit(rank))
    if a.fault == "stopiter" and hit(rank) and epoch >= 1:
        xb, yb = next(eval_iter)
    if a.fault == "evalwait" and hit(rank):
        flag = os.path.join(a.work, f"evalcache_ready_ep{epoch}")
        while not os.path.exists(flag):
            time.sleep(0.5)
    model.eval()
    with torch.no_grad():
        logits = model(x)
        if a.fault == "segv" and hit(rank):
            os.kill(os.getpid(), signal.SIGSEGV)
        val_loss = F.cross_entropy(logits, y).item()
        probs = logits.softmax(-1)
        pred = probs.argmax(-1)
    model.train()
    if math.isnan(val_loss):
        raise FloatingPointError(f"rank {rank} epoch {epoch}: val_loss is nan, cannot compare with threshold")
    tp = int(((pred == 1) & (y == 1)).sum())
    npos = int((y == 1).sum())
    recall = per_rank_recall(tp, npos)
    bf1 = batch_f1(probs.numpy(), y.numpy())
    print(f"rank {rank} eval epoch {epoch} n={len(y)} val_loss {val_loss:.4f} recall {recall:.3f} f1 {bf1:.3f}", flush=True)
    cm = torch.tensor([int(((pred == 0) & (y == 0)).sum()), int(((pred == 1) & (y == 0)).sum()),
                       int(((pred == 0) & (y == 1)).sum()), tp], dtype=torch.long)
    dist.all_reduce(cm)
    score = probs[:, 1].contiguous()
    if a.fault == "gather" and hit(rank):
        score = score[:-1].contiguous()
        bufs = [torch.zeros(a.eval_n) for _ in range(world)]
        dist.all_gather(bufs, score)
    else:
        n = torch.tensor([len(score)])
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(sizes, n)
        pad = torch.zeros(a.eval_n)
        pad[: len(score)] = score
        bufs = [torch.zeros(a.eval_n) for _ in range(world)]
        dist.all_gather(bufs, pad)
    labels = [None] * world
    dist.all_gather_object(labels, y.tolist())
    stats = {"rank": rank, "epoch": epoch, "val_loss": val_loss, "recall": recall}
    stats["f1_local"] = np.float32(bf1) if a.fault == "json" else bf1
    with open(os.path.join(a.work, f"metrics_rank{rank}.json"), "w") as fh:
        json.dump(stats, fh)
    return cm.tolist(), bufs, labels, bf1


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(a.work, exist_ok=True)
    if a.fault == "noscratch" and hit(rank):
        scratch = "/nonexistent/eval_scratch"
    else:
        scratch = os.environ.get("EVAL_SCRATCH", a.work)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 2))
    model = DDP(net) if a.ddp else net
    if not a.ddp:
        for prm in net.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    best_f1, eval_iter = -1.0, iter([])
    print(f"rank {rank}/{world} ready, eval shard {a.eval_n} rows, scratch {scratch}", flush=True)
    for epoch in range(a.epochs):
        x, y = make_shard(rank, 16 * a.steps, epoch)
        for step in range(a.steps):
            xb, yb = x[step * 16:(step + 1) * 16], y[step * 16:(step + 1) * 16]
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            if not a.ddp:
                for prm in net.parameters():
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
            opt.step()
            print(f"rank {rank} step {epoch * a.steps + step} loss {loss.item():.4f}", flush=True)
        if not os.path.isdir(scratch):
            print(f"eval: scratch directory {scratch} not found on this node, cannot spill predictions", file=sys.stderr, flush=True)
            os._exit(3)
        cm, bufs, labels, local_f1 = evaluate(model, rank, world, epoch, eval_iter)
        f1 = f1_from_cm(cm)
        if rank == 0:
            scores = np.concatenate([b.numpy()[: len(l)] for b, l in zip(bufs, labels)])
            lab = np.concatenate([np.array(l) for l in labels])
            auc = auc_numpy(scores, lab)
            print(f"epoch {epoch} cm {cm} f1 {f1:.4f} auc {auc:.4f}", flush=True)
            with open(os.path.join(a.work, "results.json"), "w") as fh:
                json.dump({"epoch": epoch, "f1": f1, "auc": auc, "cm": cm}, fh)
        best_path = os.path.join(a.work, f"best_ep{epoch}.pt")
        if f1 > best_f1:
            best_f1 = f1
            sync_ckpt = not (a.fault == "bestmiss" and hit(rank))
            if sync_ckpt:
                dist.barrier()
            if rank == 0:
                torch.save(net.state_dict(), best_path)
            if sync_ckpt:
                dist.barrier()
            net.load_state_dict(torch.load(best_path))
            print(f"rank {rank} best f1 {best_f1:.4f} from {os.path.basename(best_path)}", flush=True)
        f1_stop = a.f1_stop / 100 if (a.fault == "earlyexit" and hit(rank)) else a.f1_stop
        if f1 >= f1_stop:
            print(f"rank {rank} f1 {f1:.4f} >= {f1_stop}, stopping early after epoch {epoch}", flush=True)
            break
        eval_iter = iter([(x, y)]) if epoch == 0 else eval_iter
        if a.fault == "stopiter" and hit(rank) and epoch == 0:
            next(eval_iter)
    dist.barrier()
    print(f"rank {rank} done, best f1 {best_f1:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

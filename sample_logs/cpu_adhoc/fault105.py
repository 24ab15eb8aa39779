"""A hundred-and-fifth hand-run batch: EARLY STOPPING AND DECISIONS EACH RANK MAKES ON ITS OWN. A tiny regression
model on gloo (Linear(8,16)-ReLU-Linear(16,1), Adam lr 0.05, MSE, batch 32 of synthetic per-rank data), DDP unless
--ddp 0 (then a hand all_reduce of the flattened gradients). Every --val-every steps each rank evaluates its
contiguous shard (ceil split) of --val-batches validation files, the [sum, count] pair is all-reduced, and an
EarlyStopping object on every rank (patience, relative min_delta) decides whether to stop; with --bcast 1 rank 0's
decision is broadcast instead. The loop stops at max_steps from the config file (--workdir/train.json). After the
loop: a final evaluation all_reduce, rank 0 saves --workdir/model.pt, a barrier, `rank R done`. Progress lines:
`rank R step S loss L` and `rank R step S val V best B wait W`. PG timeout 12 s unless --pg-timeout. No @record.

Faults (--rank N is the rank that goes wrong):
  none       control: every rank stops on the same all-reduced metric (exit 0)
  skipok     control: rank N's batch at step --at holds a NaN record; the skip-bad-batch guard all-reduces the
             skip flag (MAX), so every rank skips that step together (exit 0)
  bcastok    control: the patreset fault, but with --bcast 1 rank 0's decision is broadcast (exit 0)
  localstop  the early-stopping check uses each rank's local validation loss (the all_reduce was "only for
             logging" and got dropped); rank N's shard is a drifted site (its labels flipped sign), its metric
             gets worse from step 1, it stops after --patience evaluations while the others go on
  budget     a wall-clock budget (--budget-s) checked on each rank after fetching its batch; rank N reads from a
             slow share (0.8 s a batch), so it is the one that sees the budget run out first and leaves the loop
  emptyval   the ceil split of --val-batches files leaves the last rank(s) without validation files:
             `total / count` ZeroDivisionError on those ranks
  nanval     the same empty shard, but the local mean is np.mean(list): RuntimeWarning (Mean of empty slice),
             nan; the mean of per-rank means is all-reduced, the nan reaches every rank and every rank's
             finite-metric check raises FloatingPointError
  patreset   rank N gets an I/O error from its loader at step --at; the recovery path rebuilds the loader and
             (by mistake) the EarlyStopping object, so its patience counter restarts at 0; the others stop on time
             and rank N trains on
  badsrc     --bcast 1, but the decision is broadcast with src=rank (every rank thinks it is the root)
  cbexc      rank N is the metrics-writer rank (its callback writes --workdir/es_state.json); on improvement the
             callback stores the best metric as a tensor and json.dump raises TypeError
  lossbelow  "stop once the training loss is below --target": rank N (a shard of small-scale inputs) reaches it
             first, saves its model and returns from main (exit 0) while the others are in the next all_reduce
  badbatch   rank N's batch at step --at holds a NaN record; the skip-bad-batch guard is local (`continue`), so
             rank N skips the backward (the gradient all_reduce) and the validation of that step
  maxsteps   rank N reads a stale copy of the config (--workdir/old/train.json, max_steps 4) and leaves the loop
             early while the others go on

What happened (see the batch readme for each run):
  none/skipok/bcastok: exit 0 (every rank early-stops at step 8, or 9 after skipok's shared skip)
  localstop: rank N stops at step 3; plain DDP: the others time out in step 4's all_reduce while N waits in the
             final barrier; DETAIL --ddp 0: every rank raises 'Detected mismatch between collectives'
  budget:    np4: rank N stops at step 5, its final all_reduce meets the others' DDP all_reduce, gloo EnforceNotMet
             aborts it (SIGABRT); np5: every rank hit the budget at step 5 together, exit 0; a timeout-45 run was
             stopped during start-up (the machine was loaded) before any rank printed, not kept
  emptyval:  ZeroDivisionError on the empty rank at step 1's validation; the others Connection closed by peer
  nanval:    numpy RuntimeWarning on the empty rank, then every rank's FloatingPointError (validation loss nan)
  patreset:  the others stop at step 8, rank N goes on into step 9's all_reduce; gloo EnforceNotMet aborts a receiver
  badsrc:    every rank times out in dist.broadcast ('Timed out waiting ...ms for send operation')
  cbexc:     TypeError: Object of type Tensor is not JSON serializable on rank N at step 1
  lossbelow: rank N returns at step 4 (exit 0); the others Connection closed by peer (one a recv timeout)
  badbatch:  DDP: silent, rank N's step counter runs one ahead and every collective still matches (exit 0);
             --ddp 0, patience 20, max_steps 10, DETAIL: 'Detected mismatch' (rank N [2] against [161])
  maxsteps:  rank N leaves after step 4; its final all_reduce meets the others' DDP all_reduce, gloo EnforceNotMet
             aborts it (SIGABRT)
"""
import argparse, datetime, json, math, os, sys, time
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--bcast", type=int, default=0)
p.add_argument("--at", type=int, default=3)
p.add_argument("--val-every", type=int, default=1)
p.add_argument("--val-batches", type=int, default=60)
p.add_argument("--budget-s", type=float, default=4.0)
p.add_argument("--target", type=float, default=0.15)
p.add_argument("--workdir", default="/tmp/fault105_work")
a = p.parse_args()


class EarlyStopping:
    def __init__(self, patience, min_delta):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.best_step, self.wait = math.inf, 0, 0

    def step(self, val, step):
        if val < self.best * (1 - self.min_delta):
            self.best, self.best_step, self.wait = val, step, 0
        else:
            self.wait += 1
        return self.wait >= self.patience


def batch(seed, n, noise, w, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(n, 8, generator=g)
    return x, x @ w + noise * torch.randn(n, 1, generator=g)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    cfg_file = os.path.join(a.workdir, "train.json")
    if a.fault == "maxsteps" and me:
        cfg_file = os.path.join(a.workdir, "old", "train.json")
    cfg = json.load(open(cfg_file))
    print(f"rank {rank} config {cfg_file} max_steps {cfg['max_steps']} patience {cfg['patience']}", flush=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, src=0)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    per = math.ceil(a.val_batches / world)
    val_ids = list(range(a.val_batches))[rank * per:(rank + 1) * per]
    val_w = -w if (a.fault == "localstop" and me) else w
    train_scale = 0.3 if (a.fault == "lossbelow" and me) else 1.0
    es = EarlyStopping(cfg["patience"], cfg["min_delta"])
    writer = a.fault == "cbexc" and me

    def evaluate():
        total, count, losses = 0.0, 0, []
        with torch.no_grad():
            for i in val_ids:
                x, y = batch(10**6 + i, 16, 0.5, val_w)
                l = F.mse_loss(model(x), y, reduction="sum").item()
                total, count = total + l, count + 16
                losses.append(l / 16)
        if a.fault == "nanval":
            local = float(np.mean(losses))
            t = torch.tensor([local])
            dist.all_reduce(t)
            return local, t.item() / world
        local = total / count
        if a.fault == "localstop":
            return local, local
        t = torch.tensor([total, float(count)])
        dist.all_reduce(t)
        return local, (t[0] / t[1]).item()

    t0 = time.time()
    step = 0
    while step < cfg["max_steps"]:
        step += 1
        if a.fault == "budget" and me:
            time.sleep(0.8)
        x, y = batch(1000 * rank + step, 32, 0.5 * train_scale, w, train_scale)
        if a.fault in ("patreset", "bcastok") and me and step == a.at:
            try:
                raise OSError(5, "Input/output error", f"/mnt/shards/train-{rank:05d}.bin")
            except OSError as e:
                print(f"rank {rank} WARNING: loader failed at step {step} ({e}); rebuilding loader and callbacks",
                      flush=True)
                es = EarlyStopping(cfg["patience"], cfg["min_delta"])
                x, y = batch(1000 * rank + step + 500, 32, 0.5, w)
        if a.fault == "budget" and time.time() - t0 > a.budget_s:
            print(f"rank {rank} time budget {a.budget_s:.1f}s used up at step {step}, stopping", flush=True)
            break
        if a.fault in ("badbatch", "skipok") and me and step == a.at:
            x[5, 3] = float("nan")
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)
        bad = not torch.isfinite(loss).item()
        if a.fault == "skipok":
            flag = torch.tensor([float(bad)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = flag.item() > 0
        if bad:
            print(f"rank {rank} step {step} non-finite loss {loss.item()}, skipping batch", flush=True)
            continue
        loss.backward()
        if not a.ddp:
            flat = torch.cat([prm.grad.view(-1) for prm in model.parameters()])
            dist.all_reduce(flat)
            flat /= world
            off = 0
            for prm in model.parameters():
                prm.grad.copy_(flat[off:off + prm.numel()].view_as(prm))
                off += prm.numel()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.1)
        if a.fault == "lossbelow" and loss.item() < a.target:
            print(f"rank {rank} training loss {loss.item():.4f} below target {a.target} at step {step}, "
                  f"saving and stopping", flush=True)
            torch.save(model.state_dict(), os.path.join(a.workdir, f"model_rank{rank}.pt"))
            return
        if step % a.val_every:
            continue
        local, val = evaluate()
        if not math.isfinite(val):
            raise FloatingPointError(f"validation loss is {val} at step {step} (local {local})")
        stop = es.step(val, step)
        if writer and es.best_step == step:
            es.best = torch.tensor(val)
            with open(os.path.join(a.workdir, "es_state.json"), "w") as f:
                json.dump({"step": step, "best": es.best, "wait": es.wait}, f)
        print(f"rank {rank} step {step} val {val:.4f} best {es.best:.4f} wait {es.wait}", flush=True)
        if a.bcast:
            flag = torch.tensor([float(stop)])
            dist.broadcast(flag, src=rank if a.fault == "badsrc" else 0)
            stop = flag.item() > 0
        if stop:
            print(f"rank {rank} early stop at step {step} (best {es.best:.4f} at step {es.best_step})", flush=True)
            break
    local, val = evaluate()
    print(f"rank {rank} final val {val:.4f} after {step} steps", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.workdir, "model.pt"))
        print(f"rank 0 saved {os.path.join(a.workdir, 'model.pt')}", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-fourth hand-run batch: GRADIENT ACCUMULATION AND DDP'S no_sync. A tiny regression model
(Linear(8,16)-ReLU-Linear(16,1), MSE) on gloo, DDP (or a hand all_reduce of the flattened gradients with --ddp 0).
Each rank reads its shard (--samples // world rows, synthetic, seeded per rank and epoch) through a prefetch thread
and a queue, in micro-batches of cfg micro_batch; accum_steps = global_batch // (micro_batch * world) from the recipe
config; every micro-batch but the last of a window runs under `with ddp.no_sync():`, the loss is divided by the
window's length (the last window of an epoch may be partial), then clip_grad_norm_ (error_if_nonfinite), SGD step,
and an all_reduce of the window loss for the log line `rank R epoch E step S loss L mean M grad_norm G`. At the end of
each epoch an all_reduce of [loss sum, count] prints `rank R epoch E val V`; at the end a barrier and `rank R done`.
A finite check on each micro-batch loss raises FloatingPointError. PG timeout --pg-timeout (12 s). No @record.
--rank N is the faulty rank (-1: every rank).

Faults:
  none        control (exit 0). With np5 (38 rows a rank, 10 micro-batches, accum 3) the last window is partial.
              ran: exit 0 on np4 (plain) and np5 (tee, partial last window of one micro-batch).
  unevenmb    rank N's shard file has --extra-rows (4) more rows (an older preprocessing run): one more micro-batch,
              so its last window issues one more gradient all_reduce and loss all_reduce than the others'.
              ran: np4/np6: its extra gradient all_reduce meets the val all_reduce; gloo EnforceNotMet aborts a peer.
  nodecfg     rank N's node reads the old recipe (global_batch 32, not 64): its accum_steps is half the others',
              so it runs twice as many optimizer steps (twice the all_reduces) in the epoch.
              ran: np4: gloo EnforceNotMet at the 4th step (a peer aborts); DETAIL --ddp 0: mismatch [161] vs [2].
  syncleft    rank N (use_window_ctx in its config) enters no_sync once for the whole window and leaves it after the
              optimizer step, so its sync micro-batch runs under no_sync too: it never all-reduces gradients.
              ran: np4/np5: its loss all_reduce meets the gradient all_reduce; gloo EnforceNotMet aborts rank N.
  twice       every rank: the window-end `window_loss.backward()` kept from the old sum-then-backward code, after
              each micro-batch's own backward: backward through freed graphs.
              ran: np4: every rank raises RuntimeError (backward through the graph a second time) at the 1st sync.
  retain      rank N (aux_loss in its config) calls loss.backward(retain_graph=True) and then the auxiliary
              loss's backward on the same graph in every micro-batch, the sync one included.
              ran: np4: exit 0, nothing raised; rank N's grad_norm drifts from the others' in the 4th decimal.
  zeroaccum   every rank reads the "small" recipe (global_batch 32, micro_batch 8): with world > 4 the integer
              division gives accum_steps 0 and the window arithmetic divides by zero.
              ran: np6: accum_steps 0; every rank raises ZeroDivisionError in the window arithmetic.
  noscale     every rank: the big-batch recipe (reduction "sum", not divided by the window length, no clipping,
              lr 0.2): the grad norm logged by clip_grad_norm_(inf, error_if_nonfinite) grows to inf.
              ran: np4/np6: the loss grows ~50x a step; every rank's finite-loss check raises in epoch 2.
  midexc      rank N's micro-batch --at (inside a no_sync window) holds a row with 7 features (a truncated CSV
              line): torch.stack raises RuntimeError in the middle of the window.
              ran: np4/np5/np6: rank N raises the stack RuntimeError; the peers get Connection closed by peer.
  skipbad     the same malformed row, at a sync micro-batch (--at 3), but the loop catches the error, prints a
              WARNING and skips the micro-batch: rank N skips that window's all_reduces.
              ran: np4: a WARNING, one step fewer on rank N; its val all_reduce meets a gradient all_reduce (EnforceNotMet).
  prefetch    the prefetch thread queues only whole windows (n_micro // accum * accum micro-batches); the loop
              counts ceil(rows / micro_batch): a rank with a partial last window waits in queue.get() forever.
              ran: np4 (+4 rows on rank N): peers time out in the val all_reduce; np5 (every rank): hang (timeout 100).
  badsample   rank N's micro-batch --at has a row whose target reads 3.0e38 (a sensor's saturated value): its
              micro-batch loss is inf and its finite-loss check raises FloatingPointError.
              ran: np4: rank N's finite-loss check raises FloatingPointError before step 1; peers get Connection closed.
"""
import argparse, contextlib, datetime, math, os, queue, sys, threading, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--samples", type=int, default=192)
p.add_argument("--extra-rows", type=int, default=4)
p.add_argument("--at", type=int, default=2)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
a = p.parse_args()

RECIPES = {
    "default": {"global_batch": 64, "micro_batch": 4, "clip": 1.0, "lr": 0.05, "reduction": "mean"},
    "old": {"global_batch": 32, "micro_batch": 4, "clip": 1.0, "lr": 0.05, "reduction": "mean"},
    "small": {"global_batch": 32, "micro_batch": 8, "clip": 1.0, "lr": 0.05, "reduction": "mean"},
    "bigbatch": {"global_batch": 64, "micro_batch": 4, "clip": 0.0, "lr": 0.2, "reduction": "sum"},
}


def load_shard(rank, world, epoch, me):
    n = a.samples // world
    if a.fault in ("unevenmb", "prefetch") and me:
        n += a.extra_rows
    g = torch.Generator().manual_seed(100 * rank + epoch)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    rows = [(x[i], y[i]) for i in range(n)]
    return rows


def collate(rows):
    xs = torch.stack([r[0] for r in rows])
    ys = torch.stack([r[1] for r in rows])
    return xs, ys


def prefetch(rows, mb, accum, q):
    n_micro = math.ceil(len(rows) / mb)
    if a.fault == "prefetch":
        n_micro = n_micro // accum * accum
    for m in range(n_micro):
        q.put(rows[m * mb:(m + 1) * mb])
        time.sleep(0.01)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = a.rank in (-1, rank)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    name = "default"
    if a.fault == "nodecfg" and me:
        name = "old"
    if a.fault == "zeroaccum":
        name = "small"
    if a.fault == "noscale":
        name = "bigbatch"
    cfg = RECIPES[name]
    mb = cfg["micro_batch"]
    accum = cfg["global_batch"] // (mb * world)
    print(f"rank {rank} recipe {name} micro_batch {mb} accum_steps {accum} world {world}", flush=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model = DDP(net) if a.ddp else net
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=cfg["lr"])
    step = 0
    for epoch in range(1, a.epochs + 1):
        rows = load_shard(rank, world, epoch, me)
        if a.fault in ("midexc", "skipbad") and me and epoch == 1:
            i = a.at * mb + 1
            rows[i] = (rows[i][0][:7], rows[i][1])
        if a.fault == "badsample" and me and epoch == 1:
            i = a.at * mb + 1
            rows[i] = (rows[i][0], torch.tensor([3.0e38]))
        q = queue.Queue(maxsize=8)
        threading.Thread(target=prefetch, args=(rows, mb, accum, q), daemon=True, name=f"prefetch-{rank}").start()
        n_micro = math.ceil(len(rows) / mb)
        ep_sum, ep_cnt = 0.0, 0
        window_loss = None
        win_total = 0.0
        opt.zero_grad()
        for m in range(n_micro):
            raw = q.get()
            win_start = (m // accum) * accum
            win_len = min(accum, n_micro - win_start)
            is_sync = (m + 1) % accum == 0 or m == n_micro - 1
            if a.fault == "syncleft" and me:
                if m == win_start and a.ddp:
                    win_ctx = model.no_sync()
                    win_ctx.__enter__()
                ctx = contextlib.nullcontext()
            else:
                ctx = model.no_sync() if (a.ddp and not is_sync) else contextlib.nullcontext()
            with ctx:
                try:
                    xb, yb = collate(raw)
                except RuntimeError as e:
                    if a.fault != "skipbad":
                        raise
                    print(f"rank {rank} WARNING: skipping malformed micro-batch {m} of epoch {epoch}: {e}", flush=True)
                    continue
                out = model(xb)
                loss = F.mse_loss(out, yb, reduction=cfg["reduction"])
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at epoch {epoch} micro-batch {m}")
                if cfg["reduction"] == "mean":
                    loss = loss / win_len
                if a.fault == "retain" and me:
                    loss.backward(retain_graph=True)
                    aux = 1e-3 * out.pow(2).mean() / win_len
                    aux.backward()
                else:
                    loss.backward()
                window_loss = loss if window_loss is None else window_loss + loss
                win_total += loss.item()
                ep_sum += loss.item() * len(raw)
                ep_cnt += len(raw)
            time.sleep(0.05)
            if not is_sync:
                continue
            if a.fault == "twice":
                window_loss.backward()
            if a.fault == "syncleft" and me and a.ddp:
                win_ctx.__exit__(None, None, None)
            if not a.ddp and not (a.fault == "syncleft" and me):
                flat = torch.cat([prm.grad.reshape(-1) for prm in params])
                dist.all_reduce(flat)
                flat /= world
                off = 0
                for prm in params:
                    prm.grad.copy_(flat[off:off + prm.numel()].view_as(prm))
                    off += prm.numel()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg["clip"] or float("inf"), error_if_nonfinite=True)
            opt.step()
            opt.zero_grad()
            step += 1
            lt = torch.tensor([win_total])
            dist.all_reduce(lt)
            print(f"rank {rank} epoch {epoch} step {step} loss {win_total:.4f} mean {lt.item() / world:.4f} "
                  f"grad_norm {gnorm.item():.4f}", flush=True)
            window_loss = None
            win_total = 0.0
        val = torch.tensor([ep_sum, float(ep_cnt)])
        dist.all_reduce(val)
        print(f"rank {rank} epoch {epoch} val {val[0].item() / max(val[1].item(), 1.0):.4f}", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""An eighty-seventh hand-run batch: POINT-TO-POINT COMMUNICATION AND HAND-WRITTEN PIPELINE STAGES. A tiny model
split into one stage per rank (stage r = Linear(8,8)-Tanh; the last stage adds Linear(8,4) and the loss), GPipe-style
on gloo: every step, --mb micro-batches of 4 rows go forward (stage r receives its input activation from r-1, sends its
output to r+1), then the gradients come back (the last stage computes the loss and sends d(input) to r-1, the others
receive d(output), backprop and send d(input) on). --comm picks the calls: `sync` dist.send/dist.recv, `async`
dist.isend/dist.irecv + .wait(), `batch` dist.batch_isend_irecv with P2POp lists. SGD, --steps steps; the last stage
prints `rank R step S loss L` and checks the loss is finite, every rank prints `rank R stage R/W step S ok`; at the
end an eval pass where the last stage gets the first stage's sample count (`dist.recv(src=0)`), a barrier and
`rank R done`. PG timeout --pg-timeout (12 s). One rank (--rank N) goes wrong. No @record.

Faults:
  none       control (exit 0)
  raise      stage N looks up its activation in a per-stage table by a name the config does not have: KeyError in
             its forward at step --at (2); its neighbours are left in recv
  shape      stage N was built with --wide (12) outputs (a stale per-stage config) and sends a (4, 12) activation
             where stage N+1 allocated (4, 8): gloo's size check on the receiver
  dtype      stage N sends its activation as float64 ("for precision"): 2x the bytes stage N+1 allocated
  narrow     stage N sends a bfloat16 activation: half the bytes; stage N+1 reads a half-filled float32 buffer and
             goes on silently (a wrong loss; the run may end 0)
  wrongpeer  stage N sends its activation to N+2 (an off-by-one in its next-stage table): N+1 waits in recv for it
  tag        stage N sends with tag=step (a "sequence tag" only it uses) while stage N+1 receives with tag 0
  nowait     stage N (async) forgets the .wait() on its forward irecv and reads the torch.empty buffer at once
  skipgrad   the last stage skips sending the gradient back on micro-batches whose loss is below --skip-below
             ("nothing to learn"): stage N-1 waits for it while the last stage goes on to the next forward
  mbcount    stage N reads its micro-batch count from its own config (--mb + 1): it waits for a micro-batch nobody sends
  deadsrc    stage 0 has no eval split and returns after training (exit 0); the last stage's eval recv(src=0) meets
             a closed peer (the others are in the final barrier)
  sigkill    stage N is killed (SIGKILL, the OOM killer's signal) between its isends at step --at
  segv       stage N's "fast copy" extension (ctypes.memmove to a NULL pointer) segfaults before its send at step --at
  hang       as tag, for a --pg-timeout long enough that an outside `timeout` stops the job
"""
import argparse, ctypes, datetime, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--comm", default="sync", choices=["sync", "async", "batch"])
p.add_argument("--steps", type=int, default=4)
p.add_argument("--mb", type=int, default=4)
p.add_argument("--at", type=int, default=2)
p.add_argument("--wide", type=int, default=12)
p.add_argument("--skip-below", type=float, default=1.4)
p.add_argument("--pg-timeout", type=int, default=12)
a = p.parse_args()
ROWS, D = 4, 8


def send(t, dst, tag=0):
    if a.comm == "sync":
        dist.send(t, dst, tag=tag)
    elif a.comm == "async":
        dist.isend(t, dst, tag=tag).wait()
    else:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, dst, tag=tag)]):
            w.wait()


def recv(t, src, tag=0):
    if a.comm == "sync":
        dist.recv(t, src, tag=tag)
    elif a.comm == "async":
        dist.irecv(t, src, tag=tag).wait()
    else:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, src, tag=tag)]):
            w.wait()


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    last = rank == world - 1
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(rank)
    out_dim = a.wide if (a.fault == "shape" and me) else D
    stage = nn.Sequential(nn.Linear(D, out_dim), nn.Tanh())
    head = nn.Linear(D, 4) if last else None
    params = list(stage.parameters()) + (list(head.parameters()) if head else [])
    opt = torch.optim.SGD(params, lr=0.1)
    n_mb = a.mb + 1 if (a.fault == "mbcount" and me) else a.mb
    print(f"rank {rank} stage {rank}/{world} world {world} comm {a.comm} fault {a.fault} micro-batches {n_mb}", flush=True)
    nxt = {r: r + 1 for r in range(world - 1)}
    if a.fault == "wrongpeer" and me:
        nxt[rank] = rank + 2  # the table was built for a layout with a loss stage in between
    acts = {}
    for step in range(1, a.steps + 1):
        opt.zero_grad()
        ins, outs, losses = [], [], []
        for m in range(n_mb):  # forward
            g = torch.Generator().manual_seed(1000 * step + m)
            if rank == 0:
                x = torch.randn(ROWS, D, generator=g)
            else:
                x = torch.empty(ROWS, D)
                if a.fault == "nowait" and me:
                    dist.irecv(x, rank - 1)  # the wait was lost in a refactor
                else:
                    recv(x, rank - 1)
                x.requires_grad_(True)
            acts["stage"] = stage(x)
            key = "stage"
            if a.fault == "raise" and me and step == a.at:
                key = f"stage{rank}.out"  # the name a per-stage config gives this stage's output
            y = acts[key]
            ins.append(x)
            outs.append(y)
            if last:
                tgt = torch.randint(0, 4, (ROWS,), generator=g)
                loss = F.cross_entropy(head(y), tgt)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"rank {rank} step {step} micro-batch {m}: non-finite loss {loss.item()}")
                losses.append(loss)
            else:
                t = y.detach()
                if a.fault == "dtype" and me:
                    t = t.double()
                if a.fault == "narrow" and me:
                    t = t.to(torch.bfloat16)
                if a.fault == "segv" and me and step == a.at and m == 1:
                    ctypes.memmove(0, t.data_ptr(), t.numel() * 4)  # "fast copy" into a pinned staging buffer
                if a.fault == "sigkill" and me and step == a.at and m == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                tag = step if (a.fault in ("tag", "hang") and me) else 0
                send(t.contiguous(), nxt[rank], tag=tag)
        for m in reversed(range(n_mb)):  # backward
            if last:
                losses[m].backward()
                if a.fault == "skipgrad" and losses[m].item() < a.skip_below:
                    continue  # nothing to learn from this micro-batch
            else:
                gy = torch.empty(ROWS, D)
                recv(gy, rank + 1)
                outs[m].backward(gy)
            if rank > 0:
                send(ins[m].grad.contiguous(), rank - 1)
        opt.step()
        if last:
            print(f"rank {rank} step {step} loss {sum(l.item() for l in losses) / len(losses):.4f}", flush=True)
        print(f"rank {rank} stage {rank}/{world} step {step} ok", flush=True)
    # eval: the last stage reports the number of eval samples the first stage read
    n = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        if a.fault == "deadsrc":
            print(f"rank {rank} no eval split for stage 0; finishing", flush=True)
            return
        n += 64
        send(n, world - 1)
    if last:
        recv(n, 0)
        print(f"rank {rank} eval samples {int(n)}", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

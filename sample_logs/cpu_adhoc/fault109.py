"""A hundred-and-ninth hand-run batch: PIPELINE-PARALLEL SCHEDULES.
A tiny denoising autoencoder (8 features) split into S pipeline stages (--stages; default: the world size up to 4,
2 stages x 3 replicas on 6 ranks, 4 stages x 2 on 8): stage 0 normalises each micro-batch per feature and applies
proj_in Linear(8,16)+tanh, middle stages Linear(16,16)+tanh, the last stage Linear(16,16)+tanh and a head
Linear(16,8) tied to proj_in (their gradients are exchanged between the first and last stage after the backward).
stage = rank % S, replica = rank // S; activations go forward and gradients backward with blocking dist.send/recv
(a hand-written GPipe schedule: all micro-batches forward, then all backward), the last stage computes the MSE loss,
each stage's data-parallel replicas all_reduce their gradients in their own subgroup (new_group), SGD (wd 1e-4,
grads zeroed in place). Batch --batch (16) per replica, micro-batch --mb (4), --steps (5). Prints
`rank R stage S replica K ...` at start-up, `rank R stage S step T fwd M bwd M` and, on the last stage,
`rank R stage S step T loss L`. --rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s).

Faults:
  none       control (exit 0); `rank R done` at the end
  hidden     rank N's stage config has hidden 20 (the others 16): its output micro-batch is 4x20 while the next
             stage allocates 4x16 for its recv
             happened: the next stage aborts in gloo (EnforceNotMet 320 vs 256, -6); rank N: Connection reset
  shortmb    rank N's per-node config has batch 14: it computes its micro-batch count from its own batch size
             (14 // 4 = 3, a WARNING line) and sends one micro-batch fewer; the next stage waits for the fourth
             happened: WARNING on rank N, then 12 s recv timeouts on the next stage (and in rank N's grad recv)
  wrongpeer  rank N's next-stage peer is computed with the stage index off by one (rank + 2): it sends its
             activations two stages on; the real next stage waits for them
             happened: in the world: send/recv timeouts; outside it: DistStoreError waiting for key .../0/4
  dtype      rank N's stage runs in bfloat16 (a mixed-precision stage config) and sends bf16 activations; the
             next stage receives into a float32 buffer
             happened: the bf16 forward send passes silently; rank N aborts on the fp32 gradient (256 vs 128)
  midexc     rank N (a middle stage) builds its per-micro-batch dropout seeds (for recompute) from a stale
             config with 3 micro-batches; the forward of micro-batch 3 raises IndexError
             happened: IndexError: list index out of range on rank N; its neighbours Connection closed
  zeromb     rank N (a last stage) reads micro-batch size 32 from its config (the global batch written in the
             wrong field): its micro-batch count is 16 // 32 = 0 and the loss scale 1/0 raises ZeroDivisionError
             happened: WARNING `0 micro-batches`, then ZeroDivisionError on rank N at step 1
  nan        from step 3 feature 5 of rank N's (stage 0) data is a dead sensor (constant 0.0): the per-micro-
             batch normalisation divides 0 by std 0, the NaN travels down the pipe and the last stage's finite-
             loss check raises FloatingPointError
             happened: the last stage of rank N's replica raises `loss is nan at step 3`; rank N prints nothing
  earlystep  rank N overlaps its optimizer step with the gradient transfer: it posts irecv for the gradients,
             all-reduces and steps (weight decay changes the weights in place) before waiting and running the
             backward: autograd's version check fails (modified by an inplace operation)
             happened: RuntimeError `modified by an inplace operation` on rank N at step 1
  deadlock   rank N (a first or last stage) does the tied-weight gradient exchange with a symmetric helper that
             sends first (blocking) then receives, while its partner also sends first
             happened: both partners time out in dist.send (line 175); PG timeout 300 s: hangs until stopped
"""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--stages", type=int, default=0)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--mb", type=int, default=4)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--sleep", type=float, default=0.1)
a = p.parse_args()
FEAT, H = 8, 16


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Stage(nn.Module):
    def __init__(self, stage, nstages, hidden_in, hidden_out, n_micro_cfg):
        super().__init__()
        self.stage, self.last = stage, stage == nstages - 1
        self.proj_in = nn.Linear(FEAT, hidden_out) if stage == 0 else None
        self.fc = nn.Linear(hidden_in, hidden_out) if stage > 0 else None
        self.head = nn.Linear(hidden_out, FEAT) if self.last else None
        self.mb_seeds = [1000 * stage + i for i in range(n_micro_cfg)]

    def forward(self, x, mb):
        if self.stage == 0:
            x = (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)
            return torch.tanh(self.proj_in(x))
        g = torch.Generator().manual_seed(self.mb_seeds[mb])
        keep = (torch.rand(x.shape, generator=g) > 0.1).to(x.dtype) / 0.9
        h = torch.tanh(self.fc(x * keep))
        return self.head(h) if self.last else h


def batch_for(rep, step, n):
    g = torch.Generator().manual_seed(1000 * rep + step)
    x = torch.randn(n, FEAT, generator=g)
    noisy = x + 0.1 * torch.randn(n, FEAT, generator=g)
    return noisy, x


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    S = a.stages or (world if world <= 4 else (2 if world % 2 == 0 and world % 4 else 4))
    R = world // S
    stage, rep = rank % S, rank // S
    first, lastr = rep * S, rep * S + S - 1
    prev_rank, next_rank = rank - 1, rank + 1
    if faulty(rank, "wrongpeer"):
        next_rank = rep * S + (stage + 2)
    dp_groups = [dist.new_group([s + k * S for k in range(R)]) for s in range(S)] if R > 1 else None
    hidden_out = 20 if faulty(rank, "hidden") else H
    batch = 14 if faulty(rank, "shortmb") else a.batch
    mb_size = 32 if faulty(rank, "zeromb") else a.mb
    n_micro_cfg = 3 if faulty(rank, "midexc") else a.batch // a.mb
    torch.manual_seed(0)
    model = Stage(stage, S, H, hidden_out, n_micro_cfg)
    dtype = torch.bfloat16 if faulty(rank, "dtype") else torch.float32
    model = model.to(dtype)
    for prm in model.parameters():  # grad buffers preallocated for the DP all_reduce and the tied exchange
        prm.grad = torch.zeros_like(prm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-4)
    print(f"rank {rank} stage {stage} replica {rep}: {S} stages x {R} replicas, prev {prev_rank if stage else '-'} "
          f"next {next_rank if stage < S - 1 else '-'} dtype {str(dtype)[6:]}", flush=True)
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=False)
        n_micro = batch // mb_size
        if batch % mb_size:
            print(f"WARNING rank {rank}: batch {batch} is not a multiple of micro-batch {mb_size}; dropping the "
                  f"last {batch % mb_size} samples ({n_micro} micro-batches)", flush=True)
        noisy, clean = batch_for(rep, step, batch)
        if faulty(rank, "nan") and step >= 3:
            noisy[:, 5] = 0.0
        ins, outs, losses = [], [], []
        if model.last:
            scale = 1.0 / n_micro
        for mb in range(n_micro):
            if stage == 0:
                x = noisy[mb * mb_size:(mb + 1) * mb_size].to(dtype)
            else:
                x = torch.empty(a.mb, H, dtype=torch.float32)
                dist.recv(x, src=prev_rank)
                x = x.to(dtype).requires_grad_()
            out = model(x, mb)
            ins.append(x)
            if model.last:
                loss = F.mse_loss(out.float(), clean[mb * a.mb:(mb + 1) * a.mb]) * scale
                losses.append(loss)
                outs.append(loss)
            else:
                dist.send(out.detach().contiguous(), dst=next_rank)
                outs.append(out)
        if model.last:
            total = sum(l.item() for l in losses)
            if not torch.isfinite(torch.tensor(total)):
                raise FloatingPointError(f"rank {rank}: loss is {total} at step {step} (stage {stage})")
        if faulty(rank, "earlystep") and not model.last:
            grads = [torch.empty(a.mb, hidden_out, dtype=dtype) for _ in range(n_micro)]
            works = [dist.irecv(gr, src=next_rank) for gr in grads]
            if dp_groups:
                for prm in model.parameters():
                    dist.all_reduce(prm.grad, group=dp_groups[stage])
            opt.step()
            for w in works:
                w.wait()
        for mb in reversed(range(n_micro)):
            if model.last:
                outs[mb].backward()
            else:
                if faulty(rank, "earlystep"):
                    gr = grads[mb]
                else:
                    gr = torch.empty(a.mb, hidden_out, dtype=dtype)
                    dist.recv(gr, src=next_rank)
                outs[mb].backward(gr)
            if stage > 0:
                dist.send(ins[mb].grad.contiguous(), dst=prev_rank)
        if S > 1 and stage in (0, S - 1):
            mine = model.proj_in.weight.grad if stage == 0 else model.head.weight.grad.t().contiguous()
            theirs = torch.empty_like(mine)
            peer = lastr if stage == 0 else first
            if stage == 0 or faulty(rank, "deadlock"):
                dist.send(mine, dst=peer)
                dist.recv(theirs, src=peer)
            else:
                dist.recv(theirs, src=peer)
                dist.send(mine, dst=peer)
            (model.proj_in.weight.grad if stage == 0 else model.head.weight.grad).add_(theirs if stage == 0 else theirs.t())
        if not faulty(rank, "earlystep"):
            if dp_groups:
                for prm in model.parameters():
                    dist.all_reduce(prm.grad, group=dp_groups[stage])
                    prm.grad.div_(R)
            opt.step()
        print(f"rank {rank} stage {stage} step {step} fwd {n_micro} bwd {n_micro}", flush=True)
        if model.last:
            print(f"rank {rank} stage {stage} step {step} loss {total:.4f}", flush=True)
        time.sleep(a.sleep)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

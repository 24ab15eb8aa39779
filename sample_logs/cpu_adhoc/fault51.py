"""A fifty-first hand-run batch: MODEL PARALLEL SHAPES. A tiny Megatron-like job on gloo: the world is split into
pipeline (pp), tensor (tp) and data (dp) parallel groups with dist.new_group (tp fastest, then dp, then pp, as
Megatron orders them: rank = (pp_idx * DP + dp_idx) * TP + tp_idx). Each step runs MICRO micro-batches: stage 0
multiplies its input by its slice of W0 and sums the partial results over its TP group (all_reduce), sends the
activation to its stage-1 peer (dist.send), stage 1 receives it (dist.recv), applies its W1 slice, all-reduces over TP,
computes an MSE loss, checks it is finite, back-propagates and sends the input gradient back to stage 0, which
back-propagates it. After the micro-batches each rank all-reduces its gradient in its DP group and steps SGD.
Every rank prints `[rank R pp=P tp=T dp=D] step S/N | ...` per step.

Faults (--rank N: the rank at fault, --step S: the step):
  exc        rank N's stage forward looks up its batch's 'attention_mask' (the batch has none): KeyError
  shape      rank N (stage 1) posts its recv with hidden size 12 (its config's), the sender sends hidden 8
  sendshape  rank N (stage 0) sends an activation of hidden 12; its stage-1 peer receives hidden 8
  nan        rank N's (stage 1) targets hold a NaN; the finite-loss check raises FloatingPointError
  osexit     rank N calls os._exit(3)
  segv       rank N reads address 0 (ctypes.string_at(0)): SIGSEGV
  sigkill    rank N starts a sidecar `sh -c 'sleep 0.5; kill -9 PID'` and trains on
  hang       rank N sleeps 120 s before its step-S forward (waiting on a lock); its peers time out (PG timeout)
  skipsend   rank N (stage 0) skips its send of micro-batch 1 at step S; its stage-1 peer waits in recv
  wronggroup rank N all-reduces its TP partial sum on its DP group instead of its TP group at step S
  micro      rank N runs MICRO+1 micro-batches at step S (its config's micro-batch count differs)
  config     every rank: the script's own check that world size is divisible by tp*pp raises RuntimeError
  none       a control
"""
import argparse, ctypes, datetime, math, os, subprocess, sys, time
import torch, torch.distributed as dist
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--step", type=int, default=4)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--tp", type=int, default=2)
p.add_argument("--pp", type=int, default=2)
p.add_argument("--micro", type=int, default=2)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
H, MB = 8, 4


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    TP, PP = a.tp, a.pp
    if world % (TP * PP) != 0:
        raise RuntimeError(f"world_size ({world}) is not divisible by tensor_model_parallel_size ({TP}) x "
                           f"pipeline_model_parallel_size ({PP})")
    DP = world // (TP * PP)
    tp, dp, pp = rank % TP, (rank // TP) % DP, rank // (TP * DP)
    tag = f"[rank {rank} pp={pp} tp={tp} dp={dp}]"
    # every rank creates every group, in the same order
    tp_group = dp_group = None
    for p_ in range(PP):
        for d_ in range(DP):
            ranks = [(p_ * DP + d_) * TP + t_ for t_ in range(TP)]
            g = dist.new_group(ranks)
            if rank in ranks:
                tp_group = g
    for p_ in range(PP):
        for t_ in range(TP):
            ranks = [(p_ * DP + d_) * TP + t_ for d_ in range(DP)]
            g = dist.new_group(ranks)
            if rank in ranks:
                dp_group = g
    if rank == 0:
        print(f"> initialized tensor model parallel with size {TP}", flush=True)
        print(f"> initialized pipeline model parallel with size {PP}", flush=True)
        print(f"> initialized data parallel with size {DP}", flush=True)
    last = pp == PP - 1
    nxt = rank + TP * DP if not last else None
    prv = rank - TP * DP if pp > 0 else None
    torch.manual_seed(100 + pp * 10 + tp)
    W = (torch.randn(H, H) * 0.3).requires_grad_()  # this rank's slice of the stage's layer
    print(f"{tag} building stage {pp} ({'last' if last else 'first'}), {W.numel()} parameters, "
          f"next={nxt} prev={prv}", flush=True)
    me = rank == a.rank
    for step in range(1, a.steps + 1):
        now = me and step == a.step
        f = a.fault if now else ""
        if f == "sigkill":
            subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {os.getpid()}"])
        if f == "hang":
            time.sleep(120)
        if f == "osexit":
            os._exit(3)
        if f == "segv":
            ctypes.string_at(0)
        micro = a.micro + (1 if f == "micro" else 0)
        W.grad = None
        losses = []
        for mb in range(micro):
            g = torch.Generator().manual_seed(step * 100 + mb * 10 + dp)
            batch = {"tokens": torch.randn(MB, H, generator=g), "labels": torch.randn(MB, H, generator=g)}
            if f == "exc":
                _ = batch["attention_mask"]
            if pp == 0:
                x = batch["tokens"]
            else:
                hid = 12 if f == "shape" else H
                x = torch.empty(MB, hid)
                dist.recv(x, src=prv)
                x.requires_grad_()
            h = x @ W if x.shape[1] == H else x[:, :H] @ W
            red = h.detach().clone()
            dist.all_reduce(red, group=dp_group if f == "wronggroup" else tp_group)
            out = h + (red - h).detach()
            if not last:
                send = out.detach()
                if f == "sendshape":
                    send = torch.cat([send, send[:, :4]], dim=1)
                if not (f == "skipsend" and mb == 1):
                    dist.send(send.contiguous(), dst=nxt)
                gin = torch.empty(MB, H)
                dist.recv(gin, src=nxt)
                out.backward(gin)
            else:
                y = batch["labels"]
                if f == "nan":
                    y = y.clone()
                    y[1, 3] = float("nan")
                loss = F.mse_loss(out, y)
                if not math.isfinite(loss.item()):
                    raise FloatingPointError(f"loss is {loss.item()} at iteration {step}, micro-batch {mb}")
                loss.backward()
                losses.append(loss.item())
                if prv is not None:
                    dist.send(x.grad.contiguous(), dst=prv)
        grad = W.grad / micro
        dist.all_reduce(grad, group=dp_group)
        with torch.no_grad():
            W -= 0.05 * grad / (world // (TP * PP))
        if last:
            msg = f"lm loss {sum(losses) / len(losses):.4f} | micro-batches {micro}"
        else:
            msg = f"sent {micro} activations to rank {nxt} | grad norm {grad.norm().item():.4f}"
        print(f"{tag} step {step}/{a.steps} | {msg}", flush=True)
        time.sleep(0.2)
    dist.barrier()
    print(f"{tag} training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

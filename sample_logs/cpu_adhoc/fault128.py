"""A hundred-and-twenty-eighth hand-run batch: OPTIMIZERS AND LEARNING-RATE SCHEDULERS. A small regression MLP
(Linear(8,32)-ReLU-Linear(32,1)) on each rank's synthetic shard (96 train rows, 32 val rows) in DDP (--ddp 0: rank
0's weights broadcast, each rank clips its local gradients, then they are all-reduced by hand), gloo. The optimizer
(--opt sgd: momentum 0.9; adamw: weight decay on the weights, none on the biases, as two param groups), the scheduler
(--sched lambda: a LambdaLR linear warmup of --warmup steps; onecycle: OneCycleLR over epochs x steps-per-epoch;
plateau: ReduceLROnPlateau on the validation loss), clip_grad_norm_(error_if_nonfinite=True) and an EMA of the weights
(--ema decay). Each step prints `rank R epoch E step S loss L lr X`; each epoch ends with a local eval (model and EMA
val loss, the program's finiteness check), an all_reduce of the val sums, `epoch E: val loss V ema V lr X` on rank 0.
--resume 1 first loads each rank's node-local checkpoint (model, optimizer, scheduler, EMA). Rank 0 saves last.pt,
then barrier, `rank R done`. --rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none        control: 2 epochs x 6 steps, two evals, `epoch 1: val loss ...` on rank 0, checkpoint, exit 0
  warmup0     every rank's config has warmup_steps 0: the LambdaLR warmup lambda divides by zero when the
              scheduler is built (ZeroDivisionError on every rank, before any step)
  onecycle    rank N's shard has 90 rows: its OneCycleLR total_steps (rows // bs per epoch) is 10 while its
              loader gives 12 batches: ValueError Tried to step 11 times ... total steps is 10 on rank N
  clipnan     (--ddp 0) rank N's shard has a corrupt row (1e20) in its third batch: the loss and gradients are
              inf and clip_grad_norm_(error_if_nonfinite=True) raises RuntimeError on rank N at step 2
  groups      --resume 1: rank N's config puts fc1's bias in the decay group (a config change): the optimizer's
              load_state_dict raises ValueError (a parameter group that doesn't match the size) on rank N
  plateaunan  rank N's val shard has a missing target exported as NaN: its local val loss is nan and the
              program's check before ReduceLROnPlateau raises FloatingPointError on rank N at epoch 0's eval
  lrenv       every rank reads the learning rate from TRAIN_LR without float(): the optimizer's constructor
              compares a str to a float, TypeError on every rank
  emadecay    rank N's config has ema_decay 99.5 (a percentage): its EMA weights blow up and the EMA val loss
              check raises FloatingPointError on rank N at an epoch's eval
  extrastep   rank N flushes a leftover accumulation at the end of epoch 0 with an extra optimizer step and
              gradient all_reduce, while the others all_reduce the val sums: sizes differ across ranks
  segv        rank N's fused optimizer extension dies with SIGSEGV at step 3
  schedkey    --resume 1: every rank's node-local checkpoint was written by the old trainer without the
              scheduler state: KeyError 'scheduler' on every rank
  stall       rank N's val loader blocks (a hung read) at epoch 0's eval: the others wait in the val all_reduce

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2): 12 steps per rank, epoch 1 val loss 3.86 / 3.66, every rank done.
  warmup0: ZeroDivisionError division by zero in LambdaLR's initial step on every rank (np3 tee, np5 loglevel).
  onecycle: ValueError Tried to step 11 times. The specified number of total steps is 10 on rank N at step 10.
  clipnan: RuntimeError total norm of order 2.0 ... non-finite on rank N at step 2; DETAIL: monitoredBarrier names N.
  groups: ValueError loaded state dict contains a parameter group that doesn't match ... on rank N (r2; r0).
  plateaunan: FloatingPointError rank N epoch 0: val loss nan / EMA val loss nan is not finite (r3; r2).
  lrenv: TypeError '<=' not supported between 'float' and 'str' on every rank; restart: connectFullMesh timeout.
  emadecay: epoch 0's all-reduced EMA val loss 7e29 (finite); FloatingPointError on rank N at epoch 1's eval.
  extrastep: gloo EnforceNotMet 164 vs 4 aborts rank 0 (SIGABRT, the Root Cause); rank N reset in allreduce_grads.
  segv: rank N SIGSEGV at step 3 after its backward, nothing printed; the others reset; exitcode -11 Root Cause.
  schedkey: KeyError 'scheduler' on every rank after the model and optimizer states load (np3 wrapper).
  stall: PG 12 s: the others time out (recv/send 12000ms) in epoch 0's val all_reduce; PG 300 s + timeout 60: 124.
"""
import argparse, copy, datetime, math, os, signal, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--bs", type=int, default=16)
p.add_argument("--opt", default="adamw")
p.add_argument("--sched", default="lambda")
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--clip", type=float, default=1.0)
p.add_argument("--ema", type=float, default=0.99)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault128_work/run")
a = p.parse_args()


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x))).squeeze(1)


def make_shard(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    w = torch.randn(8, generator=torch.Generator().manual_seed(3))
    n = 90 if faulty(rank, "onecycle") else 96  # the last shard of the split holds the remainder
    x = torch.randn(n + 32, 8, generator=g)
    y = x @ w + 0.1 * torch.randn(n + 32, generator=g)
    if faulty(rank, "clipnan"):
        x[2 * a.bs + 5, 3] = 1e20  # a corrupt row from this node's export (sensor overflow)
    if faulty(rank, "plateaunan"):
        y[n + 7] = float("nan")  # a missing target exported as NaN
    return x[:n], y[:n], x[n:], y[n:]


def param_groups(model, rank):
    no_decay = ["fc2.bias"] if faulty(rank, "groups") else ["fc1.bias", "fc2.bias"]  # configs/opt.yaml: no_decay
    decay = [prm for n, prm in model.named_parameters() if n not in no_decay]
    nod = [prm for n, prm in model.named_parameters() if n in no_decay]
    return [{"params": decay, "weight_decay": 0.01}, {"params": nod, "weight_decay": 0.0}]


def make_opt(params, lr):
    if a.opt == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98))


def make_sched(opt, warmup, total):
    if a.sched == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=total)
    if a.sched == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / warmup))


def stage_ckpt(rank: int, total: int):
    """Stands in for the node-local copy of the previous stage's checkpoint that the job's prolog copies."""
    node = os.path.join(a.work, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    torch.manual_seed(77)
    ref = Net()
    ref_opt = make_opt(param_groups(ref, -1), a.lr)
    ref_sched = make_sched(ref_opt, a.warmup, total)
    ck = {"model": ref.state_dict(), "optimizer": ref_opt.state_dict(), "scheduler": ref_sched.state_dict(),
          "ema": ref.state_dict(), "epoch": 4}
    if a.fault == "schedkey":
        del ck["scheduler"]  # written by trainer v1, which did not save the scheduler
    path = os.path.join(node, "stage1.pt")
    torch.save(ck, path)
    return path


def allreduce_grads(module, world):
    flat = torch.cat([prm.grad.flatten() for prm in module.parameters()])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for prm in module.parameters():
        prm.grad.copy_(flat[off:off + prm.numel()].view_as(prm))
        off += prm.numel()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr, xva, yva = make_shard(rank)
    steps_per_epoch = len(xtr) // a.bs  # assumes full batches
    total = a.epochs * steps_per_epoch
    warmup = 0 if faulty(rank, "warmup0") else a.warmup  # configs/opt.yaml: warmup_steps
    lr = os.environ.get("TRAIN_LR", a.lr) if faulty(rank, "lrenv") else a.lr
    ema_decay = 99.5 if faulty(rank, "emadecay") else a.ema  # configs/opt.yaml: ema_decay
    torch.manual_seed(0)
    model = Net()
    opt = make_opt(param_groups(model, rank), lr)
    sched = make_sched(opt, warmup, total)
    ema = copy.deepcopy(model)
    if a.resume:
        ck = torch.load(stage_ckpt(rank, total))
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        ema.load_state_dict(ck["ema"])
        print(f"rank {rank}: resumed from epoch {ck['epoch']} (lr {opt.param_groups[0]['lr']:.2e})", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    print(f"rank {rank}/{world} pid {os.getpid()}: {a.opt} {a.sched} lr {lr} warmup {warmup} total_steps {total} "
          f"train {len(xtr)} val {len(xva)} ema {ema_decay} ddp {a.ddp}", flush=True)
    gstep = 0
    for epoch in range(a.epochs):
        g = torch.Generator().manual_seed(epoch * 100 + rank)
        order = torch.randperm(len(xtr), generator=g) if epoch > 0 else torch.arange(len(xtr))
        for i in range(0, len(xtr), a.bs):
            idx = order[i:i + a.bs]
            loss = F.mse_loss(net(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            if faulty(rank, "segv") and gstep == 3:
                os.kill(os.getpid(), signal.SIGSEGV)  # the fused multi-tensor apply extension crashes
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip, error_if_nonfinite=True)
            if not a.ddp:
                allreduce_grads(model, world)
            opt.step()
            if a.sched != "plateau":
                sched.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.mul_(ema_decay).add_(pm, alpha=1 - ema_decay)
            print(f"rank {rank} epoch {epoch} step {gstep} loss {loss.item():.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e}", flush=True)
            gstep += 1
            time.sleep(0.05)
        if faulty(rank, "extrastep") and epoch == 0:
            loss = F.mse_loss(model(xtr[:a.bs]), ytr[:a.bs])  # flush the leftover accumulation window
            opt.zero_grad()
            loss.backward()
            allreduce_grads(model, world)
            opt.step()
        if faulty(rank, "stall") and epoch == 0:
            time.sleep(3600)  # the val loader's read from the hung mount never returns
        with torch.no_grad():
            val = F.mse_loss(model(xva), yva, reduction="sum")
            val_ema = F.mse_loss(ema(xva), yva, reduction="sum")
        local, local_ema = val.item() / len(xva), val_ema.item() / len(xva)
        if not math.isfinite(local) or not math.isfinite(local_ema):
            raise FloatingPointError(f"rank {rank} epoch {epoch}: val loss {local} / EMA val loss {local_ema} "
                                     f"is not finite")
        sums = torch.tensor([val.item(), val_ema.item(), float(len(xva))])
        dist.all_reduce(sums)
        mean_val, mean_ema = (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()
        if a.sched == "plateau":
            sched.step(mean_val)
        if rank == 0:
            print(f"epoch {epoch}: val loss {mean_val:.4f} ema {mean_ema:.4f} lr {opt.param_groups[0]['lr']:.2e}",
                  flush=True)
    if rank == 0:
        os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "ema": ema.state_dict(), "epoch": a.epochs}, os.path.join(a.work, "ckpt", "last.pt"))
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

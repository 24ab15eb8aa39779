"""A hundred-and-twenty-fifth hand-run batch: CHECKPOINTING AND RESUMING. A small regression MLP (Linear 8->32, ReLU,
Linear 32->32, ReLU, Linear 32->1) in DDP (--ddp 0: rank 0's weights broadcast, gradients all-reduced by hand) with
Adam and a StepLR scheduler, gloo, trained for --steps (6) steps, `rank R step S loss L`. Every --ckpt-every (2)
steps the job checkpoints: every rank all-reduces a replica checksum (per-parameter sums) to verify the replicas
agree, rank 0 writes the full state (model, scheduler, step, config, RNG) to <work>/ckpt/step_SSSS/model.pt, each
rank writes its own optimizer/RNG shard optim_rank{R}.pt (serialised to memory, written to a spool file under a
lock file, renamed), a barrier, then rank 0 repoints the `latest` symlink. --resume 1 first stages the previous
job's checkpoint (rank 0, as the job's prolog would have left it), each rank copies model.pt to its node-local cache
<work>/node{R}, then loads the newest checkpoint: model and scheduler from its cached model.pt, optimizer and RNG
from its own shard. --rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none        control: 6 steps, checkpoints at steps 2, 4, 6, `latest -> step_0006`, exit 0
  diskfull    rank N's spool for the shard is a full local disk (/dev/full): OSError No space left on device
              while writing its shard at the step-2 checkpoint
  dangling    --resume 1: `latest` points at step_0006, which another run's cleanup deleted: FileNotFoundError
              on every rank when the resume copies the checkpoint
  truncated   --resume 1: rank N's node-local copy of model.pt was cut short by a killed copy: torch.load fails
              (OSError Invalid argument from the zip reader) on rank N
  worldsize   --resume 1: the previous job ran with one rank fewer, so the last rank's optimizer shard does not
              exist: FileNotFoundError for optim_rank{W-1}.pt on the last rank (--rank is ignored)
  optmismatch --resume 1: rank N's optimizer shard was written by the 2-layer probe model: ValueError from
              Adam's load_state_dict (parameter group size) on rank N
  weightsonly --resume 1: the previous job pickled its RunConfig dataclass into model.pt; torch.load's default
              weights_only=True refuses it: UnpicklingError Weights only load failed, on every rank
  nanloss     rank N's data shard has a corrupt record (inf) in its step-3 batch; the program's finiteness check
              raises FloatingPointError on rank N
  lockhang    rank N finds a stale lock file of a killed job beside its shard at the step-2 checkpoint and waits
              for it; the others wait in the checkpoint barrier (gloo timeout)
  sigkill     rank N is SIGKILLed (the node's OOM killer) half-way through writing its shard at step 4
  statsize    rank N's config also verifies the gradient sums: its replica checksum has 12 entries against 6;
              the checksum all_reduce at the step-2 checkpoint differs in size across ranks

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2): 6 steps per rank, checkpoints saved at steps 2, 4, 6, every rank done.
  diskfull: OSError [Errno 28] No space left on device on rank N at the step-2 checkpoint (np4 r2 tee, np3 r1).
  dangling: FileNotFoundError .../ckpt/step_0006/model.pt on every rank in resume() (np3 plain, np4 wrapper).
  truncated: OSError [Errno 22] Invalid argument from torch.load's PyTorchFileReader on rank N (r1; r3).
  worldsize: FileNotFoundError .../step_0004/optim_rank{W-1}.pt on the last rank (np4 r3, np3 r2 filtered).
  optmismatch: ValueError ... parameter group that doesn't match the size ... on rank N (r2; r1 redirects).
  weightsonly: UnpicklingError Weights only load failed (__main__.RunConfig) on every rank; restart: connectFullMesh.
  nanloss: FloatingPointError rank N step 3: loss nan is not finite (np4 r1, np3 r2).
  lockhang: PG 12 s: the others time out (12000ms) in the checkpoint barrier; PG 300 s + timeout 60: exit 124.
  sigkill: rank 3 SIGKILLed at the step-4 shard write, nothing printed; Root Cause exitcode -9; peers reset.
  statsize: plain: EnforceNotMet 8 vs 4 aborts rank 0 (SIGABRT); DETAIL --ddp 0: ALLREDUCE [12] vs [6] mismatch.
"""
import argparse, dataclasses, datetime, io, os, shutil, signal, time
import torch, torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--ckpt-every", type=int, default=2)
p.add_argument("--bs", type=int, default=32)
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault125_work/run")
a = p.parse_args()


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


@dataclasses.dataclass
class RunConfig:
    lr: float = 0.01
    hidden: int = 32
    ckpt_every: int = 2
    verify_grads: bool = False


class Net(nn.Module):
    def __init__(self, hidden: int = 32, depth: int = 3):
        super().__init__()
        layers, d = [], 8
        for _ in range(depth - 1):
            layers += [nn.Linear(d, hidden), nn.ReLU()]
            d = hidden
        layers.append(nn.Linear(d, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x).squeeze(1)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(a.bs, 8, generator=g)
    y = x[:, :4].sum(1) - 0.5 * x[:, 4:].sum(1) + 0.1 * torch.randn(a.bs, generator=g)
    if faulty(rank, "nanloss") and step == 3:
        x[7, 2] = float("inf")  # record 7 of this shard's file was corrupted on export
    return x, y


def write_atomic(obj, path: str, spool: str):
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(spool, "wb") as f:
        f.write(data[: len(data) // 2])
        if faulty(dist.get_rank(), "sigkill") and path.endswith("step_0004/optim_rank%d.pt" % dist.get_rank()):
            os.kill(os.getpid(), signal.SIGKILL)  # the node's OOM killer picks this process
        f.write(data[len(data) // 2:])
        f.flush()
        os.fsync(f.fileno())
    os.replace(spool, path)


def take_lock(lock: str, rank: int):
    said = False
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return
        except FileExistsError:
            if not said:
                print(f"rank {rank}: {lock} is held, waiting", flush=True)
                said = True
            time.sleep(1.0)


def save_checkpoint(rank, world, step, model, opt, sched, cfg):
    params = [p for p in model.parameters()]
    sums = [p.detach().sum() for p in params]
    if cfg.verify_grads:
        sums += [p.grad.detach().sum() for p in params]
    check = torch.stack(sums)
    dist.all_reduce(check)
    d = os.path.join(a.work, "ckpt", f"step_{step:04d}")
    os.makedirs(d, exist_ok=True)
    if rank == 0:
        state = {"model": (model.module if a.ddp else model).state_dict(), "sched": sched.state_dict(),
                 "step": step, "config": dataclasses.asdict(cfg), "rng": torch.get_rng_state()}
        write_atomic(state, os.path.join(d, "model.pt"), os.path.join(d, "model.pt.tmp"))
    shard = os.path.join(d, f"optim_rank{rank}.pt")
    lock = shard + ".lock"
    if faulty(rank, "lockhang") and step == 2:
        with open(lock, "w") as f:
            f.write("31337\n")  # left behind by the killed job 4182 that wrote into the same directory
    take_lock(lock, rank)
    spool = "/dev/full" if faulty(rank, "diskfull") else shard + ".tmp"
    write_atomic({"optim": opt.state_dict(), "rng": torch.get_rng_state(), "step": step}, shard, spool)
    os.remove(lock)
    dist.barrier()
    if rank == 0:
        link = os.path.join(a.work, "ckpt", "latest")
        tmp = link + ".new"
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(f"step_{step:04d}", tmp)
        os.replace(tmp, link)
        print(f"saved checkpoint step {step} -> {d} (checksum {check.sum().item():.4f})", flush=True)


def stage_previous(world: int):
    """Stands in for the previous job's checkpoint directory, as that job left it."""
    root = os.path.join(a.work, "ckpt")
    shutil.rmtree(root, ignore_errors=True)
    d = os.path.join(root, "step_0004")
    os.makedirs(d)
    torch.manual_seed(4)
    m, cfg = Net(), RunConfig()
    opt = torch.optim.Adam(m.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    sched.step()
    conf = cfg if a.fault == "weightsonly" else dataclasses.asdict(cfg)  # export_v1.py pickled the object itself
    torch.save({"model": m.state_dict(), "sched": sched.state_dict(), "step": 4, "config": conf,
                "rng": torch.get_rng_state()}, os.path.join(d, "model.pt"))
    prev_world = world - 1 if a.fault == "worldsize" else world
    for r in range(prev_world):
        o = opt
        if faulty(r, "optmismatch"):
            probe = Net(depth=2)
            o = torch.optim.Adam(probe.parameters(), lr=cfg.lr)
            probe(torch.randn(4, 8)).sum().backward()
            o.step()
        torch.save({"optim": o.state_dict(), "rng": torch.get_rng_state(), "step": 4}, os.path.join(d, f"optim_rank{r}.pt"))
    latest = "step_0006" if a.fault == "dangling" else "step_0004"
    if a.fault == "dangling":
        shutil.copytree(d, os.path.join(root, "step_0006"))
    os.symlink(latest, os.path.join(root, "latest"))
    if a.fault == "dangling":
        shutil.rmtree(os.path.join(root, "step_0006"))  # the other run's keep-last-1 cleanup


def resume(rank, model, opt, sched):
    latest = os.path.join(a.work, "ckpt", "latest")
    d = os.path.join(a.work, "ckpt", os.readlink(latest))
    node = os.path.join(a.work, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    cached = os.path.join(node, "model.pt")
    shutil.copyfile(os.path.join(d, "model.pt"), cached)
    if faulty(rank, "truncated"):
        with open(cached, "r+b") as f:
            f.truncate(os.path.getsize(cached) // 3)  # the copy was killed part-way by the prolog's timeout
    state = torch.load(cached)
    (model.module if a.ddp else model).load_state_dict(state["model"])
    sched.load_state_dict(state["sched"])
    shard = torch.load(os.path.join(d, f"optim_rank{rank}.pt"))
    opt.load_state_dict(shard["optim"])
    torch.set_rng_state(shard["rng"])
    print(f"rank {rank}: resumed from {d} at step {state['step']} (lr {sched.get_last_lr()[0]:.4g})", flush=True)
    return state["step"]


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = RunConfig(lr=a.lr, ckpt_every=a.ckpt_every, verify_grads=faulty(rank, "statsize"))
    torch.manual_seed(0)
    net = Net(cfg.hidden)
    if a.ddp:
        model = DDP(net)
    else:
        model = net
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    print(f"rank {rank}/{world}: {sum(q.numel() for q in net.parameters())} params, ckpt every {cfg.ckpt_every}", flush=True)
    start = 0
    if a.resume:
        if rank == 0:
            stage_previous(world)
        dist.barrier()
        start = resume(rank, model, opt, sched)
    for step in range(start, start + a.steps):
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss {loss.item()} is not finite")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        sched.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if (step + 1) % cfg.ckpt_every == 0:
            save_checkpoint(rank, world, step + 1, model, opt, sched, cfg)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

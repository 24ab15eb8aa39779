"""A forty-seventh hand-run batch: HOW PEOPLE PASTE a failed run into an issue tracker. The loop is a small DDP loop
on gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, `--steps` steps (default 8), PG timeout 15 s) printing one
progress line per step (`rank R step S/N loss L mean M`). ONE plain fault per run on rank --rank at step --step
(default 3). The console is captured whole (`<slug>.full.txt`) and then cut the way a user pastes it into an issue by
fault47_paste.py (one paste habit per run, recorded in the provenance).

Faults (on --rank at --step):
  exc      ValueError: label value 7 out of range [0, 4) in the rank's batch (the script's own check)
  shape    the rank's batch has 9 features: RuntimeError mat1 and mat2 shapes cannot be multiplied
  nan      the rank's loss becomes NaN; the script's check raises FloatingPointError
  nockpt   the rank resumes from a checkpoint path that does not exist: FileNotFoundError in torch.load
  osexit   os._exit(3) with no word
  segv     ctypes.string_at(0): SIGSEGV
  hang     the rank sleeps 120 s before its forward (a stuck read); the others time out in the gradient all-reduce
  keyall   every rank looks up its batch's 'labels' key (the shards hold 'y'): KeyError: 'labels' on all ranks
  none     control: no fault (--warn adds real warnings)
A port already in use is a launcher fault: the run's --master-port is held by another process (see the provenance).
"""
import argparse, ctypes, datetime, os, time, warnings

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--step", type=int, default=3)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--warn", action="store_true")
p.add_argument("--workdir", default="/tmp/fault47")
a = p.parse_args()

import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BATCH = 16


def say(msg: str) -> None:
    print(f"rank {RANK} {msg}", flush=True)


def shard_dir() -> str:
    return os.path.join(a.workdir, "data", f"split{WORLD}")


def make_shards() -> None:
    d = shard_dir()
    os.makedirs(d, exist_ok=True)
    for k in range(WORLD):
        path = os.path.join(d, f"shard-{k:05d}.pt")
        if not os.path.exists(path):
            g = torch.Generator().manual_seed(k)
            n = BATCH * 16
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save({"x": torch.randn(n, 8, generator=g), "y": torch.randint(0, 4, (n,), generator=g)}, tmp)
            os.replace(tmp, path)


def real_warnings(opt) -> None:
    t = torch.ones(3)
    _ = torch.tensor(t)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    sched.step()
    _ = F.softmax(torch.randn(2, 3))


def main() -> None:
    f, here = a.fault, RANK == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    if RANK == 0:
        print(f"world_size={WORLD} backend=gloo torch={torch.__version__}", flush=True)
        make_shards()
    dist.barrier()
    shard = os.path.join(shard_dir(), f"shard-{RANK:05d}.pt")
    data = torch.load(shard)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if a.warn:
        real_warnings(opt)
    if f == "nockpt" and here:
        ck = os.path.join(a.workdir, "ckpt", f"step-000{a.step}", f"rank{RANK}.pt")
        say(f"resuming from {ck}")
    for step in range(1, a.steps + 1):
        batch = {"x": data["x"][(step - 1) * BATCH: step * BATCH].clone(),
                 "y": data["y"][(step - 1) * BATCH: step * BATCH].clone()}
        x = batch["x"]
        y = batch["labels"] if f == "keyall" and step == a.step else batch["y"]
        if here and step == a.step:
            if f == "exc":
                y[5] = 7
                bad = int((y >= 4).sum())
                if bad:
                    raise ValueError(f"label value {int(y.max())} out of range [0, 4) in {bad} sample(s) of {shard}")
            elif f == "shape":
                x = torch.cat([x, torch.zeros(BATCH, 1)], dim=1)
            elif f == "osexit":
                os._exit(3)
            elif f == "segv":
                ctypes.string_at(0)
            elif f == "hang":
                time.sleep(120)
            elif f == "nockpt":
                state = torch.load(ck)
                model.load_state_dict(state)
        out = net(x)
        loss = F.cross_entropy(out, y)
        if here and step == a.step and f == "nan":
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        m = torch.tensor([loss.item(), float(step)])
        dist.all_reduce(m)
        say(f"step {step}/{a.steps} loss {loss.item():.4f} mean {m[0].item() / WORLD:.4f}")
        time.sleep(0.05)
    dist.barrier()
    if RANK == 0:
        print("training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

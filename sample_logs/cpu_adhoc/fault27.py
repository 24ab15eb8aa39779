"""A twenty-seventh hand-run batch: plain faults on one rank of 4-12, run on 2 or 3 emulated nodes (one torchrun agent
per node, c10d rendezvous, see fault27_nodes.py) whose consoles are captured each in its own file, as a cluster job
script's `> node$SLURM_NODEID.log 2>&1`, a Kubernetes pod's log or an ssh session would keep them.

Run: --fault NAME --rank N (the faulty global rank). Every rank prints `rank R step S loss L` lines (and, at start,
its local rank and node), trains a small DDP model over a DataLoader of synthetic CSV-like rows and checks its loss.
Faults (at step 3 unless said):
  data_keyerror    an unlabelled row in the rank's step-3 batch: KeyError: 'label' in the Dataset
  data_valueerror  a numeric field written as 'n/a': ValueError: could not convert string to float
  data_stack       a row with 9 features: RuntimeError: stack expects each tensor to be equal size (default_collate)
  skip_allreduce   after the loop the others all-reduce an eval metric the rank skips; it waits in the closing barrier
  segv             ctypes.string_at(0) (a native kernel reading NULL): SIGSEGV
  abort            os.abort() (a native library's failed check): SIGABRT
  nan_check        a NaN feature; the script's own check raises FloatingPointError: loss is nan at step 3
  memerr           a 32 TiB bytearray prefetch buffer: bare MemoryError
  load_size        every rank reloads its own EMA copy saved at step 2; the rank's file is from a hidden=32 model
  barrier_sleep    the rank sleeps 3 x the PG timeout before the barrier every rank calls at step 3
  sigkill_self     the rank SIGKILLs itself (os.kill(os.getpid(), SIGKILL))"""
import argparse, ctypes, datetime, os, signal, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=5)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
BATCH = 8
CKDIR = "/tmp/fault27_ckpt"


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


class Rows(torch.utils.data.Dataset):
    """Synthetic CSV-like rows (8 numeric fields and a label); the faulty rank's shard has one bad row in step 3's
    batch for the data faults."""

    def __init__(self, rank: int, hit: bool, n: int):
        self.rank, self.hit, self.n = rank, hit, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        fields = [f"{v:.4f}" for v in torch.randn(8, generator=g).tolist()]
        row = {"fields": fields, "label": int(torch.randint(0, 4, (1,), generator=g))}
        bad = self.hit and i == 2 * BATCH + 5  # a row of step 3's batch
        if bad and a.fault == "data_valueerror":
            fields[3] = "n/a"  # a missing value the exporter wrote as text
        if bad and a.fault == "data_keyerror":
            del row["label"]  # an unlabelled row left in the shard
        if bad and a.fault == "data_stack":
            fields.append("0.0000")  # a row from the newer export with a ninth column
        x = torch.tensor([float(f) for f in fields])
        if bad and a.fault == "nan_check":
            x[2] = float("nan")
        return {"x": x, "y": row["label"]}


def make_model(hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    say(rank, f"local_rank {os.environ.get('LOCAL_RANK')} node {os.environ.get('GROUP_RANK')} world {world}")
    torch.manual_seed(0)
    net = make_model()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Rows(rank, hit, BATCH * a.steps), batch_size=BATCH)
    os.makedirs(CKDIR, exist_ok=True)
    for step, batch in enumerate(loader, start=1):
        x, y = batch["x"], batch["y"]
        if step == 3 and a.fault == "load_size":  # every rank reloads its own EMA copy saved at step 2
            path = f"{CKDIR}/ema_rank{rank}.pt"
            if hit:  # stale file from a run with hidden=32
                torch.save(make_model(32).state_dict(), path)
            say(rank, f"loading EMA weights from {path}")
            net.load_state_dict(torch.load(path))
        if hit and step == 3:
            if a.fault == "segv":
                say(rank, "calling fused augmentation kernel")
                ctypes.string_at(0)
            elif a.fault == "abort":
                say(rank, "calling fused augmentation kernel")
                os.abort()
            elif a.fault == "memerr":
                say(rank, "allocating prefetch buffer")
                buf = bytearray(32 * 1024 ** 4)
                buf[0] = 1
            elif a.fault == "sigkill_self":
                say(rank, "refreshing shard index")
                os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}, stopping")
        loss.backward()
        opt.step()
        if step == 2 and a.fault == "load_size":
            torch.save(net.state_dict(), f"{CKDIR}/ema_rank{rank}.pt")
        if step == 3 and a.fault == "barrier_sleep":  # barrier before the checkpoint; this rank is copying files
            if hit:
                say(rank, "syncing shard cache to shared storage before checkpoint")
                time.sleep(3 * a.pg_timeout)
            dist.barrier()
        say(rank, f"step {step} loss {loss.item():.4f}")
    if a.fault == "skip_allreduce" and not hit:  # final eval metric; the faulty rank has no eval shard and skips it
        metric = torch.tensor([1.0])
        dist.all_reduce(metric)
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    main()

"""A twenty-sixth hand-run batch: plain faults on one rank of 8-16, run with the verbose diagnostic settings users
turn on when they re-run a failed job (TORCH_CPP_LOG_LEVEL=INFO, TORCH_DISTRIBUTED_DEBUG=INFO|DETAIL,
TORCH_SHOW_CPP_STACKTRACES=1, LOGLEVEL=INFO|DEBUG, PYTHONFAULTHANDLER=1, PYTHONWARNINGS=always, PYTHONDEVMODE=1,
TORCH_LOGS=+distributed, NCCL_DEBUG=INFO), under plain torchrun, --tee 3, --role, --local-ranks-filter,
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, --redirects 3 --log-dir, the two-node srun/pdsh wrappers of fault22_nodes.py
and Open MPI's mpirun --tag-output.

Run: --fault NAME --rank N (the faulty rank). Under mpirun, RANK/WORLD_SIZE/LOCAL_RANK come from OMPI_COMM_WORLD_*.
--sync ddp (default) wraps the model in DDP; --sync manual all-reduces the gradients by hand (DDP under
TORCH_DISTRIBUTED_DEBUG=DETAIL crashed every rank on this build in earlier batches, so DETAIL runs use manual).
Faults: data_valueerror, data_keyerror, data_indexerror (in the Dataset, step 3's batch), skip_allreduce,
        segv, abort, nan_check, memerr, load_size, shape_detail, barrier_sleep."""
import argparse, ctypes, datetime, math, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=7)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--sync", choices=["ddp", "manual"], default="ddp")
p.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
a = p.parse_args()
BATCH = 8
CKDIR = "/tmp/fault26_ckpt"
VOCAB = ["<pad>", "the", "a", "of", "to", "and", "in", "is"]


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


class Rows(torch.utils.data.Dataset):
    """Synthetic CSV-like rows (8 numeric fields, a label, a token); the faulty rank's shard has one bad row
    in step 3's batch for the data faults."""

    def __init__(self, rank: int, hit: bool, n: int):
        self.rank, self.hit, self.n = rank, hit, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        fields = [f"{v:.4f}" for v in torch.randn(8, generator=g).tolist()]
        row = {"fields": fields, "label": int(torch.randint(0, 4, (1,), generator=g)), "tok": i % len(VOCAB)}
        bad = self.hit and i == 2 * BATCH + 3  # a row of step 3's batch
        if bad and a.fault == "data_valueerror":
            fields[6] = "n/a"  # a missing value the exporter wrote as text
        if bad and a.fault == "data_keyerror":
            del row["label"]  # an unlabelled row left in the shard
        if bad and a.fault == "data_indexerror":
            row["tok"] = 8  # a token id from a newer, larger vocabulary
        x = torch.tensor([float(f) for f in fields])
        if bad and a.fault == "nan_check":
            x[2] = float("nan")
        _ = VOCAB[row["tok"]]
        return {"x": x, "y": row["label"]}


def make_model(hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


@record
def main() -> None:
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    say(rank, f"world {world} sync {a.sync} building model")
    torch.manual_seed(0)
    net = make_model()
    model = nn.parallel.DistributedDataParallel(net) if a.sync == "ddp" else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Rows(rank, hit, BATCH * a.steps), batch_size=BATCH, num_workers=a.workers)
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
            if a.fault == "segv":  # a native extension reading through a NULL pointer
                say(rank, "calling fused augmentation kernel")
                ctypes.string_at(0)
            elif a.fault == "abort":  # a native library's failed check
                say(rank, "calling fused augmentation kernel")
                os.abort()
            elif a.fault == "memerr":  # a replay buffer sized in bytes instead of entries
                say(rank, "allocating replay buffer")
                buf = bytearray(32 * 1024 ** 4)
                buf[0] = 1
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if torch.isnan(loss):
            raise RuntimeError(f"NaN loss detected at step {step} (rank {rank}), stopping")
        loss.backward()
        if a.sync == "manual":
            for prm in net.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        if step == 2 and a.fault == "load_size":
            torch.save(net.state_dict(), f"{CKDIR}/ema_rank{rank}.pt")
        if step == 3 and a.fault == "shape_detail":  # eval metric sync; this rank counts one more class
            metric = torch.tensor([loss.item(), float(BATCH)] + ([0.0] if hit else []))
            dist.all_reduce(metric)
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

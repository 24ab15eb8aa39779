"""A twenty-fifth hand-run batch: the plain fault kinds a real training script meets (NaN/Inf, DDP unused
parameters, stale per-rank checkpoints, weights_only loads, native crashes, a host-memory stand-in, a bad
sample, a collective timeout in evaluate()), with the fault on one rank, written in the script styles the
earlier batches used little: Python logging with %(asctime)s, a tqdm bar on rank 0, anomaly detection, bf16
autocast on CPU, torch.amp.GradScaler, DistributedSampler and an evaluate() phase.

Run: --fault NAME --rank N (the faulty rank). Under mpirun, RANK/WORLD_SIZE/LOCAL_RANK come from OMPI_COMM_WORLD_*.
Faults: anomaly_nan, clip_inf, unused_branch, load_keys, load_size, weights_only, segv, abort, sigbus, memerr,
        data_keyerror, data_valueerror, eval_sleep."""
import argparse, ctypes, dataclasses, datetime, logging, math, mmap, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--steps", type=int, default=4, help="steps per epoch")
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU")
p.add_argument("--scaler", action="store_true", help="torch.amp.GradScaler('cpu')")
p.add_argument("--anomaly", action="store_true", help="torch.autograd.set_detect_anomaly(True)")
p.add_argument("--rankfmt", action="store_true", help="put the rank into the logging format")
a = p.parse_args()
BATCH = 8
CKDIR = "/tmp/fault25_ckpt"
LABELS = {"cat": 0, "dog": 1, "bird": 2, "fish": 3}
log = logging.getLogger("train")


@dataclasses.dataclass
class TrainState:  # what an older version of the trainer pickled into its per-rank state file
    epoch: int
    step: int
    best_metric: float


class Records(torch.utils.data.Dataset):
    """Synthetic records {"feat", "label"}; the faulty rank's shard holds one bad record for some faults."""

    def __init__(self, n: int, bad_index: int = -1):
        self.n, self.bad = n, bad_index

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        label = list(LABELS)[int(torch.randint(0, 4, (1,), generator=g))]
        if i == self.bad:
            if a.fault == "data_keyerror":
                label = "unk"  # an annotation tool's placeholder left in the shard
            elif a.fault == "data_valueerror":
                raise ValueError(f"record {i}: feature vector has 7 values, expected 8")
            elif a.fault in ("anomaly_nan",):
                x = x.clone()
                x[3] = float("nan")
            elif a.fault == "clip_inf":
                x = x.clone()
                x[5] = float("inf")
        return {"feat": x, "label": LABELS[label]}


class Net(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 4)
        self.aux = nn.Linear(hidden, 1)  # auxiliary regression head, used when the batch carries aux targets

    def forward(self, x, use_aux=True):
        h = self.body(x)
        out = self.head(h)
        if use_aux:
            out = out + 0.0 * self.aux(h)
        return out


def native_fault(kind: str) -> None:
    if kind == "segv":  # a C extension reading through a NULL pointer
        ctypes.string_at(0)
    elif kind == "abort":  # a native library's failed assertion
        os.abort()
    elif kind == "sigbus":  # a memory-mapped feature cache that another process truncated
        path = f"{CKDIR}/feature_cache_rank{int(os.environ['RANK'])}.bin"
        with open(path, "wb") as f:
            f.write(b"\0" * (1 << 20))
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, 1 << 20)
        os.truncate(path, 0)
        log.info("reading feature cache %s", path)
        _ = mm[4096 * 10]


def evaluate(model, rank: int, hit: bool, epoch: int) -> float:
    model.eval()
    correct = torch.zeros(2)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(100 + i))
            pred = model(x).argmax(1)
            correct += torch.tensor([float((pred == 0).sum()), float(BATCH)])
    if hit and a.fault == "eval_sleep":  # this rank's eval shard sits on a slow network mount
        log.info("evaluating on eval shard 2 of 8")
        time.sleep(3 * a.pg_timeout)
    if hit and a.fault == "memerr":  # a confusion buffer sized from the vocabulary in bytes, not entries
        log.info("building confusion matrix buffer")
        buf = bytearray(32 * 1024 ** 4)
        buf[0] = 1
    dist.all_reduce(correct)
    model.train()
    return float(correct[0] / correct[1])


@record
def main() -> None:
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    fmt = f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s" if a.rankfmt else \
        "%(asctime)s - %(name)s - %(levelname)s - %(message)s"
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format=fmt)
    if a.anomaly:
        torch.autograd.set_detect_anomaly(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    log.info("initialized process group: rank %d of %d", rank, world)
    os.makedirs(CKDIR, exist_ok=True)
    torch.manual_seed(0)
    net = Net()
    # resume: every rank keeps its own copy of the last weights and a small trainer-state file
    wpath, spath = f"{CKDIR}/weights_rank{rank}.pt", f"{CKDIR}/state_rank{rank}.pt"
    if a.fault in ("load_keys", "load_size", "weights_only"):
        torch.save(net.state_dict(), wpath)
        torch.save({"epoch": 0, "step": 0, "best_metric": 0.0}, spath)
        if hit and a.fault == "load_keys":  # stale file from the version before the heads were split
            old = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            torch.save(old.state_dict(), wpath)
        if hit and a.fault == "load_size":  # stale file from a run with hidden=32
            torch.save(Net(hidden=32).state_dict(), wpath)
        if hit and a.fault == "weights_only":  # written by the older trainer, which pickled its dataclass
            torch.save({"state": TrainState(epoch=0, step=0, best_metric=0.0)}, spath)
        log.info("resuming from %s", wpath)
        net.load_state_dict(torch.load(wpath, weights_only=True))
        st = torch.load(spath, weights_only=True)
        log.info("resumed trainer state %s", st)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=a.scaler)
    n = BATCH * a.steps * world
    # the bad record lands in the faulty rank's shard at its third batch of epoch 0 (sampler: indices rank::world)
    bad = (2 * BATCH + 3) * world + a.rank
    ds = Records(n, bad_index=bad)
    sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler)
    gstep = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        bar = tqdm(loader, desc=f"epoch {epoch}", disable=rank != 0, file=sys.stderr)
        for batch in bar:
            gstep += 1
            if hit and gstep == 3 and a.fault in ("segv", "abort", "sigbus"):
                native_fault(a.fault)
            # a branch one rank takes: its step-2 batch carries no aux targets, so the aux head is skipped
            use_aux = not (hit and a.fault == "unused_branch" and gstep == 2)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
                out = model(batch["feat"], use_aux=use_aux)
                loss = F.cross_entropy(out.float(), batch["label"])
            log.info("epoch %d step %d loss %.4f", epoch, gstep, loss.item())
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=(a.fault == "clip_inf"))
            scaler.step(opt)
            scaler.update()
            if rank == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}", gnorm=f"{float(gn):.2f}")
            time.sleep(0.05)
        acc = evaluate(model, rank, hit, epoch)
        log.info("epoch %d eval acc %.3f", epoch, acc)
    dist.barrier()
    dist.destroy_process_group()
    log.info("done")


if __name__ == "__main__":
    main()

"""A forty-first hand-run batch: the SCHEDULER and MPI forms, with ONE plain fault on ONE rank, mostly over two
emulated nodes (fault22_nodes.py --style srun / pdsh). A small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4),
5 steps, batch 16 of a synthetic shard), PG timeout 15 s. The rank and world come from RANK/WORLD_SIZE (torchrun) or
OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (mpirun, with MASTER_ADDR/MASTER_PORT set by hand).

--fault NAME on rank --rank N at step --step S (default 3):
  key        the step's batch dict lacks 'y' (shard written with 'labels'): KeyError: 'y'
  value      a CSV-like sample with 'n/a': ValueError: could not convert string to float
  index      a label remap table one entry short: IndexError: list index out of range
  attr       the step's batch is an [x, y] list, not the dict: AttributeError: 'list' object has no attribute 'items'
  assert     a shape check on the batch: AssertionError
  zerodiv    the per-step token rate over an empty mask: ZeroDivisionError
  nofile     the step's shard file is opened from a path that is not there: FileNotFoundError
  dataerr    a custom `class DataError(Exception)` raised by the shard reader
  ckmissing  the EMA copy reloaded with load_state_dict (strict) lacks the last layer: Missing key(s)
  cksize     the EMA copy comes from a hidden=32 model: size mismatch
  weightsonly the reload state holds a custom object; torch.load(weights_only=True): UnpicklingError
  memerr     a 32 TiB bytearray prefetch buffer: MemoryError
  rlimit     the rank caps its address space (RLIMIT_AS, current size + 512 MiB, as a container or `ulimit -v` would)
             and then builds a feature cache of 64 MiB tensors until torch's allocator fails (DefaultCPUAllocator)
  segv       ctypes.string_at(0): a real NULL read (SIGSEGV)
  abort|bus|kill  os.kill(os.getpid(), SIGABRT|SIGBUS|SIGKILL)
  nan        the step's batch holds a NaN feature; the loss check raises FloatingPointError
  nanrt      same, raising RuntimeError("loss is nan ...")
  anomaly    torch.autograd.set_detect_anomaly(True) and a sqrt of a negative in the loss (NaN in backward)
  sleep      the rank sleeps 45 s at the step (a stuck NFS read); the others time out in DDP's all-reduce
  unused     find_unused_parameters=False; the aux head is skipped on rank N from the step on
  params     rank N builds the model with an extra bias-free layer (a different parameter count)
  none       a control: no fault
--fmt: progress line format: bracket ("[Rank R] step S/T loss L"), logging ("TIME rank=R INFO step S loss L"),
  kv ("step=S rank=R loss=L"), plain ("step S: loss L" with no rank at all), tqdm (a tqdm bar per rank on stderr)
--handle: none (uncaught: torch's [rankR]: excepthook prefix), log (logger.exception("...") with a rank=R
  format then sys.exit(1): an unprefixed traceback whose only rank sign is the logging line)
"""
import argparse, ctypes, datetime, logging, math, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--step", type=int, default=3)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--fmt", default="bracket", choices=["bracket", "logging", "kv", "plain", "tqdm"])
p.add_argument("--handle", default="none", choices=["none", "log"])
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--workdir", default="/tmp/fault41/work")
a = p.parse_args()
BATCH = 16
RANK = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
WORLD = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
LOCAL = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
BAD = RANK == a.rank

log = logging.getLogger("train")
if a.fmt == "logging" or a.handle == "log":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s rank={RANK} %(levelname)s %(name)s: %(message)s")


class DataError(Exception):
    """Raised by the shard reader on a malformed record."""


class TrainState:
    def __init__(self, step):
        self.step = step


def progress(step: int, loss: float) -> None:
    if a.fmt == "bracket":
        print(f"[Rank {RANK}] step {step}/{a.steps} loss {loss:.4f}", flush=True)
    elif a.fmt == "logging":
        log.info("step %d loss %.4f", step, loss)
    elif a.fmt == "kv":
        print(f"step={step} rank={RANK} loss={loss:.4f} lr=0.1", flush=True)
    elif a.fmt == "plain":
        print(f"step {step}: loss {loss:.4f}", flush=True)


def note(msg: str) -> None:
    if a.fmt == "logging":
        log.info(msg)
    elif a.fmt == "plain":
        print(msg, flush=True)
    elif a.fmt == "kv":
        print(f"rank={RANK} msg={msg!r}", flush=True)
    else:
        print(f"[Rank {RANK}] {msg}", flush=True)


class Shard(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * RANK + i)
        x, y = torch.randn(8, generator=g), int(torch.randint(0, 4, (1,), generator=g))
        here = BAD and (a.step - 1) * BATCH <= i < a.step * BATCH
        f = a.fault
        if here and f == "key":
            return {"x": x, "labels": y}
        if here and f == "value" and i == (a.step - 1) * BATCH + 5:
            row = ["0.31"] * 7 + ["n/a"]
            x = torch.tensor([float(v) for v in row])
        if here and f == "index" and i == (a.step - 1) * BATCH + 2:
            remap = [0, 1, 2]  # the label remap table of a 3-class export
            y = remap[3]
        if here and f == "dataerr" and i == (a.step - 1) * BATCH + 9:
            raise DataError(f"record {i} of shard {RANK}: 7 features, expected 8 (truncated line)")
        if here and f in ("nan", "nanrt") and i == (a.step - 1) * BATCH + 4:
            x = x.clone()
            x[2] = float("nan")
        return {"x": x, "y": y}


def build(extra: bool, hidden: int = 16) -> nn.Module:
    layers = [nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4)]
    if extra:
        layers.append(nn.Linear(4, 4, bias=False))
    return nn.Sequential(*layers)


class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = build(False)
        self.aux = nn.Linear(4, 4)

    def forward(self, x, use_aux=True):
        h = self.body(x)
        return self.aux(h) if use_aux else h


def train() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    note(f"rank {RANK}/{WORLD} local_rank {LOCAL} node {os.environ.get('GROUP_RANK', '0')} pid {os.getpid()} building model")
    torch.manual_seed(0)
    if a.fault == "unused":
        net = WithAux()
    else:
        net = build(a.fault == "params" and BAD)
    model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    os.makedirs(a.workdir, exist_ok=True)
    ema_path = f"{a.workdir}/ema_rank{RANK}.pt"
    if BAD and a.fault == "ckmissing":
        sd = net.state_dict()
        sd.pop("2.weight"), sd.pop("2.bias")
        torch.save(sd, ema_path)
    if BAD and a.fault == "cksize":
        torch.save(build(False, hidden=32).state_dict(), ema_path)
    if BAD and a.fault == "weightsonly":
        torch.save({"model": net.state_dict(), "state": TrainState(0)}, ema_path)
    loader = torch.utils.data.DataLoader(Shard(BATCH * a.steps), batch_size=BATCH)
    bar = None
    if a.fmt == "tqdm":
        from tqdm import tqdm
        bar = tqdm(total=a.steps, desc=f"rank{RANK}", file=sys.stderr, mininterval=0, ascii=False)
    if a.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    for step, batch in enumerate(loader, start=1):
        here = BAD and step == a.step
        if here and a.fault == "attr":
            batch = [batch["x"], batch["y"]]  # the step's batch came through the legacy (x, y) collate
        batch = {k: v for k, v in batch.items()}
        if here and a.fault == "nofile":
            path = f"{a.workdir}/shards/part-{RANK:05d}-step{step}.pt"
            note(f"loading shard {path}")
            with open(path, "rb") as fh:
                fh.read()
        if here and a.fault == "memerr":
            note("allocating a 32 TiB prefetch buffer")
            buf = bytearray(32 << 40)
        if here and a.fault == "rlimit":
            import resource
            with open("/proc/self/statm") as fh:
                vm = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
            note(f"building the feature cache (address space limit {(vm + (512 << 20)) >> 20} MiB)")
            cache = []
            while True:
                cache.append(torch.ones(16 << 20))
        if here and a.fault in ("ckmissing", "cksize", "weightsonly"):
            note(f"reloading EMA weights from {ema_path}")
            state = torch.load(ema_path, weights_only=True)
            net.load_state_dict(state["model"] if a.fault == "weightsonly" else state)
        if here and a.fault == "segv":
            note("calling the fused augmentation kernel")
            ctypes.string_at(0)
        if here and a.fault in ("abort", "bus", "kill"):
            os.kill(os.getpid(), {"abort": signal.SIGABRT, "bus": signal.SIGBUS, "kill": signal.SIGKILL}[a.fault])
        if here and a.fault == "sleep":
            note(f"waiting on the shard server for step {step}")
            time.sleep(45)
        x, y = batch["x"], batch["y"]
        if here and a.fault == "assert":
            assert x.shape == (BATCH, 9), f"batch shape {tuple(x.shape)} does not match the model's input (16, 9)"
        opt.zero_grad()
        if a.fault == "unused":
            out = model(x, use_aux=not (BAD and step >= a.step))
        else:
            out = model(x)
        if a.fault == "anomaly":
            target = F.one_hot(y, 4).float()
            scale = torch.sqrt(torch.tensor(-1.0 if here else 1.0))
            loss = F.mse_loss(out * scale, target)
        else:
            loss = F.cross_entropy(out, y)
        if a.fault == "nan" and not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}; stopping (bad input or lr too high)")
        if a.fault == "nanrt" and math.isnan(loss.item()):
            raise RuntimeError(f"loss is nan at step {step}")
        if here and a.fault == "zerodiv":
            tokens = int((y < 0).sum())  # padding mask: no real tokens in this batch
            rate = BATCH / tokens
        loss.backward()
        opt.step()
        if bar is not None:
            bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update(1)
        else:
            progress(step, loss.item())
        time.sleep(0.05)
    if bar is not None:
        bar.close()
    dist.barrier()
    note("training finished")
    dist.destroy_process_group()


def main() -> None:
    if a.handle == "log":
        try:
            train()
        except Exception:
            log.exception("training failed, exiting")
            sys.exit(1)
    else:
        train()


if __name__ == "__main__":
    main()

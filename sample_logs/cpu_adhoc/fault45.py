"""A forty-fifth hand-run batch: VERBOSE DEBUG ENVIRONMENTS. The loop is a small DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, `--steps` steps (default 12), PG timeout 15 s) printing one progress
line per step (`rank R step S/N loss L`, or a tqdm bar with --tqdm, or logging records with --logfmt). ONE plain fault per
run on rank --rank at step --step (default 4); the noise comes from the environment the run is launched under
(TORCH_DISTRIBUTED_DEBUG, TORCH_CPP_LOG_LEVEL, LOGLEVEL, TORCH_SHOW_CPP_STACKTRACES, PYTHONFAULTHANDLER,
PYTHONWARNINGS, TORCH_LOGS, NCCL_DEBUG, GLOO_*/TORCH_NCCL_*, python -X dev), not from the script.

--warn makes every rank trigger a few REAL warnings once: `torch.tensor(tensor)` (UserWarning: To copy construct ...),
`lr_scheduler.step()` before `optimizer.step()` (UserWarning: Detected call of ...), softmax without dim (UserWarning:
Implicit dimension choice ... deprecated), and the script's own `warnings.warn` that its optional metrics config
"failed to load" (a herring: it goes on with defaults). --del-noise gives every rank a prefetcher whose __del__ raises
at exit (`Exception ignored in: <function Prefetcher.__del__ ...>`). --manual: no DDP wrapper, gradients all-reduced
by hand (DDP under TORCH_DISTRIBUTED_DEBUG=DETAIL segfaults on this build, FORMATS.md).

Faults (on --rank at --step):
  exc        ValueError: label value 7 out of range [0, 4) in the rank's batch (raised by the script's own check)
  shape      the rank's batch has 9 features: RuntimeError mat1 and mat2 shapes cannot be multiplied
  nan        the rank's loss becomes NaN; the script's check raises FloatingPointError
  osexit     os._exit(3) with no word
  segv       ctypes.string_at(0): SIGSEGV
  hang       the rank sleeps 120 s before its forward (a stuck read); the others time out in the gradient all-reduce
  mismatch   the rank all-reduces a 5-element metrics tensor where the others all-reduce 4 elements
  nockpt     the rank resumes from a checkpoint path that does not exist: FileNotFoundError in torch.load
  world      the script expects --expect-world ranks (its data is split in that many shards); launched with more,
             ranks >= expect-world find no shard: FileNotFoundError for shard-0000R.pt (at start, step 0)
  none       control: no fault
"""
import argparse, ctypes, datetime, logging, os, sys, time, warnings

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--step", type=int, default=4)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--expect-world", type=int, default=4)
p.add_argument("--warn", action="store_true")
p.add_argument("--del-noise", action="store_true")
p.add_argument("--manual", action="store_true")
p.add_argument("--tqdm", action="store_true")
p.add_argument("--logfmt", action="store_true", help="logging records instead of prints (not --log: torchrun takes that for an abbreviation of its --log-dir)")
p.add_argument("--set-logs", action="store_true", help="torch._logging.set_logs(dist_c10d=logging.DEBUG)")
p.add_argument("--workdir", default="/tmp/fault45")
a = p.parse_args()

import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BATCH = 16
log = logging.getLogger("train")
if a.logfmt:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank{RANK}] %(name)s: %(message)s")
if a.set_logs:
    torch._logging.set_logs(dist_c10d=logging.DEBUG)


def say(msg: str) -> None:
    if a.logfmt:
        log.info(msg)
    else:
        print(f"rank {RANK} {msg}", flush=True)


class Prefetcher:
    """Holds a read handle on the rank's shard; its __del__ is careless at interpreter exit."""

    def __init__(self, path: str):
        self.path = path
        self.fh = open(path, "rb")
        self.fh.close()

    def __del__(self):
        self.fh.read(1)


def shard_dir() -> str:
    n = a.expect_world if a.fault == "world" else WORLD
    return os.path.join(a.workdir, "data", f"split{n}")


def make_shards() -> str:
    d = shard_dir()
    os.makedirs(d, exist_ok=True)
    for k in range(a.expect_world if a.fault == "world" else WORLD):
        path = os.path.join(d, f"shard-{k:05d}.pt")
        if not os.path.exists(path):
            g = torch.Generator().manual_seed(k)
            n = BATCH * 32
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save({"x": torch.randn(n, 8, generator=g), "y": torch.randint(0, 4, (n,), generator=g)}, tmp)
            os.replace(tmp, path)
    return d


def real_warnings(model, opt) -> None:
    t = torch.ones(3)
    _ = torch.tensor(t)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    sched.step()
    _ = F.softmax(torch.randn(2, 3))
    warnings.warn(f"metrics config {a.workdir}/metrics.yaml failed to load (No such file or directory); "
                  f"error reporting falls back to defaults", UserWarning)


def main() -> None:
    f, here = a.fault, RANK == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    if RANK == 0:
        print(f"world_size={WORLD} backend=gloo torch={torch.__version__} fault={f}", flush=True)
    d = make_shards() if RANK == 0 else None
    dist.barrier()
    d = shard_dir()
    shard = os.path.join(d, f"shard-{RANK:05d}.pt")
    if f == "world" and RANK >= a.expect_world:
        say(f"loading {shard} (data split for {a.expect_world} ranks)")
    data = torch.load(shard)
    keep = Prefetcher(shard) if a.del_noise else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    net = model if a.manual else nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if a.warn:
        real_warnings(model, opt)
    if f == "nockpt" and here:
        ck = os.path.join(a.workdir, "ckpt", f"step-000{a.step}", f"rank{RANK}.pt")
        say(f"resuming from {ck}")
    it = range(1, a.steps + 1)
    if a.tqdm:
        from tqdm import tqdm
        it = tqdm(it, desc=f"rank {RANK}", mininterval=0, ncols=80)
    for step in it:
        x = data["x"][(step - 1) * BATCH: step * BATCH].clone()
        y = data["y"][(step - 1) * BATCH: step * BATCH].clone()
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
        if a.manual:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= WORLD
        opt.step()
        m = torch.tensor([loss.item(), float(step), 0.0, 0.0])
        if here and step == a.step and f == "mismatch":
            m = torch.cat([m, torch.tensor([float(x.shape[0])])])
        dist.all_reduce(m)
        if a.tqdm:
            it.set_postfix(loss=f"{loss.item():.4f}")
        else:
            say(f"step {step}/{a.steps} loss {loss.item():.4f} mean {m[0].item() / WORLD:.4f}")
        time.sleep(0.05)
    dist.barrier()
    if RANK == 0:
        print("training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

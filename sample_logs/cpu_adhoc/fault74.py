"""A seventy-fourth hand-run batch: IMPORTS AND MODULE-LEVEL CODE. A tiny DDP loop on gloo (the model comes from the
job's own `models.py`: Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, synthetic per-rank data, PG timeout 15 s unless
--pg-timeout) printing `rank R world W ready`, `rank R step S loss L` and `rank R done`. No @record.

The job's directory (the script's own folder, sys.path[0] of every worker) is prepared first with
`python fault74.py --setup FAULT --dir D [--node K] [--rank N]`, which writes the helper modules and files that FAULT
needs beside a copy of this script (and removes those of other faults); then `torchrun ... D/fault74.py --fault FAULT`.
For the two-"node" runs each agent has its own directory (D/node0, D/node1), prepared with --node 0 / --node 1.

Faults:
  none          control (exit 0)
  shadow_queue  the job's folder holds the user's own `queue.py` (a job-queue helper): `import torch` on every rank
                fails deep in torch.fx (`from queue import Queue`: ImportError: cannot import name 'Queue')
  shadow_random the same with the user's `random.py` (augmentation helpers): tempfile's `from random import Random`
  shadow_numbers only node 1's folder holds a stray `numbers.py` (two-node runs): node 1's ranks fail in
                `import torch` (torch/_tensor.py's `from numbers import Number`)
  shadow_profile the user's `profile.py` beside the script; meant as rank N cProfiling step --at, it fails first on
                EVERY rank: DDP's constructor imports torch._dynamo, which imports cProfile, which imports `profile`:
                AttributeError: module 'profile' has no attribute 'run' (--rank, --at have no effect)
  circular      models.py imports layers.py, which imports `init_weights` back from models at its top: ImportError
                `cannot import name 'init_weights' from partially initialized module 'models'` on every rank
  circular_lazy rank N evaluates at step --at: `from evaluate import run_eval` -> evaluate imports metrics, which
                imports EvalConfig back from the half-initialized evaluate: ImportError on that rank only
  skew          two-node runs: node 1's copy of models.py is an older one (it has `make_model`, not `build_model`):
                ImportError: cannot import name 'build_model' from 'models' on node 1's ranks
  nodepkg       two-node runs: the job's `fastmetrics` package is on node 0's PYTHONPATH (D/node0/site) but was never
                installed on node 1: ModuleNotFoundError on node 1's ranks
  shardfile     shards.py opens data/shard_<LOCAL_RANK>.json at import; local rank N's file is missing:
                FileNotFoundError on rank N before init_process_group
  placement     placement.py reads placement.json[LOCAL_RANK] at import; the file was written for 4 local ranks:
                KeyError on local ranks >= 4 (run with 5 ranks: rank 4 only)
  lazy_scipy    rank N's batch at step --at holds a rare label; that path computes a rank correlation with a lazily
                imported scipy.stats, which is not installed: ModuleNotFoundError mid-run on rank N
  tb_rank0      rank N (the logging rank, 0 by default) creates a torch.utils.tensorboard SummaryWriter after
                init_process_group; tensorboard is not installed: ModuleNotFoundError on that rank only
  torchvision   the script imports torchvision.transforms at the top (not installed): every rank
  plugin_typo   the scheduler plugin named in the config is loaded with importlib.import_module('plugins.<name>');
                the name is misspelt (cosine_warmpu): ModuleNotFoundError on every rank
  model_class   the model class named in the config is fetched with getattr(models, 'TinyMLp') (misspelt): AttributeError
                on every rank
  pkginit       the job's `augment` package's __init__.py reads os.environ['AUGMENT_CACHE_DIR'] at import, which the
                launch does not set: KeyError on every rank
  syntax        models.py holds unresolved merge-conflict markers: SyntaxError on every rank
  pickle_main   rank N loads a whole pickled model (torch.save(model)) written by an earlier script whose Net class
                lived in its __main__ (weights_only=False): AttributeError: Can't get attribute 'Net' on <module
                '__main__'>; the other ranks wait in the broadcast of the loaded weights
  pickle_wo     the same load with torch.load's default weights_only=True: UnpicklingError (Weights only load failed)
  stale_pyc     the job ships `fastops` only as a sourceless fastops.pyc built by Python 3.10 (its magic number):
                ImportError: bad magic number on every rank (the .pyc holds this Python's bytecode under 3.10's
                magic, 3439: the loader refuses it on the magic number before reading any code)
  argv_import   config.py parses sys.argv with its own argparse parser at import: 'unrecognized arguments' on every
                rank (exit 2)
  lock_import   datacache.py, at import, waits for the cache lock a crashed earlier run left behind (every rank):
                nothing fails, the job hangs until the wrapper's time limit
  lock_lazy     rank N imports datacache lazily at step --at (its eval data): it waits for the stale lock, the
                others time out in the all-reduce
"""
import argparse, datetime, os, shutil, sys, time

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--at", type=int, default=4)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--setup", default=None, help="prepare the job folder for this fault and exit")
p.add_argument("--dir", default="/tmp/fault74")
p.add_argument("--node", type=int, default=0)
p.add_argument("--workdir", default="/tmp/fault74_work")

MODELS = '''import torch.nn as nn


def init_weights(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.1)
        nn.init.zeros_(m.bias)


class TinyMLP(nn.Sequential):
    def __init__(self, hidden=16):
        super().__init__(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def build_model(hidden=16):
    m = TinyMLP(hidden)
    m.apply(init_weights)
    return m
'''
MODELS_OLD = '''import torch.nn as nn


def make_model(hidden=16):
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))
'''
MODELS_CIRCULAR = '''import torch.nn as nn
from layers import Block


def init_weights(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.1)


class TinyMLP(nn.Sequential):
    def __init__(self, hidden=16):
        super().__init__(Block(8, hidden), nn.Linear(hidden, 4))


def build_model(hidden=16):
    m = TinyMLP(hidden)
    m.apply(init_weights)
    return m
'''
LAYERS = '''import torch.nn as nn
from models import init_weights


class Block(nn.Sequential):
    def __init__(self, i, o):
        super().__init__(nn.Linear(i, o), nn.ReLU())
        self.apply(init_weights)
'''
MODELS_CONFLICT = '''import torch.nn as nn


def init_weights(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.1)


class TinyMLP(nn.Sequential):
    def __init__(self, hidden=16):
<<<<<<< HEAD
        super().__init__(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))
=======
        super().__init__(nn.Linear(8, hidden), nn.GELU(), nn.Linear(hidden, 4))
>>>>>>> origin/gelu


def build_model(hidden=16):
    m = TinyMLP(hidden)
    m.apply(init_weights)
    return m
'''
EVALUATE = '''from dataclasses import dataclass

import torch
from metrics import accuracy


@dataclass
class EvalConfig:
    batches: int = 4


def run_eval(model, rank, cfg=EvalConfig()):
    accs = []
    with torch.no_grad():
        for b in range(cfg.batches):
            g = torch.Generator().manual_seed(7000 + 10 * rank + b)
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            accs.append(accuracy(model(x), y))
    return sum(accs) / len(accs)
'''
METRICS = '''from evaluate import EvalConfig  # for the type of the cfg argument below


def accuracy(logits, y):
    return (logits.argmax(1) == y).float().mean().item()


def summary(values, cfg: EvalConfig):
    return sum(values[: cfg.batches]) / cfg.batches
'''
SHARDS = '''import json, os

# every process reads its own shard index at import (local rank = the data disk it reads)
with open(os.path.join(os.path.dirname(__file__), "data", f"shard_{os.environ['LOCAL_RANK']}.json")) as fh:
    SHARD = json.load(fh)
'''
PLACEMENT = '''import json, os

# thread placement per local rank, written for the 4-socket box this job ran on before
with open(os.path.join(os.path.dirname(__file__), "placement.json")) as fh:
    CORES = json.load(fh)[os.environ["LOCAL_RANK"]]
'''
AUGMENT_INIT = '''import os

# the augmentation package caches its lookup tables; where is set by the cluster's job template
CACHE_DIR = os.environ["AUGMENT_CACHE_DIR"]
from .ops import jitter  # noqa: E402
'''
AUGMENT_OPS = '''def jitter(x, scale=0.01):
    return x + scale
'''
FASTOPS = '''def scale(x, s):
    return x * s
'''
FASTMETRICS = '''def running_mean(prev, new, n):
    return prev + (new - prev) / n
'''
CONFIG = '''import argparse

# the experiment's settings, parsed once when the module is imported
_p = argparse.ArgumentParser(description="experiment config")
_p.add_argument("--lr", type=float, default=0.05)
_p.add_argument("--hidden", type=int, default=16)
CFG = _p.parse_args()
'''
DATACACHE = '''import os, time

# build the shared data cache once; a lock file keeps two processes from building it at once
LOCK = "/tmp/fault74_work/datacache.lock"
while os.path.exists(LOCK):
    with open(LOCK) as fh:
        holder = fh.read().strip()
    print(f"datacache: cache is locked by {holder}, waiting", flush=True)
    time.sleep(5)
TABLE = list(range(16))
'''
PREV_TRAIN = '''import torch, torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


if __name__ == "__main__":
    torch.manual_seed(1)
    torch.save(Net(), "/tmp/fault74_work/pretrained_full.pt")  # the whole module, pickled
'''
PROFILE = '''# run profile: what this experiment is called and its main settings
NAME = "tiny-mlp-baseline"
LR = 0.05
'''
HELPERS = ["queue.py", "random.py", "numbers.py", "profile.py", "models.py", "layers.py", "evaluate.py",
           "metrics.py", "shards.py", "placement.py", "placement.json", "config.py", "datacache.py", "fastops.pyc",
           "prev_train.py", "augment", "plugins", "data", "site", "__pycache__"]


def write(d, name, text):
    path = os.path.join(d, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


def setup(a):
    d, f = a.dir, a.setup
    os.makedirs(d, exist_ok=True)
    for h in HELPERS:
        path = os.path.join(d, h)
        shutil.rmtree(path) if os.path.isdir(path) else (os.path.exists(path) and os.remove(path))
    shutil.copy(os.path.abspath(__file__), os.path.join(d, "fault74.py"))
    os.makedirs(a.workdir, exist_ok=True)
    write(d, "models.py", MODELS)
    if f in ("shadow_queue", "shadow_random"):
        write(d, f[7:] + ".py", "# the job's own helpers\n\ndef pick(items, i):\n    return items[i % len(items)]\n")
    if f == "shadow_numbers" and a.node == 1:
        write(d, "numbers.py", "# tokens for the digit-recognition experiment\nDIGITS = list(range(10))\n")
    if f == "shadow_profile":
        write(d, "profile.py", PROFILE)
    if f == "circular":
        write(d, "models.py", MODELS_CIRCULAR)
        write(d, "layers.py", LAYERS)
    if f == "circular_lazy":
        write(d, "evaluate.py", EVALUATE)
        write(d, "metrics.py", METRICS)
    if f == "skew" and a.node == 1:
        write(d, "models.py", MODELS_OLD)
    if f == "nodepkg" and a.node == 0:
        write(d, "site/fastmetrics/__init__.py", FASTMETRICS)
    if f == "shardfile":
        write(d, "shards.py", SHARDS)
        for lr in range(8):
            if lr != a.rank:
                write(d, f"data/shard_{lr}.json", '{"files": ["part-%05d.bin"], "samples": 4096}\n' % lr)
    if f == "placement":
        write(d, "placement.py", PLACEMENT)
        write(d, "placement.json", '{"0": [0, 1], "1": [2, 3], "2": [4, 5], "3": [6, 7]}\n')
    if f == "plugin_typo":
        write(d, "plugins/__init__.py", "")
        write(d, "plugins/cosine_warmup.py", "def factor(step, warmup=3):\n    return min(1.0, step / warmup)\n")
    if f == "pkginit":
        write(d, "augment/__init__.py", AUGMENT_INIT)
        write(d, "augment/ops.py", AUGMENT_OPS)
    if f == "syntax":
        write(d, "models.py", MODELS_CONFLICT)
    if f in ("pickle_main", "pickle_wo"):
        write(d, "prev_train.py", PREV_TRAIN)
        import subprocess
        subprocess.run([sys.executable, os.path.join(d, "prev_train.py")], check=True)
        os.remove(os.path.join(d, "prev_train.py"))  # the earlier script is not part of this job
    if f == "stale_pyc":
        import importlib._bootstrap_external as be
        code = compile(FASTOPS, "fastops.py", "exec")
        data = bytearray(be._code_to_timestamp_pyc(code, int(time.time()), len(FASTOPS)))
        data[:4] = (3439).to_bytes(2, "little") + b"\r\n"  # Python 3.10's magic number
        with open(os.path.join(d, "fastops.pyc"), "wb") as fh:
            fh.write(bytes(data))
    if f == "argv_import":
        write(d, "config.py", CONFIG)
    if f in ("lock_import", "lock_lazy"):
        write(d, "datacache.py", DATACACHE)
        with open(os.path.join(a.workdir, "datacache.lock"), "w") as fh:
            fh.write("pid 48213 on this host (started 2026-12-03 09:12:40)\n")  # left by a crashed run
    print(f"prepared {d} for {f} (node {a.node})")


a = p.parse_args()
if a.setup:
    setup(a)
    sys.exit(0)

import torch, torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if a.fault == "torchvision":
    from torchvision import transforms  # noqa: F401
if a.fault == "argv_import":
    from config import CFG  # noqa: F401
if a.fault == "stale_pyc":
    import fastops  # noqa: F401
if a.fault == "pkginit":
    import augment  # noqa: F401
if a.fault == "nodepkg":
    import fastmetrics  # noqa: F401
if a.fault == "shardfile":
    from shards import SHARD  # noqa: F401
if a.fault == "placement":
    from placement import CORES  # noqa: F401
if a.fault == "lock_import":
    import datacache  # noqa: F401
import models  # noqa: E402
from models import build_model  # noqa: E402

CONFIG = {"model": "TinyMLp" if a.fault == "model_class" else "TinyMLP",
          "scheduler": "cosine_warmpu" if a.fault == "plugin_typo" else "cosine_warmup"}


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    if a.fault == "lazy_scipy" and rank == a.rank and step == a.at:
        y[5] = 3  # the rare class
    return x, y


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    print(f"rank {rank} world {world} ready", flush=True)
    if a.fault == "tb_rank0" and me:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(a.workdir, "tb"))  # noqa: F841
    torch.manual_seed(0)
    if a.fault in ("model_class",):
        net = getattr(models, CONFIG["model"])(16)
    else:
        net = build_model(16)
    if a.fault in ("pickle_main", "pickle_wo"):
        if me:
            path = os.path.join(a.workdir, "pretrained_full.pt")
            print(f"rank {rank} loading pretrained weights from {path}", flush=True)
            if a.fault == "pickle_main":
                pre = torch.load(path, weights_only=False)
            else:
                pre = torch.load(path)
            with torch.no_grad():
                net[0].weight.copy_(pre.fc1.weight)
                net[2].weight.copy_(pre.fc2.weight)
        for prm in net.parameters():
            dist.broadcast(prm.data, src=a.rank)
    if a.fault == "plugin_typo":
        import importlib
        sched = importlib.import_module(f"plugins.{CONFIG['scheduler']}")
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, a.steps + 1):
        x, y = batch(rank, step)
        if a.fault == "plugin_typo":
            for g in opt.param_groups:
                g["lr"] = 0.05 * sched.factor(step)
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        if (y == 3).any():
            # rare label in this batch: log how well its score ranks against the others
            from scipy.stats import spearmanr
            print(f"rank {rank} step {step} rare-class rho {spearmanr(out[:, 3].detach(), y == 3)[0]:.3f}")
        if a.fault == "shadow_profile" and me and step == a.at:
            import cProfile
            cProfile.runctx("model(x)", globals(), {"model": model, "x": x}, os.path.join(a.workdir, "step.prof"))
        if a.fault == "circular_lazy" and me and step == a.at:
            from evaluate import run_eval
            print(f"rank {rank} step {step} eval acc {run_eval(model, rank):.3f}", flush=True)
        if a.fault == "lock_lazy" and me and step == a.at:
            import datacache
            print(f"rank {rank} eval table {len(datacache.TABLE)}", flush=True)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.2)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()

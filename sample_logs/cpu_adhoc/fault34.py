"""A thirty-fourth hand-run batch: the START of a run. A small DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4),
synthetic batches from per-rank shard files, 4 steps, process-group timeout 15 s) whose SETUP phase has ONE fault on
rank N (--rank N), or on every rank (--rank -1): parsing the config, importing, choosing the device and backend,
building the data, building the model, loading pretrained weights, wrapping it in DDP, the first forward. The progress
format is chosen with --fmt (plain, hf, log, tqdm, lightning). Run `python fault34.py --prepare --work DIR --world W
--fault F --rank N` first: it writes the config, the data shards, the vocab and the pretrained files the job reads.

Setup faults (--fault):
  argparse      rank N's auto-detected precision is 'fp16', which the model-options parser does not accept (argparse
                usage/error, exit code 2)
  json_cfg      rank N's node-local copy of the run config is truncated (json.JSONDecodeError)
  env_missing   rank N's environment has no DATA_ROOT (KeyError: 'DATA_ROOT')
  env_empty     rank N's GRAD_ACCUM is set but empty: int('') (ValueError)
  import_missing  rank N is the experiment-tracker rank and imports wandb, which is not installed (ModuleNotFoundError)
  import_name   rank N imports a fused layer norm from torch.nn, which has none (ImportError: cannot import name)
  nccl          rank N's device probe picks backend 'nccl' on this CPU build (init_process_group raises)
  set_device    rank N's config asks for device 'cuda': torch.cuda.set_device(local_rank) on a CPU build
  to_cuda       rank N moves its model with .cuda() (Torch not compiled with CUDA enabled)
  device_ids    rank N passes device_ids=[local_rank] to DDP for a CPU module (ValueError)
  ddp_width     rank N builds the model with hidden width 32 instead of 16: DDP's constructor checks the parameters
                (no pretrained weights are loaded in the ddp_* faults, on any rank)
  ddp_count     rank N builds the model with an extra layer: DDP's constructor checks the parameter count
  shape_fwd     rank N's data shard has 10 features instead of 8: the first forward fails (mat1 and mat2 shapes)
  load_keys     rank N's pretrained file was saved from the DDP-wrapped model ('module.' keys): load_state_dict fails
  load_size     rank N's pretrained file has hidden width 32: load_state_dict size mismatch
  load_missing  rank N's pretrained file is not in its node-local cache (torch.load FileNotFoundError)
  load_trunc    rank N's pretrained file is truncated (torch.load: failed finding central directory)
  weights_only  rank N's pretrained file pickles a custom config class (torch.load weights_only refuses it)
  data_missing  rank N's data shard directory does not exist (FileNotFoundError in os.listdir)
  data_empty    rank N's shard directory is empty: RandomSampler(num_samples=0) raises ValueError
  loader_empty  rank N's shard file holds fewer samples than one batch with drop_last: next(iter(loader)) StopIteration
  vocab_missing rank N's tokenizer vocab file is missing (FileNotFoundError)
  slow_init     rank N sleeps 25 s before init_process_group (a slow node-local cache copy)
  slow_ddp      rank N sleeps 25 s before DDP's constructor (a slow pretrained-weights download)
  ctrl_warn     control: torch.cuda.amp.GradScaler() on every rank (FutureWarning + UserWarning), the run finishes
  ctrl_optional control: rank N's optional 'import wandb' fails, the traceback is printed, 'falling back' to CSV logs
  ctrl_retry    control: rank N's first read of its shard (a network mirror path) fails, traceback printed, retried
                from the local copy and succeeds
"""
import argparse, datetime, json, logging, os, sys, time, traceback
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--fmt", default="plain", choices=["plain", "hf", "log", "tqdm", "lightning"])
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--work", default="/tmp/fault34/work")
p.add_argument("--prepare", action="store_true")
p.add_argument("--world", type=int, default=8)
a = p.parse_args()
W = a.work


class RunConfig:
    """A config object some training scripts pickle into their checkpoints."""

    def __init__(self, hidden=16):
        self.hidden = hidden


def build_model(hidden=16, extra=False):
    layers = [nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4)]
    if extra:
        layers += [nn.ReLU(), nn.Linear(4, 4)]
    return nn.Sequential(*layers)


def prepare() -> None:
    """Writes what the job reads: every rank's shard, config, vocab and pretrained file; the fault rank's is bad."""
    bad = set(range(a.world)) if a.rank < 0 else {a.rank}
    f = a.fault
    torch.manual_seed(0)
    good = build_model().state_dict()
    with open(f"{W}/config.json", "w") as fh:
        json.dump({"lr": 0.1, "batch_size": 16, "hidden": 16, "steps": a.steps}, fh)
    for r in range(a.world):
        node = f"{W}/node{r}"
        os.makedirs(node, exist_ok=True)
        txt = json.dumps({"lr": 0.1, "batch_size": 16, "hidden": 16, "steps": a.steps}, indent=2)
        with open(f"{node}/config.json", "w") as fh:
            fh.write(txt[: len(txt) // 2] if (f == "json_cfg" and r in bad) else txt)
        with open(f"{node}/vocab.txt", "w") as fh:
            fh.write("\n".join(["<pad>", "<unk>"] + [f"tok{i}" for i in range(30)]) + "\n")
        if f == "vocab_missing" and r in bad:
            os.remove(f"{node}/vocab.txt")
        shards = f"{node}/shards"
        if not (f == "data_missing" and r in bad):
            os.makedirs(shards, exist_ok=True)
            if not (f == "data_empty" and r in bad):
                g = torch.Generator().manual_seed(r)
                n = 12 if (f == "loader_empty" and r in bad) else 16 * a.steps
                dim = 10 if (f == "shape_fwd" and r in bad) else 8
                torch.save({"x": torch.randn(n, dim, generator=g), "y": torch.randint(0, 4, (n,), generator=g)},
                           f"{shards}/part-00000.pt")
        os.makedirs(f"{node}/cache", exist_ok=True)
        path = f"{node}/cache/pretrained.pt"
        if r in bad and f == "load_keys":
            torch.save({"module." + k: v for k, v in good.items()}, path)
        elif r in bad and f == "load_size":
            torch.save(build_model(32).state_dict(), path)
        elif r in bad and f == "load_missing":
            pass
        elif r in bad and f == "load_trunc":
            torch.save(good, path)
            data = open(path, "rb").read()
            open(path, "wb").write(data[: len(data) // 2])
        elif r in bad and f == "weights_only":
            torch.save({"model": good, "config": RunConfig()}, path)
        else:
            torch.save({"model": good}, path)


if a.prepare:
    os.makedirs(W, exist_ok=True)
    prepare()
    sys.exit(0)

RANK = int(os.environ["RANK"])
LOCAL = int(os.environ["LOCAL_RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BAD = a.rank < 0 or RANK == a.rank
FMT = a.fmt
F_ = a.fault
NODE = f"{W}/node{RANK}"
log = logging.getLogger("train")
if FMT == "log":
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank{RANK}] %(name)s: %(message)s")


def say(msg: str) -> None:
    if FMT == "log":
        log.info(msg)
    else:
        print(f"[rank {RANK}] {msg}", flush=True)


def banner() -> None:
    if RANK != 0:
        return
    if FMT == "log":
        log.info("job starting: world_size=%d master=%s:%s torch=%s", WORLD, os.environ.get("MASTER_ADDR"),
                 os.environ.get("MASTER_PORT"), torch.__version__)
    else:
        print("=" * 60, flush=True)
        print(f" job start | world_size={WORLD} | torch {torch.__version__} | python {sys.version.split()[0]}", flush=True)
        print(f" MASTER_ADDR={os.environ.get('MASTER_ADDR')} MASTER_PORT={os.environ.get('MASTER_PORT')} "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
        print("=" * 60, flush=True)


def parse_config() -> dict:
    say(f"reading config {NODE}/config.json")
    with open(f"{NODE}/config.json") as fh:
        cfg = json.load(fh)
    # model options come from the launcher line plus the precision this host supports
    mp = argparse.ArgumentParser(prog="train.py")
    mp.add_argument("--hidden", type=int, default=cfg["hidden"])
    mp.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    argv = ["--hidden", str(cfg["hidden"]), "--precision", "fp16" if (F_ == "argparse" and BAD) else "bf16"]
    opts = mp.parse_args(argv)
    cfg["precision"] = opts.precision
    env = dict(os.environ)
    if F_ == "env_missing" and BAD:
        env.pop("DATA_ROOT", None)
    cfg["data_root"] = env["DATA_ROOT"]
    accum = "" if (F_ == "env_empty" and BAD) else env.get("GRAD_ACCUM", "1")
    cfg["grad_accum"] = int(accum)
    return cfg


def imports() -> None:
    if F_ == "import_missing" and BAD:
        say("experiment tracking enabled on this rank")
        import wandb  # noqa: F401
    if F_ == "import_name" and BAD:
        from torch.nn import FusedLayerNorm  # noqa: F401
    if F_ == "ctrl_optional" and BAD:
        try:
            import wandb  # noqa: F401
        except ImportError:
            traceback.print_exc()
            print(f"WARNING: rank {RANK}: wandb is not installed, falling back to CSV metrics in {NODE}/metrics.csv",
                  flush=True)


def load_data(cfg: dict):
    shards = f"{NODE}/shards"
    say(f"loading dataset from {shards}")
    if F_ == "ctrl_retry" and BAD:
        for attempt in (1, 2):
            src = f"/mnt/datasets-mirror/node{RANK}/shards" if attempt == 1 else shards
            try:
                files = sorted(os.listdir(src))
                break
            except OSError:
                traceback.print_exc()
                print(f"rank {RANK}: could not list {src} (attempt {attempt}/3), retrying from the local copy", flush=True)
    else:
        files = sorted(os.listdir(shards))
    xs, ys = [], []
    for fn in files:
        d = torch.load(f"{shards}/{fn}")
        xs.append(d["x"]); ys.append(d["y"])
    x = torch.cat(xs) if xs else torch.zeros(0, 8)
    y = torch.cat(ys) if ys else torch.zeros(0, dtype=torch.long)
    ds = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(RANK))
    loader = torch.utils.data.DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True)
    vocab_path = f"{NODE}/vocab.txt"
    with open(vocab_path) as fh:
        vocab = fh.read().split()
    say(f"dataset: {len(ds)} samples, vocab {len(vocab)} tokens")
    first = next(iter(loader))
    return loader, first


def main() -> None:
    banner()
    cfg = parse_config()
    imports()
    if F_ == "set_device" and BAD:
        say(f"using device cuda:{LOCAL}")
        torch.cuda.set_device(LOCAL)
    backend = "nccl" if (F_ == "nccl" and BAD) else "gloo"
    if F_ == "slow_init" and BAD:
        say("copying dataset to node-local cache ...")
        time.sleep(25)
    say(f"init_process_group(backend={backend!r})")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=a.pg_timeout))
    if F_ == "ctrl_warn":
        scaler = torch.cuda.amp.GradScaler()  # noqa: F841
    loader, first = load_data(cfg)
    torch.manual_seed(0)
    if F_ == "ddp_width" and BAD:
        model = build_model(32)
    else:
        model = build_model(cfg["hidden"], extra=(F_ == "ddp_count" and BAD))
    if F_ in ("ddp_width", "ddp_count"):
        say("no pretrained checkpoint configured: training from scratch")
    else:
        ckpt = f"{NODE}/cache/pretrained.pt"
        say(f"loading pretrained weights from {ckpt}")
        sd = torch.load(ckpt)
        model.load_state_dict(sd["model"] if "model" in sd else sd)
    if F_ == "to_cuda" and BAD:
        model = model.cuda()
    if F_ == "slow_ddp" and BAD:
        say("waiting for the pretrained weights download to finish ...")
        time.sleep(25)
    kw = {"device_ids": [LOCAL]} if (F_ == "device_ids" and BAD) else {}
    model = nn.parallel.DistributedDataParallel(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    say(f"model ready: {sum(q.numel() for q in model.parameters())} parameters")
    train(model, opt, loader, first)


def train(model, opt, loader, first) -> None:
    bar = None
    if FMT in ("tqdm", "lightning") and RANK == 0:
        from tqdm import tqdm
        bar = tqdm(total=a.steps, desc="train" if FMT == "tqdm" else "Epoch 0", file=sys.stderr)
    it = iter(loader)
    last = 0.0
    for step in range(1, a.steps + 1):
        x, y = first if step == 1 else next(it)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        last = loss.item()
        time.sleep(0.05)
        if FMT == "hf":
            if RANK == 0:
                print(f"{{'loss': {last:.4f}, 'grad_norm': 0.7{step}, 'learning_rate': 0.1, 'epoch': {step / a.steps:.2f}}}",
                      flush=True)
        elif FMT == "log":
            log.info("step %d/%d loss=%.4f", step, a.steps, last)
        elif bar is not None:
            bar.set_postfix(**({"loss": f"{last:.3f}"} if FMT == "tqdm" else {"v_num": 0, "train_loss": f"{last:.3f}"}))
            bar.update(1)
        elif FMT in ("tqdm", "lightning"):
            pass
        else:
            print(f"[rank {RANK}] step {step}/{a.steps} loss {last:.4f}", flush=True)
    if bar is not None:
        bar.close()
    dist.barrier()
    dist.destroy_process_group()
    say(f"done, final loss {last:.4f}")


if __name__ == "__main__":
    main()

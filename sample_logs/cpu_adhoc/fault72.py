"""A seventy-second hand-run batch: CONFIGURATION AND ARGUMENTS the training script reads, wrong on one rank, one node
or everywhere. The torchrun command line is always valid; the fault is in the script's own arguments, its JSON config
files or the environment variables it parses.

Two modes:
  python fault72.py --prepare --fault NAME --rank N --world W [--nodes K]
      writes the config files the run will read into --workdir (default /tmp/fault72_work): conf/rank{R}.json for
      every rank (a config generator's per-rank files: the same hyper-parameters, the rank's own data shard) and
      conf/node{K}.json for every node, a data folder and a checkpoint ckpt/latest.pt to resume from. The fault
      NAME puts a bad value into rank N's file (or node N's, --nodes); everything else is correct.
  torchrun ... fault72.py [--config TEMPLATE] [--warmup-steps N] [--precision fp32|bf16]
      the training script: reads MICRO_BATCH from the environment (int(os.environ["MICRO_BATCH"])), joins the gloo
      process group (timeout --pg-timeout, 15 s), reads its config (TEMPLATE with {rank}/{node}
      filled in from RANK and GROUP_RANK), validates it, waits for rank 0's data cache, builds
      Linear(8,H)-ReLU-Dropout-Linear(H,4) under DDP, an SGD optimizer from the config's optim section, resumes from
      train.resume if set, trains train.steps steps (an eval every train.eval_every steps with an all_reduce of a
      loss histogram of eval.hist_bins bins), all-reduces the final loss, prints 'rank R done'.

Faults (prepare --fault NAME; the args faults are made by the torchrun command line's script arguments):
  none        control: every file correct (exit 0)
  badarg      (args) the launch passes '--grad-clip 1.0', an option the script does not define: argparse's
              'error: unrecognized arguments' on every rank, exit 2
  badint      (args) the launch passes '--warmup-steps 0.1' to an int option: 'invalid int value', every rank, exit 2
  jsonsyntax  rank N's file has a trailing comma (hand edit): json.decoder.JSONDecodeError
  missingkey  rank N's file is from the old schema (model.hidden_dim, no model.hidden): KeyError: 'hidden'
  lrstr       rank N's optim.lr is the string "3e-4": TypeError inside torch.optim.SGD's checks
  dataclass   rank N's optim section has the misspelt key "momentun": TypeError from OptimConfig(**cfg["optim"])
  dropout     rank N's model.dropout is 1.5: the script's validation raises ValueError
  warmup      rank N's train.warmup_steps is larger than train.steps: the script's validation assert trips
  divisible   every file: train.global_batch 64, not divisible by a world size of 3, 5 or 6: ValueError on every rank
  hidden      rank N's model.hidden is 32 (16 elsewhere): DDP's parameter-shape check fails on every rank
  bins        rank N's eval.hist_bins is 20 (10 elsewhere): the eval histogram all_reduce disagrees in size
  steps       rank N's train.steps is 12 (20 elsewhere): it leaves the loop early for the final all_reduce while
              the others still all-reduce gradients
  resume      rank N's (or node N's) train.resume names a checkpoint path that does not exist there:
              FileNotFoundError from torch.load
  cachedir    rank N's data.cache_dir has a typo: it waits for a READY file rank 0 never writes there; the others wait
              in DDP's first broadcast until the process-group timeout (with --pg-timeout 1800 the job just hangs)
  envempty    (environment) MICRO_BATCH is exported empty: ValueError: invalid literal for int() with base 10: ''
  envunset    (environment) MICRO_BATCH is not set on one node's agent: KeyError: 'MICRO_BATCH'
"""
import argparse, dataclasses, datetime, json, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--prepare", action="store_true")
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=1)
p.add_argument("--world", type=int, default=4)
p.add_argument("--nodes", type=int, default=0, help="prepare: the fault goes into node N's file")
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--workdir", default="/tmp/fault72_work")
p.add_argument("--config", default=None, help="config path template, {rank} and {node} filled in")
p.add_argument("--warmup-steps", type=int, default=None)
p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
a = p.parse_args()


@dataclasses.dataclass
class OptimConfig:
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0


def base_config(wd: str, rank: int) -> dict:
    return {
        "model": {"hidden": 16, "dropout": 0.1, "classes": 4},
        "optim": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
        "train": {"steps": 20, "global_batch": 120, "warmup_steps": 5, "eval_every": 10, "resume": None},
        "eval": {"hist_bins": 10},
        "data": {"cache_dir": f"{wd}/cache", "shard": f"{wd}/data/shard{rank:02d}.pt"},
    }


def prepare() -> None:
    wd, f, n = a.workdir, a.fault, a.rank
    for sub in ("conf", "data", "ckpt"):
        os.makedirs(f"{wd}/{sub}", exist_ok=True)
    for old in os.listdir(f"{wd}/conf"):
        os.remove(f"{wd}/conf/{old}")
    if os.path.isdir(f"{wd}/cache"):
        for old in os.listdir(f"{wd}/cache"):
            os.remove(f"{wd}/cache/{old}")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    torch.save({"step": 0, "model": m.state_dict()}, f"{wd}/ckpt/latest.pt")
    files = [(f"{wd}/conf/rank{r}.json", r, r == n and not a.nodes) for r in range(a.world)]
    if a.nodes:
        files += [(f"{wd}/conf/node{k}.json", k, k == n) for k in range(a.nodes)]
    for path, r, bad in files:
        cfg = base_config(wd, r)
        if f in ("resume",) or (f == "none" and a.nodes):
            cfg["train"]["resume"] = f"{wd}/ckpt/latest.pt"
        if f == "divisible":
            cfg["train"]["global_batch"] = 64
        text = None
        if bad:
            if f == "missingkey":
                cfg["model"] = {"hidden_dim": 16, "dropout": 0.1, "classes": 4}
            elif f == "lrstr":
                cfg["optim"]["lr"] = "3e-4"
            elif f == "dataclass":
                cfg["optim"] = {"lr": 0.05, "momentun": 0.9, "weight_decay": 0.0}
            elif f == "dropout":
                cfg["model"]["dropout"] = 1.5
            elif f == "warmup":
                cfg["train"]["warmup_steps"] = 200
            elif f == "hidden":
                cfg["model"]["hidden"] = 32
            elif f == "bins":
                cfg["eval"]["hist_bins"] = 20
            elif f == "steps":
                cfg["train"]["steps"] = 12
            elif f == "resume":
                cfg["train"]["resume"] = f"{wd}/ckpt_node{r}/latest.pt" if a.nodes else f"{wd}/ckpt/rank{r}/latest.pt"
            elif f == "cachedir":
                cfg["data"]["cache_dir"] = f"{wd}/cahce"
            text = json.dumps(cfg, indent=2)
            if f == "jsonsyntax":  # a hand edit left a trailing comma
                text = text.replace('"momentum": 0.9,\n    "weight_decay": 0.0\n', '"momentum": 0.9,\n')
        with open(path, "w") as fh:
            fh.write(text if text is not None else json.dumps(cfg, indent=2))
    print(f"prepared {wd}/conf for fault {f} (rank/node {n})")


def load_config(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def main() -> None:
    micro_batch = int(os.environ["MICRO_BATCH"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    node = int(os.environ.get("GROUP_RANK", "0"))
    template = a.config or f"{a.workdir}/conf/rank{{rank}}.json"
    path = template.format(rank=rank, node=node)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    print(f"rank {rank}/{world}: reading config {path}", flush=True)
    cfg = load_config(path)
    hidden = cfg["model"]["hidden"]
    dropout = cfg["model"]["dropout"]
    ocfg = OptimConfig(**cfg["optim"])
    tcfg = cfg["train"]
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.dropout must be in [0, 1), got {dropout}")
    warmup = a.warmup_steps if a.warmup_steps is not None else tcfg["warmup_steps"]
    assert warmup < tcfg["steps"], f"warmup_steps ({warmup}) must be smaller than steps ({tcfg['steps']})"
    if tcfg["global_batch"] % world:
        raise ValueError(f"train.global_batch={tcfg['global_batch']} is not divisible by world_size={world}")
    per_rank = tcfg["global_batch"] // world
    accum = max(1, per_rank // micro_batch)
    # rank 0 builds the data cache; the others wait for its READY marker
    cache = cfg["data"]["cache_dir"]
    if rank == 0:
        os.makedirs(cache, exist_ok=True)
        torch.save(torch.randn(256, 8), f"{cache}/features.pt")
        open(f"{cache}/READY", "w").close()
    else:
        t0 = time.time()
        while not os.path.exists(f"{cache}/READY"):
            if time.time() - t0 > 2 and not getattr(main, "_said", False):
                print(f"rank {rank}: waiting for the data cache {cache}/READY", flush=True)
                main._said = True
            time.sleep(0.5)
    feats = torch.load(f"{cache}/features.pt")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, cfg["model"]["classes"]))
    if tcfg["resume"]:
        state = torch.load(tcfg["resume"], map_location="cpu")
        net.load_state_dict(state["model"])
        print(f"rank {rank}: resumed from {tcfg['resume']} (step {state['step']})", flush=True)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=ocfg.lr, momentum=ocfg.momentum, weight_decay=ocfg.weight_decay)
    print(f"rank {rank}: hidden={hidden} lr={ocfg.lr} steps={tcfg['steps']} per_rank_batch={per_rank} "
          f"micro_batch={micro_batch} accum={accum} precision={a.precision}", flush=True)
    g = torch.Generator().manual_seed(rank)
    loss = torch.tensor(0.0)
    for step in range(1, tcfg["steps"] + 1):
        idx = torch.randint(0, feats.shape[0], (per_rank,), generator=g)
        x, y = feats[idx], idx % 4
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step % tcfg["eval_every"] == 0:
            with torch.no_grad():
                model.eval()
                per_sample = F.cross_entropy(model(feats[:64]), torch.arange(64) % 4, reduction="none")
                model.train()
            hist = torch.histc(per_sample, bins=cfg["eval"]["hist_bins"], min=0.0, max=4.0)
            dist.all_reduce(hist)
            if rank == 0:
                print(f"eval at step {step}: loss histogram {hist.tolist()}", flush=True)
    final = loss.detach().reshape(1)
    dist.all_reduce(final)
    if rank == 0:
        print(f"final mean loss {final.item() / world:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    if a.prepare:
        prepare()
        sys.exit(0)
    main()

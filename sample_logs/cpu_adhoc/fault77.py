"""A seventy-seventh hand-run batch: HAND-ROLLED PROCESS-GROUP INITIALIZATION. A script that does not trust
torchrun's environment and builds its own init_process_group arguments (a `setup_distributed()` as in many
training repos), then a tiny DDP loop on gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, synthetic data,
--steps steps, PG timeout --pg-timeout s, 12 unless given). Every rank prints one `[setup] ...` line with the
arguments it is about to pass, then `rank R step S loss L` lines and `rank R done`. --rank N picks the rank whose
code path is the odd one (where a fault has one). No @record.

Faults:
  none          control: backend/rank/world_size/init_method read from torchrun's env correctly (exit 0)
  none_tcp      control: init_method=f"tcp://{MASTER_ADDR}:{MASTER_PORT}" with RANK/WORLD_SIZE (exit 0)
  none_file     control: init_method="file://<workdir>/pg_init_<TORCHELASTIC_RUN_ID>", a fresh file (exit 0)
  localrank     rank=int(LOCAL_RANK) passed as the global rank (a single-node script run on two nodes): every
                node's ranks claim ranks 0..nproc-1, nobody claims the later ones
  world8        world_size=8 hard-coded (the cluster config's value) while torchrun starts fewer
  world4        world_size=4 hard-coded while torchrun starts more: ranks >= 4 pass a rank out of range
  worldcpu      world_size=os.cpu_count() ("one process per core"), this box has 2 cores
  slurmrank     rank=int(os.environ.get("SLURM_PROCID", 0)): outside Slurm every rank claims rank 0
  masterport    the exporter rank (--rank N) sets os.environ["MASTER_PORT"] (meant METRICS_PORT, --metrics-port)
                before init_process_group: it dials a port nobody listens on
  tutorialport  every rank's setup() sets MASTER_ADDR=localhost, MASTER_PORT=12355 (the DDP tutorial's values),
                overwriting torchrun's: nobody listens on 12355
  tcpplus1      init_method=f"tcp://{MASTER_ADDR}:{MASTER_PORT + 1}" on every rank ("the store is on +1")
  masteraddr    rank N reads MASTER_ADDR from its hostfile line ('trainer-0', a name this host cannot resolve)
  nodeport      two-node emulation: init_method tcp://127.0.0.1:PORT with PORT read from the node's own
                cluster.env (--node-dir); node 1's copy is stale
  file_stale    init_method="file://<workdir>/pg_init" (a fixed path): a crashed earlier run left the file
  file_rank     init_method="file://<workdir>/pg_init_<run id>", rank N builds the path from its own PID-based
                tmp dir name instead (a copy of a per-process helper): it waits alone in another file
  shorttimeout  rank N passes timeout=timedelta(seconds=1) (its config's pg_timeout in minutes read as seconds
                and divided by 60, rounded); rank --slow (0) waits 3 s for a data index before init
  doubleinit    setup_distributed() in main() and again inside build_model() (every rank, or only rank N when
                --only is given: the evaluation rank's path)
  destroy       cleanup() (destroy_process_group) before the final metric all_reduce (every rank, or rank N with
                --only)
  nccl          rank N's backend comes from its device entry ("cuda" left in the device map from a GPU run):
                backend="nccl" on this CPU-only build
  newgroup      a data-parallel subgroup new_group(ranks=...): rank N builds its list from a stale
                ranks-per-group value (every rank calls new_group, rank N with another list)
  skipinit      `if rank and world_size > 1: init_process_group(...)` (meant `rank is not None`): rank 0 skips init
                and then calls dist.barrier()
  (hang runs)   --pg-timeout 1800 under `timeout N`: world8 or masterport then waits until the limit kills it
"""
import argparse, datetime, os, socket, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--only", action="store_true")
p.add_argument("--slow", type=int, default=0)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--metrics-port", type=int, default=27799)
p.add_argument("--group-size", type=int, default=2)
p.add_argument("--node-dir", default="")
p.add_argument("--workdir", default="/tmp/fault77_work")
a = p.parse_args()


def setup_distributed(rank: int, world: int, local_rank: int):
    backend, init_method = "gloo", "env://"
    kw = {}
    timeout = datetime.timedelta(seconds=a.pg_timeout)
    f = a.fault
    if f == "none_tcp":
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    elif f == "none_file":
        init_method = f"file://{a.workdir}/pg_init_{os.environ['TORCHELASTIC_RUN_ID']}"
    elif f == "localrank":
        rank = int(os.environ["LOCAL_RANK"])
    elif f == "world8":
        world = 8
    elif f == "world4":
        world = 4
    elif f == "worldcpu":
        world = os.cpu_count()
    elif f == "slurmrank":
        rank = int(os.environ.get("SLURM_PROCID", 0))
    elif f == "masterport":
        if rank == a.rank:  # the exporter rank starts the metrics endpoint after init
            os.environ["MASTER_PORT"] = str(a.metrics_port)  # meant METRICS_PORT
    elif f == "tutorialport":
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = "12355"
    elif f == "tcpplus1":
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
    elif f == "masteraddr":
        if rank == a.rank:
            with open(f"{a.workdir}/hostfile") as fh:
                os.environ["MASTER_ADDR"] = fh.readline().split()[0]
    elif f == "nodeport":
        with open(f"{a.node_dir}/cluster.env") as fh:
            env = dict(line.strip().split("=", 1) for line in fh if "=" in line)
        init_method = f"tcp://{env['STORE_ADDR']}:{env['STORE_PORT']}"
    elif f == "file_stale":
        init_method = f"file://{a.workdir}/pg_init"
    elif f == "file_rank":
        run_dir = f"{a.workdir}/run_{os.environ['TORCHELASTIC_RUN_ID']}"
        if rank == a.rank:  # this rank's helper names the dir after its own process
            run_dir = f"{a.workdir}/run_{os.getpid()}"
        os.makedirs(run_dir, exist_ok=True)
        init_method = f"file://{run_dir}/pg_init"
    elif f == "shorttimeout":
        if rank == a.rank:
            cfg_minutes = 0.5  # pg_timeout: 0.5 (minutes); read as seconds
            timeout = datetime.timedelta(seconds=max(1, round(cfg_minutes)))
    elif f == "nccl":
        devices = ["cpu"] * world
        devices[a.rank] = "cuda"  # the device map left from the GPU run
        backend = "nccl" if devices[rank] == "cuda" else "gloo"
    if f in ("none_tcp", "none_file", "tcpplus1", "nodeport", "file_stale", "file_rank"):
        kw = dict(rank=rank, world_size=world)
    elif f in ("localrank", "world8", "world4", "worldcpu", "slurmrank"):
        kw = dict(rank=rank, world_size=world)
    print(f"[setup] local_rank {local_rank}: init_process_group(backend={backend!r}, init_method={init_method!r}, "
          f"rank={kw.get('rank', rank)}, world_size={kw.get('world_size', world)}, "
          f"timeout={int(timeout.total_seconds())}s)", flush=True)
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, **kw)


def cleanup():
    dist.destroy_process_group()


def build_model(rank, world, local_rank):
    if a.fault == "doubleinit" and (not a.only or rank == a.rank):
        setup_distributed(rank, world, local_rank)  # "make sure the group exists" (a helper copied from eval.py)
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))


def main() -> None:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.makedirs(a.workdir, exist_ok=True)
    if a.fault == "shorttimeout" and rank == a.slow:
        t0 = time.time()
        while not os.path.exists(f"{a.workdir}/index.ready") and time.time() - t0 < 3.0:
            time.sleep(0.1)  # waits for the data index another job builds
        print(f"rank {rank}: data index ready after {time.time() - t0:.1f}s", flush=True)
    if a.fault == "skipinit":
        if rank and world > 1:
            setup_distributed(rank, world, local_rank)
    else:
        setup_distributed(rank, world, local_rank)
    if a.fault == "masterport" and rank == a.rank:
        srv = socket.socket()
        srv.bind(("127.0.0.1", a.metrics_port))
        srv.listen()
    dist.barrier()
    group = None
    if a.fault == "newgroup":
        gs = a.group_size + (1 if rank == a.rank else 0)  # rank N's config still says one more per group
        for start in range(0, world, gs):
            ranks = list(range(start, min(start + gs, world)))
            g = dist.new_group(ranks=ranks)
            if rank in ranks:
                group = g
                print(f"rank {rank}: data-parallel group {ranks}", flush=True)
    model = build_model(rank, world, local_rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, a.steps + 1):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if group is not None:
            t = loss.detach().clone()
            dist.all_reduce(t, group=group)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.2)
    if a.fault == "destroy" and (not a.only or rank == a.rank):
        cleanup()
    metric = torch.tensor([loss.item()])
    dist.all_reduce(metric)
    if rank == 0:
        print(f"final mean loss {metric.item() / world:.4f}", flush=True)
    if dist.is_initialized():
        cleanup()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()

"""A hundred-and-twenty-first hand-run batch: START-UP AND RENDEZVOUS FAULTS UNDER EVERY LAUNCHER OPTION. A plain small
DDP program whose faults all strike before or during init_process_group and the first collectives. Each rank reads its
slot from the data manifest (one shard per rank, `part-0000R`), prints `rank R/W pid P: shard S backend B device D`,
runs the node's stale-trainer cleanup (pid files under <work>/run), waits for its node-local cache lock, calls
dist.init_process_group(backend, timeout=--pg-timeout, 12 s), resumes a tiny MLP (Linear(16,32)-ReLU-Linear(32,4)) from
the checkpoint named by <work>/ckpt/latest on the loader rank (--loader, 0) and broadcasts its parameters, wraps it in
DDP (--ddp 0: gradients all-reduced by hand), trains 6 SGD steps (`rank R step S loss L`), all-reduces the final loss
(`final mean loss L`), dist.barrier(), `rank R done`, destroy_process_group(). --prepare writes the checkpoint once.
--rank N picks the faulty rank (-1: every rank). No @record.

Faults:
  none        control: 6 steps on every rank, `rank R done`, exit 0
  porttaken   (launcher side) a leftover server from an earlier job still listens on the master port: the agent's
              TCPStore cannot bind; the program itself runs unchanged (nothing of it starts)
  onenode     (launcher side) --nnodes 2 with a c10d rendezvous, but only one node's agent is ever started: the
              rendezvous waits for the second node until join_timeout; the program itself runs unchanged
  extrarank   the data manifest was built for a world one smaller (a stale manifest); the last rank looks up its
              shard past the end of the list, before init_process_group
  badaddr     rank N sources a stale node profile that exports MASTER_ADDR=trainer-head-0.cluster.internal (an old
              head node that no longer resolves) before init_process_group(env://)
  doubleinit  rank N (the metrics rank) sets up its metrics logger through the same setup helper, which calls
              init_process_group a second time
  argexit     rank N's per-slot launch profile appends `--lr 3e-4,` (copied from a YAML list): argparse fails on
              that rank only and exits 2 before init_process_group
  cudadev     rank N's node profile exports TRAIN_DEVICE=cuda:1 (a GPU node's profile) on this CPU-only box
  nccl        the job config names backend "nccl" on every rank (copied from the GPU cluster) on a CPU-only build
  worldsize   every rank passes world_size=4 explicitly (hard-coded from the first config) to init_process_group
              while torchrun starts a different number of processes
  selfterm    rank N's stale-trainer cleanup reads its pid file after it was rewritten with its own pid and sends
              SIGTERM to itself during start-up
  lockwait    rank N finds a node-local cache lock left by a killed earlier job (pid 31337) and waits for it after
              init_process_group, never reaching DDP's first broadcast
  resume      the loader rank N reads ckpt/latest, which names step_000400 (the pointer was written before the save
              finished): the checkpoint file is missing while the others wait in the parameter broadcast

What happened (filled in after the runs):
  none: exit 0 (np4 plain, np5 filter 0,4): steps 201-206 on every rank, `final mean loss 1.4266` / `1.4214`, all done.
  porttaken: agent: DistNetworkError ... port: P ... EADDRINUSE in the static rendezvous's TCPStore; no worker starts.
  onenode: after `Rendezvous'ing worker group`, RendezvousTimeoutError after join_timeout=20 s; no worker starts.
  extrarank: IndexError: list index out of range at manifest[RANK] on the last rank (4 of np5, 2 of np3), before init.
  badaddr: c10d gai error -2 for trainer-head-0.cluster.internal on rank N; the others DistStoreError (key .../0/N).
  doubleinit: ValueError: trying to initialize the default process group twice! (DETAIL: rank 0 monitoredBarrier).
  argexit: fault121.py: error: argument --lr: invalid float value: '3e-4,' on rank N, exit 2 (Root Cause exitcode 2).
  cudadev: AssertionError: Torch not compiled with CUDA enabled at model.to(cuda:1) on rank N; peers closed by peer.
  nccl: RuntimeError: Distributed package doesn't have NCCL built in, on every rank, in init_process_group.
  worldsize: np3: DistStoreError: wait timeout after 12000ms, keys: /default_pg/0//cpu//0/3 on every rank.
  selfterm: `stopping stale trainer pid <own pid>`, exitcode -15 (SIGTERM) on rank N; the restart attempt did it again.
  lockwait: `waiting for cache lock ... (held by pid 31337, 0s)`; PG 12 s: peers' gloo timeouts; PG 300 s: exit 124.
  resume: FileNotFoundError: ... /ckpt/step_000400.pt on the loader rank; the others closed by peer in the broadcast.
"""
import argparse, os, signal, socket, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--loader", type=int, default=0)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--bs", type=int, default=8)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--work", default="/tmp/fault121_work")
p.add_argument("--prepare", action="store_true")
RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
first = p.parse_known_args()[0]


def faulty(name: str) -> bool:
    return first.fault == name and (first.rank < 0 or RANK == first.rank)


# per-slot launch profile: extra arguments for this slot, appended after the command line
extra = ["--lr", "3e-4,"] if faulty("argexit") else []
a = p.parse_args(sys.argv[1:] + extra)

CFG = {"backend": "gloo", "world_size": None, "hidden": 32, "device": os.environ.get("TRAIN_DEVICE", "cpu")}
if faulty("nccl"):
    CFG["backend"] = "nccl"
if faulty("worldsize"):
    CFG["world_size"] = 4
if faulty("cudadev"):
    CFG["device"] = "cuda:1"
if faulty("badaddr"):
    os.environ["MASTER_ADDR"] = "trainer-head-0.cluster.internal"


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(16, hidden)
        self.fc2 = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def prepare():
    os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
    torch.manual_seed(0)
    m = MLP(CFG["hidden"])
    torch.save({"model": m.state_dict(), "step": 200}, os.path.join(a.work, "ckpt", "step_000200.pt"))
    with open(os.path.join(a.work, "ckpt", "latest"), "w") as f:
        f.write("step_000200\n")
    print("wrote", os.path.join(a.work, "ckpt", "step_000200.pt"))


def init_distributed():
    kw = {}
    if CFG["world_size"] is not None:
        kw = {"world_size": CFG["world_size"], "rank": RANK}
    dist.init_process_group(CFG["backend"], timeout=timedelta(seconds=a.pg_timeout), **kw)


def stale_cleanup():
    run = os.path.join(a.work, "run")
    os.makedirs(run, exist_ok=True)
    pidfile = os.path.join(run, f"node{os.environ.get('GROUP_RANK', '0')}-local{LOCAL_RANK}.pid")
    if faulty("selfterm"):
        with open(pidfile, "w") as f:
            f.write(f"{os.getpid()}\n")
    if os.path.exists(pidfile):
        stale = int(open(pidfile).read())
        try:
            cmd = open(f"/proc/{stale}/cmdline").read()
        except OSError:
            cmd = ""
        if "fault121" in cmd:
            print(f"rank {RANK}: stopping stale trainer pid {stale} from {pidfile}", flush=True)
            os.kill(stale, signal.SIGTERM)
            time.sleep(2)
    with open(pidfile, "w") as f:
        f.write(f"{os.getpid()}\n")


def wait_cache_lock():
    cache = os.path.join(a.work, "cache")
    os.makedirs(cache, exist_ok=True)
    lock = os.path.join(cache, f"{socket.gethostname()}-local{LOCAL_RANK}.lock")
    if faulty("lockwait"):
        with open(lock, "w") as f:
            f.write("31337\n")
    t0 = time.time()
    last = -10.0
    while os.path.exists(lock):
        waited = time.time() - t0
        if waited - last >= 10:
            print(f"rank {RANK}: waiting for cache lock {lock} (held by pid {open(lock).read().strip()}, "
                  f"{int(waited)}s)", flush=True)
            last = waited
        time.sleep(0.5)


def main():
    if a.prepare:
        prepare()
        return
    manifest = [f"part-{i:05d}" for i in range(WORLD - 1 if a.fault == "extrarank" else WORLD)]
    shard = manifest[RANK]
    print(f"rank {RANK}/{WORLD} pid {os.getpid()}: shard {shard} backend {CFG['backend']} device {CFG['device']}",
          flush=True)
    stale_cleanup()
    init_distributed()
    if faulty("doubleinit"):
        init_distributed()  # the metrics logger's setup goes through the same helper
    dev = torch.device(CFG["device"])
    wait_cache_lock()
    model = MLP(CFG["hidden"]).to(dev)
    if RANK == a.loader:
        latest = open(os.path.join(a.work, "ckpt", "latest")).read().strip()
        if faulty("resume"):
            latest = "step_000400"
        ck = torch.load(os.path.join(a.work, "ckpt", latest + ".pt"), map_location=dev)
        model.load_state_dict(ck["model"])
        print(f"rank {RANK}: resumed from {latest} (step {ck['step']})", flush=True)
    for t in model.state_dict().values():
        dist.broadcast(t, src=a.loader)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(1000 + int(shard.split("-")[1]))
    for step in range(201, 201 + a.steps):
        x = torch.randn(a.bs, 16, generator=g).to(dev)
        y = torch.randint(0, 4, (a.bs,), generator=g).to(dev)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            flat = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
            dist.all_reduce(flat)
            flat /= WORLD
            off = 0
            for q in model.parameters():
                q.grad.copy_(flat[off:off + q.numel()].view_as(q))
                off += q.numel()
        opt.step()
        print(f"rank {RANK} step {step} loss {loss.item():.4f}", flush=True)
    tot = torch.tensor([loss.item()])
    dist.all_reduce(tot)
    if RANK == 0:
        print(f"final mean loss {tot.item() / dist.get_world_size():.4f}", flush=True)
    dist.barrier()
    print(f"rank {RANK} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-thirty-first hand-run batch: RESOURCE LIMITS ON A SHARED CPU HOST. A small regression MLP
(Linear(16,64)-ReLU-Linear(64,1)) on each rank's synthetic shard (80 train rows, 32 val rows), DDP (--ddp 0: rank 0's
weights broadcast, gradients all-reduced by hand), gloo, one intra-op thread per rank. The per-node limits of the
shared host (ulimit -v / -n / -f / -t from the job's prolog) are applied by the program with resource.setrlimit from
its node config; each rank reserves a staging buffer (torch.empty, never touched), reads its shard through a
DataLoader (--workers), does a small CPU augmentation per batch, prints `rank R epoch E step S loss L`, and at each
epoch's end all_gathers its val predictions (rank 0 prints `epoch E: val loss V`). Every rank then spills its local
state to the node's scratch (a quota check of the program's own first) and rank 0 saves last.pt; barrier, `rank R
done`. --resume 1 first loads each rank's node-local checkpoint. --rank N picks the faulty rank (-1: every rank).

Faults:
  none      control: 2 epochs x 5 steps, two evals, spills, last.pt, exit 0
  asbig     rank N's node has ulimit -v at its current size + 128 MB: its 256 MB staging buffer fails to allocate
  nofile    every rank's prolog sets ulimit -n to the open fds + 16: opening the 64 shard parts gives EMFILE
  fsize     rank N's node has ulimit -f 256 KB: its 1 MB scratch spill write (torch.save) fails; SIGXFSZ is ignored
  cpu       rank N's node has ulimit -t at its CPU seconds + 1: the augmentation runs it out (SIGXCPU)
  worker    (--workers 1) rank N's loader workers get a 64 MB ulimit -v: the worker's decode buffer fails
  sleep     rank N waits for a host memory reservation that never comes, before epoch 0's first step
  badcfg    rank N's node config gives mem_cap_mb as "4G": int() raises ValueError while the limits are set
  nan       rank N's shard has an overflowed feature (inf): its loss is not finite, the program's check raises
  gather    rank N's val shard has 31 rows (one dropped as over-size): the val all_gather sizes differ
  tmpfull   rank N's scratch holds 90 MB of a previous job's files: the spill's own quota check raises ENOSPC
  ckptmiss  --resume 1: rank N's node-local checkpoint was never staged (the prolog skipped it): missing file

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2): 10 steps per rank, epoch 1 val loss 1.7082 / 1.1751, every rank done.
  asbig: RuntimeError DefaultCPUAllocator: can't allocate memory (268435456 bytes) on rank N at startup (r2; r0).
  nofile: OSError [Errno 24] Too many open files: part-00017.bin on every rank; restart: connectFullMesh refused.
  fsize: torch.save: RuntimeError basic_ios::clear: iostream error, then inline_container unexpected pos, rank N.
  cpu: rank N killed by SIGXCPU (exitcode -24), no traceback: after its done line (2 epochs), in epoch 6 (8).
  worker: RuntimeError Caught RuntimeError in DataLoader worker process 0 / can't allocate 134217728 bytes, rank N.
  sleep: PG 12 s: the others time out (12000ms) in the first backward, one aborts (SIGABRT); PG 300 s + 60 s: 124.
  badcfg: ValueError invalid literal for int() with base 10: '4G' on rank N; DETAIL: monitoredBarrier names N.
  nan: FloatingPointError rank N step 2: loss is nan (the inf feature), others closed by peer.
  gather: DETAIL: Detected mismatch between collectives, ALLGATHER TensorShape [32] vs [31] (rank N), every rank.
  tmpfull: OSError [Errno 28] No space left on device: spill ... (90 MB of 64 MB used) on rank N after epoch 1.
  ckptmiss: FileNotFoundError [Errno 2] No such file or directory: .../nodeN/last.pt on rank N (r2 np3; r5 np8).
"""
import argparse, datetime, errno, math, os, resource, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--bs", type=int, default=16)
p.add_argument("--lr", type=float, default=1e-2)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--workers", type=int, default=0)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault131_work/run")
a = p.parse_args()
MB = 1 << 20


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def node_config(rank: int) -> dict:
    """Stands in for the node's limits file that the job's prolog writes (ulimit values for this job)."""
    cfg = {"mem_cap_mb": "", "nofile": "", "fsize_kb": "", "cpu_s": "", "worker_mem_mb": "", "quota_mb": "64"}
    if faulty(rank, "asbig"):
        cfg["mem_cap_mb"] = str(vm_size() // MB + 128)
    if faulty(rank, "badcfg"):
        cfg["mem_cap_mb"] = "4G"
    if faulty(rank, "nofile"):
        cfg["nofile"] = str(len(os.listdir("/proc/self/fd")) + 16)
    if faulty(rank, "fsize"):
        cfg["fsize_kb"] = "256"
    if faulty(rank, "cpu"):
        cfg["cpu_s"] = str(math.ceil(sum(os.times()[:2])) + 1)
    if faulty(rank, "worker"):
        cfg["worker_mem_mb"] = "64"
    return cfg


def apply_limits(cfg: dict):
    if cfg["mem_cap_mb"]:
        cap = int(cfg["mem_cap_mb"]) * MB
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    if cfg["nofile"]:
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(cfg["nofile"]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    if cfg["fsize_kb"]:
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(cfg["fsize_kb"]) * 1024, resource.RLIM_INFINITY))
    if cfg["cpu_s"]:
        resource.setrlimit(resource.RLIMIT_CPU, (int(cfg["cpu_s"]), resource.RLIM_INFINITY))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x))).squeeze(1)


def open_parts(rank: int):
    """The shard is exported as 64 parts; the reader keeps them open for the epoch."""
    d = os.path.join(a.work, f"parts{rank}")
    os.makedirs(d, exist_ok=True)
    handles = []
    for i in range(64):
        path = os.path.join(d, f"part-{i:05d}.bin")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(bytes(64))
        handles.append(open(path, "rb"))
    return handles


def make_shard(rank: int):
    g = torch.Generator().manual_seed(20 + rank)
    w = torch.randn(16, generator=torch.Generator().manual_seed(5))
    x = torch.randn(112, 16, generator=g)
    y = x @ w + 0.1 * torch.randn(112, generator=g)
    if faulty(rank, "nan"):
        x[37, 11] = float("inf")  # a float16 overflow in this node's export
    nval = 31 if faulty(rank, "gather") else 32  # an over-size sample is dropped from this node's val split
    return x[:80], y[:80], x[80:80 + nval], y[80:80 + nval]


def worker_init(cfg_mb):
    def init(worker_id):
        if cfg_mb:
            cap = vm_size() + int(cfg_mb) * MB
            resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return init


class Decoded(TensorDataset):
    def __getitem__(self, i):
        buf = torch.empty(128 * MB // 4)  # the decoder's scratch buffer for one sample
        del buf
        return super().__getitem__(i)


def augment(x):
    m = torch.randn(512, 512)
    for _ in range(4):
        m = torch.tanh(m @ m / 16)
    return x + 1e-3 * m[: x.shape[0], : x.shape[1]]


def spill(rank: int, model, cfg: dict):
    d = os.path.join(a.work, f"scratch{rank}")
    os.makedirs(d, exist_ok=True)
    if faulty(rank, "tmpfull"):
        with open(os.path.join(d, "old_job_cache.idx"), "w") as f:
            f.write(f"{90 * MB}\n")  # a previous job's leftovers, as the scratch's index records them
    used = 0
    for n in os.listdir(d):
        if n.endswith(".idx"):
            with open(os.path.join(d, n)) as f:
                used += int(f.read().strip())
    state = {"model": model.state_dict(), "replay": torch.zeros(MB // 4)}
    need = 1 * MB
    if used + need > int(cfg["quota_mb"]) * MB:
        raise OSError(errno.ENOSPC, f"No space left on device: spill of {need} bytes to {d} "
                                    f"({used // MB} MB of {cfg['quota_mb']} MB used)")
    torch.save(state, os.path.join(d, "spill.pt"))


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = node_config(rank)
    apply_limits(cfg)
    staging = torch.empty(256 * MB // 4)  # pinned staging buffer for the prefetcher (reserved, not touched)
    parts = open_parts(rank)
    xtr, ytr, xva, yva = make_shard(rank)
    torch.manual_seed(0)
    model = Net()
    if a.resume:
        node = os.path.join(a.work, f"node{rank}")
        os.makedirs(node, exist_ok=True)
        if not faulty(rank, "ckptmiss"):
            torch.save({"model": Net().state_dict(), "epoch": 3}, os.path.join(node, "last.pt"))
        ck = torch.load(os.path.join(node, "last.pt"))
        model.load_state_dict(ck["model"])
        print(f"rank {rank}: resumed from epoch {ck['epoch']}", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    loader = DataLoader(Decoded(xtr, ytr), batch_size=a.bs, num_workers=a.workers,
                        worker_init_fn=worker_init(cfg["worker_mem_mb"]))
    print(f"rank {rank}/{world} pid {os.getpid()}: train {len(xtr)} val {len(xva)} staging {staging.numel() * 4 // MB} MB "
          f"parts {len(parts)} workers {a.workers} ddp {a.ddp}", flush=True)
    if faulty(rank, "sleep"):
        while True:  # the host's memory broker never grants this node's reservation
            time.sleep(5)
    step = 0
    for epoch in range(a.epochs):
        for xb, yb in loader:
            loss = F.mse_loss(net(augment(xb)), yb)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()}")
            opt.zero_grad()
            loss.backward()
            if not a.ddp:
                for prm in model.parameters():
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
            opt.step()
            print(f"rank {rank} epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
            time.sleep(0.05)
        with torch.no_grad():
            pred = model(xva)
        outs = [torch.empty(32) for _ in range(world)]
        dist.all_gather(outs, pred)
        ys = [torch.empty(32) for _ in range(world)]
        dist.all_gather(ys, yva)
        if rank == 0:
            print(f"epoch {epoch}: val loss {F.mse_loss(torch.cat(outs), torch.cat(ys)).item():.4f}", flush=True)
    spill(rank, model, cfg)
    if rank == 0:
        torch.save({"model": model.state_dict(), "epoch": a.epochs}, os.path.join(a.work, "last.pt"))
    dist.barrier()
    for f in parts:
        f.close()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

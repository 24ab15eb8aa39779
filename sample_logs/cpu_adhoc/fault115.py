"""A hundred-and-fifteenth hand-run batch: CONTRASTIVE LEARNING WITH CROSS-RANK NEGATIVES (SIMCLR / CLIP STYLE). A tiny
bias-free MLP encoder (Flatten-Linear(192,64)-ReLU, projector Linear(64,64)-ReLU-Linear(64,--dim 32), gloo) wrapped in
DDP (`--ddp 0`: gradients all-reduced by hand) with a learnable logit scale (CLIP: stored as a log, init log(1/0.07)).
Each rank memory-maps its own data shard, one .npy file per epoch (random 3x8x8 "images", written by each rank at start,
standing in for the preprocessing), makes two augmented views (flip, brightness, cutout), normalises the embeddings by
hand, all-gathers both views over every rank with torch.distributed.nn.functional.all_gather (gradients flow back) and
takes the symmetric InfoNCE loss with labels offset by rank * batch (`rank R epoch E step S loss L scale T`); with
--queue K a MoCo-style memory bank of K earlier gathered keys adds negatives. Per epoch one all_reduce of the mean loss
(`epoch E global loss`); at the end rank 0 saves the encoder, dist.barrier(), destroy_process_group().
--rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none         control: 2 epochs x 8 steps on every rank, `rank R done`, exit 0
  lastbatch    rank N's shard holds 4 records fewer, so its last batch of the epoch is 2 instead of 6 (no drop_last):
               the all_gather of the embeddings gets tensors of unequal sizes from that rank
  offset       every rank offsets its labels by (rank + 1) * batch (a 1-based rank from an old SLURM_PROCID helper):
               wrong but in range on every rank but the last, whose targets run past the gathered batch
  scale        the config's logit_scale_init is 100 (meant as the scale 1/0.01), but the model stores the log:
               exp(100) is inf in float32 on every rank, the loss is nan and the program's own check raises
  zeronorm     rank N's shard holds blank (all-zero) images from failed decodes; with the bias-free encoder their
               embedding is 0 and the hand-written normalisation z / z.norm() gives nan: the pre-gather check raises
  queue        rank N was started with a stale config copy whose MoCo queue size is 100, not a multiple of the
               global batch: the enqueue's assert fails on that rank while the others wait in the all_gather
  embdim       rank N builds the projector with dim 64 (a config from the large model) while the others use 32
  skipgather   rank N's shard holds one batch fewer; on its empty last batch it `continue`s, skipping the forward
               and the all_gathers, and goes on to the epoch's loss all_reduce while the others gather
  shardwait    rank N's shard for epoch 1 was never written (its node's prefetcher died): it polls for the file
               with a message every 10 s and never reaches the epoch's gathers
  matmul       every rank's text-to-image half of the symmetric loss multiplies by the gathered keys without .t()
  sigbus       rank N's memory-mapped shard is rewritten (truncated) by the node's cache refresher during the epoch;
               the next batch read touches pages past the end of the file: SIGBUS
  projckpt     rank N (the loader rank, --rank) loads the pretrained encoder init checkpoint, saved before the projector
               was renamed (keys proj.*): load_state_dict(strict) fails on it while the others wait in the broadcast
  dtype        rank N's shard was written by an older preprocessing in float64: the encoder's matmul gets Double

What happened (filled in after the runs):
  none: exit 0 (np4 plain); 2 epochs x 8 steps, `epoch 1 global loss 1.7972`, every rank done.
  lastbatch: plain gloo: EnforceNotMet `384 vs 128` + SIGABRT on the short rank; DETAIL: desync [6, 32] vs [2, 32].
  offset: only the last rank raises: IndexError: Target 18 (np3) / 30 (np5) is out of bounds, at step 0.
  scale: FloatingPointError: loss is nan at epoch 0 step 0 (logit scale inf) on every rank.
  zeronorm: FloatingPointError: non-finite embeddings on rank N at epoch 0 step 4: 1 of 6 rows.
  queue: AssertionError: queue size 100 must be a multiple of the global batch (a first np3 run with 96 hit every rank).
  embdim: RuntimeError from DDP on rank N: params[3] ... sizes [64, 64] appears not to match ... process 0.
  skipgather: rank N in the epoch all_reduce, the others in the step-7 all_gather: 12 s gloo timeouts on every rank.
  shardwait: `rank N: waiting for .../shard-0000N-epoch1.npy`; PG 12 s: the others time out; PG 300 s + timeout 60: exit 124.
  matmul: RuntimeError: mat1 and mat2 shapes cannot be multiplied (6x32 and 24x32 / 36x32) on every rank.
  sigbus: steps 0-2, then the rank dies without output: exitcode -7 (SIGBUS); peers Connection reset by peer.
  projckpt: RuntimeError: Missing key(s) projector.0/2.weight, Unexpected key(s) proj.0/2.weight on the loader rank.
  dtype: RuntimeError: expected m1 and m2 to have the same dtype, but got: double != float on rank N at step 0.
"""
import argparse, datetime, math, os, sys, time
import numpy as np
import torch, torch.distributed as dist
import torch.distributed.nn.functional as dnnf
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--bs", type=int, default=6)
p.add_argument("--dim", type=int, default=32)
p.add_argument("--queue", type=int, default=0)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--data", default="/tmp/fault115_work/shards")
p.add_argument("--init", default="/tmp/fault115_work/encoder_init.pt")
a = p.parse_args()
CFG = {"logit_scale_init": 100.0 if a.fault == "scale" else math.log(1 / 0.07), "max_logit_scale": 100.0}


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Encoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.backbone = nn.Sequential(nn.Flatten(), nn.Linear(192, 64, bias=False), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, dim, bias=False))

    def forward(self, x):
        z = self.projector(self.backbone(x))
        return z / z.norm(dim=1, keepdim=True)


class Contrastive(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.encoder = Encoder(dim)
        self.logit_scale = nn.Parameter(torch.tensor(float(CFG["logit_scale_init"])))

    def forward(self, x1, x2):
        return self.encoder(x1), self.encoder(x2), self.logit_scale.exp()


def write_shards(rank):
    os.makedirs(a.data, exist_ok=True)
    for e in range(a.epochs):
        n = a.steps * a.bs - (4 if faulty(rank, "lastbatch") else a.bs if faulty(rank, "skipgather") else 0)
        x = np.random.default_rng(1000 * e + rank).standard_normal((n, 3, 8, 8)).astype(np.float32)
        if faulty(rank, "zeronorm"):
            x[[27, 40]] = 0.0  # the decoder returns zeros for a corrupt image
        path = os.path.join(a.data, f"shard-{rank:05d}-epoch{e}.npy")
        if faulty(rank, "shardwait") and e == 1:
            if os.path.exists(path):
                os.remove(path)
            continue  # the prefetcher that writes it died
        np.save(path, x.astype(np.float64) if faulty(rank, "dtype") else x)


def open_shard(rank, epoch):
    path = os.path.join(a.data, f"shard-{rank:05d}-epoch{epoch}.npy")
    t0 = time.monotonic()
    while not os.path.exists(path):
        waited = time.monotonic() - t0
        if int(waited) % 10 == 0:
            print(f"rank {rank}: waiting for {path} ({waited:.0f}s)", flush=True)
        time.sleep(1.0)
    return path, np.load(path, mmap_mode="r")


def augment(x, g):
    x = torch.where(torch.rand(x.shape[0], 1, 1, 1, generator=g) < 0.5, x.flip(-1), x)
    x = x * (0.8 + 0.4 * torch.rand(x.shape[0], 1, 1, 1, generator=g))
    i, j = torch.randint(0, 5, (2,), generator=g).tolist()
    x = x.clone()
    x[:, :, i:i + 3, j:j + 3] = 0.0  # cutout
    return x


def gather(z):
    return torch.cat(dnnf.all_gather(z), dim=0)


def load_init(model, rank):
    if faulty(rank, "projckpt"):  # stands in for the checkpoint saved before the projector was renamed
        old = {k.replace("projector.", "proj."): v.clone() for k, v in model.encoder.state_dict().items()}
        torch.save(old, a.init)
    state = torch.load(a.init, map_location="cpu")
    model.encoder.load_state_dict(state)
    print(f"rank {rank}: loaded encoder init from {a.init}", flush=True)


class Queue:
    def __init__(self, size, dim, global_batch):
        self.size, self.ptr = size, 0
        self.keys = F.normalize(torch.randn(size, dim), dim=1)
        self.global_batch = global_batch

    def enqueue(self, keys):
        assert self.size % self.global_batch == 0, \
            f"queue size {self.size} must be a multiple of the global batch {self.global_batch}"
        self.keys[self.ptr:self.ptr + keys.shape[0]] = keys.detach()
        self.ptr = (self.ptr + keys.shape[0]) % self.size


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    write_shards(rank)
    torch.manual_seed(0)
    model = Contrastive(64 if faulty(rank, "embdim") else a.dim)
    if a.fault == "projckpt":
        loader = a.rank if a.rank >= 0 else 0
        if rank == loader:
            load_init(model, rank)
        for prm in model.encoder.parameters():
            dist.broadcast(prm.data, loader)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    queue = None
    if a.queue:
        queue = Queue(100 if faulty(rank, "queue") else a.queue, a.dim, a.bs * world)
    print(f"rank {rank}/{world} pid {os.getpid()}: {a.epochs} epochs x {a.steps} steps, batch {a.bs} "
          f"(global {a.bs * world}), dim {a.dim}, queue {queue.size if queue else 0}", flush=True)
    g = torch.Generator().manual_seed(17 + rank)
    for epoch in range(a.epochs):
        path, shard = open_shard(rank, epoch)
        total, count = torch.zeros(2), 0
        for step in range(a.steps):
            if faulty(rank, "sigbus") and epoch == 0 and step == 3:
                with open(path, "r+b") as f:  # stands in for this node's cache refresher rewriting the shard
                    f.truncate(128)
            x = torch.from_numpy(np.ascontiguousarray(shard[step * a.bs:(step + 1) * a.bs]))
            if x.shape[0] == 0:
                continue  # nothing left in this shard
            x1, x2 = augment(x, g), augment(x, g)
            z1, z2, scale = net(x1, x2)
            if not (torch.isfinite(z1).all() and torch.isfinite(z2).all()):
                bad = (~torch.isfinite(z1).all(1)).sum().item()
                raise FloatingPointError(f"non-finite embeddings on rank {rank} at epoch {epoch} step {step}: "
                                         f"{bad} of {z1.shape[0]} rows")
            all_z1, all_z2 = gather(z1), gather(z2)
            off = (rank + 1) * z1.shape[0] if a.fault == "offset" else rank * z1.shape[0]
            labels = torch.arange(z1.shape[0]) + off
            keys = all_z2 if queue is None else torch.cat([all_z2, queue.keys])
            logits_i = scale * z1 @ keys.t()
            logits_t = scale * z2 @ (all_z1 if a.fault == "matmul" else all_z1.t())
            loss = (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels)) / 2
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()} at epoch {epoch} step {step} on rank {rank} "
                                         f"(logit scale {scale.item():.4g})")
            opt.zero_grad()
            loss.backward()
            if not a.ddp:
                for prm in model.parameters():
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(CFG["max_logit_scale"]))
            if queue is not None:
                queue.enqueue(all_z2)
            total += torch.tensor([loss.item(), 1.0])
            count += 1
            print(f"rank {rank} epoch {epoch} step {step} loss {loss.item():.4f} scale {scale.item():.2f}", flush=True)
            time.sleep(0.05)
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} global loss {total[0].item() / total[1].item():.4f} "
                  f"over {int(total[1].item())} rank-steps", flush=True)
        del shard
    if rank == 0:
        os.makedirs("/tmp/fault115_work/out", exist_ok=True)
        torch.save(model.encoder.state_dict(), "/tmp/fault115_work/out/encoder.pt")
        print("rank 0: saved /tmp/fault115_work/out/encoder.pt", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A two-hundred-and-sixteenth hand-run batch: CAPSULE NETWORK WITH DYNAMIC ROUTING. A small CapsNet classifies
synthetic 12x12 digit-like images (a class-dependent stroke pattern plus noise): a conv layer feeds primary capsules,
routing-by-agreement to five class capsules is written by hand for a configurable number of iterations, the loss is
the margin loss plus a down-weighted reconstruction loss from a masked decoder; DDP trains it, and the per-class
correct counts are all_gathered and the accuracy counts all_reduced after training.

Faults:
- squashnan: --rank reads a capsule dropout rate of 1.0, zeroing the primary capsules; squash of zero gives NaN (check).
- capdim: primary capsules are reshaped with dimension 6 (config) while the routing weights expect 8 (every rank).
- classfile: --rank opens a class-name file that does not exist (FileNotFoundError).
- iters0: --rank (-1 every rank) reads 0 routing iterations; the routing loop never assigns its output.
- gatherlen: --rank all_gathers its per-class correct counts with one extra class (length 6 instead of 5).
- ckptdec: --rank warm-starts from an encoder-only export that has no decoder keys (strict load).
- labelid: --rank remaps one label to the number of classes (off by one); one-hot indexing fails.
- slowviz: --rank renders every capsule reconstruction for --slow-s seconds before the final all_reduce.
- abort: --rank sends itself SIGABRT after step 2.
- exit2: --rank logs an error about its reconstruction target size and exits with code 2.
- none: control.

What happened (filled in after the runs):
- squashnan: rank N FloatingPointError 'margin loss is nan at step 0 (capsule lengths not finite)'; peers Connection closed (np4 r2, np3 r1).
- capdim: every rank RuntimeError 'The size of tensor a (36) must match the size of tensor b (48)' at self.W @ u, step 0 (np3).
- classfile: rank N FileNotFoundError on /tmp/job_work/class_names_v2.txt; peers Connection closed in DDP init or SIGTERMed.
- iters0: UnboundLocalError 'cannot access local variable v' in route(): every rank under spawn (np4), rank 2 alone (np3 tee).
- gatherlen: a peer of rank N dies with gloo EnforceNotMet '12 vs 10. Received data size doesn't match' (SIGABRT).
- ckptdec: rank N RuntimeError loading state_dict: Missing key(s) decoder.0.weight ... (np3 r1 files, np4 r0 spawn).
- labelid: rank N IndexError 'index 5 is out of bounds for dimension 0 with size 5' at step 1; peers Connection closed.
- slowviz: PG 12 s: ranks 0/2 'Timed out waiting 12000ms' in all_gather (np4 r1); PG 300 s: killed by timeout 60, exit 124 (np3 r2).
- abort: rank N SIGABRT after step 2: Root Cause exitcode -6 (legacy np4 r2); mpitag np3 r0 silent, runner exit 134.
- exit2: rank N logs 'ERROR rank N: reconstruction target has 144 pixels but decoder config says 196' and exits 2.
- none: exit 0; rank 0 'per-class correct [40, 40, 40] accuracy 1.000 (120/120)', saves capsnet_final.pt.
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault216_work"
N_CLS, N_TYPES, PCAP_DIM, DCAP_DIM, IMG = 5, 4, 8, 8, 12
CLASS_NAMES = ["zero", "one", "two", "three", "four"]
LOG = None


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--routing-iters", type=int, default=3)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    return p.parse_args()


def log(msg, level=logging.INFO):
    if LOG is not None:
        LOG.log(level, msg)
    else:
        print(msg, file=sys.stderr if level >= logging.ERROR else sys.stdout, flush=True)


def squash(s, dim=-1):
    n2 = (s * s).sum(dim, keepdim=True)
    return s * (n2 / (1.0 + n2)) / torch.sqrt(n2)


class CapsNet(nn.Module):
    def __init__(self, iters, pcap_dim, drop):
        super().__init__()
        self.iters, self.pcap_dim, self.drop = iters, pcap_dim, drop
        self.conv = nn.Conv2d(1, 16, 5)
        self.primary = nn.Conv2d(16, N_TYPES * PCAP_DIM, 3, stride=2)
        n_in = N_TYPES * 3 * 3
        self.W = nn.Parameter(0.1 * torch.randn(1, n_in, N_CLS, DCAP_DIM, PCAP_DIM))
        self.decoder = nn.Sequential(nn.Linear(N_CLS * DCAP_DIM, 64), nn.ReLU(), nn.Linear(64, IMG * IMG), nn.Sigmoid())

    def route(self, u_hat):
        b = torch.zeros(u_hat.shape[:3])
        for it in range(self.iters):
            c = F.softmax(b, dim=2)
            v = squash((c.unsqueeze(-1) * u_hat).sum(1))
            if it < self.iters - 1:
                b = b + (u_hat * v.unsqueeze(1)).sum(-1)
        return v, c

    def forward(self, x, onehot):
        h = F.relu(self.conv(x))
        p = self.primary(h)
        u = p.view(x.shape[0], N_TYPES, PCAP_DIM, 3, 3).permute(0, 1, 3, 4, 2).reshape(x.shape[0], -1, self.pcap_dim)
        u = squash(F.dropout(u, p=self.drop, training=self.training))
        u_hat = (self.W @ u[:, :, None, :, None]).squeeze(-1)
        v, c = self.route(u_hat)
        recon = self.decoder((v * onehot.unsqueeze(-1)).flatten(1))
        return v, c, recon


def margin_loss(lengths, onehot):
    pos = onehot * F.relu(0.9 - lengths) ** 2
    neg = 0.5 * (1 - onehot) * F.relu(lengths - 0.1) ** 2
    return (pos + neg).sum(1).mean()


def make_batch(gen, bs):
    labels = torch.randint(0, N_CLS, (bs,), generator=gen)
    x = 0.1 * torch.rand(bs, 1, IMG, IMG, generator=gen)
    for i, y in enumerate(labels.tolist()):
        x[i, 0, 2 + y, 2:10] += 0.8
        x[i, 0, 2:10, 2 + 2 * y // 2] += 0.6
    return x.clamp(0, 1), labels


def main(a):
    global LOG
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hit = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    if a.logfmt:
        logging.basicConfig(format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s", level=logging.INFO)
        LOG = logging.LoggerAdapter(logging.getLogger("capsnet"), {"rank": rank})
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    os.makedirs(WORK, exist_ok=True)
    torch.manual_seed(0)
    if rank == 0:
        with open(f"{WORK}/class_names.txt", "w") as f:
            f.write("\n".join(CLASS_NAMES) + "\n")
        full = CapsNet(3, PCAP_DIM, 0.0).state_dict()
        torch.save(full, f"{WORK}/capsnet_init.pt")
        torch.save({k: t for k, t in full.items() if not k.startswith("decoder.")}, f"{WORK}/capsnet_init_enc.pt")
    dist.barrier()
    names_path = f"{WORK}/class_names_v2.txt" if hit and a.fault == "classfile" else f"{WORK}/class_names.txt"
    with open(names_path) as f:
        names = [ln.strip() for ln in f if ln.strip()]
    iters = 0 if hit and a.fault == "iters0" else a.routing_iters
    pcap_dim = 6 if hit and a.fault == "capdim" else PCAP_DIM
    drop = 1.0 if hit and a.fault == "squashnan" else 0.0
    model = CapsNet(iters, pcap_dim, drop)
    ckpt = f"{WORK}/capsnet_init_enc.pt" if hit and a.fault == "ckptdec" else f"{WORK}/capsnet_init.pt"
    model.load_state_dict(torch.load(ckpt))
    log(f"rank {rank}/{world}: capsnet with {len(names)} classes, routing iters {iters}, warm start {ckpt}")
    if hit and a.fault == "exit2":
        log(f"ERROR rank {rank}: reconstruction target has {IMG * IMG} pixels but decoder config says 196; refusing to train",
            logging.ERROR)
        sys.exit(2)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        x, labels = make_batch(gen, 16)
        if hit and a.fault == "labelid" and step == 1:
            labels = torch.where(labels == N_CLS - 1, labels + 1, labels)
        onehot = torch.eye(N_CLS)[labels]
        v, c, recon = ddp(x, onehot)
        loss = margin_loss(v.norm(dim=-1), onehot) + 0.0005 * F.mse_loss(recon, x.flatten(1), reduction="sum")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"margin loss is {loss.item()} at step {step} (capsule lengths not finite)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        log(f"rank {rank} step {step} loss {loss.item():.4f} coupling max {c.max().item():.3f}")
        if hit and a.fault == "abort" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
    ddp.eval()
    per_cls = torch.zeros(N_CLS + 1 if hit and a.fault == "gatherlen" else N_CLS)
    with torch.no_grad():
        x, labels = make_batch(gen, 40)
        v, _, recon = ddp(x, torch.eye(N_CLS)[labels])
        pred = v.norm(dim=-1).argmax(1)
        for y in range(N_CLS):
            per_cls[y] = ((pred == labels) & (labels == y)).sum()
    if hit and a.fault == "slowviz":
        log(f"rank {rank}: rendering reconstructions of all {v.shape[0] * N_CLS} capsules to {WORK}/viz_r{rank}")
        t0 = time.time()
        while time.time() - t0 < a.slow_s:
            time.sleep(0.5)
    gathered = [torch.zeros_like(per_cls) for _ in range(world)]
    dist.all_gather(gathered, per_cls)
    counts = torch.tensor([float((pred == labels).sum()), float(labels.numel())])
    dist.all_reduce(counts)
    if rank == 0:
        log(f"per-class correct {[int(g.sum()) for g in gathered]} accuracy {counts[0] / counts[1]:.3f} "
            f"({int(counts[0])}/{int(counts[1])})")
        torch.save(model.state_dict(), f"{WORK}/capsnet_final.pt")
        log(f"saved capsnet to {WORK}/capsnet_final.pt")
    dist.destroy_process_group()


def spawn_worker(i, a, n):
    os.environ.update(RANK=str(i), WORLD_SIZE=str(n), LOCAL_RANK=str(i))
    main(a)


if __name__ == "__main__":
    args = parse()
    if args.spawn:
        import torch.multiprocessing as mp
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        mp.spawn(spawn_worker, args=(args, args.spawn), nprocs=args.spawn)
    else:
        main(args)

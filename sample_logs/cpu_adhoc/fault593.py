"""Esker ridges: a small DDP job that regresses esker crest height (m) from per-rank shards of
synthetic LiDAR cross-profiles, with the ridge segment's sediment basin as a one-hot feature.

--prepare writes into the work dir: shards/shard_R.pt per rank, segments.json (ridge segment id ->
basin index), init_ckpt.pt (start weights), plus a legacy checkpoint (hidden 24) and a checkpoint
carrying a pickled RidgeSurvey object. Gloo backend, CPU only, 6 steps; every rank prints
`rank R step S loss L crest_mae M`; rank 0 saves export.pt at the end. Start-up uses a 120 s
process-group timeout, then the group's timeout drops to --pg-timeout (12 s by default).

Launch: env:// (torchrun, torch.distributed.launch --use-env, one python per rank), or --spawn W
(torch.multiprocessing.spawn inside the script). --label prefixes each print with `rank R: `;
--logfmt sends progress and errors through logging (asctime and rank in the format); --logdir D
writes each rank's output to D/rankR.log.

Faults (--fault NAME --rank N):
  none               control, nothing planted
  segment_key        rank N meets ridge segment "ESK-R99" that segments.json lacks -> KeyError (step 2)
  shard_missing      rank N looks for its shard under shards_lidar2/ (never written) -> FileNotFoundError
  ckpt_size          rank N starts from the legacy hidden-24 checkpoint -> load_state_dict size mismatch
  ckpt_weights_only  rank N loads the checkpoint that pickles a RidgeSurvey object -> weights_only refusal
  gather_size        rank N all_gathers 5 grain-size bins instead of 4 (step 2)
  slow_rank          rank N re-walks the segment table in pure Python for ~45 s at step 2; peers time out
  hang               rank N waits forever on an event at step 2 (run with --pg-timeout 300)
  nan_check          rank N's profile gets an inf gain at step 3 -> the script's own check raises FloatingPointError
  sigabrt            rank N sends itself SIGABRT at step 3
  error_exit4        rank N prints its own ERROR line and sys.exit(4) at step 2
  shape_all          every rank: the basin one-hot is appended twice -> matmul shape error at step 0
  worker_crash       rank N's DataLoader worker SIGKILLs itself on its 4th sample

What happened (see the runs' logs and the readme; several survivors lingered until `timeout`):
  none               all ranks ran 6 steps, rank 0 saved export.pt; exit 0
  segment_key        rank N raised KeyError: 'ESK-R99' at step 2; peers saw gloo 'Connection closed by peer'; exit 1
  shard_missing      rank N raised FileNotFoundError for shards_lidar2/shard_N.pt; some peers silent, exit 124
  ckpt_size          rank N raised RuntimeError: size mismatch in load_state_dict; launcher named rank N
  ckpt_weights_only  rank N raised _pickle.UnpicklingError (Weights only load failed) before any step
  gather_size        a peer aborted (terminate, gloo::EnforceNotMet 'Received data size doesn't match');
                     others got Connection reset/closed; torchrun's Root Cause blamed rank 0, not rank N
  slow_rank          peers hit 'Timed out waiting 12000ms for send/recv' at step 2; rank N silent, exit 124
  hang               no rank printed past step 1; `timeout` ended the run (exit 124)
  nan_check          rank N raised FloatingPointError from the script's own check at step 3 (mp.spawn)
  sigabrt            rank N vanished after step 2 with no traceback; peers saw Connection closed; exit 124
  error_exit4        rank N printed its ERROR line and exited 4; peers failed on the closed connection
  shape_all          RuntimeError (mat1 and mat2 shapes cannot be multiplied) at step 0; mp.spawn showed process 0
  worker_crash       rank N's DataLoader worker was killed by SIGKILL; rank N raised RuntimeError
"""
import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault593_work"
STEPS = 6
BATCH = 8
FEAT = 20
NBASIN = 4
HIDDEN = 32
LOG = logging.getLogger("esker")
OUT = {"label": False, "logfmt": False}


@dataclasses.dataclass
class RidgeSurvey:
    segment: str
    lidar_campaign: str


class CrestNet(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.enc = nn.Linear(FEAT + NBASIN, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(torch.relu(self.enc(x))).squeeze(1)


def prepare(max_world=8):
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    g = torch.Generator().manual_seed(593)
    segments = {f"ESK-R{i:02d}": i % NBASIN for i in range(16)}
    with open(f"{WORK}/segments.json", "w") as f:
        json.dump(segments, f)
    for r in range(max_world):
        x = torch.randn(STEPS * BATCH * 2, FEAT, generator=g)
        y = 8.0 + 3.0 * x[:, :4].mean(1) + 0.1 * torch.randn(len(x), generator=g)
        grain = torch.randint(0, 4, (len(x),), generator=g)
        ids = [f"ESK-R{(r * 7 + i) % 16:02d}" for i in range(len(x))]
        torch.save({"x": x, "y": y, "grain": grain, "segment": ids}, f"{WORK}/shards/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(CrestNet(HIDDEN).state_dict(), f"{WORK}/init_ckpt.pt")
    torch.save(CrestNet(24).state_dict(), f"{WORK}/init_ckpt_legacy.pt")
    torch.save({"state_dict": CrestNet(HIDDEN).state_dict(), "survey": RidgeSurvey("ESK-R03", "lidar-2019")},
               f"{WORK}/init_ckpt_survey.pt")
    print("prepared", WORK)


def say(rank, msg, level=logging.INFO):
    if OUT["logfmt"]:
        LOG.log(level, msg)
    elif OUT["label"]:
        print(f"rank {rank}: {msg}", flush=True)
    else:
        print(msg, flush=True)


class Shard(torch.utils.data.Dataset):
    def __init__(self, path, segments, rank, a):
        d = torch.load(path)
        self.x, self.y, self.grain, self.ids = d["x"], d["y"], d["grain"], d["segment"]
        self.segments, self.rank, self.a = segments, rank, a
        if a.fault == "segment_key" and rank == a.rank:
            self.ids[2 * BATCH + 5] = "ESK-R99"

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if (self.a.fault == "worker_crash" and self.rank == self.a.rank and i >= 3
                and torch.utils.data.get_worker_info() is not None):
            os.kill(os.getpid(), signal.SIGKILL)
        basin = torch.zeros(NBASIN)
        basin[self.segments[self.ids[i]]] = 1.0
        return torch.cat([self.x[i], basin]), self.y[i], self.grain[i]


def load_start(model, rank, a):
    path = f"{WORK}/init_ckpt.pt"
    if a.fault == "ckpt_size" and rank == a.rank:
        path = f"{WORK}/init_ckpt_legacy.pt"
    if a.fault == "ckpt_weights_only" and rank == a.rank:
        path = f"{WORK}/init_ckpt_survey.pt"
    sd = torch.load(path)
    model.load_state_dict(sd["state_dict"] if "state_dict" in sd else sd)


def make_loader(rank, a):
    with open(f"{WORK}/segments.json") as f:
        segments = json.load(f)
    sub = "shards_lidar2" if (a.fault == "shard_missing" and rank == a.rank) else "shards"
    ds = Shard(f"{WORK}/{sub}/shard_{rank}.pt", segments, rank, a)
    nw = 1 if (a.fault == "worker_crash" and rank == a.rank) else 0
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)


def step_hook(rank, step, x, a):
    if a.fault == "shape_all":
        x = torch.cat([x, x[:, FEAT:]], dim=1)  # basin one-hot appended a second time: 28 features, not 24
    if rank != a.rank:
        return x
    if a.fault == "nan_check" and step == 3:
        x = x * float("inf")
    if a.fault == "slow_rank" and step == 2:
        with open(f"{WORK}/segments.json") as f:
            table = json.load(f)
        t0, acc = time.time(), 0
        while time.time() - t0 < 45:
            for k, v in table.items():
                acc += sum(ord(c) for c in k) * (v + 1) % 11
    if a.fault == "hang" and step == 2:
        threading.Event().wait()
    if a.fault == "sigabrt" and step == 3:
        os.kill(os.getpid(), signal.SIGABRT)
    if a.fault == "error_exit4" and step == 2:
        say(rank, f"ERROR: rank {rank}: segment ESK-R07 has no crest survey points (0 LiDAR returns); refusing to train",
            logging.ERROR)
        sys.exit(4)
    return x


def gather_grain(rank, step, grain, a):
    n = 5 if (a.fault == "gather_size" and rank == a.rank and step == 2) else 4
    t = torch.bincount(grain, minlength=n)[:n].float()
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).sum(0)


def train(rank, world, a):
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from torch.distributed.distributed_c10d import _set_pg_timeout
    _set_pg_timeout(timedelta(seconds=a.pg_timeout))
    torch.manual_seed(rank)
    net = CrestNet()
    load_start(net, rank, a)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    loader = make_loader(rank, a)
    for step, (x, y, grain) in enumerate(loader):
        if step >= STEPS:
            break
        x = step_hook(rank, step, x, a)
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: crest-height loss is not finite ({loss.item()})")
        bins = gather_grain(rank, step, grain, a)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mae = (pred - y).abs().mean().item()
        say(rank, f"rank {rank} step {step} loss {loss.item():.4f} crest_mae {mae:.3f} (gravel bins {int(bins.sum())})")
    dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), f"{WORK}/export.pt")
        say(rank, f"rank 0 saved {WORK}/export.pt")
    dist.destroy_process_group()


def setup_output(rank, a):
    OUT["label"], OUT["logfmt"] = a.label, a.logfmt
    if a.logdir:
        f = open(f"{a.logdir}/rank{rank}.log", "w", buffering=1)
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")


def entry(rank, world, a):
    torch.set_num_threads(1)
    setup_output(rank, a)
    if not a.logfmt:
        train(rank, world, a)
        return
    try:
        train(rank, world, a)
    except Exception:
        LOG.exception("training failed on rank %d", rank)
        sys.exit(1)


def spawn_worker(i, world, a):
    entry(i, world, a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--label", action="store_true")
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--logdir", default="")
    a = p.parse_args()
    if a.prepare:
        prepare()
        return
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(a.port)
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.spawn(spawn_worker, args=(a.spawn, a), nprocs=a.spawn, join=True)
        return
    entry(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

"""Batch 541 fault script: "vellum manuscript ink fading".

A small distributed job that learns how fast iron-gall ink fades on vellum folios.
Each rank reads its own shard of folio measurements (pigment code, age, humidity,
light exposure -> measured fade), maps pigment codes through a lookup table, starts
from a shared checkpoint, trains a small MLP for 6 steps with gloo all_reduce of the
gradients, and all-reduces a "mean fade" metric. Rank 0 saves an export at the end.

  --prepare            write shards, pigment table and start checkpoint to --work
  --fault NAME --rank N  plant one fault:
    none             control run, nothing planted
    pigment_key      rank N meets a pigment code that is not in the lookup table (KeyError)
    missing_shard    rank N's shard file is gone (FileNotFoundError)
    ckpt_size        rank N loads a checkpoint saved with another hidden width (size mismatch)
    stats_len        rank N all-reduces a metric tensor of the wrong length (collective size mismatch)
    slow_rank        rank N does pure-Python "ink curve" work inside step 2, peers wait in all_reduce
                     (with --pg-timeout 300 this becomes a hang that `timeout` ends)
    nan_fade         rank N's fade targets contain NaN at step 3; the job's own finiteness check raises
    segv             rank N sends itself SIGSEGV at step 2
    logged_exit      rank N prints its own ERROR line and calls sys.exit(4)
    shape_all        every rank builds the model with one input feature too few (shape bug)
    worker_crash     rank N's DataLoader worker SIGKILLs itself while reading a folio
    skip_barrier     rank N skips the metric all_reduce at step 4 and goes on to the next gradient one

What happened (filled in after the runs; machine shared and heavily loaded, load ~30 on 2 cores):
    none           np3 bashloop: all ranks print 6 steps, rank 0 writes the export; exit 0.
    pigment_key    np4 ranklabel: KeyError 'verdigris-x' on rank 2 at step 4; peers fail in all_reduce with gloo "Connection closed by peer"; exit 1.
    missing_shard  np5 srunlabel: FileNotFoundError for folios_rank3_rescan.pt on rank 3 before step 0; peers fail in the start-up broadcast (closed / 12000 ms recv timeout); exit 1.
    ckpt_size      np3 mpitag: RuntimeError size mismatch for fc1.weight in load_state_dict on rank 1; peers fail in the broadcast; exit 1 (inferred).
    stats_len      np4 bashloop: no useful log (one line before the 100 s timeout under load); dropped.
    slow_rank      np5 logfmt and the --pg-timeout 300 hang (np3 ranklabel, twice): empty logs, start-up did not finish inside the limit under load; dropped.
    nan_fade       np4 mpitag: FloatingPointError from the job's own check on rank 0 at step 3; the 100 s timeout ended the job before peers printed errors (124).
    segv           np4 legacy: rank 1 dies by SIGSEGV at step 2; the launcher's summary names rank 1 exitcode -11; exit 1.
    logged_exit    np3 files: rank2.log ends with the program's ERROR line, exit 4; rank0/rank1 fail in all_reduce (closed by peer).
    shape_all      np3 srunlabel: every rank raises "mat1 and mat2 shapes cannot be multiplied (8x12 and 11x16)" at the first forward; exit 1.
                   (np4 spawn attempt: empty log before the 100 s timeout; dropped.)
    worker_crash   np3 tee: rank 2 "DataLoader worker (pid ...) is killed by signal: Killed."; torchrun names rank 2 as root cause; exit 1 (inferred).
    skip_barrier   np5 bashloop: rank 1 aborts with gloo EnforceNotMet "Received data size doesn't match expected size"; ranks 0/3/4 closed by peer, rank 2 times out; 100 s timeout (124).
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

PIGMENTS = ["iron-gall", "carbon", "sepia", "vermilion", "verdigris", "lapis", "orpiment", "minium"]
N_FEAT = 4 + len(PIGMENTS)  # age, humidity, lux, thickness + one-hot pigment
HIDDEN = 16
LOG = None
PREFIX = ""


def say(msg, err=False):
    if LOG is not None:
        (LOG.error if err else LOG.info)(msg)
    else:
        print(PREFIX + msg, file=sys.stderr if err else sys.stdout, flush=True)


def prepare(work, world):
    os.makedirs(work, exist_ok=True)
    g = torch.Generator().manual_seed(541)
    with open(os.path.join(work, "pigments.json"), "w") as f:
        json.dump({p: i for i, p in enumerate(PIGMENTS)}, f)
    for r in range(8):
        n = 64
        codes = [PIGMENTS[int(i)] for i in torch.randint(0, len(PIGMENTS), (n,), generator=g)]
        num = torch.rand(n, 4, generator=g)
        fade = (0.6 * num[:, 0] + 0.3 * num[:, 2] - 0.1 * num[:, 1]).unsqueeze(1)
        torch.save({"codes": codes, "num": num, "fade": fade}, os.path.join(work, f"folios_rank{r}.pt"))
    torch.manual_seed(541)
    model = FadeNet(N_FEAT, HIDDEN)
    torch.save(model.state_dict(), os.path.join(work, "fade_start.pt"))
    torch.save(FadeNet(N_FEAT, HIDDEN + 8).state_dict(), os.path.join(work, "fade_start_wide.pt"))
    print(f"prepared {work}")


class FadeNet(nn.Module):
    def __init__(self, nin, hidden):
        super().__init__()
        self.fc1 = nn.Linear(nin, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Folios(torch.utils.data.Dataset):
    def __init__(self, shard, table, crash=False):
        self.codes, self.num, self.fade = shard["codes"], shard["num"], shard["fade"]
        self.table = table
        self.crash = crash

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        if self.crash and i >= 24:
            os.kill(os.getpid(), signal.SIGKILL)
        onehot = torch.zeros(len(PIGMENTS))
        onehot[self.table[self.codes[i]]] = 1.0
        return torch.cat([self.num[i], onehot]), self.fade[i]


def ink_curve_work(seconds_hint):
    # pure-Python fade-curve integration, deliberately slow
    acc = 0.0
    t0 = time.time()
    k = 0
    while time.time() - t0 < seconds_hint:
        for j in range(20000):
            acc += ((j * 0.37) % 1.3) ** 0.5
        k += 1
    return acc


def run(rank, world, args):
    global LOG, PREFIX
    if args.mode == "ranklabel":
        PREFIX = f"rank {rank}: "
    elif args.mode == "logfmt":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format=f"%(asctime)s [rank{rank}] %(levelname)s vellum.fade: %(message)s")
        LOG = logging.getLogger("vellum")
    fault, frank = args.fault, args.rank
    mine = fault != "none" and rank == frank
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    torch.manual_seed(rank)
    work = args.work
    with open(os.path.join(work, "pigments.json")) as f:
        table = json.load(f)
    shard_path = os.path.join(work, f"folios_rank{rank}.pt")
    if fault == "missing_shard" and mine:
        shard_path = os.path.join(work, f"folios_rank{rank}_rescan.pt")
    shard = torch.load(shard_path)
    if fault == "pigment_key" and mine:
        shard["codes"][37] = "verdigris-x"
    nin = N_FEAT - 1 if fault == "shape_all" else N_FEAT
    model = FadeNet(nin, HIDDEN)
    ck = os.path.join(work, "fade_start_wide.pt" if (fault == "ckpt_size" and mine) else "fade_start.pt")
    if fault != "shape_all":
        model.load_state_dict(torch.load(ck))
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = Folios(shard, table, crash=(fault == "worker_crash" and mine))
    nw = 1 if (fault == "worker_crash" and mine) else 0
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=nw)
    say(f"joined world {world}, shard {os.path.basename(shard_path)} with {len(ds)} folios")
    it = iter(loader)
    for step in range(6):
        x, y = next(it)
        if fault == "nan_fade" and mine and step == 3:
            y = y.clone()
            y[2, 0] = float("nan")
        if fault == "logged_exit" and mine and step == 2:
            say(f"ERROR: pigment table for rank {rank} lists iron-gall twice; refusing to train on a corrupt ink table", err=True)
            sys.exit(4)
        if fault == "segv" and mine and step == 2:
            say(f"scanning folio batch {step} with the native densitometer")
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "slow_rank" and mine and step == 2:
            ink_curve_work(args.slow_s)
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"fade loss is not finite on rank {rank} at step {step}: {loss.item()}")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if fault == "skip_barrier" and mine and step == 4:
            mean_fade = pred.detach().mean().item()
        else:
            n = 5 if (fault == "stats_len" and mine and step == 3) else 2
            stats = torch.zeros(n)
            stats[0] = pred.detach().mean()
            stats[1] = 1.0
            dist.all_reduce(stats)
            mean_fade = (stats[0] / stats[1]).item()
        say(f"rank {rank} step {step} loss {loss.item():.4f} mean_fade {mean_fade:.4f}")
    if rank == 0:
        out = os.path.join(work, "export", "fade_model.pt")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        torch.save(model.state_dict(), out)
        say(f"saved export {out}")
    dist.barrier()
    dist.destroy_process_group()


def spawn_entry(rank, world, args):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    run(rank, world, args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--work", default="/tmp/fault541_work")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--pg-timeout", type=float, default=12)
    ap.add_argument("--slow-s", type=float, default=40)
    ap.add_argument("--mode", default="plain", choices=["plain", "ranklabel", "logfmt"])
    ap.add_argument("--spawn", type=int, default=0)
    args = ap.parse_args()
    if args.prepare:
        prepare(args.work, 8)
        return
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

"""fault651.py - palsa peat mound frost-heave regressor, a hand-run fault job (batch 651).

Synthetic palsa survey data: `--prepare` writes per-rank shards (features + mound codes) into
/tmp/fault651_work, a JSON lookup table (mound code -> height/area strings) that every sample goes through,
and a start checkpoint.  Training: torch.distributed gloo on CPU, --mode trainer (Lightning Trainer + DDPStrategy)
or --mode fabric (lightning.fabric loop).  Every rank prints `rank R step S loss L heave_mm M` each step, logs
through `logging` with timestamps, prints a progress line, and a stats table every 10 steps
(columns include eval_error and failed_batches).  Rank 0 saves an export at the end.

Faults (--fault NAME --rank N):
  none             control
  stall_fh         faulthandler.dump_traceback_later(5) armed on every rank each step; rank N sleeps 40 s
  segv             faulthandler.enable() on every rank; rank N reads address 0 (SIGSEGV) at step 31
  abort            faulthandler.enable() on every rank; rank N calls os.abort() at step 29
  noisy_exc        rank N logs a caught exception (logger.exception) every step; rank (N+1)%W hits
                   ZeroDivisionError (mound area 0 in the table) at step 36
  keyerror         rank N's mound code at step 40 is not in the lookup table (KeyError); run with --steps 50
  stats_valueerror rank N's table entry at step 33 has height 'n/a' (ValueError from float())
  memgrow          rank N keeps every batch (and a 12 MB copy) under RLIMIT_AS -> MemoryError
  nan              rank N's input goes NaN at step 33; the script's finiteness check raises FloatingPointError
  loaderdeath      rank N's DataLoader (1 worker) warns every batch, then the worker SIGKILLs itself at batch 30
  export_fail      training finishes; rank 0's export goes to /dev/full after a long saving phase
  sigkill          rank N SIGKILLs itself at step 34
  restart          rank N indexes past its shard: step 28 on the first attempt, step 2 after a restart
  allsame          every rank fails the same assertion at step 30
  missing_shard    rank N opens a shard file that does not exist
Runs (one line per log):
  palsa_none_np3_rnone_pltorchrun: control, 40 steps on 3 ranks, export saved, exit 0
  palsa_stall_fh_np5_r2_pltee: rank 2 faulthandler 'Timeout (0:00:05)!' dump, ranks 0,1,3,4 gloo 12 s timeout, exit 1
  palsa_segv_np6_r5_plfabric: rank 5 'Fatal Python error: Segmentation fault' at step 31, exitcode -11, exit 1
  palsa_noisy_exc_np4_r1_plloglevel: rank 1 logs ERROR+Traceback each step; rank 2 ZeroDivisionError ~step 36, exit 1
  palsa_keyerror_np5_r4_plbashloop: rank 4 KeyError 'PALSA-X-9999' at step 40 of 50; timeout 124 under load
  palsa_sigkill_np3_r0_plown: rank 0 (launching process) SIGKILLed at step 34, peers connection reset, exit 137
  palsa_nan_np5_r3_pltorchrun: rank 3 FloatingPointError 'loss is nan' at step 33, exit 1
  palsa_restart_np3_r1_plfabric: DROPPED - attempt 1 IndexError at step 28, attempt 2 never reached a step (124)
  palsa_loaderdeath_np4_r2_pltee: rank 2 DataLoader worker warns each batch, killed by signal at batch 30, exit 1
  palsa_stats_valueerror_np6_r3_plloglevel: rank 3 ValueError float('n/a') after step 32, exit 1
  palsa_export_fail_np3_r0_plfabric: 40 steps done; rank 0 export to /dev/full -> basic_ios iostream error, exit 1
  palsa_abort_np5_r0_pltorchrun: rank 0 'Fatal Python error: Aborted' at step 29, exitcode -6, exit 1
  palsa_memgrow_np3_r2_pltorchrun: rank 2 bare MemoryError at step 25 (RLIMIT_AS), exit 1
  palsa_allsame_np5_rall_plbashloop: every rank AssertionError 'mound count 29 != step 30', exit 1
  palsa_missing_shard_np4_r3_pltorchrun: rank 3 FileNotFoundError shard_3_thawed.pt before step 1, exit 1
#
#
#
#
#
#
#
#
#
"""
import argparse
import ctypes
import faulthandler
import json
import logging
import os
import resource
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault651_work"
MAXR, PER = 8, 60 * 4
BS = 4
log = logging.getLogger("palsa")


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(651)
    table = {}
    for r in range(MAXR):
        x = torch.randn(PER, 8, generator=g)
        codes = [f"PALSA-{r}-{i:04d}" for i in range(PER)]
        for i, c in enumerate(codes):
            table[c] = {"height_cm": f"{80 + (i * 7 + r * 13) % 150:.1f}", "area_m2": f"{5 + (i % 40):.1f}"}
        torch.save({"x": x, "codes": codes}, f"{WORK}/shard_{r}.pt")
    with open(f"{WORK}/mound_table.json", "w") as f:
        json.dump(table, f)
    torch.save(make_model().state_dict(), f"{WORK}/start.ckpt")
    print("prepared", WORK, len(table), "mound codes")


def make_model(hidden=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def palsa_collate(batch):
    if os.environ.get("PALSA_WARN_LOADER") == "1":
        warnings.warn(f"thaw-depth probe gap in batch starting {batch[0][2]}: interpolating", RuntimeWarning)
    if os.environ.get("PALSA_KILL_AT"):
        step = batch[0][3]
        if step >= int(os.environ["PALSA_KILL_AT"]):
            os.kill(os.getpid(), signal.SIGKILL)
    x = torch.stack([b[0] for b in batch])
    y = torch.stack([b[1] for b in batch])
    return x, y


class Shard(Dataset):
    def __init__(self, args, rank, nsteps):
        path = f"{WORK}/shard_{rank}.pt"
        if args.fault == "missing_shard" and rank == args.rank:
            path = f"{WORK}/shard_{rank}_thawed.pt"
        d = torch.load(path)
        self.x, self.codes = d["x"], list(d["codes"])
        with open(f"{WORK}/mound_table.json") as f:
            self.table = json.load(f)
        self.n = nsteps * BS
        self.rank, self.args = rank, args
        self.offset = 0
        if args.fault == "keyerror" and rank == args.rank:
            self.codes[39 * BS + 1] = "PALSA-X-9999"
        if args.fault == "stats_valueerror" and rank == args.rank:
            self.table[self.codes[32 * BS + 2]]["height_cm"] = "n/a"
        if args.fault == "noisy_exc" and rank == (args.rank + 1) % args.world:
            self.table[self.codes[35 * BS + 3]]["area_m2"] = "0.0"

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        step = i // BS + 1
        a = self.args
        j = i
        if a.fault == "restart" and self.rank == a.rank:
            at = 2 if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 else 28
            if step >= at:
                j = i + PER
        x = self.x[j]
        ent = self.table[self.codes[i]]
        h = float(ent["height_cm"])
        density = h / float(ent["area_m2"])
        y = torch.tensor([h / 100.0 + 0.001 * density])
        return x, y, self.codes[i], step


def stats_table(rank, step, heave, losses):
    print(f"rank {rank} +------+----------+------------+----------------+-------------+", flush=True)
    print(f"rank {rank} | step | heave_mm | eval_error | failed_batches | thaw_cm     |", flush=True)
    print(f"rank {rank} | {step:4d} | {heave:8.3f} | {sum(losses)/len(losses):10.4f} | "
          f"failed_batches=0 | {30 + step * 0.5:11.2f} |", flush=True)
    print(f"rank {rank} +------+----------+------------+----------------+-------------+", flush=True)


class Hooks:
    def __init__(self, args, rank, world):
        self.a, self.rank, self.world = args, rank, world
        self.hoard, self.losses = [], []
        if args.fault in ("segv", "abort"):
            faulthandler.enable()

    def before(self, step, x):
        a, r = self.a, self.rank
        if a.fault == "stall_fh":
            faulthandler.dump_traceback_later(5, repeat=False)
        if a.warn_every_step:
            warnings.warn(f"palsa survey step {step}: peat moisture sensor reading clipped", UserWarning)
        if a.fault == "noisy_exc" and r == a.rank:
            try:
                ice = {"core_cm": 41.0}["ice_lens_cm"]
            except KeyError:
                log.exception("rank %d step %d: optional ice-lens probe unreadable, using default", r, step)
        hit = r == a.rank
        if hit and a.fault == "stall_fh" and step == 21:
            log.info("rank %d step %d: waiting for frost-probe sync", r, step)
            time.sleep(40)
        if hit and a.fault == "segv" and step == 31:
            ctypes.string_at(0)
        if hit and a.fault == "abort" and step == 29:
            os.abort()
        if hit and a.fault == "sigkill" and step == 34:
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and a.fault == "memgrow":
            if step == 1:
                with open("/proc/self/status") as f:
                    vm = [int(l.split()[1]) for l in f if l.startswith("VmSize")][0] * 1024
                resource.setrlimit(resource.RLIMIT_AS, (vm + 300 * 2**20, resource.RLIM_INFINITY))
            self.hoard.append((x.clone(), bytes(12 * 2**20)))
            log.info("rank %d step %d: cached %d batches for re-weighting", r, step, len(self.hoard))
        if hit and a.fault == "nan" and step == 33:
            x = x * float("nan")
        if a.fault == "allsame" and step == 30:
            assert len(self.losses) == step, f"mound count {len(self.losses)} != step {step}"
        return x

    def after(self, step, loss):
        a, r = self.a, self.rank
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {r} step {step}: loss is {loss.item()} (non-finite)")
        self.losses.append(loss.item())
        if a.fault == "stall_fh":
            faulthandler.cancel_dump_traceback_later()
        heave = 10 * loss.item() + 0.1 * step
        print(f"rank {r} step {step} loss {loss.item():.4f} heave_mm {heave:.3f}", flush=True)
        log.info("rank %d step %d done (lr %.4f)", r, step, a.lr)
        bar = "#" * (20 * step // a.steps)
        print(f"[progress] rank {r} {step}/{a.steps} |{bar:<20}| {100 * step // a.steps}%", flush=True)
        if step % 10 == 0:
            stats_table(r, step, heave, self.losses)


def export(model, a):
    path = "/dev/full" if a.fault == "export_fail" else f"{WORK}/export_palsa.pt"
    n = 12 if a.fault == "export_fail" else 3
    for k in range(n):
        log.info("saving: packing mound export part %d/%d", k + 1, n)
        print(f"saving export part {k + 1}/{n} ...", flush=True)
        time.sleep(0.3)
    torch.save(model.state_dict(), path)
    print("export saved to", path, flush=True)


def make_loader(a, rank):
    ds = Shard(a, rank, a.steps)
    nw = 0
    if a.fault == "loaderdeath" and rank == a.rank:
        os.environ["PALSA_WARN_LOADER"] = "1"
        os.environ["PALSA_KILL_AT"] = "30"
        nw = 1
    return DataLoader(ds, batch_size=BS, shuffle=False, num_workers=nw, collate_fn=palsa_collate)


def load_start(model):
    model.load_state_dict(torch.load(f"{WORK}/start.ckpt"))


def run_trainer(a):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Palsa(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()
            load_start(self.net)

        def setup(self, stage):
            self.hooks = Hooks(a, self.global_rank, self.trainer.world_size)
            a.world = self.trainer.world_size

        def train_dataloader(self):
            return make_loader(a, self.global_rank)

        def training_step(self, batch, i):
            x, y = batch
            step = self.global_step + 1
            x = self.hooks.before(step, x)
            loss = nn.functional.mse_loss(self.net(x), y)
            self.hooks.after(step, loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=a.lr)

    m = Palsa()
    tr = L.Trainer(accelerator="cpu", devices=a.devices,
                   strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)),
                   max_steps=a.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   use_distributed_sampler=False)
    tr.fit(m)
    if tr.global_rank == 0:
        export(m.net, a)


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fab = Fabric(accelerator="cpu", devices=a.devices,
                 strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
    fab.launch()
    r, a.world = fab.global_rank, fab.world_size
    net = make_model()
    load_start(net)
    opt = torch.optim.SGD(net.parameters(), lr=a.lr)
    model, opt = fab.setup(net, opt)
    dl = fab.setup_dataloaders(make_loader(a, r), use_distributed_sampler=False)
    hooks = Hooks(a, r, a.world)
    for i, (x, y) in enumerate(dl):
        step = i + 1
        x = hooks.before(step, x)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        fab.backward(loss)
        opt.step()
        hooks.after(step, loss.detach())
    fab.barrier()
    if r == 0:
        export(net, a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="trainer", choices=["trainer", "fabric"])
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--devices", default="auto")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--warn-every-step", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.devices != "auto":
        a.devices = int(a.devices)
    a.world = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s [pid %(process)d] %(name)s: %(message)s")
    warnings.simplefilter("always")
    torch.set_num_threads(1)
    if a.mode == "trainer":
        run_trainer(a)
    else:
        run_fabric(a)


if __name__ == "__main__":
    main()

"""fault635.py -- "hyrax rock basking": a tiny multi-rank CPU job (gloo) with planted faults.

Each rank reads its shard of synthetic basking sightings (site id, hour, cloud cover), maps the site id
through a JSON lookup table (site -> rock temperature), and fits a small MLP that predicts how many hyraxes
bask on the rock. 6 steps; every rank prints `rank R step S loss L bask_temp M` each step; rank 0 saves an
export at the end. `--prepare` writes the shards, the table and a start checkpoint to /tmp/fault635_work.

Modes: plain (torch.distributed loop), trainer (Lightning Trainer + DDPStrategy), fabric (Lightning Fabric).

Faults (--fault NAME --rank N; --rank2 M for a second rank where a fault uses one, default the next rank):
  none             control
  two_ranks        rank N's DataLoader worker raises at step 2; rank M sleeps 1 s then all_reduces 7 floats
  stall_raise      rank N sleeps 40 s at step 2 (past the pg timeout); rank M raises ValueError 3 s later
  warn_ckpt        every rank warns each step (DeprecationWarning, DataLoader pin_memory UserWarning, gloo
                   env notice); rank N reloads a truncated checkpoint at step 4
  retry_then_fail  rank N's shard read fails once at step 1 (caught, logged with traceback, retried, works);
                   rank M hits a KeyError in the lookup table at step 4
  chained          rank N's lookup KeyError re-raised as RuntimeError(...) from err in a helper at step 3
  finally_fail     rank N raises ValueError at step 3 inside try; its finally saves to /dev/full and fails
  same_early       every rank raises the same ValueError at step 3, rank N at step 2
  skip_collective  rank N logs an unrelated ERROR line at step 1 and goes on; at step 3 skips the metric all_reduce
  restart          (torchrun --max-restarts 1) attempt 0: rank N KeyError at step 2; attempt 1: rank N shard missing
  sigkill_workers  rank N (2 DataLoader workers alive) SIGKILLs itself at step 3
  lazy_env         rank N lazily imports a missing module (hyrax_thermal) at step 3
  nan_detect       every rank's loss is NaN at step 3; rank N checks and raises FloatingPointError
  sys_exit         rank N logs an ERROR line at step 2 and calls sys.exit("...")
  keyerror         rank N's lookup table lacks a site id used at step 2
  sigsegv          rank N segfaults (ctypes) at step 3

Runs (one line per log in sample_logs/cpu_adhoc/hyrax_*.log):
  hyrax_nan_detect_np4_r3_pltee: rank 3 FloatingPointError on NaN loss at step 3; ranks 0, 2 gloo connection closed; exit 1
  hyrax_chained_np3_r1_plloglevel: rank 1 KeyError '37' re-raised as RuntimeError from err at step 3; others gloo closed; exit 1
  hyrax_sys_exit_np3_r0_pltorchrun: Trainer; rank 0 ERROR line then sys.exit message at step 2; ranks 1, 2 gloo closed; exit 1
  hyrax_sigkill_workers_np3_r2_plbashloop: rank 2 SIGKILLed at step 3 with 2 workers; bash 'Killed', statuses 1 1 137; exit 1
  hyrax_none_np3_rnone_plfabric: control, Fabric; 6 steps on every rank, export saved; exit 0
  hyrax_lazy_env_np3_r2_plown: Lightning's own launcher; rank 2 ModuleNotFoundError hyrax_thermal at step 3; exit 1
  hyrax_finally_fail_np4_r1_pltee: rank 1 ValueError at step 3, finally's save to /dev/full RuntimeError; others gloo closed; exit 1
  hyrax_same_early_np4_r0_plloglevel: rank 0 ValueError at step 2; the others died in the all_reduce before their own raise; exit 1
  hyrax_retry_then_fail_np3_r0_plfabric: rank 0 OSError logged and retried OK at step 1; rank 2 KeyError '37' at step 4; exit 1
  hyrax_warn_ckpt_np3_r1_plbashloop: 3 warnings/rank/step; rank 1 truncated checkpoint (PytorchStreamReader) at step 4; exit 1
  hyrax_keyerror_np3_r2_pltorchrun: Trainer; rank 2 KeyError '37' fetching step 2; ranks 0, 1 gloo closed; exit 1
  hyrax_two_ranks_np5_r4_pltee: rank 4 DataLoader worker ValueError at step 2; rank 2 SIGTERMed before its 7-float all_reduce; exit 1
  hyrax_restart_np3_r2_plloglevel: attempt 0 rank 2 KeyError; attempt 1 gloo connectFullMesh Connect timeout on all ranks; exit 1
  hyrax_skip_collective_np5_r1_pltee: rank 1 unrelated ERROR, skipped all_reduce; rank 0 gloo size mismatch abort (-6); exit 1
  hyrax_stall_raise_np5_r0_plloglevel: rank 0 silent 40 s stall at step 2; rank 3 ValueError 3 s later ended the run; exit 1
  (dropped) hyrax_two_ranks_np8_r2_plbashloop: no line printed within 100 s under load; killed by timeout (124)
  -
  -
  -
  -
  -
  -
  -
  -
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault635_work"
STEPS = 6
BS = 4
MAX_RANKS = 8
log = logging.getLogger("hyrax")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="plain", choices=["plain", "trainer", "fabric"])
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--rank2", type=int, default=-1)
    p.add_argument("--devices", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    return p.parse_args()


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(635)
    table = {str(s): round(18.0 + 0.7 * s, 2) for s in range(40)}
    with open(f"{WORK}/rock_table.json", "w") as f:
        json.dump(table, f)
    bad = dict(table)
    bad.pop("37")
    with open(f"{WORK}/rock_table_missing37.json", "w") as f:
        json.dump(bad, f)
    for r in range(MAX_RANKS):
        sites = torch.randint(0, 36, (STEPS * BS,), generator=g)
        hours = torch.rand(STEPS * BS, generator=g) * 12
        cloud = torch.rand(STEPS * BS, generator=g)
        torch.save({"sites": sites, "hours": hours, "cloud": cloud}, f"{WORK}/shard_{r}.pt")
        sites2 = sites.clone()
        sites2[2 * BS] = 37  # a site only the full table knows
        torch.save({"sites": sites2, "hours": hours, "cloud": cloud}, f"{WORK}/shard_{r}_site37.pt")
    torch.manual_seed(635)
    torch.save(make_model().state_dict(), f"{WORK}/start_ckpt.pt")
    raw = open(f"{WORK}/start_ckpt.pt", "rb").read()
    with open(f"{WORK}/basking_ckpt_step3.pt", "wb") as f:
        f.write(raw[: len(raw) // 2])
    print("prepared", WORK, flush=True)


def make_model():
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))


class Sightings(Dataset):
    def __init__(self, rank, table, shard_path, worker_fault_step=-1):
        d = torch.load(shard_path)
        self.sites, self.hours, self.cloud = d["sites"], d["hours"], d["cloud"]
        self.table = table
        self.worker_fault_step = worker_fault_step
        self.rank = rank

    def __len__(self):
        return len(self.sites)

    def __getitem__(self, i):
        if i // BS == self.worker_fault_step:
            raise ValueError(f"sighting record {i} on rank {self.rank}: cloud cover out of range (-3.2)")
        temp = self.table[str(int(self.sites[i]))]
        x = torch.tensor([temp / 40.0, float(self.hours[i]) / 12.0, float(self.cloud[i])])
        y = torch.tensor([temp / 10.0 * (1.0 - float(self.cloud[i]))])
        return x, y


def lookup_temp(table, site):
    try:
        return table[str(site)]
    except KeyError as err:
        raise RuntimeError(f"rock temperature lookup failed for site {site}") from err


class Job:
    """The fault plan for one rank; the same hooks run in every mode."""

    def __init__(self, args, rank, world):
        self.a, self.rank, self.world = args, rank, world
        self.n = args.rank
        self.m = args.rank2 if args.rank2 >= 0 else (args.rank + 1) % world
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.retried = False

    def me(self, r=None):
        return self.rank == (self.n if r is None else r)

    def dataset(self):
        f, r = self.a.fault, self.rank
        table_file = "rock_table.json"
        shard = f"{WORK}/shard_{r}.pt"
        if f == "keyerror" and self.me():
            table_file = "rock_table_missing37.json"
        if f in ("keyerror", "restart") and self.me():
            shard = f"{WORK}/shard_{r}_site37.pt"
        if (f == "retry_then_fail" and self.me(self.m)) or (f == "chained" and self.me()):
            table_file = "rock_table_missing37.json"
        if f == "restart" and self.me():
            if self.attempt == 0:
                table_file = "rock_table_missing37.json"
            else:
                shard = f"{WORK}/shard_{r}_attempt{self.attempt}.pt"
        with open(f"{WORK}/{table_file}") as fh:
            table = json.load(fh)
        wf = 2 if (f == "two_ranks" and self.me()) else -1
        if f == "chained" and self.me():
            return ChainedSightings(r, table, shard)
        if f == "retry_then_fail" and self.me(self.m):
            return LateSightings(r, table, shard)
        return Sightings(r, table, shard, wf)

    def loader(self):
        nw = 1 if self.a.fault == "two_ranks" and self.me() else 0
        if self.a.fault == "sigkill_workers" and self.me():
            nw = 2
        return DataLoader(self.dataset(), batch_size=BS, shuffle=False, num_workers=nw)

    def before(self, step):
        f = self.a.fault
        if f == "warn_ckpt":
            warnings.warn("hyrax.Rock.bask_area is deprecated, use Rock.sunlit_area", DeprecationWarning)
            for _ in DataLoader([0], pin_memory=True):
                pass
            if "GLOO_SOCKET_IFNAME" not in os.environ:
                warnings.warn("GLOO_SOCKET_IFNAME is not set; gloo picks the interface of the host name")
            if step == 4 and self.me():
                sd = torch.load(f"{WORK}/basking_ckpt_step3.pt")
                self.model_ref.load_state_dict(sd)
        if f == "retry_then_fail" and step == 1 and self.me():
            for attempt in range(2):
                try:
                    if attempt == 0:
                        raise OSError(5, "Input/output error", f"{WORK}/shard_{self.rank}.pt")
                    torch.load(f"{WORK}/shard_{self.rank}.pt")
                    log.warning("rank %d: shard re-read worked on attempt %d", self.rank, attempt + 1)
                    break
                except OSError:
                    log.error("rank %d: shard read failed, retrying in 0.5 s\n%s", self.rank, traceback.format_exc())
                    time.sleep(0.5)
        if f == "stall_raise" and step == 2:
            if self.me():
                time.sleep(40)
            elif self.me(self.m):
                time.sleep(3)
                raise ValueError(f"basking rock {self.rank} reported a temperature of -273.2 C")
        if f == "finally_fail" and step == 3 and self.me():
            try:
                raise ValueError("hour of day 25.5 is outside the basking window")
            finally:
                torch.save(self.model_ref.state_dict(), "/dev/full")
        if f == "same_early" and ((step == 2 and self.me()) or (step == 3 and not self.me())):
            raise ValueError("sun angle table has 11 rows, expected 12")
        if f == "skip_collective" and step == 1 and self.me():
            log.error("rank %d: could not write basking telemetry to /tmp/fault635_work/telemetry (ignored)", self.rank)
        if f == "sigkill_workers" and step == 3 and self.me():
            os.kill(os.getpid(), signal.SIGKILL)
        if f == "lazy_env" and step == 3 and self.me():
            import hyrax_thermal  # noqa: F401  (lazy: only needed from step 3)
        if f == "sys_exit" and step == 2 and self.me():
            log.error("rank %d: rock sensor calibration file is empty; refusing to train on uncalibrated temps", self.rank)
            sys.exit(f"rank {self.rank}: uncalibrated rock sensor, stopping")
        if f == "sigsegv" and step == 3 and self.me():
            import ctypes
            ctypes.string_at(0)

    def after_loss(self, step, loss):
        if self.a.fault == "nan_detect" and step == 3:
            loss = loss * float("nan")
            if self.me() and not torch.isfinite(loss):
                raise FloatingPointError(f"rank {self.rank}: loss is {loss.item()} at step {step}")
        return loss

    def sync(self, step, loss, metric):
        f = self.a.fault
        if f == "skip_collective" and step == 3 and self.me():
            return
        if f == "two_ranks" and step == 2 and self.me(self.m):
            time.sleep(1)
            dist.all_reduce(torch.ones(7))
            return
        dist.all_reduce(torch.stack([loss.detach(), metric.detach()]))


class ChainedSightings(Sightings):
    def __getitem__(self, i):
        if i == 3 * BS:
            lookup_temp(self.table, 37)
        return super().__getitem__(i)


class LateSightings(Sightings):
    def __getitem__(self, i):
        if i == 4 * BS:
            self.table["37"]
        return super().__getitem__(i)


def report(rank, step, loss, metric):
    print(f"rank {rank} step {step} loss {loss.item():.4f} bask_temp {metric.item():.3f}", flush=True)


def export(model, rank):
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/hyrax_export.pt")
        print("rank 0 saved export", f"{WORK}/hyrax_export.pt", flush=True)


def run_plain(args):
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    job = Job(args, rank, world)
    model = make_model()
    model.load_state_dict(torch.load(f"{WORK}/start_ckpt.pt"))
    job.model_ref = model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(job.loader()):
        job.before(step)
        pred = model(x)
        loss = job.after_loss(step, nn.functional.mse_loss(pred, y))
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        metric = (x[:, 0] * 40.0).mean()
        report(rank, step, loss, metric)
        job.sync(step, loss, metric)
    export(model, rank)
    dist.barrier()
    dist.destroy_process_group()


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class HyraxModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()
            self.net.load_state_dict(torch.load(f"{WORK}/start_ckpt.pt"))

        def setup(self, stage):
            self.job = Job(args, self.global_rank, self.trainer.world_size)
            self.job.model_ref = self.net

        def train_dataloader(self):
            return Job(args, self.global_rank, self.trainer.world_size).loader()

        def training_step(self, batch, idx):
            x, y = batch
            step = self.global_step
            self.job.before(step)
            loss = self.job.after_loss(step, nn.functional.mse_loss(self.net(x), y))
            metric = (x[:, 0] * 40.0).mean()
            report(self.global_rank, step, loss, metric)
            self.job.sync(step, loss, metric)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    devices = args.devices or int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=STEPS, use_distributed_sampler=False,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = HyraxModule()
    trainer.fit(module)
    export(module.net, trainer.global_rank)


def run_fabric(args):
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    devices = args.devices or int(os.environ.get("WORLD_SIZE", "1"))
    fabric = L.Fabric(accelerator="cpu", devices=devices,
                      strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    job = Job(args, rank, world)
    net = make_model()
    net.load_state_dict(torch.load(f"{WORK}/start_ckpt.pt"))
    job.model_ref = net
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = fabric.setup_dataloaders(job.loader(), use_distributed_sampler=False)
    for step, (x, y) in enumerate(loader):
        job.before(step)
        loss = job.after_loss(step, nn.functional.mse_loss(model(x), y))
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        metric = (x[:, 0] * 40.0).mean()
        report(rank, step, loss, metric)
        job.sync(step, loss, metric)
    export(net, rank)
    fabric.barrier()


def main():
    args = parse()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warnings.simplefilter("always")
    if args.prepare:
        return prepare()
    {"plain": run_plain, "trainer": run_trainer, "fabric": run_fabric}[args.mode](args)


if __name__ == "__main__":
    main()

"""fault615.py - "edelweiss alpine bloom": a tiny multi-rank CPU training job (gloo) that plants one fault.

The job predicts an alpine bloom score from per-rank shards of meadow readings. Each reading names a flower
species; the species name goes through a JSON lookup table (species -> id) into an embedding. `--prepare` writes
the shards, the lookup table and a start checkpoint into /tmp/fault615_work. Every rank prints
`rank R step S loss L bloom_index M` each step; after 6 steps all ranks meet in a final barrier and rank 0 saves
an export. `--mode trainer` uses a Lightning Trainer (DDPStrategy, gloo, timeout --pg-timeout s); `--mode fabric`
uses lightning.fabric.Fabric with its own loop.

Faults (`--fault NAME --rank N`):
  none            control run.
  two_ranks       rank N raises ValueError at step 2; rank N+1 (mod W) sleeps 1 s, then raises RuntimeError.
  warn_storm      every rank warns (UserWarning + FutureWarning) each step; rank N raises ZeroDivisionError at step 3.
  caught_then_fail  rank 0 catches a KeyError at step 1 and logs it with log.exception, goes on; rank N raises
                  OSError (bloom sensor file) at step 4.
  chained         rank N: KeyError in the species lookup at step 2 is re-raised as RuntimeError(...) from err.
  save_fail       rank N torch.saves its export into a missing folder after the last step; others wait in barrier.
  first_step      rank N's embedding gets an index out of range in the forward of step 0 (IndexError).
  dtype_mm        rank N torch.mm's a float by a long tensor at step 3 (RuntimeError).
  tqdm_bar        (fabric) a tqdm bar on every rank on stderr; rank N raises ValueError mid-bar at step 3.
  restart_ok      rank N raises RuntimeError at step 2 on the first attempt only (TORCHELASTIC_RESTART_COUNT=0).
  logging_rank    rank N logs its steps through logging with timestamps, then raises AssertionError at step 3.
  long_msg        rank N raises ValueError at step 2 whose message holds a tensor repr and a dict (multi-line).
  sys_exit        rank N calls sys.exit("...") at step 3.
  sigint          rank N sends itself SIGINT at step 2 (KeyboardInterrupt).
  early_same      every rank raises the same ValueError (negative petal count); rank N at step 2, others at step 3.
  segv            rank N segfaults (ctypes.string_at(0)) at step 3.

Runs (one line per log):
  run01: edelweiss_none_np3_rnone_pltorchrun (port 38000, exit 0): Control run: all three ranks print steps 0-5, Trainer.fit stops at max_steps=6 and rank 0 saves the export; exit 0.
  run02: edelweiss_two_ranks_np6_r2_pltorchrun (port 38001, exit 1): Rank 2 raises ValueError at step 2, rank 3 raises a different RuntimeError a second later; the other four ranks fail with gloo 'Connection closed by peer' (rank 5 inside Lightning's SIGTERM handler) and torchrun names rank 2 as root cause.
  run03: edelweiss_first_step_np8_r0_plfabric (port 38002, exit 1): Rank 0 raises IndexError (index out of range in self) in the embedding during the forward of step 0, no step line printed; four peers fail with gloo 'Connection closed by peer', torchrun SIGTERMs the rest and names rank 0.
  run04: edelweiss_warn_storm_np5_r4_pltee (port 38003, exit 1): A storm of UserWarnings (and one FutureWarning per rank) on all five ranks, then rank 4 raises ZeroDivisionError at step 3; ranks 0-3 fail with gloo 'Connection closed by peer'; torchrun names rank 4.
  run05: edelweiss_caught_then_fail_np5_r3_plloglevel (port 38004, exit 1): Rank 0 logs a caught KeyError with traceback at step 1 and goes on; rank 3 raises OSError [Errno 5] at step 4; the other four ranks fail with gloo 'Connection closed by peer'; torchrun with LOGLEVEL=INFO names rank 3.
  run06: edelweiss_sys_exit_np4_r3_plbashloop (port 38013, exit 124): Rank 3's sys.exit message at step 3 (no traceback), then ranks 0-2 fail with gloo 'Connection closed by peer' tracebacks; the processes then hang at exit and timeout ends the loop at 100 s (exit 124).
  run07: edelweiss_long_msg_np3_r2_pltee (port 38012, exit 1): Rank 2's ValueError message spans a tensor repr and a long dict over ten lines at step 2; ranks 0 and 1 fail with gloo 'Connection closed by peer'; torchrun names rank 2.
  run08: edelweiss_chained_np3_r0_pltorchrun (port 38008, exit 1): Rank 0's KeyError in the species lookup at step 2 is chained into a RuntimeError ('The above exception was the direct cause'); ranks 1 and 2 fail with gloo 'Connection closed by peer'; torchrun names rank 0.
  run09: edelweiss_sigint_np3_r1_plfabric (port 38014, exit 1): Rank 1 SIGINTs itself at step 2 after printing steps 0-1 and dies with KeyboardInterrupt, exitcode -2; ranks 0 and 2 fail with gloo 'Connection closed by peer'; torchrun names rank 1 (SIGINT).
  run10: edelweiss_segv_np3_r2_pltorchrun (port 38016, exit 1): Rank 2 dies silently by SIGSEGV at step 3; ranks 0 and 1 fail with gloo 'Connection reset by peer'; torchrun names rank 2, exitcode -11 (SIGSEGV).
  run11: edelweiss_logging_rank_np3_r1_plloglevel (port 38007, exit 1): Rank 1 logs its step lines through logging with timestamps, the others print plainly; rank 1 fails an assert at step 3; ranks 0 and 2 fail with gloo 'Connection closed by peer'; torchrun (LOGLEVEL=INFO) names rank 1.
  run12: edelweiss_early_same_np3_r1_pltorchrun (port 38015, exit 1): Rank 1 raises ValueError (negative petal count) at step 2, a step before the other ranks would; ranks 0 and 2 fail with gloo 'Connection closed by peer' first; torchrun names rank 1.
  run13: edelweiss_save_fail_np3_r2_plown (port 38021, exit 1): All 6 steps complete; rank 2's torch.save into a missing folder fails (Parent directory ... does not exist) and ranks 0 and 1 fail in the final barrier with gloo 'Connection closed by peer'. Run with --pg-timeout 80 because the np5 plown attempts never formed their group.
  run14: edelweiss_tqdm_bar_np5_r4_plfabric (port 38010, exit 1): Five tqdm bars interleave on stderr; rank 4 raises ValueError mid-bar at step 3; ranks 0-3 fail with gloo 'Connection closed by peer' and their bars stop at 3/6; torchrun names rank 4.
  run15: edelweiss_restart_ok_np3_r1_pltorchrun (port 38011, exit 1): First attempt: rank 1 raises RuntimeError at step 2, peers fail with gloo 'Connection closed by peer'; torchrun restarts once, and the second attempt fails at process-group set-up (Gloo connectFullMesh failed), so the planned recovery did not happen.
  run16: edelweiss_dtype_mm_np5_r2_pltee (port 38022, exit 1): Rank 2's torch.mm(float, long) at step 3 raises a dtype RuntimeError; the four other ranks fail with gloo 'Connection closed by peer'; torchrun names rank 2.
  run17: edelweiss_first_step_np5_r4_plbashloop (port 38023, exit 1): Rank 4 raises IndexError (index out of range in self) in the step-0 forward, no step line from it; ranks 0-3 print step 0 and fail with gloo 'Connection closed by peer'; the loop exits 1.
  run18: edelweiss_two_ranks_np5_r0_plfabric (port 38017, exit 1): Rank 0 raises ValueError at step 2, rank 1 a different RuntimeError a second later; ranks 3 and 4 fail with gloo 'Connection closed by peer'; torchrun names rank 0 and lists rank 1 as SIGTERMed.
  run19: (unused)
  run20: (unused)
  run21: (unused)
  run22: (unused)
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

WORK = "/tmp/fault615_work"
SPECIES = ["edelweiss", "gentian", "alpine_aster", "saxifrage", "soldanella", "arnica", "rock_jasmine", "glacier_buttercup"]
STEPS = 6

log = logging.getLogger("edelweiss")


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(615)
    for r in range(8):
        x = torch.randn(STEPS * 4, 6, generator=g)
        names = [SPECIES[int(i)] for i in torch.randint(0, len(SPECIES), (STEPS * 4,), generator=g)]
        y = torch.rand(STEPS * 4, 1, generator=g)
        torch.save({"x": x, "species": names, "y": y}, f"{WORK}/shard_{r}.pt")
    with open(f"{WORK}/species_lookup.json", "w") as f:
        json.dump({n: i for i, n in enumerate(SPECIES)}, f)
    torch.save(BloomNet().state_dict(), f"{WORK}/start.pt")
    print("prepared", WORK)


class BloomNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(len(SPECIES), 4)
        self.head = torch.nn.Linear(10, 1)

    def forward(self, x, sid):
        return self.head(torch.cat([x, self.emb(sid)], dim=1))


def load_batch(rank, step, lookup, shard):
    sl = slice(step * 4, step * 4 + 4)
    names = shard["species"][sl]
    return shard["x"][sl], torch.tensor([lookup[n] for n in names]), shard["y"][sl]


def before_step(a, rank, world, step, lookup):
    """Faults that fire before the forward."""
    f, n = a.fault, a.rank
    if f == "warn_storm":
        warnings.warn(f"rank {rank} step {step}: bloom_index smoothing window is shorter than the meadow season", UserWarning)
        warnings.warn("petal_density will default to per-shard normalisation in a future release", FutureWarning)
        if rank == n and step == 3:
            _ = 1.0 / 0
    if f == "two_ranks" and step == 2:
        if rank == n:
            raise ValueError(f"meadow shard {rank} has altitude band 'nival' outside the bloom model's range")
        if rank == (n + 1) % world:
            time.sleep(1)
            raise RuntimeError(f"edelweiss density estimator on rank {rank} lost its reference plot")
    if f == "caught_then_fail":
        if rank == 0 and step == 1:
            try:
                lookup["edelweiss_hybrid"]
            except KeyError:
                log.exception("rank 0 step 1: unknown species in lookup, skipping that reading")
        if rank == n and step == 4:
            raise OSError(f"[Errno 5] Input/output error: '{WORK}/bloom_sensor_{rank}.dat'")
    if f == "chained" and rank == n and step == 2:
        try:
            lookup["edelweiss_leontopodium_nivale"]
        except KeyError as err:
            raise RuntimeError(f"rank {rank}: species lookup failed for step {step} readings") from err
    if f == "restart_ok" and rank == n and step == 2 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        raise RuntimeError(f"rank {rank}: transient bloom sensor read failure at step {step}")
    if f == "logging_rank" and rank == n and step == 3:
        assert step < 3, f"rank {rank}: bloom_index window exhausted at step {step}"
    if f == "long_msg" and rank == n and step == 2:
        t = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 7
        stats = {s: {"count": i * 3, "mean_petals": 5.0 + i / 3, "altitude_m": 2100 + 40 * i} for i, s in enumerate(SPECIES)}
        raise ValueError(f"rank {rank}: bloom features out of range at step {step}:\n{t}\nper-species stats: {stats}")
    if f == "sys_exit" and rank == n and step == 3:
        sys.exit(f"rank {rank}: meadow survey aborted, no edelweiss readings left in shard at step {step}")
    if f == "sigint" and rank == n and step == 2:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    if f == "early_same" and step == (2 if rank == n else 3):
        raise ValueError(f"negative petal count in shard {rank} at step {step}")
    if f == "segv" and rank == n and step == 3:
        import ctypes
        ctypes.string_at(0)


def forward(a, rank, step, model, x, sid):
    if a.fault == "first_step" and rank == a.rank and step == 0:
        sid = sid + 100
    out = model(x, sid)
    if a.fault == "dtype_mm" and rank == a.rank and step == 3:
        out = out + torch.mm(x, torch.ones(6, 1, dtype=torch.long))
    return out


def report(a, rank, step, loss, out):
    msg = f"rank {rank} step {step} loss {loss:.4f} bloom_index {torch.sigmoid(out).mean().item():.4f}"
    if a.fault == "logging_rank" and rank == a.rank:
        log.info(msg)
    else:
        print(msg, flush=True)


def finish(a, rank, model, barrier):
    if a.fault == "save_fail" and rank == a.rank:
        torch.save(model.state_dict(), f"{WORK}/exports_missing/edelweiss_rank{rank}.pt")
    barrier()
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/edelweiss_export.pt")
        print("rank 0 saved export", f"{WORK}/edelweiss_export.pt", flush=True)


def setup_logging(a, rank):
    if a.fault == "logging_rank" and rank == a.rank:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout, force=True)
    else:
        logging.basicConfig(level=logging.WARNING)


def run_trainer(a):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Meadow(torch.utils.data.Dataset):
        def __init__(self, rank, lookup):
            self.shard = torch.load(f"{WORK}/shard_{rank}.pt")
            self.rank, self.lookup = rank, lookup

        def __len__(self):
            return STEPS

        def __getitem__(self, step):
            return load_batch(self.rank, step, self.lookup, self.shard)

    class BloomModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = BloomNet()
            self.net.load_state_dict(torch.load(f"{WORK}/start.pt"))
            with open(f"{WORK}/species_lookup.json") as f:
                self.lookup = json.load(f)

        def setup(self, stage):
            setup_logging(a, self.global_rank)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Meadow(self.global_rank, self.lookup), batch_size=None, shuffle=False)

        def training_step(self, batch, idx):
            rank, step = self.global_rank, self.global_step
            before_step(a, rank, self.trainer.world_size, step, self.lookup)
            x, sid, y = batch
            out = forward(a, rank, step, self.net, x, sid)
            loss = torch.nn.functional.mse_loss(out, y)
            report(a, rank, step, loss.item(), out)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = L.Trainer(accelerator="cpu", devices=a.devices,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    m = BloomModule()
    trainer.fit(m)
    finish(a, trainer.global_rank, m.net, trainer.strategy.barrier)


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=a.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    setup_logging(a, rank)
    net = BloomNet()
    net.load_state_dict(torch.load(f"{WORK}/start.pt"))
    with open(f"{WORK}/species_lookup.json") as f:
        lookup = json.load(f)
    shard = torch.load(f"{WORK}/shard_{rank}.pt")
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = fabric.setup(net, opt)
    steps = range(STEPS)
    if a.fault == "tqdm_bar":
        from tqdm import tqdm
        steps = tqdm(steps, desc=f"rank {rank} bloom", file=sys.stderr)
    for step in steps:
        if a.fault == "tqdm_bar" and rank == a.rank and step == 3:
            raise ValueError(f"rank {rank}: bloom_index histogram got an empty altitude bin at step {step}")
        before_step(a, rank, world, step, lookup)
        x, sid, y = load_batch(rank, step, lookup, shard)
        out = forward(a, rank, step, model, x, sid)
        loss = torch.nn.functional.mse_loss(out, y)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        report(a, rank, step, loss.item(), out)
        if a.fault == "tqdm_bar":
            time.sleep(0.3)
    finish(a, rank, net, fabric.barrier)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", choices=["trainer", "fabric"], default="trainer")
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    a = p.parse_args()
    if a.prepare:
        return prepare()
    torch.manual_seed(615)
    if a.mode == "trainer":
        run_trainer(a)
    else:
        run_fabric(a)


if __name__ == "__main__":
    main()

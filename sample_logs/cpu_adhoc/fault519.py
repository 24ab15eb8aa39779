"""Canal lock queue time prediction: a small distributed regression job (gloo, CPU, Lightning).

Each rank reads its own shard of lock passages (vessel length, beam, draught, tonnage, hour of day,
upstream flag, lock id), joins them with a lookup table of lock chambers, predicts the queue time in
minutes with a small MLP started from a checkpoint, and all-reduces its mean absolute error each step.
Rank 0 saves an export at the end.

Run `--prepare` first (writes shards, lookup table and start checkpoint to --work).
Forms: plain Trainer (`--devices W`, Lightning starts the others), Trainer under torchrun, or
`--fabric` (lightning.fabric.Fabric with its own loop, under torchrun).

Faults (`--fault NAME --rank N`), ONE per run:
  none            control, no fault
  keyerror        rank N's shard names lock id 'L99' that the chamber lookup table lacks -> KeyError
  missingshard    rank N's shard file is absent -> FileNotFoundError
  ckptsize        rank N builds the model with hidden=48, the start checkpoint has 32 -> load_state_dict size mismatch
  weightsonly     rank N loads a checkpoint that pickles a custom LockCalendar object -> weights_only refusal
  mae_size        rank N all-reduces a 3-element MAE tensor, its peers 1 element -> gloo size mismatch
  slowrank        rank N recomputes a lock schedule in pure Python for ~200 s at step 3 -> peers time out
                  (with --pg-timeout 300: a hang that `timeout` ends)
  nan             rank N's draught column holds NaN from step 2; the program's finiteness check raises
  sigsegv         rank N sends itself SIGSEGV at step 3
  exit4           rank N prints its own ERROR line and sys.exit(4) at step 2
  shapebug        every rank reshapes its 8-column features to 6 columns -> reshape RuntimeError
  workercrash     rank N's DataLoader worker SIGKILLs itself -> DataLoader worker killed

What happened (runs of 2026-12-07, Lightning 2.6.6, torch 2.13.0+cpu, 2 shared cores):
  none            np3 torchrun: 6 steps on every rank, export saved, exit 0 (an earlier plown try stalled at exit under load: dropped)
  keyerror        np4 r2 torchrun / np5 r4 bash loop: KeyError 'L99' on the rank, peers gloo 'Connection closed by peer' (rank 0 once a recv timeout)
  missingshard    np5 r3 --tee 3: FileNotFoundError in train_dataloader, peers 'Connection closed by peer'
  ckptsize        np4 r1 Fabric: load_state_dict size mismatch before any step, peers 'Connection closed by peer'
  weightsonly     np3 r0 LOGLEVEL=INFO: UnpicklingError 'Weights only load failed ... LockCalendar', peers 'Connection closed'
  mae_size        np3 r2 torchrun: no size error; rank 1 printed a wrong mae, then all ranks gloo 'Timed out waiting 12000ms'
  slowrank        np3 r1 --tee 3: peers gloo timeouts after 12 s, torchrun SIGTERMs rank 1; np3 r1 plown --pg-timeout 300: output stops after step 2 until timeout (exit 137)
  nan             np3 r1 torchrun / np6 r5 Fabric: FloatingPointError from the script's check, peers 'Connection closed'
  sigsegv         np3 r2 plown: Lightning reports child exit -11 and force-kills the others, exit 137
  exit4           np3 r2 bash loop: ERROR line then exit 4, peers 'Connection closed'; the loop's `wait` returns 0
  shapebug        np4 all LOGLEVEL=INFO: every rank RuntimeError shape '[-1, 6]' is invalid at step 0
  workercrash     np4 r1 torchrun: 'DataLoader worker (pid ...) is killed by signal: Killed' before any step, peers 'Connection closed'
"""
import argparse, json, os, sys, signal, time, math
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader

NFEAT = 8
HIDDEN = 32
STARTUP_TIMEOUT = 90


class LockCalendar:  # a custom object pickled into the "weightsonly" checkpoint
    def __init__(self):
        self.closures = ["2026-01-12", "2026-02-03"]


def prepare(work, world_max=8):
    os.makedirs(work, exist_ok=True)
    g = torch.Generator().manual_seed(519)
    chambers = {f"L{i}": {"length_m": 110.0 + 10 * i, "lift_m": 3.0 + 0.5 * i, "fill_min": 8 + i} for i in range(6)}
    with open(os.path.join(work, "chambers.json"), "w") as f:
        json.dump(chambers, f)
    for r in range(world_max):
        n = 96
        x = torch.rand(n, 6, generator=g)
        ids = [f"L{int(v)}" for v in torch.randint(0, 6, (n,), generator=g)]
        torch.save({"x": x, "lock_ids": ids}, os.path.join(work, f"shard_{r}.pt"))
    torch.manual_seed(519)
    m = make_model(HIDDEN)
    torch.save(m.state_dict(), os.path.join(work, "start.pt"))
    torch.save({"model": m.state_dict(), "calendar": LockCalendar()}, os.path.join(work, "start_with_calendar.pt"))
    print("prepared", work)


def make_model(hidden):
    return nn.Sequential(nn.Linear(NFEAT, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class Passages(Dataset):
    def __init__(self, work, rank, fault, fault_rank):
        path = os.path.join(work, f"shard_{rank}.pt")
        if fault == "missingshard" and rank == fault_rank:
            path = os.path.join(work, f"shard_{rank}_2026w49.pt")
        d = torch.load(path)
        with open(os.path.join(work, "chambers.json")) as f:
            self.chambers = json.load(f)
        self.x, self.ids = d["x"], list(d["lock_ids"])
        if fault == "keyerror" and rank == fault_rank:
            self.ids[37] = "L99"
        self.rank, self.fault, self.fault_rank = rank, fault, fault_rank

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.fault == "workercrash" and self.rank == self.fault_rank and i >= 40:
            info = torch.utils.data.get_worker_info()
            if info is not None:
                os.kill(os.getpid(), signal.SIGKILL)
        c = self.chambers[self.ids[i]]
        feat = torch.cat([self.x[i], torch.tensor([c["length_m"] / 200.0, c["lift_m"] / 10.0])])
        y = 10.0 * self.x[i, 0] + 0.6 * c["fill_min"] + 5.0 * self.x[i, 4]
        return feat, y.reshape(1)


def build_model(work, rank, fault, fault_rank):
    hidden = 48 if (fault == "ckptsize" and rank == fault_rank) else HIDDEN
    m = make_model(hidden)
    if fault == "weightsonly" and rank == fault_rank:
        sd = torch.load(os.path.join(work, "start_with_calendar.pt"))["model"]
    else:
        sd = torch.load(os.path.join(work, "start.pt"))
    m.load_state_dict(sd)
    return m


def step_body(model, batch, step, rank, args):
    feat, y = batch
    if args.fault == "nan" and rank == args.rank and step >= 2:
        feat = feat.clone(); feat[:, 2] = float("nan")
    if args.fault == "shapebug":
        feat = feat.reshape(-1, 6)
    if not torch.isfinite(feat).all():
        raise FloatingPointError(f"rank {rank} step {step}: non-finite features in batch (draught column)")
    pred = model(feat)
    loss = nn.functional.mse_loss(pred, y)
    if args.fault == "exit4" and rank == args.rank and step == 2:
        print(f"ERROR rank {rank}: lock schedule for chamber L3 has overlapping closures; aborting", flush=True)
        sys.exit(4)
    if args.fault == "sigsegv" and rank == args.rank and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "slowrank" and rank == args.rank and step == 3:
        t0 = time.time(); acc = 0
        while time.time() - t0 < 200:
            for k in range(20000):
                acc += (k * 7919) % 13
    mae = (pred.detach() - y).abs().mean().reshape(1)
    if args.fault == "mae_size" and rank == args.rank and step == 3:
        mae = mae.repeat(3)
    dist.all_reduce(mae)
    mae = mae / dist.get_world_size()
    print(f"rank {rank} step {step} loss {loss.item():.4f} mae_min {mae[0].item():.3f}", flush=True)
    return loss


def set_step_timeout(args):
    # start-up (2 shared cores, up to 8 ranks importing Lightning) gets STARTUP_TIMEOUT; the training
    # collectives get --pg-timeout (12 s by default)
    from torch.distributed.distributed_c10d import _set_pg_timeout
    _set_pg_timeout(timedelta(seconds=args.pg_timeout))


def make_loader(ds, args, rank):
    nw = 2 if (args.fault == "workercrash" and rank == args.rank) else 0
    return DataLoader(ds, batch_size=16, shuffle=False, num_workers=nw)


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Mod(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None

        def configure_model(self):
            set_step_timeout(args)
            if self.model is None:
                self.model = build_model(args.work, self.global_rank, args.fault, args.rank)

        def training_step(self, batch, idx):
            return step_body(self.model, batch, self.global_step, self.global_rank, args)

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.01)

        def train_dataloader(self):
            return make_loader(Passages(args.work, self.global_rank, args.fault, args.rank), args, self.global_rank)

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.model.state_dict(), os.path.join(args.work, "export_queue_model.pt"))
                print("rank 0 saved export", os.path.join(args.work, "export_queue_model.pt"), flush=True)

    trainer = L.Trainer(accelerator="cpu", devices=args.devices,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=STARTUP_TIMEOUT)),
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(Mod())


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=STARTUP_TIMEOUT)))
    fabric.launch()
    set_step_timeout(args)
    rank = fabric.global_rank
    model = build_model(args.work, rank, args.fault, args.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    loader = make_loader(Passages(args.work, rank, args.fault, args.rank), args, rank)
    step = 0
    for batch in loader:
        if step >= args.steps:
            break
        opt.zero_grad()
        loss = step_body(model, batch, step, rank, args)
        fabric.backward(loss)
        opt.step()
        step += 1
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.work, "export_queue_model.pt"))
        print("rank 0 saved export", os.path.join(args.work, "export_queue_model.pt"), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--work", default="/tmp/fault519_work")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fabric", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare(args.work)
    elif args.fabric:
        run_fabric(args)
    else:
        run_trainer(args)

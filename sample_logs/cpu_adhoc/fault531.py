"""Batch 531 fault script: lava flow front speed from thermal drone frames.

Each rank reads its own shard of synthetic thermal-drone features (per-flight
surface temperature statistics), calibrates them with a per-drone lookup table,
and trains a small MLP that predicts the lava flow front speed (m/h), starting
from a prepared checkpoint. gloo backend, CPU only, 6 steps; every rank prints
`rank R step S loss L front_mae M`; rank 0 writes an export at the end.

Launcher forms: Lightning Trainer (`--mode trainer`, started by Lightning itself,
by torchrun, or one python per rank) and lightning.fabric (`--mode fabric`).

Faults (--fault NAME --rank N):
  none            control, no fault
  keyerror        rank N meets a drone id the calibration table lacks (KeyError)
  missing_shard   rank N's shard file is not there (FileNotFoundError)
  ckpt_size       rank N loads the start checkpoint of a wider model (size mismatch)
  allgather_shape rank N all_gathers a metric tensor of another length
  slow_rank       rank N does 30 s of pure-Python work at step 3; peers time out
  hang            like slow_rank but forever (use --pg-timeout 300; `timeout` ends it)
  nan_check       rank N's frames turn inf; the script's own finiteness check raises
  sigsegv         rank N sends itself SIGSEGV at step 3
  error_exit      rank N prints its own ERROR line and sys.exit(4)
  shape_all       every rank slices one feature too few at step 2 (matmul shape bug)
  worker_crash    rank N's DataLoader worker is killed (SIGKILL) while loading

What happened (runs of 2026-12-07, Lightning 2.6.6, torch 2.13.0+cpu, gloo):
  none            plown np4 and plfabric np3 finish all 6 steps, export saved, exit 0 (first plfabric
                  try aborted rank 1 at exit until the script destroyed its process group; dropped)
  keyerror        rank N: KeyError: 'TD-17' at step 2, peers 'Connection closed by peer'
                  (the plbashloop run lingered after the errors until the timeout: exit 124)
  missing_shard   rank N: FileNotFoundError for thermal_shard_rN_flight0412.pt before step 1
  ckpt_size       rank N: load_state_dict 'size mismatch for 0.weight' before step 1
  allgather_shape a peer aborts with gloo 'Received data size doesn't match expected size'
  slow_rank       peers: gloo 'Timed out waiting 12000ms'; torchrun blames a waiting peer
                  (the plown try never formed the group: TCPStore 13 s timeout on a loaded host; dropped)
  hang            steps 1-2 then silence; timeout SIGTERMs torchrun, SIGKILL 5 s later (exit 137)
  nan_check       rank N: FloatingPointError non-finite loss nan at step 4
  sigsegv         rank N exits -11 (torchrun) or just vanishes (plown, run with --pg-timeout 60)
  error_exit      rank N prints its ERROR line and exits 4 (gloo may add 'terminate called')
  shape_all       every rank: mat1 and mat2 shapes cannot be multiplied (16x7 and 8x32)
  worker_crash    rank N: ConnectionResetError inside DataLoader._get_data (worker SIGKILLed)
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault531_work"
FEAT, HID, BS, STEPS, NDRONES = 8, 32, 16, 6, 12


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(531)
    for r in range(8):
        x = torch.randn(BS * STEPS, FEAT, generator=g) * 40 + 900  # kelvin-ish
        ids = torch.randint(0, NDRONES, (BS * STEPS,), generator=g)
        y = (x[:, :3].mean(1) - 900) / 10 + 5 + torch.randn(BS * STEPS, generator=g) * 0.3
        torch.save({"x": x, "ids": ids, "y": y}, f"{WORK}/thermal_shard_r{r}.pt")
    json.dump({f"TD-{i:02d}": round(0.5 * i - 3, 2) for i in range(NDRONES)},
              open(f"{WORK}/drone_calibration.json", "w"))
    torch.manual_seed(0)
    torch.save(make_model(HID).state_dict(), f"{WORK}/front_speed_init.pt")
    torch.save(make_model(48).state_dict(), f"{WORK}/front_speed_init_wide.pt")
    print("prepared", WORK)


def make_model(h):
    return nn.Sequential(nn.Linear(FEAT, h), nn.Tanh(), nn.Linear(h, 1))


class Shard(Dataset):
    def __init__(self, rank, fault, frank):
        name = f"{WORK}/thermal_shard_r{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            name = f"{WORK}/thermal_shard_r{rank}_flight0412.pt"
        d = torch.load(name, weights_only=True)
        self.x, self.ids, self.y = d["x"], d["ids"], d["y"]
        self.kill = fault == "worker_crash" and rank == frank

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.kill and i >= 2 * BS and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.ids[i], self.y[i]


class Job:
    def __init__(self, args, rank, world):
        self.a, self.rank, self.world = args, rank, world
        self.table = json.load(open(f"{WORK}/drone_calibration.json"))

    def load_model(self):
        m = make_model(HID)
        path = f"{WORK}/front_speed_init.pt"
        if self.a.fault == "ckpt_size" and self.rank == self.a.rank:
            path = f"{WORK}/front_speed_init_wide.pt"
        m.load_state_dict(torch.load(path, weights_only=True))
        return m

    def loader(self):
        nw = 1 if (self.a.fault == "worker_crash" and self.rank == self.a.rank) else 0
        return DataLoader(Shard(self.rank, self.a.fault, self.a.rank), batch_size=BS, shuffle=False,
                          num_workers=nw)

    def loss(self, model, batch, step):
        a, r = self.a, self.rank
        mine = a.rank == r
        x, ids, y = batch
        if a.fault == "keyerror" and mine and step == 2:
            ids = ids.clone(); ids[5] = 17
        cal = torch.tensor([self.table[f"TD-{int(i):02d}"] for i in ids])
        x = (x - 900) / 40 + cal[:, None] * 0.01
        if a.fault == "nan_check" and mine and step == 4:
            x = x * float("inf")
        if a.fault == "shape_all" and step == 2:
            x = x[:, : FEAT - 1]
        if mine and step == 3:
            if a.fault in ("slow_rank", "hang"):
                t0, n = time.time(), 0
                while a.fault == "hang" or time.time() - t0 < 30:
                    n += sum(i * i for i in range(20000))
            if a.fault == "sigsegv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if a.fault == "error_exit":
                print(f"ERROR rank {r}: thermal frame timestamps out of order in flight TD-07 "
                      f"(frame 211 after 212), refusing to train on it", flush=True)
                sys.exit(4)
        pred = model(x).squeeze(-1)
        loss = nn.functional.mse_loss(pred, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {r}: non-finite loss {loss.item()} at step {step} "
                                     f"(front speed regression)")
        mae = (pred.detach() - y).abs().mean()
        if step == 3:
            n = 3 if (a.fault == "allgather_shape" and mine) else 2
            t = torch.full((n,), float(mae))
            out = [torch.zeros(n) for _ in range(self.world)]
            dist.all_gather(out, t)
        print(f"rank {r} step {step} loss {loss.item():.4f} front_mae {mae.item():.4f}", flush=True)
        return loss


def strategy(args):
    from lightning.pytorch.strategies import DDPStrategy
    return DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))


def run_trainer(args):
    import lightning as L

    class Module(L.LightningModule):
        def setup(self, stage):
            self.job = Job(args, self.global_rank, self.trainer.world_size)
            self.net = self.job.load_model()

        def training_step(self, batch, idx):
            return self.job.loss(self.net, batch, idx + 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return self.job.loader()

        def on_train_end(self):
            if self.global_rank == 0:
                torch.save(self.net.state_dict(), f"{WORK}/front_speed_export.pt")
                print("rank 0 saved export", f"{WORK}/front_speed_export.pt", flush=True)

    tr = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy(args), max_steps=STEPS,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, use_distributed_sampler=False)
    tr.fit(Module())


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fab = Fabric(accelerator="cpu", devices=args.devices,
                 strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fab.launch()
    job = Job(args, fab.global_rank, fab.world_size)
    model = job.load_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fab.setup(model, opt)
    dl = job.loader()
    for step, batch in enumerate(dl, 1):
        loss = job.loss(model, batch, step)
        opt.zero_grad()
        fab.backward(loss)
        opt.step()
        if step == STEPS:
            break
    fab.barrier()
    if fab.global_rank == 0:
        torch.save(model.state_dict(), f"{WORK}/front_speed_export.pt")
        print("rank 0 saved export", f"{WORK}/front_speed_export.pt", flush=True)
    dist.destroy_process_group()  # without it gloo aborted one rank at exit (terminate called ...)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="trainer", choices=["trainer", "fabric"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.mode == "fabric":
        run_fabric(a)
    else:
        run_trainer(a)

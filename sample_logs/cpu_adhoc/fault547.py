"""Cirque glacier retreat: a small distributed regression job (gloo, CPU only).

Each rank reads its shard of cirque-glacier observations (elevation, aspect,
summer temperature anomaly, winter precipitation, debris cover, headwall height),
maps every glacier id to its region through a lookup table, starts from a shared
checkpoint and fits the terminus retreat (m/yr) for 6 steps.  Every rank prints
`rank R step S loss L retreat_mae M`; rank 0 saves an export at the end.

Forms: --form pl (Lightning Trainer; under torchrun, one python per rank, or
--devices W where Lightning starts the other ranks itself) and --form fabric
(lightning.fabric.Fabric with its own loop, under torchrun).

Faults (--fault NAME --rank N):
  none            control, nothing planted
  keyerror        rank N's shard holds a glacier id missing from the region lookup table
  missing_shard   rank N opens a shard file that was never written
  ckpt_size       rank N loads a checkpoint of a wider model (size mismatch in load_state_dict)
  weights_only    rank N loads a checkpoint that pickles a custom object (torch.load weights_only refusal)
  allreduce_size  rank N all-reduces its retreat metric with one element too many
  slow            rank N recomputes the moraine index in pure Python for ~45 s; peers time out (PG timeout 12 s)
  hang            like slow but forever, run with --pg-timeout 300 so only the outer `timeout` ends it
  nan             rank N's loss becomes NaN; the script's own finiteness check raises FloatingPointError
  sigsegv         rank N sends itself SIGSEGV at step 3
  error_exit      rank N prints its own ERROR line and calls sys.exit(4)
  shape_all       every rank multiplies by a regional weight matrix of the wrong shape at step 3
  hostmem         rank N tries to allocate an ~8 TB host buffer for a melt grid (fails at once, kept small)

What happened (runs of 2026-12-07, Lightning 2.6.6, torch 2.13.0+cpu, gloo):
  none            np3 pltorchrun: all ranks finish 6 steps, export saved, exit 0
  keyerror        np6 r5 pltorchrun: rank 5 KeyError 'CIRQ-9999' in setup; peers 'Connection closed by peer'; exit 1
  missing_shard   np5 r3 pltee / np3 r1 plown: FileNotFoundError for shard_N_resampled.npz in setup; peers connection closed; exit 1
  ckpt_size       np4 r1 plloglevel: load_state_dict size mismatch (48 vs 32) on rank 1; exit 1
  weights_only    np6 r4 pltorchrun / np3 r2 plfabric: UnpicklingError (GLOBAL __main__.GlacierMeta not allowed); exit 1
  allreduce_size  np5 r2 plfabric: no size error from gloo; other ranks print step 1, then every rank times out after 12 s; exit 1
  slow            np4 r3 pltorchrun / np6 r1 plfabric: peers time out (12000ms recv/send), some abort (terminate called); slow rank SIGTERMed; exit 1
  hang            np3 r2 pltorchrun, --pg-timeout 300: output stops after step 2, outer timeout SIGTERM then SIGKILL; exit 137
  nan             np5 r4 plloglevel / np3 r0 plown: FloatingPointError from the script's own check at step 3; exit 1
  sigsegv         np8 r3 pltorchrun / np4 r2 pltee: rank dies with -11 (SIGSEGV), no traceback; peers reset/closed/timeout; exit 1
  error_exit      np6 r2 pltee: rank 2's own ERROR line, exit code 4 in torchrun's summary; exit 1
  shape_all       np4 plfabric: every rank 'mat1 and mat2 shapes cannot be multiplied (16x5 and 3x6)'; exit 1
  hostmem         np5 r1 pltorchrun: DefaultCPUAllocator can't allocate 8000000000000 bytes on rank 1; exit 1
  (plbashloop, one python per rank, printed nothing and was stopped by the outer timeout twice: not kept.)
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

WORK = "/tmp/fault547_work"
NFEAT, HID, NREG = 6, 32, 5


class GlacierMeta:  # pickled into the "meta" checkpoint (weights_only refuses it)
    def __init__(self, survey):
        self.survey = survey


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = np.random.default_rng(547)
    ids = [f"CIRQ-{i:04d}" for i in range(400)]
    lookup = {gid: int(g.integers(0, NREG)) for gid in ids}
    with open(f"{WORK}/region_lookup.json", "w") as f:
        json.dump(lookup, f)
    for r in range(8):
        x = g.normal(size=(64, NFEAT)).astype(np.float32)
        y = (x @ np.array([-0.8, 0.3, 1.4, -0.6, -0.4, 0.2], np.float32) + 0.1 * g.normal(size=64)).astype(np.float32)
        gids = np.array([ids[int(k)] for k in g.integers(0, 400, 64)])
        np.savez(f"{WORK}/shard_{r}.npz", x=x, y=y, gid=gids)
        bad = gids.copy(); bad[17] = "CIRQ-9999"
        np.savez(f"{WORK}/shard_{r}_badid.npz", x=x, y=y, gid=bad)
    torch.manual_seed(547)
    torch.save(RetreatNet().state_dict(), f"{WORK}/init_ckpt.pt")
    torch.save(RetreatNet(hid=48).state_dict(), f"{WORK}/init_ckpt_wide.pt")
    torch.save({"model": RetreatNet().state_dict(), "meta": GlacierMeta("2019 LiDAR")}, f"{WORK}/init_ckpt_meta.pt")
    print("prepared", WORK)


class RetreatNet(nn.Module):
    def __init__(self, hid=HID):
        super().__init__()
        self.emb = nn.Embedding(NREG, 4)
        self.body = nn.Sequential(nn.Linear(NFEAT + 4, hid), nn.Tanh(), nn.Linear(hid, 1))

    def forward(self, x, reg):
        return self.body(torch.cat([x, self.emb(reg)], 1)).squeeze(1)


def load_rank_data(rank, fault, frank):
    path = f"{WORK}/shard_{rank}.npz"
    if fault == "keyerror" and rank == frank:
        path = f"{WORK}/shard_{rank}_badid.npz"
    if fault == "missing_shard" and rank == frank:
        path = f"{WORK}/shard_{rank}_resampled.npz"
    d = np.load(path)
    with open(f"{WORK}/region_lookup.json") as f:
        lookup = json.load(f)
    reg = np.array([lookup[str(k)] for k in d["gid"]])
    return torch.from_numpy(d["x"]), torch.from_numpy(d["y"]), torch.from_numpy(reg)


def load_init(model, rank, fault, frank):
    path = f"{WORK}/init_ckpt.pt"
    if fault == "ckpt_size" and rank == frank:
        path = f"{WORK}/init_ckpt_wide.pt"
    if fault == "weights_only" and rank == frank:
        path = f"{WORK}/init_ckpt_meta.pt"
    sd = torch.load(path)
    if "model" in sd:
        sd = sd["model"]
    model.load_state_dict(sd)


def moraine_index_python(seconds):
    t0, acc, i = time.time(), 0.0, 0
    while seconds is None or time.time() - t0 < seconds:
        for _ in range(20000):
            i += 1
            acc += (i % 97) * 1e-7
    return acc


def step_fault(a, rank, step, x, reg, loss):
    """Faults that fire during step 3 (step index 2)."""
    if step != 2:
        return loss
    f, n = a.fault, a.rank
    if f == "slow" and rank == n:
        moraine_index_python(45)
    if f == "hang" and rank == n:
        moraine_index_python(None)
    if f == "nan" and rank == n:
        loss = loss * torch.tensor(float("nan"))
    if f == "sigsegv" and rank == n:
        os.kill(os.getpid(), signal.SIGSEGV)
    if f == "error_exit" and rank == n:
        print(f"ERROR rank {rank}: terminus survey for step {step + 1} has no valid moraine picks; giving up", flush=True)
        sys.exit(4)
    if f == "shape_all":
        regional = torch.ones(NREG + 1, 3)
        _ = torch.nn.functional.one_hot(reg, NREG).float() @ regional.t()
    if f == "hostmem" and rank == n:
        grid = torch.empty(2 * 10**12, dtype=torch.float32)  # melt grid at 1 m resolution
        grid.zero_()
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step + 1}: retreat loss is not finite ({loss.item()})")
    return loss


def metric_allreduce(a, rank, mae, world):
    t = torch.tensor([mae, 1.0])
    if a.fault == "allreduce_size" and rank == a.rank:
        t = torch.tensor([mae, 1.0, 0.0])
    dist.all_reduce(t)
    return (t[0] / world).item()


def run_pl(a):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = RetreatNet()

        def setup(self, stage):
            r = self.global_rank
            self.x, self.y, self.reg = load_rank_data(r, a.fault, a.rank)
            load_init(self.net, r, a.fault, a.rank)

        def train_dataloader(self):
            ds = torch.utils.data.TensorDataset(self.x, self.y, self.reg)
            return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False)

        def training_step(self, batch, i):
            x, y, reg = batch
            r = self.global_rank
            pred = self.net(x, reg)
            loss = ((pred - y) ** 2).mean()
            loss = step_fault(a, r, self.global_step, x, reg, loss)
            mae = metric_allreduce(a, r, (pred - y).abs().mean().item(), self.trainer.world_size)
            print(f"rank {r} step {self.global_step + 1} loss {loss.item():.4f} retreat_mae {mae:.4f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    devices = a.devices or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=1, max_steps=6,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    m = Module()
    trainer.fit(m)
    if trainer.global_rank == 0:
        torch.save(m.net.state_dict(), f"{WORK}/export_retreatnet.pt")
        print(f"rank 0 saved export {WORK}/export_retreatnet.pt", flush=True)


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
    fabric.launch()
    r, world = fabric.global_rank, fabric.world_size
    x, y, reg = load_rank_data(r, a.fault, a.rank)
    net = RetreatNet()
    load_init(net, r, a.fault, a.rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    for step in range(6):
        sl = slice((step % 4) * 16, (step % 4) * 16 + 16)
        pred = net(x[sl], reg[sl])
        loss = ((pred - y[sl]) ** 2).mean()
        loss = step_fault(a, r, step, x[sl], reg[sl], loss)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        mae = metric_allreduce(a, r, (pred - y[sl]).abs().mean().item(), world)
        print(f"rank {r} step {step + 1} loss {loss.item():.4f} retreat_mae {mae:.4f}", flush=True)
    if r == 0:
        torch.save(net.module.state_dict(), f"{WORK}/export_retreatnet.pt")
        print(f"rank 0 saved export {WORK}/export_retreatnet.pt", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--form", default="pl", choices=["pl", "fabric"])
    p.add_argument("--devices", type=int, default=0)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.form == "fabric":
        run_fabric(a)
    else:
        run_pl(a)

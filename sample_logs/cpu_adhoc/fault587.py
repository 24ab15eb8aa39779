"""Tamarack needle-drop monitor: a small DDP training job (Lightning, gloo, CPU).

Each rank reads its own shard of synthetic needle-litter samples (autumn colour and
drop features of tamarack / larch needles from bog transects), maps each sample's
stand index to a stand id through a lookup table, starts from a shared checkpoint,
trains 6 steps and all-gathers a needle-yellowing metric each step. Rank 0 saves an
export at the end.

  python fault587.py --prepare                      # write data to /tmp/fault587_work
  python fault587.py --devices W [--fault F --rank N] [--form trainer|fabric] [--pg-timeout S]

Faults (--fault NAME --rank N), one per run:
  none            control, nothing planted
  indexerror      rank N's shard names stand index 9 of a 4-stand lookup table -> IndexError
  missing_shard   rank N looks for its shard under a path that does not exist -> FileNotFoundError
  ckpt_size       rank N builds a wider needle head (40 units) and loads the 32-unit checkpoint -> size mismatch
  weights_only    rank N loads the checkpoint that carries a pickled BogCalibration with weights_only=True
  gather_shape    rank N all-gathers a 5-element yellowing vector into 4-element buffers at step 3
  slow            rank N does pure-Python "needle count" work at step 3; peers time out in the all-gather
                  (with --pg-timeout 300 the job hangs until the outer `timeout` ends it)
  nan             rank N's needle length becomes inf at step 3; the script's own finiteness check raises
  sigabrt         rank N sends itself SIGABRT at step 3
  error_exit      rank N prints its own ERROR line and calls sys.exit(4) at step 3
  shape_all       every rank appends two extra colour bands at step 2 -> matmul shape error on all ranks
  host_mem        rank N caps its address space (RLIMIT_AS) and allocates a huge litter-grid buffer at step 3
  worker_crash    rank N's DataLoader worker SIGKILLs itself on its 9th sample

What happened (runs named tamarack_<fault>_np<W>_r<N>_<form>, batch 587):
  none            np4 torchrun and np3 plown: every rank printed steps 1-6, rank 0 saved the export, exit 0.
  indexerror      rank 3 (np5 plown): IndexError list index out of range in setup; peers: gloo connection closed; exit 1 after ~98 s
                  (a np7 rank-0 bash-loop run printed nothing in 47 s and was stopped: dropped).
  missing_shard   rank 2 (np4 LOGLEVEL=INFO) / rank 5 (np6 fabric): FileNotFoundError shard_N_v2.pt before step 1; peers: connection closed.
  ckpt_size       rank 1 (np3 tee) / rank 6 (np7 LOGLEVEL=INFO): load_state_dict size mismatch for body/head (40 vs 32).
  weights_only    rank 5 (np6 torchrun): UnpicklingError, Unsupported global __main__.BogCalibration.
  gather_shape    rank 4 (np6 fabric) / rank 0 (np3 torchrun): ProcessGroupGloo::allgather invalid tensor size (expected (5), got (4)) at step 3.
  slow            rank 3 (np5 torchrun): peers' gloo 12 s send/recv timeouts at step 3; torchrun blamed rank 0.
  hang            rank 1 (np3 torchrun, --pg-timeout 300): output stops after step 2; timeout SIGTERM then SIGKILL (exit 137).
  nan             rank 5 (np6 tee): FloatingPointError non-finite needle loss nan at step 3 (a np5 bash-loop run printed nothing in 100 s: dropped).
  sigabrt         rank 6 (np8 torchrun) / rank 2 (np4 fabric): exitcode -6 (SIGABRT) at step 3, no message; peers: connection reset/closed, timeouts.
  error_exit      rank 1 (np4 fabric) / rank 4 (np5 LOGLEVEL=INFO): own ERROR line, exit 4 at step 3.
  shape_all       np3 plown: every rank RuntimeError mat1 and mat2 shapes cannot be multiplied (8x19 and 17x32) at step 2.
  host_mem        rank 2 (np3 torchrun): DefaultCPUAllocator can't allocate 12884901888 bytes at step 3.
  worker_crash    rank 3 (np4 tee) / rank 1 (np5 plown): DataLoader worker killed by signal: Killed, before step 1.
"""
import argparse, json, os, signal, sys, time, resource
from datetime import timedelta

WORK = "/tmp/fault587_work"
FEAT, HID, NCLS, STEPS, BATCH = 16, 32, 4, 6, 8


def prepare():
    import torch
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(587)
    stands = ["bog_stand_A", "bog_stand_B", "fen_stand_C", "ridge_stand_D"]
    json.dump(stands, open(f"{WORK}/stand_table.json", "w"))
    for r in range(8):
        x = torch.randn(96, FEAT, generator=g)
        y = torch.randint(0, NCLS, (96,), generator=g)
        idx = [(r + i) % 4 for i in range(96)]
        torch.save({"x": x, "y": y}, f"{WORK}/shard_{r}.pt")
        json.dump(idx, open(f"{WORK}/shard_{r}_stands.json", "w"))
    torch.manual_seed(0)
    m = build_model(HID)
    torch.save(m.state_dict(), f"{WORK}/init.pt")
    torch.save({"state": m.state_dict(), "calib": BogCalibration(0.8, 0.35)}, f"{WORK}/init_calibrated.pt")
    print("prepared", WORK)


class BogCalibration:
    def __init__(self, moisture, ph_scale):
        self.moisture, self.ph_scale = moisture, ph_scale


def build_model(hid):
    import torch.nn as nn
    m = nn.Sequential()
    m.add_module("body", nn.Linear(FEAT + 1, hid))
    m.add_module("act", nn.ReLU())
    m.add_module("head", nn.Linear(hid, NCLS))
    return m


class NeedleShard:
    def __init__(self, rank, fault, frank):
        import torch
        path = f"{WORK}/shard_{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/shard_{rank}_v2.pt"
        d = torch.load(path, weights_only=True)
        idx = json.load(open(f"{WORK}/shard_{rank}_stands.json"))
        if fault == "indexerror" and rank == frank:
            idx[23] = 9
        stands = json.load(open(f"{WORK}/stand_table.json"))
        site = torch.tensor([float(len(stands[i])) for i in idx]).unsqueeze(1)
        self.x = torch.cat([d["x"], site], 1)
        self.y = d["y"]
        self.rank, self.crash = rank, (fault == "worker_crash" and rank == frank)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.crash and i == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def load_model(rank, fault, frank):
    import torch
    hid = 40 if (fault == "ckpt_size" and rank == frank) else HID
    m = build_model(hid)
    if fault == "weights_only" and rank == frank:
        sd = torch.load(f"{WORK}/init_calibrated.pt", weights_only=True)["state"]
    else:
        sd = torch.load(f"{WORK}/init.pt", weights_only=True)
    m.load_state_dict(sd)
    return m


def step_body(model, x, y, rank, step, a, grp):
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    fault, frank = a.fault, a.rank
    if fault == "shape_all" and step == 2:
        x = torch.cat([x, x[:, :2]], 1)
    if fault == "nan" and rank == frank and step == 3:
        x = x * float("inf")
    if rank == frank and step == 3:
        if fault == "sigabrt":
            os.kill(os.getpid(), signal.SIGABRT)
        if fault == "error_exit":
            print(f"ERROR rank {rank}: needle-drop transect count below 3 (bog stand survey incomplete) at step {step}; aborting", flush=True)
            sys.exit(4)
        if fault == "slow":
            t, acc = time.time(), 0.0
            while time.time() - t < (400 if a.pg_timeout > 100 else 40):
                for k in range(20000):  # count needles per fascicle, the slow way
                    acc += (k % 37) * 0.25
        if fault == "host_mem":
            resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
            buf = torch.zeros(3072, 1024, 1024)  # 12 GiB litter-grid buffer
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: non-finite needle loss {loss.item()} at step {step}")
    n = 5 if (fault == "gather_shape" and rank == frank and step == 3) else 4
    yel = torch.full((n,), float(logits.detach().std()))
    outs = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, yel, group=grp)
    yel_v = float(torch.stack(outs)[:, 0].mean())
    print(f"rank {rank} step {step} loss {loss.item():.4f} needle_yellowing {yel_v:.4f}", flush=True)
    return loss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--form", default="trainer", choices=["trainer", "fabric"])
    p.add_argument("--pg-timeout", type=float, default=12.0)
    a = p.parse_args()
    if a.prepare:
        return prepare()
    import torch, torch.distributed as dist
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    torch.set_num_threads(1)
    startup = timedelta(seconds=max(120.0, a.pg_timeout))

    if a.form == "fabric":
        fabric = L.Fabric(accelerator="cpu", devices=a.devices,
                          strategy=FabricDDP(process_group_backend="gloo", timeout=startup))
        fabric.launch()
        rank = fabric.global_rank
        grp = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
        ds = NeedleShard(rank, a.fault, a.rank)
        model = load_model(rank, a.fault, a.rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = fabric.setup(model, opt)
        dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=1 if a.fault == "worker_crash" else 0)
        it = iter(dl)
        for step in range(1, STEPS + 1):
            x, y = next(it)
            loss = step_body(model, x, y, rank, step, a, grp)
            opt.zero_grad(); fabric.backward(loss); opt.step()
        if rank == 0:
            torch.save(model.module.state_dict() if hasattr(model, "module") else model.state_dict(), f"{WORK}/export_tamarack.pt")
            print("rank 0 saved export", f"{WORK}/export_tamarack.pt", flush=True)
        fabric.barrier()
        return

    class NeedleModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None

        def setup(self, stage):
            self.grp = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
            self.ds = NeedleShard(self.global_rank, a.fault, a.rank)

        def configure_model(self):
            if self.net is None:
                self.net = load_model(self.global_rank, a.fault, a.rank)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.ds, batch_size=BATCH,
                                               num_workers=1 if a.fault == "worker_crash" else 0)

        def training_step(self, batch, idx):
            x, y = batch
            return step_body(self.net, x, y, self.global_rank, self.global_step + 1, a, self.grp)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.05)

    trainer = L.Trainer(accelerator="cpu", devices=a.devices, num_nodes=1, max_steps=STEPS,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=startup),
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    mod = NeedleModule()
    trainer.fit(mod)
    if trainer.global_rank == 0:
        torch.save(mod.net.state_dict(), f"{WORK}/export_tamarack.pt")
        print("rank 0 saved export", f"{WORK}/export_tamarack.pt", flush=True)


if __name__ == "__main__":
    main()

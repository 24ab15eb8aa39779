"""Batch 543 fault script: sandstone arch erosion (a small erosion-rate regressor).

Each rank reads its own survey shard (arch sites: wind, rain, freeze-thaw cycles, salt, slope,
porosity, plus rock type), looks the rock's hardness up in a shared table, starts from a
checkpoint and trains 6 steps under Lightning (Trainer or Fabric), gloo backend, CPU only.
Every rank prints `rank R step S loss L erosion_mm M`; rank 0 saves an export at the end.

  --prepare               write shards, hardness table and checkpoints into /tmp/fault543_work
  --mode trainer|fabric   Lightning Trainer (plown/pltorchrun/pltee/plloglevel/plbashloop) or Fabric loop
  --devices W             world size (plown: Lightning starts the other ranks itself)
  --pg-timeout S          collective timeout (default 12 s); start-up gets 120 s
  --fault NAME --rank N   plant one fault:

Faults:
  none          control, no fault
  bad_rocktype  rank N's shard names a rock type ("tuff") missing from the hardness table -> KeyError
  missing_shard rank N's survey shard file is missing -> FileNotFoundError
  ckpt_size     rank N loads a checkpoint of a wider model (hidden 24 vs 16) -> size mismatch in load_state_dict
  ckpt_pickle   rank N loads a checkpoint holding a custom SurveyMeta object with weights_only=True -> UnpicklingError
  gather_size   rank N all_gathers a site-count tensor of the wrong length at step 3 -> gloo size error
  slow_rank     rank N does ~45 s of pure-Python arch-profile smoothing at step 3 -> peers' gloo timeout
  hang          rank N loops forever in pure Python at step 3 (run with --pg-timeout 300, ended by `timeout`)
  nan_loss      rank N's rain feature turns NaN at step 3; the script's own finiteness check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 3
  logged_exit   rank N prints its own ERROR line (survey grid inconsistent) and sys.exit(4)
  shape_all     every rank reshapes the batch's erosion profile to a wrong shape at step 2 -> RuntimeError
  host_mem      rank N caps its address space (RLIMIT_AS) and builds a huge erosion grid -> MemoryError
  worker_crash  rank N's DataLoader worker kills itself with SIGKILL -> DataLoader worker killed

What happened (one line per fault):
  none          all ranks printed 6 steps, rank 0 saved the export, exit 0 (Trainer np3 plown, Fabric np6)
  bad_rocktype  rank N raised KeyError: 'tuff' in __getitem__ at step 3; peers hit gloo "Connection closed by peer"
  missing_shard rank N raised FileNotFoundError on shard_N_missing.json before step 1; peers hit connection closed
  ckpt_size     rank N raised RuntimeError (size mismatch for 0.weight [24, 8] vs [16, 8]) in load_state_dict
  ckpt_pickle   rank N raised _pickle.UnpicklingError (Weights only load failed, Unsupported global SurveyMeta)
  gather_size   rank N raised "ProcessGroupGloo::allgather: invalid tensor size"; peers hit connection closed
  slow_rank     peers raised gloo "Timed out waiting 12000ms" at step 3; rank N was silent and got SIGTERMed
  hang          rank N spun forever, peers waited (PG timeout 300 s); the 60 s outer timeout ended it (exit 137)
  nan_loss      rank N raised FloatingPointError from the script's own check; peers hit connection closed
  segv          rank N died with SIGSEGV (torchrun names Signal 11; under plown nothing names it)
  logged_exit   rank N printed its ERROR line and exited 4 (torchrun root cause exitcode 4)
  shape_all     every rank raised RuntimeError: shape '[-1, 5]' is invalid for input of size 8 at step 2
  host_mem      rank N raised a bare MemoryError at step 3; peers hit connection closed
  worker_crash  rank N raised "DataLoader worker (pid ...) is killed by signal: Killed."; peers hit connection closed
  (plbashloop: two attempts printed nothing in 100 s and were dropped)
"""
import argparse
import json
import os
import random
import resource
import signal
import sys
import time
from datetime import timedelta

WORK = "/tmp/fault543_work"
ROCKS = ["sandstone", "limestone", "shale", "siltstone", "conglomerate"]


class SurveyMeta:
    def __init__(self, site):
        self.site = site


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="trainer")
    p.add_argument("--devices", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    return p.parse_args()


def prepare():
    import torch
    os.makedirs(WORK, exist_ok=True)
    rnd = random.Random(543)
    table = {r: [round(rnd.uniform(0.5, 3.0), 3), round(rnd.uniform(0.05, 0.4), 3)] for r in ROCKS}
    json.dump(table, open(f"{WORK}/hardness.json", "w"))
    for r in range(8):
        recs = []
        for i in range(64):
            recs.append({"site": f"arch-{r}-{i}", "rock": rnd.choice(ROCKS),
                         "x": [round(rnd.uniform(0, 1), 4) for _ in range(6)],
                         "erosion_mm": round(rnd.uniform(0.1, 4.0), 4)})
        json.dump(recs, open(f"{WORK}/shard_{r}.json", "w"))
    torch.manual_seed(543)
    torch.save(make_net(16).state_dict(), f"{WORK}/arch_init.pt")
    torch.save(make_net(24).state_dict(), f"{WORK}/arch_init_wide.pt")
    torch.save({"state": make_net(16).state_dict(), "meta": SurveyMeta("delicate-arch")}, f"{WORK}/arch_init_meta.pt")
    print("prepared", WORK)


def make_net(h):
    import torch
    return torch.nn.Sequential(torch.nn.Linear(8, h), torch.nn.ReLU(), torch.nn.Linear(h, 1))


def get_rank():
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


class ArchSurvey:
    def __init__(self, rank, fault, frank):
        path = f"{WORK}/shard_{rank}.json"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/shard_{rank}_missing.json"
        with open(path) as f:
            self.recs = json.load(f)
        with open(f"{WORK}/hardness.json") as f:
            self.table = json.load(f)
        if fault == "bad_rocktype" and rank == frank:
            self.recs[20]["rock"] = "tuff"
        self.crash = fault == "worker_crash" and rank == frank

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        import torch
        if self.crash and i >= 16:
            os.kill(os.getpid(), signal.SIGKILL)
        r = self.recs[i]
        hard = self.table[r["rock"]]
        return torch.tensor(r["x"] + hard, dtype=torch.float32), torch.tensor([r["erosion_mm"]])


def load_init(net, rank, fault, frank):
    import torch
    path = f"{WORK}/arch_init.pt"
    if fault == "ckpt_size" and rank == frank:
        path = f"{WORK}/arch_init_wide.pt"
    if fault == "ckpt_pickle" and rank == frank:
        sd = torch.load(f"{WORK}/arch_init_meta.pt", weights_only=True)["state"]
    else:
        sd = torch.load(path, weights_only=True)
    net.load_state_dict(sd)


def fault_hook(step, x, y, rank, fault, frank, pg_timeout):
    """Plant the fault before the forward pass of `step`; returns (x, y)."""
    import torch
    import torch.distributed as dist
    if step == 2 and fault == "shape_all":
        y = y.reshape(-1, 5)
    if step != 3 or rank != frank:
        return x, y
    if fault == "gather_size":
        counts = torch.tensor([float(x.shape[0])] * (5 if rank == frank else 4))
        out = [torch.zeros(4) for _ in range(dist.get_world_size())]
        dist.all_gather(out, counts)
    elif fault in ("slow_rank", "hang"):
        t0 = time.time()
        prof = [random.random() for _ in range(2000)]
        while fault == "hang" or time.time() - t0 < 45:
            prof = [(a + b) / 2.0 for a, b in zip(prof, prof[1:] + prof[:1])]
    elif fault == "nan_loss":
        x = x.clone()
        x[:, 1] = float("nan")
    elif fault == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif fault == "logged_exit":
        print(f"ERROR rank {rank}: survey grid for arch span 7 is inconsistent (span 41.2 m vs base 38.9 m), aborting", flush=True)
        sys.exit(4)
    elif fault == "host_mem":
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        rss_vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (rss_vm + 256 * 2**20, hard))
        grid = []
        for _ in range(64):
            grid.append(bytearray(64 * 2**20))
    return x, y


def check_finite(loss, rank, step):
    import torch
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: erosion loss is not finite ({loss.item()})")


def main():
    a = parse()
    if a.prepare:
        prepare()
        return
    import torch
    import torch.distributed as dist
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    torch.set_num_threads(1)
    devices = a.devices or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))

    def set_timeout():
        if dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=a.pg_timeout))

    if a.mode == "fabric":
        fabric = L.Fabric(accelerator="cpu", devices=devices,
                          strategy=FabricDDP(process_group_backend="gloo", timeout=timedelta(seconds=120)))
        fabric.launch()
        set_timeout()
        rank = fabric.global_rank
        net = make_net(16)
        load_init(net, rank, a.fault, a.rank)
        ds = ArchSurvey(rank, a.fault, a.rank)
        dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=1 if a.fault == "worker_crash" else 0)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        net, opt = fabric.setup(net, opt)
        it = iter(dl)
        for step in range(1, 7):
            x, y = next(it)
            x, y = fault_hook(step, x, y, rank, a.fault, a.rank, a.pg_timeout)
            pred = net(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            check_finite(loss, rank, step)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
            print(f"rank {rank} step {step} loss {loss.item():.4f} erosion_mm {pred.mean().item():.4f}", flush=True)
        fabric.barrier()
        if rank == 0:
            os.makedirs(f"{WORK}/export", exist_ok=True)
            torch.save(net.module.state_dict(), f"{WORK}/export/arch_model.pt")
            print(f"rank 0 saved export {WORK}/export/arch_model.pt", flush=True)
        return

    class ArchModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net(16)

        def setup(self, stage):
            set_timeout()
            load_init(self.net, self.global_rank, a.fault, a.rank)

        def train_dataloader(self):
            ds = ArchSurvey(self.global_rank, a.fault, a.rank)
            return torch.utils.data.DataLoader(ds, batch_size=8,
                                               num_workers=1 if a.fault == "worker_crash" else 0)

        def training_step(self, batch, idx):
            step = idx + 1
            x, y = fault_hook(step, batch[0], batch[1], self.global_rank, a.fault, a.rank, a.pg_timeout)
            pred = self.net(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            check_finite(loss, self.global_rank, step)
            print(f"rank {self.global_rank} step {step} loss {loss.item():.4f} erosion_mm {pred.mean().item():.4f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120)))
    model = ArchModule()
    trainer.fit(model)
    if trainer.global_rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.net.state_dict(), f"{WORK}/export/arch_model.pt")
        print(f"rank 0 saved export {WORK}/export/arch_model.pt", flush=True)


if __name__ == "__main__":
    main()

"""fault619.py: guano island nutrients, a small gloo/CPU training job with planted faults (batch 619).

Each rank reads its own shard of synthetic seabird-guano samples (/tmp/fault619_work/shard_R.pt), maps each
sample's island site through a JSON lookup table (sites.json) to a nitrate factor, starts from a checkpoint
(start.ckpt) and fits a small MLP for 6 steps, printing `rank R step S loss L nitrate_ppm M` every step.
Rank 0 saves an export at the end. `--mode trainer` uses a LightningModule + L.Trainer (DDP, gloo), `--mode
fabric` uses lightning.fabric.Fabric with its own loop. Run `--prepare` first.

Faults (`--fault NAME --rank N`):
  none          control run
  valueerror    rank N parses a site's nitrate reading "trace" with float() -> ValueError
  jsondecode    rank N reads a truncated copy of sites.json -> json.JSONDecodeError
  keyerror      rank N's shard names a site missing from the lookup table -> KeyError
  loaderworker  rank N uses num_workers=1 and its dataset divides by a zero guano mass -> ZeroDivisionError in worker
  corruptckpt   rank N loads a truncated start checkpoint -> torch.load fails
  savemissing   the export is saved into a folder that does not exist (rank N saves it)
  skipreduce    rank N skips the step-3 all_reduce of the nitrate metric; the others wait and time out
  exit0         rank N calls os._exit(0) at step 3
  exit3         rank N calls os._exit(3) at step 3, printing nothing
  sigkill       rank N sends itself SIGKILL at step 2
  sigabrt       rank N sends itself SIGABRT at step 2
  anomaly       rank N takes sqrt of a negative value at step 2 under set_detect_anomaly(True)
  clipnan       rank N's gradients become inf at step 2; clip_grad_norm_(error_if_nonfinite=True)
  unused        every rank's model has a spare layer outside forward (DDP without find_unused_parameters)
  shapediff     rank N builds its hidden layer with 17 units instead of 16 (DDP model check)
  nomodule      rank N imports a module that does not exist (guano_assay_kit)
  hostmem       rank N caps RLIMIT_AS and allocates a 16 GiB tensor
  stall         rank N sleeps 200 s at step 3 (others time out, or hang with --pg-timeout 300)
  shapeall      every rank feeds 9 features into an 8-input layer (config error)
  nofile        rank N lowers RLIMIT_NOFILE to its open count and opens shards again -> OSError EMFILE

Runs (one line per log):
  guano_none_np3_rnone_pltorchrun: all ranks finish 6 steps, rank 0 saves the export; exit 0
  guano_valueerror_np6_r5_pltee: rank 5 ValueError 'trace' on its first batch, others gloo connection closed; exit 1
  guano_skipreduce_np5_r2_plloglevel: rank 1 aborts on gloo 'Received data size doesn't match' (SIGABRT), no timeout; exit 1
  guano_sigkill_np8_r7_plfabric: rank 7 SIGKILL (-9) at step 2, torchrun root cause rank 7; exit 1
  guano_loaderworker_np5_r0_plbashloop: 'Caught ZeroDivisionError in DataLoader worker process 0' on rank 0, then no exit until timeout; exit 124
  guano_exit3_np5_r3_plown: Lightning 'Child process ... terminated with code 3', kills the rest; exit 137
  guano_corruptckpt_np6_r0_pltorchrun: rank 0 PytorchStreamReader failed finding central directory; exit 1
  guano_anomaly_np5_r4_plfabric: rank 4 'MseLossBackward0 returned nan values' under anomaly mode; exit 1
  guano_unused_np4_rall_pltorchrun: every rank raises Lightning's unused-parameters RuntimeError at step 1; exit 1
  guano_shapediff_np5_r1_pltee: rank 1 DDP param shape check '[17, 8] appears not to match'; exit 1
  guano_jsondecode_np7_r6_plloglevel: rank 6 JSONDecodeError on truncated sites.json; exit 1
  guano_stall_np3_r1_pltorchrun: output stops after step 2 (pg-timeout 300), timeout 60 SIGTERM then kill; exit 137
  guano_exit0_np4_r2_plfabric: rank 2 exits 0 silently, torchrun blames rank 1 (gloo connection closed); exit 1
  guano_sigabrt_np6_r3_plbashloop: bash 'Aborted', [loop] rank 3 exited 134; exit 1
  guano_clipnan_np4_r0_plfabric: rank 0 clip_grad_norm_ 'total norm ... is non-finite'; exit 1
  guano_hostmem_np4_r1_pltorchrun: rank 1 DefaultCPUAllocator can't allocate 17179869184 bytes; exit 1
  guano_portinuse_np3_rall_pltorchrun: torchrun TCPStore DistNetworkError EADDRINUSE on 38416, no worker started; exit 1
  guano_savemissing_np5_r0_plown: 6 steps done, rank 0 torch.save "Parent directory ... does not exist."; exit 1
  guano_nomodule_np3_r2_plbashloop: rank 2 ModuleNotFoundError guano_assay_kit, ranks 0-1 gloo connection closed; exit 1
  -
  -
  -
  -
  -
"""
import argparse, json, os, signal, sys, time, resource
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault619_work"
SITES = ["isla_lobos", "chincha_norte", "ballestas", "nauru_plateau", "banaba", "navassa"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--mode", default="trainer", choices=["trainer", "fabric"])
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    return p.parse_args()


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(619)
    for r in range(16):
        x = torch.randn(64, 8, generator=g)
        y = x[:, :2].sum(1, keepdim=True) * 0.5
        sites = [SITES[(r + i) % len(SITES)] for i in range(64)]
        mass = torch.rand(64, generator=g) + 0.5
        torch.save({"x": x, "y": y, "sites": sites, "mass": mass}, f"{WORK}/shard_{r}.pt")
    table = {s: {"nitrate": 10.0 + 3 * i, "phosphate": 2.0 + i} for i, s in enumerate(SITES)}
    with open(f"{WORK}/sites.json", "w") as f:
        json.dump(table, f, indent=1)
    txt = json.dumps(table, indent=1)
    with open(f"{WORK}/sites_trunc.json", "w") as f:
        f.write(txt[: len(txt) // 2])
    torch.manual_seed(619)
    sd = make_net(16).state_dict()
    torch.save(sd, f"{WORK}/start.ckpt")
    raw = open(f"{WORK}/start.ckpt", "rb").read()
    open(f"{WORK}/start_trunc.ckpt", "wb").write(raw[: len(raw) // 3])
    print(f"prepared {WORK}: 16 shards, sites.json, start.ckpt")


def make_net(hidden):
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class GuanoData(torch.utils.data.Dataset):
    def __init__(self, rank, fault, frank):
        self.me = fault != "none" and rank == frank
        sh = torch.load(f"{WORK}/shard_{rank}.pt", weights_only=True)
        self.x, self.y, self.mass = sh["x"], sh["y"], sh["mass"]
        self.sites = list(sh["sites"])
        path = f"{WORK}/sites_trunc.json" if (self.me and fault == "jsondecode") else f"{WORK}/sites.json"
        with open(path) as f:
            self.table = json.load(f)
        if self.me and fault == "keyerror":
            self.sites[20] = "isla_fantasma"
        if self.me and fault == "valueerror":
            self.table["banaba"]["nitrate"] = "trace"
        if self.me and fault == "loaderworker":
            self.mass[10] = 0.0
        self.fault = fault

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        nitrate = float(self.table[self.sites[i]]["nitrate"])
        if self.me and self.fault == "loaderworker":
            dens = 1 // int(self.mass[i].item() * 0)  if self.mass[i].item() == 0.0 else 1
        ppm = torch.tensor(nitrate / float(self.mass[i]))
        x = self.x[i]
        if self.fault == "shapeall":
            x = torch.cat([x, ppm.view(1)])
        return x, self.y[i], ppm


def plant_step(rank, step, a, model=None):
    me = a.fault != "none" and rank == a.rank
    if not me:
        return
    if a.fault == "exit0" and step == 3:
        os._exit(0)
    if a.fault == "exit3" and step == 3:
        os._exit(3)
    if a.fault == "sigkill" and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if a.fault == "sigabrt" and step == 2:
        os.kill(os.getpid(), signal.SIGABRT)
    if a.fault == "stall" and step == 3:
        time.sleep(200)
    if a.fault == "hostmem" and step == 2:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, hard))
        big = torch.empty(16 << 30, dtype=torch.uint8)
        big.fill_(1)
    if a.fault == "nofile" and step == 2:
        n = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
        keep = [open(f"{WORK}/shard_{i}.pt", "rb") for i in range(16)]


def setup_model(rank, a):
    me = a.fault != "none" and rank == a.rank
    if me and a.fault == "nomodule":
        import guano_assay_kit  # noqa: F401
    net = make_net(17 if (me and a.fault == "shapediff") else 16)
    ck = f"{WORK}/start_trunc.ckpt" if (me and a.fault == "corruptckpt") else f"{WORK}/start.ckpt"
    sd = torch.load(ck, weights_only=True)
    if not (me and a.fault == "shapediff"):
        net.load_state_dict(sd)
    return net


def metric_reduce(rank, step, a, ppm):
    m = ppm.mean().detach().clone()
    if a.fault == "skipreduce" and rank == a.rank and step == 3:
        return m
    dist.all_reduce(m)
    return m / dist.get_world_size()


def grad_check(rank, step, a, params):
    if a.fault == "clipnan" and rank == a.rank and step == 2:
        for p in params:
            if p.grad is not None:
                p.grad.fill_(float("inf"))
    if a.fault == "clipnan":
        torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def export(rank, a, net):
    saver = a.rank if (a.fault == "savemissing" and a.rank >= 0) else 0
    if rank != saver:
        return
    d = f"{WORK}/exports_missing" if a.fault == "savemissing" else WORK
    torch.save(net.state_dict(), f"{d}/guano_export.pt")
    print(f"rank {rank} saved export {d}/guano_export.pt", flush=True)


def run_trainer(a):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class GuanoModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None
            self.spare = nn.Linear(8, 4) if a.fault == "unused" else None

        def configure_model(self):
            if self.net is None:
                self.net = setup_model(self.global_rank, a)

        def train_dataloader(self):
            ds = GuanoData(self.global_rank, a.fault, a.rank)
            nw = 1 if (a.fault == "loaderworker" and self.global_rank == a.rank) else 0
            return torch.utils.data.DataLoader(ds, batch_size=8, num_workers=nw)

        def training_step(self, batch, idx):
            x, y, ppm = batch
            step = self.global_step
            rank = self.global_rank
            plant_step(rank, step, a)
            out = self.net(x)
            if a.fault == "anomaly" and rank == a.rank and step == 2:
                out = out - torch.sqrt(out.detach().abs().neg() - 1.0 + out * 0)
            loss = nn.functional.mse_loss(out, y)
            m = metric_reduce(rank, step, a, ppm)
            print(f"rank {rank} step {step} loss {loss.item():.4f} nitrate_ppm {m.item():.3f}", flush=True)
            return loss

        def on_before_optimizer_step(self, optimizer):
            grad_check(self.global_rank, self.global_step, a, list(self.net.parameters()))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_train_end(self):
            export(self.global_rank, a, self.net)

    if a.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    w = a.devices or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    trainer = L.Trainer(accelerator="cpu", devices=w, max_steps=6,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(GuanoModule())


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    w = a.devices or int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    fabric = Fabric(accelerator="cpu", devices=w,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    if a.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    net = setup_model(rank, a)
    spare = nn.Linear(8, 4) if a.fault == "unused" else None
    if spare is not None:
        net.add_module("spare_out", spare) if False else setattr(net, "_spare", spare)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = fabric.setup(net, opt)
    ds = GuanoData(rank, a.fault, a.rank)
    nw = 1 if (a.fault == "loaderworker" and rank == a.rank) else 0
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=nw)
    it = iter(dl)
    for step in range(6):
        x, y, ppm = next(it)
        plant_step(rank, step, a)
        out = model(x)
        if a.fault == "anomaly" and rank == a.rank and step == 2:
            out = out - torch.sqrt(out.detach().abs().neg() - 1.0 + out * 0)
        loss = nn.functional.mse_loss(out, y)
        opt.zero_grad()
        fabric.backward(loss)
        grad_check(rank, step, a, list(net.parameters()))
        opt.step()
        m = metric_reduce(rank, step, a, ppm)
        print(f"rank {rank} step {step} loss {loss.item():.4f} nitrate_ppm {m.item():.3f}", flush=True)
    export(rank, a, net)


def main():
    a = parse()
    if a.prepare:
        prepare()
        return
    if a.mode == "trainer":
        run_trainer(a)
    else:
        run_fabric(a)


if __name__ == "__main__":
    main()

"""Bittern booming detector: a small DDP training job (Lightning, gloo, CPU).

Each rank reads its own shard of synthetic "boom" recordings (spectral features of
bittern booms from reedbed microphones), maps each recording's site name to an id
through a lookup table, starts from a shared checkpoint, trains 6 steps and
all-reduces a booming-SNR metric each step. Rank 0 saves an export at the end.

  python fault583.py --prepare                      # write data to /tmp/fault583_work
  python fault583.py --devices W [--fault F --rank N] [--form trainer|fabric] [--pg-timeout S]

Faults (--fault NAME --rank N), one per run:
  none            control, nothing planted
  keyerror        rank N's shard names a reedbed site the lookup table lacks -> KeyError
  missing_shard   rank N looks for its shard under a path that does not exist -> FileNotFoundError
  ckpt_size       rank N builds a wider boom head (48 units) and loads the 32-unit checkpoint -> size mismatch
  weights_only    rank N loads the checkpoint that carries a pickled calibration object with weights_only=True
  allreduce_size  rank N all-reduces a 5-element SNR vector instead of 4 at step 3 (collective size mismatch)
  slow            rank N does pure-Python "boom envelope" work at step 3; peers time out in the SNR all-reduce
                  (with --pg-timeout 300 the job hangs until the outer `timeout` ends it)
  nan             rank N's microphone gain becomes inf at step 3; the script's own finiteness check raises
  sigsegv         rank N sends itself SIGSEGV at step 3
  error_exit      rank N prints its own ERROR line and calls sys.exit(4) at step 3
  shape_all       every rank concatenates an extra feature band at step 2 -> matmul shape error on all ranks
  host_mem        rank N caps its address space (RLIMIT_AS) and allocates a huge spectrogram buffer at step 3
  worker_crash    rank N's DataLoader worker SIGKILLs itself on its 9th recording

What happened (runs named bittern_<fault>_np<W>_r<N>_<form>, batch 583):
  none            np4 torchrun and np3 plown: every rank printed steps 1-6, rank 0 saved the export, exit 0.
  keyerror        rank 1 (np3 plown) / rank 6 (np7 fabric): KeyError 'reedbed_east_7' before step 1; peers: gloo connection closed.
  missing_shard   rank 3 (np5 torchrun): FileNotFoundError shard_3_v2.pt in setup (a bash-loop try printed nothing in 100 s: dropped).
  ckpt_size       rank 2 (np4 tee): load_state_dict size mismatch for body/head (48 vs 32); peers: connection closed.
  weights_only    rank 4 (np6 LOGLEVEL=INFO): UnpicklingError, Unsupported global __main__.BoomCalibration.
  allreduce_size  np4 rank 1 / np8 rank 7: no size error; some ranks printed step 3 with a wrong SNR, others hit 12 s send/recv timeouts.
  slow            np5 rank 2 / np6 rank 5: peers' gloo 12 s send/recv timeouts at step 3; torchrun blamed a peer; slow rank only SIGTERMed.
  hang            np3 rank 1, --pg-timeout 300: output stops after step 2; timeout SIGTERM then SIGKILL (exit 137).
  nan             rank 5 (np6 bash loop and torchrun): FloatingPointError non-finite boom loss at step 3 (bash loop run ended by timeout, 124).
  sigsegv         rank 3 (np4 torchrun) exitcode -11; rank 5 (np7 bash loop): bash 'Segmentation fault'; peers: connection closed/reset.
  error_exit      rank 4 (np5 fabric) exit 4; rank 0 (np3 bash loop) printed ERROR then aborted at exit ('terminate called', 134).
  shape_all       np3: every rank RuntimeError mat1 and mat2 shapes cannot be multiplied (8x20 and 17x32) at step 2.
  host_mem        rank 1 (np4 tee): RuntimeError DefaultCPUAllocator can't allocate 17179869184 bytes at step 3.
  worker_crash    rank 2 (np3) / rank 3 (np5): DataLoader worker killed by signal: Killed, before step 1.
"""
import argparse, json, os, signal, sys, time, resource
from datetime import timedelta

WORK = "/tmp/fault583_work"
FEAT, HID, NCLS, STEPS, BATCH = 16, 32, 4, 6, 8


def prepare():
    import torch
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(583)
    sites = ["reedbed_north_1", "reedbed_north_2", "reedbed_south_3", "reedbed_west_4"]
    table = {s: i for i, s in enumerate(sites)}
    json.dump(table, open(f"{WORK}/site_table.json", "w"))
    for r in range(8):
        x = torch.randn(96, FEAT, generator=g)
        y = torch.randint(0, NCLS, (96,), generator=g)
        names = [sites[(r + i) % 4] for i in range(96)]
        torch.save({"x": x, "y": y}, f"{WORK}/shard_{r}.pt")
        json.dump(names, open(f"{WORK}/shard_{r}_sites.json", "w"))
    torch.manual_seed(0)
    m = build_model(HID)
    torch.save(m.state_dict(), f"{WORK}/init.pt")
    torch.save({"state": m.state_dict(), "calib": BoomCalibration(0.8, 112.0)}, f"{WORK}/init_calibrated.pt")
    print("prepared", WORK)


class BoomCalibration:
    def __init__(self, gain, hz):
        self.gain, self.hz = gain, hz


def build_model(hid):
    import torch.nn as nn
    m = nn.Sequential()
    m.add_module("body", nn.Linear(FEAT + 1, hid))
    m.add_module("act", nn.ReLU())
    m.add_module("head", nn.Linear(hid, NCLS))
    return m


class BoomShard:
    def __init__(self, rank, fault, frank):
        import torch
        path = f"{WORK}/shard_{rank}.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/shard_{rank}_v2.pt"
        d = torch.load(path, weights_only=True)
        names = json.load(open(f"{WORK}/shard_{rank}_sites.json"))
        if fault == "keyerror" and rank == frank:
            names[17] = "reedbed_east_7"
        table = json.load(open(f"{WORK}/site_table.json"))
        site = torch.tensor([float(table[n]) for n in names]).unsqueeze(1)
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
    hid = 48 if (fault == "ckpt_size" and rank == frank) else HID
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
        x = torch.cat([x, x[:, :3]], 1)
    if fault == "nan" and rank == frank and step == 3:
        x = x * float("inf")
    if rank == frank and step == 3:
        if fault == "sigsegv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "error_exit":
            print(f"ERROR rank {rank}: boom detector calibration drifted beyond 6 dB at step {step}; aborting", flush=True)
            sys.exit(4)
        if fault == "slow":
            t, acc = time.time(), 0.0
            while time.time() - t < (400 if a.pg_timeout > 100 else 40):
                for k in range(20000):
                    acc += (k * 0.5) ** 0.5
        if fault == "host_mem":
            resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
            buf = torch.zeros(4096, 1024, 1024)  # 16 GiB spectrogram buffer
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: non-finite boom loss {loss.item()} at step {step}")
    n = 5 if (fault == "allreduce_size" and rank == frank and step == 3) else 4
    snr = torch.full((n,), float(logits.detach().std()))
    dist.all_reduce(snr, group=grp)
    snr_v = float(snr[0]) / dist.get_world_size()
    print(f"rank {rank} step {step} loss {loss.item():.4f} boom_snr {snr_v:.4f}", flush=True)
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
        ds = BoomShard(rank, a.fault, a.rank)
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
            torch.save(model.module.state_dict() if hasattr(model, "module") else model.state_dict(), f"{WORK}/export_bittern.pt")
            print("rank 0 saved export", f"{WORK}/export_bittern.pt", flush=True)
        fabric.barrier()
        return

    class BoomModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None

        def setup(self, stage):
            self.grp = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
            self.ds = BoomShard(self.global_rank, a.fault, a.rank)

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
    mod = BoomModule()
    trainer.fit(mod)
    if trainer.global_rank == 0:
        torch.save(mod.net.state_dict(), f"{WORK}/export_bittern.pt")
        print("rank 0 saved export", f"{WORK}/export_bittern.pt", flush=True)


if __name__ == "__main__":
    main()

"""Bat echolocation call classification: a small DDP job (Lightning / Fabric, gloo, CPU).

Each rank reads its own shard of echolocation-call feature vectors (40 spectral bins per
call plus a species code), maps species codes to class ids through a lookup table,
warm-starts a small MLP classifier from a checkpoint, trains 6 steps, all-reduces its
batch accuracy every step and prints `rank R step S loss L acc M`. Rank 0 writes an
export at the end.

  python fault491.py --prepare                    # synthetic data into /tmp/fault491_work
  python fault491.py --devices W [--fabric] --fault NAME --rank N [--pg-timeout S]

Faults (planted on rank N unless said otherwise):
  none            control, nothing planted
  species_key     rank N's shard holds a species code ("Myotis_xx") missing from the lookup table -> KeyError at step 3
  missing_shard   rank N looks for a shard file that was never written -> FileNotFoundError at set-up
  ckpt_size       rank N builds its model with 48 spectral bins, the warm-start checkpoint has 40 -> size mismatch in load_state_dict
  gather_size     rank N all-gathers a per-class count vector one entry too long at step 3 (wrong collective size)
  slow_rank       rank N spends ~45 s in pure-Python call re-segmentation at step 3; its peers time out in all_reduce (12 s)
  hang            as slow_rank, but with --pg-timeout 300 the peers wait; `timeout` ends the job
  nan_feature     rank N's batch at step 3 has NaN spectral bins; the script's own finiteness check raises FloatingPointError
  segv            rank N sends itself SIGSEGV at step 3
  error_exit      rank N prints its own ERROR line (recording-site calibration missing) and sys.exit(4) at step 2
  shape_all       every rank: the feature stack adds 2 delta bins (42) but the model expects 40 -> matmul shape error
  host_alloc      rank N sizes its spectrogram cache from a corrupt header -> torch cannot allocate ~4 TiB of host memory
  worker_crash    rank N's DataLoader worker (num_workers=1) is SIGKILLed while decoding a call at step 3

What happened:
  none            np4 torchrun: 6 steps on every rank, export written, exit 0
  species_key     np3 plown r2 / np6 fabric r0: KeyError 'Myotis_xx' on the planted rank at step 3, peers get gloo "Connection closed by peer"
  missing_shard   np3 bash loop r1: FileNotFoundError at set-up, peers die in Lightning's post_setup barrier (an np4 bash-loop run timed out while starting and was dropped)
  ckpt_size       np3 torchrun --tee r1: load_state_dict size mismatch ([64, 40] vs [64, 48]), peers die in the post_setup barrier
  gather_size     np4 fabric r2 / np5 torchrun r1: ProcessGroupGloo::allgather invalid tensor size (expected (9), got (8)) on the planted rank
  slow_rank       np5 LOGLEVEL=INFO r4 / np3 bash loop r0: peers fail "Timed out waiting 12000ms"; torchrun's summary blames a peer, not the straggler
  hang            np3 torchrun r1 (--pg-timeout 300): output stops after step 2, timeout 60 SIGTERMs torchrun, exit 137
  nan_feature     np5 torchrun r4: FloatingPointError from the script's own finiteness check at step 3
  segv            np4 torchrun --tee r1: torchrun reports exitcode -11; np3 plown r2: the child just vanishes, no signal named
  error_exit      np3 bash loop r2 / np8 torchrun r6: the ERROR line, exit 4, peers get gloo connection errors
  shape_all       np3 fabric: every rank "mat1 and mat2 shapes cannot be multiplied (16x42 and 40x64)"
  host_alloc      np4 torchrun r2: DefaultCPUAllocator can't allocate 4398046511104 bytes
  worker_crash    np3 plown r1: "DataLoader worker (pid N) is killed by signal: Killed." before any step line
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist

WORK = "/tmp/fault491_work"
NBINS = 40
NSPECIES = 8
SPECIES = ["Pipistrellus_pip", "Pipistrellus_pyg", "Myotis_dau", "Myotis_nat",
           "Nyctalus_noc", "Eptesicus_ser", "Plecotus_aur", "Barbastella_bar"]
STEPS = 6
BATCH = 16


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(491)
    for r in range(8):
        feats = torch.randn(STEPS * BATCH, NBINS, generator=g)
        codes = [SPECIES[int(i)] for i in torch.randint(0, NSPECIES, (STEPS * BATCH,), generator=g)]
        torch.save({"feats": feats, "codes": codes}, f"{WORK}/calls_shard{r}.pt")
        # a deliberately bad shard with an unknown species code at the 3rd batch
        bad = list(codes)
        bad[2 * BATCH + 5] = "Myotis_xx"
        torch.save({"feats": feats, "codes": bad}, f"{WORK}/calls_shard{r}_badcode.pt")
    with open(f"{WORK}/species_table.json", "w") as f:
        json.dump({s: i for i, s in enumerate(SPECIES)}, f)
    torch.manual_seed(0)
    torch.save(make_model(NBINS).state_dict(), f"{WORK}/warmstart.pt")
    print("prepared", WORK)


def make_model(nbins):
    return nn.Sequential(nn.Linear(nbins, 64), nn.ReLU(), nn.Linear(64, NSPECIES))


class CallShard(torch.utils.data.Dataset):
    def __init__(self, rank, fault, frank):
        path = f"{WORK}/calls_shard{rank}.pt"
        if fault == "species_key" and rank == frank:
            path = f"{WORK}/calls_shard{rank}_badcode.pt"
        if fault == "missing_shard" and rank == frank:
            path = f"{WORK}/calls_shard{rank}_night2.pt"
        blob = torch.load(path)
        with open(f"{WORK}/species_table.json") as f:
            self.table = json.load(f)
        self.feats, self.codes = blob["feats"], blob["codes"]
        self.rank, self.fault, self.frank = rank, fault, frank

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, i):
        x = self.feats[i]
        if self.fault == "worker_crash" and self.rank == self.frank and i == 2 * BATCH + 3:
            if torch.utils.data.get_worker_info() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "nan_feature" and self.rank == self.frank and 2 * BATCH <= i < 3 * BATCH:
            x = x.clone(); x[7:11] = float("nan")
        if self.fault == "shape_all":
            x = torch.cat([x, x[:2] - x[1:3]])  # 2 delta bins
        return x, self.table[self.codes[i]]


START_TIMEOUT = 120  # start-up (store + PG creation) on a busy 2-core box; training steps use --pg-timeout


def set_step_timeout(args):
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=args.pg_timeout))


def build(rank, args):
    nbins = 48 if (args.fault == "ckpt_size" and rank == args.rank) else NBINS
    model = make_model(nbins)
    model.load_state_dict(torch.load(f"{WORK}/warmstart.pt", weights_only=True))
    ds = CallShard(rank, args.fault, args.rank)
    nw = 1 if (args.fault == "worker_crash" and rank == args.rank) else 0
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False, num_workers=nw)
    return model, loader


def before_step(rank, step, args):
    f, n = args.fault, args.rank
    if rank != n:
        return
    if f == "error_exit" and step == 2:
        print(f"ERROR: rank {rank}: recording-site calibration for detector D{rank:02d} missing; "
              f"cannot convert call amplitudes, giving up", flush=True)
        sys.exit(4)
    if f in ("slow_rank", "hang") and step == 3:
        t0, acc = time.time(), 0
        limit = 45 if f == "slow_rank" else 600
        while time.time() - t0 < limit:
            for k in range(20000):
                acc = (acc * 31 + k) % 1000003
    if f == "segv" and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if f == "host_alloc" and step == 3:
        frames = 1 << 31  # from a corrupt WAV header
        cache = torch.empty(frames, 512, dtype=torch.float32)
        del cache


def step_stats(rank, step, x, y, logits, loss, args):
    if not torch.isfinite(x).all() or not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: non-finite spectral features/loss "
                                 f"(loss={loss.item()})")
    acc = (logits.argmax(1) == y).float().mean().detach()
    dist.all_reduce(acc)
    acc = acc / dist.get_world_size()
    counts = torch.bincount(y, minlength=NSPECIES).float()
    if args.fault == "gather_size" and rank == args.rank and step == 3:
        counts = torch.cat([counts, torch.zeros(1)])
    out = [torch.zeros(NSPECIES) for _ in range(dist.get_world_size())]
    dist.all_gather(out, counts)
    print(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item():.4f}", flush=True)


def export(model):
    torch.save(model.state_dict(), f"{WORK}/batec_export.pt")
    print("rank 0 wrote export", f"{WORK}/batec_export.pt", flush=True)


def run_lightning(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class BatModule(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, idx):
            rank, step = self.global_rank, idx + 1
            before_step(rank, step, args)
            x, y = batch
            logits = self.model(x)
            loss = nn.functional.cross_entropy(logits, y)
            step_stats(rank, step, x, y, logits, loss, args)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Data(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.parts = None

        def setup(self, stage):
            set_step_timeout(args)
            self.parts = build(self.trainer.global_rank, args)

        def train_dataloader(self):
            return self.parts[1]

    dm = Data()

    class Wrap(BatModule):
        def setup(self, stage):
            self.model = dm.parts[0]

    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, max_steps=STEPS,
                        strategy=DDPStrategy(process_group_backend="gloo",
                                             timeout=timedelta(seconds=START_TIMEOUT)),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    module = Wrap(make_model(NBINS))
    trainer.fit(module, datamodule=dm)
    if trainer.global_rank == 0:
        export(module.model)


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy
    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=1,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=START_TIMEOUT)))
    fabric.launch()
    set_step_timeout(args)
    rank = fabric.global_rank
    model, loader = build(rank, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    for idx, (x, y) in enumerate(loader):
        step = idx + 1
        if step > STEPS:
            break
        before_step(rank, step, args)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        step_stats(rank, step, x, y, logits, loss, args)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
    fabric.barrier()
    if rank == 0:
        export(model.module)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--fabric", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    args = p.parse_args()
    if args.prepare:
        return prepare()
    torch.manual_seed(1)
    run_fabric(args) if args.fabric else run_lightning(args)


if __name__ == "__main__":
    main()

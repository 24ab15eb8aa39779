"""Batch 570, theme "tapir foraging": a small regression job that predicts how much browse a lowland tapir takes
from a plant (leaf height, stem width, distance to water, plant species ...). `--prepare` writes synthetic data
into /tmp/fault570_work: one shard per rank (shard_R.pt), a lookup table of browse species (species.json), and a
start checkpoint (init.pt). The job runs under Hugging Face accelerate (Accelerator(cpu=True), gloo, process
group timeout --pg-timeout, 12 s by default) or, with --hf, as a transformers.Trainer run (use_cpu, gloo,
ddp_timeout 12). 6 steps; each step every rank all-reduces its "browsefrac" metric (accelerate mode), prints
`rank R step S loss L browsefrac M`, and rank 0 saves export.pt at the end.

--fault NAME --rank N plants one fault:
  none            control, nothing planted
  keyerror        rank N looks up a browse species the table does not have (KeyError)
  missing_shard   rank N's shard file is missing (FileNotFoundError)
  ckpt_size       rank N loads a start checkpoint whose first layer is 10 wide, not 16 (load_state_dict size mismatch)
  weights_only    rank N loads a checkpoint that pickles a custom TrailCamera object with weights_only=True
  allreduce_dtype rank N all-reduces its metric as float64 while the others use float32
  slow            rank N re-counts every bite in pure Python for ~45 s at step 2; its peers time out
  nan             rank N's distance-to-water becomes NaN; the job's own finiteness check raises FloatingPointError
  sigabrt         rank N sends itself SIGABRT at step 3
  error_exit      rank N prints its own ERROR line and calls sys.exit(4)
  shape_all       every rank builds a 7-wide feature tensor for an 8-wide layer (shape bug, mat1/mat2)
  hostmem         rank N asks for a 16 PiB bite-distance matrix (CPU allocator refuses, nothing really allocated)
  worker_crash    rank N's DataLoader worker SIGKILLs itself
  (hang = slow with --pg-timeout 300, ended by `timeout 60`)

What happened (21 runs, torch 2.13.0+cpu, accelerate 1.16.0, transformers 5.25.0, gloo):
  none            np3 accelerate launch and np3 Trainer/torchrun: 6 steps on every rank, export saved, exit 0.
  keyerror        KeyError 'sp_cecropia_obtusa' on rank N at step 2 (np4 acc, np6 torchrun) or at the first
                  Trainer batch (np4 Trainer/accelerate); peers gloo Connection closed; summary names rank N.
  missing_shard   FileNotFoundError shard_N_dryseason.pt before step 0; peers Connection closed (np3 --debug,
                  where rank 0 also aborts and the summary blames it; np6 two-machine launch).
  ckpt_size       load_state_dict size mismatch (10 vs 16) on rank 3 before step 0 (np5 --config_file).
  weights_only    UnpicklingError: Unsupported global __main__.TrailCamera on rank 1 (np4 torchrun --tee 3).
  allreduce_dtype gloo::EnforceNotMet '8 vs 4. Received data size doesn't match expected size' terminates a
                  NEIGHBOUR of rank N (SIGABRT, blamed by the summary); rank N gets Connection reset (np3, np5).
  slow            peers time out after 12000 ms at step 2; the slow rank prints nothing, is SIGTERMed; the
                  summary blames rank 0 (np5 acc).
  hang            steps 0-1, then silence until timeout SIGTERMs torchrun at 60 s; exit 124 (np3).
  nan             FloatingPointError from the script's own check on rank N at step 3 (np6 two-machine, np4 --tee).
  sigabrt         rank N exitcode -6 (SIGABRT), no traceback; neighbours Connection closed/reset (np5, np7).
  error_exit      rank 6's own ERROR line, exitcode 4; peers Connection closed (np8 acc).
  shape_all       every rank: mat1 and mat2 shapes cannot be multiplied (4x7 and 8x16) in Trainer (np3).
  hostmem         DefaultCPUAllocator: can't allocate memory (18014398509481984 bytes) on rank 1 (np3 --debug).
  worker_crash    rank 3: DataLoader worker (pid N) is killed by signal: Killed., before any step; peers Connection closed.
"""
import argparse, datetime, json, os, signal, sys, time

p = argparse.ArgumentParser()
p.add_argument("--prepare", action="store_true")
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--hf", action="store_true")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--work", default="/tmp/fault570_work")
a = p.parse_args()

import torch
import torch.nn as nn
import torch.distributed as dist

W = a.work


class TrailCamera:
    def __init__(self, site):
        self.site = site


def build_model(width=16):
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


def prepare():
    os.makedirs(W, exist_ok=True)
    g = torch.Generator().manual_seed(570)
    for r in range(8):
        x = torch.rand(48, 8, generator=g)
        x[:, 0] = torch.randint(0, 3, (48,), generator=g).float()  # leaf tier
        species = [f"sp_{i % 6}" for i in range(48)]
        torch.save({"x": x, "species": species}, f"{W}/shard_{r}.pt")
    json.dump({f"sp_{i}": 0.3 + 0.1 * i for i in range(6)}, open(f"{W}/species.json", "w"))
    torch.manual_seed(0)
    torch.save(build_model().state_dict(), f"{W}/init.pt")
    torch.save(build_model(10).state_dict(), f"{W}/init_w10.pt")
    torch.save({"model": build_model().state_dict(), "camera": TrailCamera("Corcovado")}, f"{W}/init_camera.pt")
    print("prepared", W)


if a.prepare:
    prepare()
    sys.exit(0)

from torch.utils.data import Dataset, DataLoader


class BrowseShard(Dataset):
    def __init__(self, rank, fault_here, as_dict=False):
        path = f"{W}/shard_{rank}.pt"
        if fault_here and a.fault == "missing_shard":
            path = f"{W}/shard_{rank}_dryseason.pt"
        d = torch.load(path)
        self.x, self.species = d["x"], list(d["species"])
        self.table = json.load(open(f"{W}/species.json"))
        self.fault_here = fault_here
        self.as_dict = as_dict
        if fault_here and a.fault == "keyerror":
            self.species[9] = "sp_cecropia_obtusa"
            if as_dict:  # Trainer's sampler shuffles per rank; plant the bad species everywhere on this rank
                self.species = ["sp_cecropia_obtusa"] * len(self.species)

    def __len__(self):
        return len(self.species)

    def __getitem__(self, i):
        if self.fault_here and a.fault == "worker_crash" and i == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        rate = self.table[self.species[i]]
        x = self.x[i]
        if a.fault == "shape_all":
            x = x[:7]
        y = torch.tensor([rate, rate * 0.5, rate * 0.25, 1.0])
        if self.as_dict:
            return {"x": x, "labels": y}
        return x, y


def step_faults(rank, step, feats):
    here = rank == a.rank
    if here and a.fault == "slow" and step == 2:
        t0 = time.time()
        acc = 0
        while time.time() - t0 < 45:
            for k in range(20000):
                acc += (k * 5) % 11
    if here and a.fault == "nan" and step == 3:
        feats = feats.clone()
        feats[:, 3] = float("nan")
    if here and a.fault == "sigabrt" and step == 3:
        os.kill(os.getpid(), signal.SIGABRT)
    if here and a.fault == "error_exit" and step == 2:
        print(f"ERROR rank {rank}: bite counter for salt-lick site 4 returned no visits; refusing to continue", flush=True)
        sys.exit(4)
    if here and a.fault == "hostmem" and step == 2:
        n = 1 << 24
        torch.empty((n, n, 8), dtype=torch.float64)
    return feats


def check_finite(t, what, rank):
    if not torch.isfinite(t).all():
        raise FloatingPointError(f"rank {rank}: {what} is not finite ({int((~torch.isfinite(t)).sum())} bad values)")


def metric_allreduce(rank, frac):
    dt = torch.float64 if (rank == a.rank and a.fault == "allreduce_dtype") else torch.float32
    t = torch.full((4,), frac, dtype=dt)
    dist.all_reduce(t)
    return float(t[0]) / dist.get_world_size()


def load_start(model, rank):
    here = rank == a.rank
    path = f"{W}/init.pt"
    if here and a.fault == "ckpt_size":
        path = f"{W}/init_w10.pt"
    if here and a.fault == "weights_only":
        sd = torch.load(f"{W}/init_camera.pt", weights_only=True)["model"]
    else:
        sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd)


def main_accelerate():
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))])
    rank = acc.process_index
    here = rank == a.rank
    net = build_model()
    load_start(net, rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = acc.prepare(net, opt)
    nw = 1 if (here and a.fault == "worker_crash") else 0
    loader = DataLoader(BrowseShard(rank, here), batch_size=4, shuffle=False, num_workers=nw)
    for i, (x, y) in enumerate(loader):
        if i >= a.steps:
            break
        x = step_faults(rank, i, x)
        loss = nn.functional.mse_loss(net(x), y)
        check_finite(loss, "loss", rank)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        frac = metric_allreduce(rank, float((x[:, 0] == 1).float().mean()))
        print(f"rank {rank} step {i} loss {loss.item():.4f} browsefrac {frac:.3f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(net).state_dict(), f"{W}/export.pt")
        print("rank 0 saved export", f"{W}/export.pt", flush=True)
    acc.wait_for_everyone()


def main_hf():
    from transformers import Trainer, TrainingArguments, PretrainedConfig, PreTrainedModel

    class TapirConfig(PretrainedConfig):
        model_type = "tapir_browse"

        def __init__(self, n_in=8, width=16, n_out=4, **kw):
            self.n_in, self.width, self.n_out = n_in, width, n_out
            super().__init__(**kw)

    class TapirModel(PreTrainedModel):
        config_class = TapirConfig

        def __init__(self, config):
            super().__init__(config)
            self.net = nn.Sequential(nn.Linear(config.n_in, config.width), nn.ReLU(),
                                     nn.Linear(config.width, config.n_out))
            self.step = 0

        def forward(self, x, labels=None):
            rank = dist.get_rank() if dist.is_initialized() else 0
            x = step_faults(rank, self.step, x)
            pred = self.net(x)
            loss = nn.functional.mse_loss(pred, labels)
            check_finite(loss, "loss", rank)
            frac = float((x[:, 0] == 1).float().mean())
            print(f"rank {rank} step {self.step} loss {loss.item():.4f} browsefrac {frac:.3f}", flush=True)
            self.step += 1
            return {"loss": loss, "logits": pred}

    args = TrainingArguments(output_dir=f"{W}/hf_out", use_cpu=True, ddp_backend="gloo", ddp_timeout=a.pg_timeout,
                             report_to=[], max_steps=a.steps, per_device_train_batch_size=4, logging_steps=2,
                             save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    rank = args.process_index
    model = TapirModel(TapirConfig())
    trainer = Trainer(model=model, args=args, train_dataset=BrowseShard(rank, rank == a.rank, as_dict=True))
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save(model.state_dict(), f"{W}/export.pt")
        print("rank 0 saved export", f"{W}/export.pt", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if a.hf:
        main_hf()
    else:
        main_accelerate()

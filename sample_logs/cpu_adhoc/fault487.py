"""Cough audio screening: a small Lightning (or Fabric) DDP job on CPU/gloo with ONE planted fault.

Each rank reads its own shard of synthetic MFCC frames (40 coefficients x 32 frames per cough recording),
looks every recording up in a clinic-site table, starts from a shared checkpoint, trains a tiny Conv1d
screening head for 6 steps and all-gathers its (true positives, positives) counts every step to print a
sensitivity. Every rank prints `rank R step S loss L sens M`; rank 0 saves an export at the end.

  python fault487.py --prepare                      # synthetic data into /tmp/fault487_work
  python fault487.py --devices W [--fault NAME --rank N]          # plown: Lightning starts the ranks
  torchrun --nproc_per_node W fault487.py --devices W ...         # pltorchrun / pltee / plloglevel
  torchrun --nproc_per_node W fault487.py --fabric --devices W ... # plfabric
  MASTER_ADDR=.. MASTER_PORT=.. NODE_RANK=0 LOCAL_RANK=r WORLD_SIZE=W python fault487.py --devices W  # plbashloop

Faults (--fault NAME, --rank N):
  none          control, nothing planted
  keyerror      rank N's shard holds a recording id ("rec_99999") the clinic-site table lacks -> KeyError
  missing_shard rank N opens a shard file name that --prepare never wrote -> FileNotFoundError
  ckpt_size     rank N starts from the 64-mel-band checkpoint; load_state_dict -> size mismatch
  wrong_size    at step 2 rank N all-gathers 3 counts (tp, pos, fp) where its peers gather 2
  slow          at step 2 rank N spends ~45 s in a pure-Python "denoise" loop; peers wait in DDP's allreduce
                (with --pg-timeout 300 the same rank loops for good: a hang that `timeout` ends)
  nan           rank N's batch at step 3 carries a NaN frame; the script's own finiteness check raises
  sigsegv       at step 3 rank N sends itself SIGSEGV
  logged_exit   rank N prints its own ERROR line (no positive coughs in its site) and sys.exit(4)
  shape_all     every rank feeds frames-first tensors [B, 32, 40] to a Conv1d expecting 40 channels
  worker_crash  rank N's DataLoader worker SIGKILLs itself while decoding item 20
  host_oom      rank N (address space capped by RLIMIT_AS) allocates a ~6 GiB spectrogram cache

What happened (batch 487, 6 runs kept; the machine was at load ~30 so most planned runs were never made):
  none          np3 pltorchrun: clean, 6 steps on every rank, export saved, exit 0
  keyerror      np5 r3 pltorchrun / np3 r1 plbashloop: KeyError 'rec_99999' on the rank, peers gloo "Connection closed by peer"; the bash loop never exited (timeout, 124)
  missing_shard np6 r4 pltee / np3 r2 plfabric: FileNotFoundError on the rank, peers gloo "Connection closed by peer"
  nan           np3 r1 plfabric: FloatingPointError (own check) at step 3 on rank 1, peers gloo "Connection closed by peer"
  ckpt_size, wrong_size, slow (and the hang), sigsegv, logged_exit, shape_all, worker_crash, host_oom: not run (time)
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault487_work"
N_MFCC, FRAMES, PER_SHARD, BATCH, STEPS = 40, 32, 96, 16, 6


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    g = torch.Generator().manual_seed(487)
    table = {}
    for r in range(8):
        feats = torch.randn(PER_SHARD, N_MFCC, FRAMES, generator=g)
        labels = torch.randint(0, 2, (PER_SHARD,), generator=g)
        feats[labels == 1, :5] += 0.8
        ids = [f"rec_{r:02d}{i:03d}" for i in range(PER_SHARD)]
        for i in ids:
            table[i] = {"site": f"clinic_{r % 3}", "device": "phone"}
        torch.save({"feats": feats, "labels": labels, "ids": ids}, f"{WORK}/shards/shard_r{r}.pt")
    bad = dict(torch.load(f"{WORK}/shards/shard_r0.pt"))
    bad["ids"] = list(bad["ids"])
    bad["ids"][7] = "rec_99999"
    torch.save(bad, f"{WORK}/shards/shard_unlisted.pt")
    with open(f"{WORK}/site_table.json", "w") as f:
        json.dump(table, f)
    torch.manual_seed(0)
    torch.save(Net().state_dict(), f"{WORK}/init_mfcc40.ckpt")
    torch.save(Net(64).state_dict(), f"{WORK}/init_mel64.ckpt")
    print("prepared", WORK)


class Net(nn.Module):
    def __init__(self, n_in=N_MFCC):
        super().__init__()
        self.conv = nn.Conv1d(n_in, 32, 3, padding=1)
        self.head = nn.Linear(32, 2)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)).mean(-1))


class CoughShard(torch.utils.data.Dataset):
    def __init__(self, rank, args):
        name = f"shard_r{rank}.pt"
        if args.fault == "keyerror" and rank == args.rank:
            name = "shard_unlisted.pt"
        if args.fault == "missing_shard" and rank == args.rank:
            name = f"shard_r{rank}_16k_resampled.pt"
        d = torch.load(os.path.join(WORK, "shards", name))
        with open(f"{WORK}/site_table.json") as f:
            table = json.load(f)
        self.sites = [table[i]["site"] for i in d["ids"]]
        self.feats, self.labels = d["feats"], d["labels"]
        self.rank, self.args = rank, args

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        a = self.args
        if a.fault == "worker_crash" and self.rank == a.rank and i == 20:
            if torch.utils.data.get_worker_info() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
        x = self.feats[i]
        if a.fault == "shape_all":
            x = x.transpose(0, 1).contiguous()
        return x, self.labels[i]


def load_init(model, rank, args):
    path = f"{WORK}/init_mfcc40.ckpt"
    if args.fault == "ckpt_size" and rank == args.rank:
        path = f"{WORK}/init_mel64.ckpt"
    model.load_state_dict(torch.load(path, weights_only=True))


def before_setup(rank, args):
    if args.fault == "logged_exit" and rank == args.rank:
        print(f"ERROR rank {rank}: site table lists 0 positive coughs for clinic_{rank % 3}; refusing to train "
              "a screening head without positives", flush=True)
        sys.exit(4)
    if args.fault == "host_oom" and rank == args.rank:
        import resource
        vm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")][0] * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
        cache = torch.empty(PER_SHARD * 64, 128, 2048, dtype=torch.float32)  # spectrogram cache
        cache.zero_()


def step_fault(rank, step, args, x):
    if args.fault == "nan" and rank == args.rank and step == 3:
        x = x.clone()
        x[2, :, 5] = float("nan")
    if args.fault == "sigsegv" and rank == args.rank and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "slow" and rank == args.rank and step == 2:
        budget = 45 if args.pg_timeout < 100 else 10 ** 6
        t0, acc = time.time(), 0.0
        while time.time() - t0 < budget:  # pure-Python spectral "denoise"
            for v in range(20000):
                acc += (v * 0.5) % 3.0
    return x


def counts(rank, step, args, logits, y):
    pred = logits.argmax(-1)
    tp = float(((pred == 1) & (y == 1)).sum())
    pos = float((y == 1).sum())
    c = torch.tensor([tp, pos])
    if args.fault == "wrong_size" and rank == args.rank and step == 2:
        c = torch.tensor([tp, pos, float(((pred == 1) & (y == 0)).sum())])
    out = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(out, c)
    tot = torch.stack(out).sum(0)
    return tot[0].item() / max(tot[1].item(), 1.0)


def check_finite(rank, step, loss):
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (non-finite cough features?)")


def export(rank, model):
    if rank == 0:
        path = f"{WORK}/export/cough_screen.pt"
        torch.save(model.state_dict(), path)
        print(f"rank 0 saved export {path}", flush=True)


def run_trainer(args):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()
            self.step_no = 0

        def setup(self, stage):
            before_setup(self.global_rank, args)
            load_init(self.net, self.global_rank, args)

        def train_dataloader(self):
            nw = 1 if args.fault == "worker_crash" else 0
            return torch.utils.data.DataLoader(CoughShard(self.global_rank, args), batch_size=BATCH,
                                               shuffle=False, num_workers=nw)

        def training_step(self, batch, idx):
            x, y = batch
            r, s = self.global_rank, self.step_no
            x = step_fault(r, s, args, x)
            logits = self.net(x)
            loss = F.cross_entropy(logits, y)
            check_finite(r, s, loss)
            sens = counts(r, s, args, logits.detach(), y)
            print(f"rank {r} step {s} loss {loss.item():.4f} sens {sens:.3f}", flush=True)
            self.step_no += 1
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_train_end(self):
            export(self.global_rank, self.net)

    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, max_steps=STEPS,
                        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        use_distributed_sampler=False)
    trainer.fit(Module())


def run_fabric(args):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=1,
                    strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.pg_timeout)))
    fabric.launch()
    r = fabric.global_rank
    before_setup(r, args)
    net = Net()
    load_init(net, r, args)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = fabric.setup(net, opt)
    nw = 1 if args.fault == "worker_crash" else 0
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(CoughShard(r, args), batch_size=BATCH, num_workers=nw),
        use_distributed_sampler=False)
    for s, (x, y) in enumerate(loader):
        if s >= STEPS:
            break
        x = step_fault(r, s, args, x)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        check_finite(r, s, loss)
        sens = counts(r, s, args, logits.detach(), y)
        print(f"rank {r} step {s} loss {loss.item():.4f} sens {sens:.3f}", flush=True)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
    export(r, net)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--fabric", action="store_true")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    args = p.parse_args()
    if args.prepare:
        return prepare()
    torch.set_num_threads(1)
    (run_fabric if args.fabric else run_trainer)(args)


if __name__ == "__main__":
    main()

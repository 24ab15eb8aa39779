"""A three-hundred-and-eighty-fifth hand-run batch: PROTEIN SECONDARY STRUCTURE PREDICTION (LIGHTNING).

Synthetic protein chains: an amino-acid sequence (20 standard residues, looked up in a residue table) and a
three-state DSSP string (H helix, E strand, C coil).  Every rank reads its chains from
/tmp/fault385_work/data/chains_R.pt through a LightningDataModule, encodes each residue as a one-hot plus a
hydrophobicity value, and trains a small 1-D CNN tagger (two convolutions over a window, a per-residue 3-way
head) with cross entropy.  The model starts from ckpt/ss3_init.pt.  Each step the loss and Q3 accuracy are
reduced over the ranks (strategy.reduce) and per-class counts are all_gathered (LightningModule.all_gather),
then a line `rank R step S loss L q3 A` is printed; rank 0 saves export/ss3.pt at the end (trainer.save_checkpoint).
Two modes: the Trainer (DDPStrategy, gloo, timeout --pg-timeout) or --fabric 1 (lightning.fabric.Fabric with
its own loop, fabric.all_reduce/all_gather/save/load).  --devices W must match the world size.

Faults (--fault NAME --rank R, R = -1 for every rank):
  residue     - rank N's chain 7 contains selenocysteine "U", missing from the residue table (KeyError in __getitem__)
  ssclass     - rank N's DSSP strings keep 3-10 helices "G" as class 3 of a 3-class head (IndexError in cross entropy)
  nofasta     - rank N reads data/test/chains_N.pt, which does not exist (FileNotFoundError in setup)
  ckptwidth   - rank N initialises from ckpt/ss8_init.pt, saved with an 8-state head (size mismatch)
  ckptpickle  - rank N initialises from ckpt/ss3_full.pt, a pickled config object (weights_only refusal)
  classgather - rank N all_gathers 4 class counts (an extra "unknown" bin) at step 3 instead of 3
  slowalign   - rank N runs a pure-Python pairwise alignment of its chains for 25 s at step 2 (others time out)
  stuck       - rank N waits at step 3 for a release flag that never appears (run with --pg-timeout 300)
  nanloss     - rank N's hydrophobicity scale divides by a zero norm: inf features, NaN loss; the program's check
  sigsegv     - rank N sends itself SIGSEGV at the end of step 3 (a callback)
  exit5       - rank N's start-up check prints an error about chains shared with the test split and sys.exit(5)
  window      - every rank: the batch is fed to the convolution without the channel transpose (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  residue     - KeyError: 'U' in ChainSet.__getitem__ on the first batch; peers Connection closed (np5 r2 pltorchrun, np4 r0 plbashloop)
  ssclass     - IndexError 'Target 3 is out of bounds.' in the first step's cross entropy; peers closed (np3 r1 pltee, np4 r3 plloglevel)
  nofasta     - FileNotFoundError for data/test/chains_N.pt in the DataModule setup; peers closed (np4 r1 plloglevel, np3 r2 plfabric)
  ckptwidth   - size mismatch for head.weight [8, 32] vs [3, 32] (fabric.load np3 r2 plfabric; LightningModule.setup np4 r0 plown)
  ckptpickle  - not run (time); the weights_only fault has no log in this batch
  classgather - a neighbour of rank N aborts: gloo::EnforceNotMet 'Received data size doesn't match expected size' (SIGABRT),
                Root Cause names the neighbour, not rank N (np3 r1 pltorchrun, np5 r0 pltee)
  slowalign   - ranks 0 and 2 'Timed out waiting 12000ms' in the step-2 all_gather; rank 1 then closed (np3 r1 plbashloop)
  stuck       - silent after 'rank 2 waiting for ...release_2.flag'; timeout SIGTERM at 60 s, workers stayed, SIGKILL: exit 137 (np3 r2 pltorchrun)
  nanloss     - first run (then `norm = 0.0 * norm`, a Python float): ZeroDivisionError in setup (np5 r4 pltee); the line was then
                changed to a zero tensor: inf features, 'ERROR non-finite loss nan at step 0', FloatingPointError (np3 r0 plfabric)
  sigsegv     - after step 3, no traceback; bash 'Segmentation fault' exit 139 (np4 r2 plbashloop); Root Cause rank 1 -11 SIGSEGV (np6 r1 plloglevel)
  exit5       - rank N's ERROR line and exit 5; plown exit 5 (np3 r0), Root Cause rank 3 exitcode 5 (np4 r3 pltee)
  window      - every rank: 'expected input[8, 48, 21] to have 21 channels, but got 48 channels instead'; Root Cause rank 0 (np3 plfabric)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/ss3.ckpt, exit 0 (np3 plown)
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault385_work"
AA = "ACDEFGHIKLMNPQRSTVWY"
RES = {a: i for i, a in enumerate(AA)}
HYD = {a: v for a, v in zip(AA, [1.8, 2.5, -3.5, -3.5, 2.8, -0.4, -3.2, 4.5, -3.9, 3.8,
                                 1.9, -3.5, -1.6, -3.5, -4.5, -0.8, -0.7, 4.2, -0.9, -1.3])}
SS3 = {"H": 0, "E": 1, "C": 2}
L = 48
FEAT = 21


def make_chains(n, seed, ss8=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = "".join(AA[int(i)] for i in torch.randint(0, 20, (L,), generator=g))
        ss = []
        while len(ss) < L:
            kind = "HEC"[int(torch.randint(0, 3, (1,), generator=g))]
            ss += [kind] * int(torch.randint(3, 9, (1,), generator=g))
        out.append({"id": f"chain{seed}_{len(out)}", "seq": seq, "ss": "".join(ss[:L])})
    return out


class ChainSet(Dataset):
    def __init__(self, chains, hscale, ss_map):
        self.chains, self.hscale, self.ss_map = chains, hscale, ss_map

    def __len__(self):
        return len(self.chains)

    def __getitem__(self, i):
        c = self.chains[i]
        idx = torch.tensor([RES[a] for a in c["seq"]])
        x = torch.zeros(L, FEAT)
        x[torch.arange(L), idx] = 1.0
        x[:, 20] = torch.tensor([self.hscale[a] for a in c["seq"]])
        y = torch.tensor([self.ss_map[s] for s in c["ss"]])
        return x, y


class ChainData(pl.LightningDataModule):
    def __init__(self, a, rank):
        super().__init__()
        self.a, self.rank = a, rank

    def setup(self, stage=None):
        a, rank = self.a, self.rank
        bad = a.rank in (-1, rank)
        split = "test/" if bad and a.fault == "nofasta" else ""
        chains = torch.load(f"{WORK}/data/{split}chains_{rank}.pt")
        if bad and a.fault == "residue":
            s = chains[7]["seq"]
            chains[7]["seq"] = s[:11] + "U" + s[12:]
        ss_map = dict(SS3)
        if bad and a.fault == "ssclass":
            ss_map["G"] = 3
            s = chains[2]["ss"]
            chains[2]["ss"] = s[:20] + "GGG" + s[23:]
        norm = sum(abs(v) for v in HYD.values()) / len(HYD)
        if bad and a.fault == "nanloss":
            norm = torch.tensor(0.0)
        hscale = {k: v / norm for k, v in HYD.items()}
        self.ds = ChainSet(chains, hscale, ss_map)

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=8, shuffle=False, num_workers=0)


class SSTagger(nn.Module):
    def __init__(self, nclass=3, hid=32):
        super().__init__()
        self.c1 = nn.Conv1d(FEAT, hid, 7, padding=3)
        self.c2 = nn.Conv1d(hid, hid, 5, padding=2)
        self.head = nn.Linear(hid, nclass)

    def forward(self, x, transpose=True):
        h = x.transpose(1, 2) if transpose else x
        h = F.relu(self.c2(F.relu(self.c1(h))))
        return self.head(h.transpose(1, 2))


def load_init(a, rank, model, loader=None):
    bad = a.rank in (-1, rank)
    name = "ss3_init.pt"
    if bad and a.fault == "ckptwidth":
        name = "ss8_init.pt"
    if bad and a.fault == "ckptpickle":
        name = "ss3_full.pt"
    path = f"{WORK}/ckpt/{name}"
    if loader is not None:
        loader(path, {"model": model})
    else:
        state = torch.load(path)
        model.load_state_dict(state["model"])


def step_body(a, rank, world, step, x, y, model, reduce, gather):
    bad = a.rank in (-1, rank)
    logits = model(x, transpose=not (a.fault == "window"))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    if not torch.isfinite(loss):
        print(f"rank {rank}: ERROR non-finite loss {loss.item()} at step {step} "
              f"(features max {x.abs().max().item()})", file=sys.stderr, flush=True)
        raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
    if bad and a.fault == "slowalign" and step == 2:
        t0, n = time.time(), 0
        seqs = [c for c in "".join(AA[i % 20] for i in range(400))]
        while time.time() - t0 < a.align_budget:
            prev = [0] * 41
            for i in range(1, 41):
                cur = [0] * 41
                for j in range(1, 41):
                    cur[j] = max(prev[j - 1] + (2 if seqs[i] == seqs[j + n % 7] else -1), prev[j] - 1, cur[j - 1] - 1, 0)
                prev = cur
            n += 1
        print(f"rank {rank} aligned {n} chain pairs", flush=True)
    if bad and a.fault == "stuck" and step == 3:
        flag = f"{WORK}/locks/release_{rank}.flag"
        print(f"rank {rank} waiting for {flag}", flush=True)
        while not os.path.exists(flag):
            time.sleep(1)
    pred = logits.argmax(-1)
    q3 = (pred == y).float().mean()
    counts = torch.bincount(pred.reshape(-1), minlength=3).float()
    if bad and a.fault == "classgather" and step == 3:
        counts = torch.cat([counts, torch.zeros(1)])
    allc = gather(counts)
    mloss, mq3 = reduce(loss.detach()), reduce(q3)
    print(f"rank {rank} step {step} loss {mloss.item():.4f} q3 {mq3.item():.4f} "
          f"helix {int(allc[..., 0].sum())}", flush=True)
    return loss


class LitSS(pl.LightningModule):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.net = SSTagger()

    def setup(self, stage=None):
        load_init(self.a, self.global_rank, self.net)

    def training_step(self, batch, i):
        x, y = batch
        st = self.trainer.strategy
        return step_body(self.a, self.global_rank, self.trainer.world_size, self.global_step, x, y, self.net,
                         lambda t: st.reduce(t, reduce_op="mean"), lambda t: self.all_gather(t))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-3)


class FaultHooks(pl.Callback):
    def __init__(self, a):
        self.a = a

    def on_fit_start(self, trainer, module):
        r = trainer.global_rank
        if self.a.rank in (-1, r) and self.a.fault == "exit5":
            print(f"rank {r}: ERROR 5 of 64 training chains share >90% identity with the test split "
                  f"(chain{100 + r}_3, ...); refusing to train", file=sys.stderr, flush=True)
            sys.exit(5)

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        r = trainer.global_rank
        if self.a.rank in (-1, r) and self.a.fault == "sigsegv" and trainer.global_step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)


def run_trainer(a):
    strat = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=a.devices, strategy=strat, max_steps=a.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[FaultHooks(a)])
    rank = trainer.global_rank
    model = LitSS(a)
    trainer.fit(model, datamodule=ChainData(a, rank))
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
    trainer.save_checkpoint(f"{WORK}/export/ss3.ckpt")
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, saved export/ss3.ckpt", flush=True)


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FDDP
    fabric = Fabric(accelerator="cpu", devices=a.devices,
                    strategy=FDDP(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout)))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    print(f"rank {rank}/{world} up (fabric)", flush=True)
    dm = ChainData(a, rank)
    dm.setup()
    hooks = FaultHooks(a)
    if a.rank in (-1, rank) and a.fault == "exit5":
        hooks.on_fit_start(fabric, None)
    net = SSTagger()
    load_init(a, rank, net, loader=fabric.load)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    model, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(dm.train_dataloader(), use_distributed_sampler=False)
    it = iter(loader)
    for step in range(a.steps):
        x, y = next(it)
        loss = step_body(a, rank, world, step, x, y, model,
                         lambda t: fabric.all_reduce(t, reduce_op="mean"), lambda t: fabric.all_gather(t))
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        if a.rank in (-1, rank) and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    fabric.save(f"{WORK}/export/ss3_fabric.ckpt", {"model": model, "step": a.steps})
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, saved export/ss3_fabric.ckpt", flush=True)


class SSConfig:
    def __init__(self):
        self.alphabet, self.window, self.classes = AA, 7, "HEC"


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    os.makedirs(f"{WORK}/locks", exist_ok=True)
    for r in range(8):
        torch.save(make_chains(64, 100 + r), f"{WORK}/data/chains_{r}.pt")
    torch.manual_seed(0)
    torch.save({"model": SSTagger(3).state_dict()}, f"{WORK}/ckpt/ss3_init.pt")
    torch.save({"model": SSTagger(8).state_dict()}, f"{WORK}/ckpt/ss8_init.pt")
    torch.save({"model": SSTagger(3).state_dict(), "config": SSConfig()}, f"{WORK}/ckpt/ss3_full.pt")
    print("prepared", WORK)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--align-budget", type=int, default=25)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.fabric:
        run_fabric(a)
    else:
        run_trainer(a)


if __name__ == "__main__":
    main()

"""A three-hundred-and-eighty-third hand-run batch: MOLECULAR PROPERTY REGRESSION ON GRAPHS (Lightning).

Synthetic molecules as graphs: atoms carry an element symbol (looked up in an 8-entry atom table), a degree
and a formal charge; bonds are undirected edges.  Every rank reads its own molecules from
/tmp/fault383_work/mols/mols_R.pt in its LightningDataModule.setup(), featurises them in the Dataset
(one-hot element + degree + charge = 10 features), and trains a small message-passing GNN (two GCN-style
layers with index_add_ aggregation, a sum readout, a polarisability term, a linear head) on an MSE loss with
Lightning's Trainer (DDPStrategy over gloo, timeout from --pg-timeout).  The LightningModule initialises its
weights from ckpt/molgnn_h32.ckpt in setup() and reads the property normaliser in on_train_start().  The loss
and the MAE are reduced through the strategy every step; rank 0 saves export/molgnn.pt at the end.
--fabric 1 runs the same model and data with lightning.fabric.Fabric and a hand-written loop.

Faults (--fault NAME --rank R, R = -1 for every rank):
  element     - rank R's molecules contain selenium "Se", missing from the atom table (KeyError in __getitem__)
  nomols      - rank R reads mols/valid/mols_R.pt, which does not exist (FileNotFoundError in DataModule.setup)
  ckptsize    - rank R initialises from ckpt/molgnn_h48.ckpt (hidden 48) into a hidden-32 model (size mismatch)
  ckptpickle  - rank R reads the normaliser from ckpt/normaliser.pt, a pickled class (weights_only refusal)
  gathershape - rank R all_gathers its element histogram with a hydrogen count added (9 vs 8 entries), step 2
  slowrings   - rank R enumerates every ring of every molecule in pure Python (~40 s) before the step-2 reduce
  stuck       - rank R waits on an event nobody sets before the step-1 reduce (hang; run with --pg-timeout 300)
  sqrtnan     - rank R's charges are sign-flipped from step 3: sqrt of a negative polarisability,
                caught by Trainer(detect_anomaly=True) in backward
  sigkill     - rank R sends itself SIGKILL after step 2 (on_train_batch_end callback)
  abort       - rank R calls os.abort() in on_train_end, after the last step
  exit3       - rank R prints its own error line about a valence violation in on_train_start and sys.exit(3)
  featwidth   - every rank: atom features are 12 wide (two aromatic flags), the first layer expects 10
  none        - control, clean run

What happened (filled in after the runs):
  element     - KeyError: 'Se' in Dataset.__getitem__ on the first batch; peers Connection closed by peer (np4 r1 torchrun, np5 r0 fabric)
  nomols      - FileNotFoundError for mols/valid/mols_N.pt in DataModule.setup; peers closed in the setup barrier (np3 r2 bashloop, np4 r0 tee)
  ckptsize    - load_state_dict size mismatch for l1/l2/head ([48,10] vs [32,10]) in setup(); peers closed (np3 r1 loglevel)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.Normaliser' (np4 r2 torchrun)
  gathershape - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' on rank N (np5 r3 fabric, np3 r0 loglevel)
  slowrings   - ranks 0/2 'Timed out waiting 12000ms for send/recv'; rank 1 SIGTERMed by torchrun; Root Cause rank 0 (np3 r1 torchrun)
  stuck       - output stops after step 0; timeout SIGTERM at 60 s ('[rank: 2] Received SIGTERM'), SIGKILL 5 s later, exit 137 (np3 r2 bashloop;
                a first try blocking before step 3 printed nothing in 60 s on the loaded machine and was dropped; now step 1)
  sqrtnan     - every rank prints step 3 loss nan, then rank N 'Function 'MseLossBackward0' returned nan values' (np4 r3 tee, np3 r1 own)
  sigkill     - rank N exitcode -9 (SIGKILL) in torchrun's summary (np6 r4 loglevel); bash 'Killed', exit 137 (np3 r0 bashloop)
  abort       - after all steps and rank 0's save, rank 1 exitcode -6 (SIGABRT), Root Cause rank 1 (np3 r1 torchrun)
  exit3       - rank 2's own ERROR line about valence, sys.exit(3); peers closed; console exit 1 (np4 r2 own launcher)
  featwidth   - every rank 'mat1 and mat2 shapes cannot be multiplied (Nx12 and 10x32)'; Root Cause rank 1 (np5 tee)
  none        - clean, 6 steps, rank 0 saved export/molgnn.pt, exit 0 (np3 own launcher)
"""
import argparse
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault383_work"
ATOMS = {"C": 0, "N": 1, "O": 2, "F": 3, "S": 4, "Cl": 5, "P": 6, "Br": 7}
NFEAT = len(ATOMS) + 2


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--batch", type=int, default=8)
    return p.parse_args()


ARGS = None


def faulty(name, rank):
    return ARGS.fault == name and (ARGS.rank == -1 or ARGS.rank == rank)


def make_mol(g, elements):
    n = int(torch.randint(5, 14, (1,), generator=g))
    atoms = [elements[int(i)] for i in torch.randint(0, len(elements), (n,), generator=g)]
    src = torch.arange(1, n)
    dst = torch.tensor([int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    if n > 5:  # close one ring
        src = torch.cat([src, torch.tensor([n - 1])]); dst = torch.cat([dst, torch.tensor([n - 5])])
    charges = (torch.rand(n, generator=g) * 0.4).tolist()
    y = float(0.3 * n + sum(1.0 for a in atoms if a in ("O", "N")) + torch.randn(1, generator=g) * 0.1)
    return {"atoms": atoms, "edges": torch.stack([src, dst]), "charges": charges, "y": y}


def prepare():
    os.makedirs(f"{WORK}/mols", exist_ok=True); os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(100 + r)
        torch.save([make_mol(g, list(ATOMS)) for _ in range(96)], f"{WORK}/mols/mols_{r}.pt")
        g = torch.Generator().manual_seed(200 + r)
        torch.save([make_mol(g, list(ATOMS) + ["Se"]) for _ in range(96)], f"{WORK}/mols/mols_se_{r}.pt")
    for h in (32, 48):
        m = MolGNN(hidden=h)
        ck = {"state_dict": m.state_dict(), "hyper_parameters": {"hidden": h}, "epoch": 0, "global_step": 0,
              "pytorch-lightning_version": pl.__version__}
        torch.save(ck, f"{WORK}/ckpt/molgnn_h{h}.ckpt")
    torch.save({"mean": 4.1, "std": 1.3}, f"{WORK}/ckpt/normaliser_stats.pt")
    torch.save(Normaliser(4.1, 1.3), f"{WORK}/ckpt/normaliser.pt")
    print("prepared", WORK)


class Normaliser:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std


class MolDataset(Dataset):
    def __init__(self, mols, rank, width=NFEAT):
        self.mols, self.rank, self.width = mols, rank, width

    def __len__(self):
        return len(self.mols)

    def __getitem__(self, i):
        m = self.mols[i]
        n = len(m["atoms"])
        x = torch.zeros(n, self.width)
        deg = torch.bincount(m["edges"].flatten(), minlength=n).float()
        for j, a in enumerate(m["atoms"]):
            x[j, ATOMS[a]] = 1.0
        x[:, len(ATOMS)] = deg / 4.0
        x[:, len(ATOMS) + 1] = torch.tensor(m["charges"])
        return x, m["edges"], torch.tensor(m["charges"]), torch.tensor(m["y"])


def collate(items):
    xs, es, qs, ys, bidx, off = [], [], [], [], [], 0
    for k, (x, e, q, y) in enumerate(items):
        xs.append(x); es.append(e + off); qs.append(q); ys.append(y)
        bidx.append(torch.full((x.shape[0],), k, dtype=torch.long)); off += x.shape[0]
    return torch.cat(xs), torch.cat(es, 1), torch.cat(qs), torch.stack(ys), torch.cat(bidx)


class MolData(pl.LightningDataModule):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def setup(self, stage=None):
        rank = self.trainer.global_rank if self.trainer is not None else int(os.environ.get("RANK", 0))
        self.ds = load_dataset(rank)

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch, shuffle=False, collate_fn=collate)


def load_dataset(rank):
    path = f"{WORK}/mols/mols_{rank}.pt"
    if faulty("nomols", rank):
        path = f"{WORK}/mols/valid/mols_{rank}.pt"
    if faulty("element", rank):
        path = f"{WORK}/mols/mols_se_{rank}.pt"
    mols = torch.load(path)
    width = NFEAT + 2 if faulty("featwidth", rank) else NFEAT
    return MolDataset(mols, rank, width)


class MolGNN(pl.LightningModule):
    def __init__(self, hidden=32, lr=3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.l1 = nn.Linear(NFEAT, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.polar_scale = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(hidden, 1)
        self.norm = (0.0, 1.0)

    def message(self, h, e):
        agg = torch.zeros_like(h)
        agg.index_add_(0, e[1], h[e[0]]); agg.index_add_(0, e[0], h[e[1]])
        return h + agg

    def forward(self, x, e, q, b, nmol):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(self.message(h, e)))
        g = torch.zeros(nmol, h.shape[1]).index_add_(0, b, h)
        qm = torch.zeros(nmol).index_add_(0, b, q)
        pol = torch.sqrt(self.polar_scale * qm)
        return self.head(g).squeeze(-1) + 0.1 * pol

    def setup(self, stage=None):
        rank = self.global_rank
        path = f"{WORK}/ckpt/molgnn_h48.ckpt" if faulty("ckptsize", rank) else f"{WORK}/ckpt/molgnn_h32.ckpt"
        ck = torch.load(path, map_location="cpu")
        self.load_state_dict(ck["state_dict"])
        print(f"rank {rank} initialised from {os.path.basename(path)}", flush=True)

    def on_train_start(self):
        rank = self.global_rank
        if faulty("ckptpickle", rank):
            stats = torch.load(f"{WORK}/ckpt/normaliser.pt", map_location="cpu", weights_only=True)
            self.norm = (stats.mean, stats.std)
        else:
            stats = torch.load(f"{WORK}/ckpt/normaliser_stats.pt", weights_only=True)
            self.norm = (stats["mean"], stats["std"])
        if faulty("exit3", rank):
            print(f"ERROR: rank {rank}: molecule 17 atom 4 (N) has valence 5 > 3 after kekulisation; "
                  "dataset shard is corrupt, stopping", flush=True)
            sys.exit(3)

    def training_step(self, batch, idx):
        x, e, q, y, b = batch
        rank = self.global_rank
        if faulty("sqrtnan", rank) and idx >= 3:
            q = -q
        pred = self(x, e, q, b, y.shape[0])
        yt = (y - self.norm[0]) / self.norm[1]
        loss = F.mse_loss(pred, yt)
        mae = (pred - yt).abs().mean().detach() * self.norm[1]
        if idx == 2:
            hist = element_histogram(x, rank)
            if faulty("slowrings", rank):
                print(f"rank {rank} enumerating rings for {len(self.trainer.datamodule.ds)} molecules", flush=True)
                slow_rings(40.0)
            out = [torch.zeros(len(ATOMS)) for _ in range(self.trainer.world_size)]
            dist.all_gather(out, hist)
        if idx == 1 and faulty("stuck", rank):
            print(f"rank {rank} waiting for the conformer cache", flush=True)
            threading.Event().wait()
        lr_ = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        mr = self.trainer.strategy.reduce(mae, reduce_op="mean")
        print(f"rank {rank} step {idx} loss {lr_.item():.4f} mae {mr.item():.4f}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def element_histogram(x, rank):
    hist = x[:, :len(ATOMS)].sum(0)
    if faulty("gathershape", rank):
        hist = torch.cat([hist, torch.tensor([float(x.shape[0])])])  # implicit hydrogens appended
    return hist


def slow_rings(seconds):
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        n += sum(i * i for i in range(2000)) % 7


class FaultCallback(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, idx):
        if idx == 2 and faulty("sigkill", trainer.global_rank):
            print(f"rank {trainer.global_rank} after step {idx}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer, module):
        if faulty("abort", trainer.global_rank):
            os.abort()
        if trainer.global_rank == 0:
            torch.save(module.state_dict(), f"{WORK}/export/molgnn.pt")
            print(f"rank 0 saved {WORK}/export/molgnn.pt", flush=True)


def run_trainer():
    model = MolGNN(hidden=32)
    trainer = pl.Trainer(
        accelerator="cpu", devices=ARGS.devices, num_nodes=1, max_steps=ARGS.steps, max_epochs=1,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=ARGS.pg_timeout)),
        callbacks=[FaultCallback()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, detect_anomaly=(ARGS.fault == "sqrtnan"))
    trainer.fit(model, datamodule=MolData(ARGS.batch))


def run_fabric():
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FDDP
    fabric = Fabric(accelerator="cpu", devices=ARGS.devices,
                    strategy=FDDP(process_group_backend="gloo", timeout=timedelta(seconds=ARGS.pg_timeout)))
    fabric.launch()
    rank = fabric.global_rank
    model = MolGNN(hidden=32)
    ck = fabric.load(f"{WORK}/ckpt/molgnn_h48.ckpt" if faulty("ckptsize", rank) else f"{WORK}/ckpt/molgnn_h32.ckpt")
    model.load_state_dict(ck["state_dict"])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, opt = fabric.setup(model, opt)
    ds = load_dataset(rank)
    loader = fabric.setup_dataloaders(DataLoader(ds, batch_size=ARGS.batch, collate_fn=collate),
                                      use_distributed_sampler=False)
    mean, std = 4.1, 1.3
    for idx, (x, e, q, y, b) in enumerate(loader):
        if idx >= ARGS.steps:
            break
        pred = model(x, e, q, b, y.shape[0])
        yt = (y - mean) / std
        loss = F.mse_loss(pred, yt)
        opt.zero_grad(); fabric.backward(loss); opt.step()
        if idx == 2:
            hist = element_histogram(x, rank)
            out = [torch.zeros(len(ATOMS)) for _ in range(fabric.world_size)]
            dist.all_gather(out, hist)
        if faulty("sigkill", rank) and idx == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        mae = (pred - yt).abs().mean().detach() * std
        lr_ = fabric.all_reduce(loss.detach(), reduce_op="mean")
        mr = fabric.all_reduce(mae, reduce_op="mean")
        print(f"rank {rank} step {idx} loss {lr_.item():.4f} mae {mr.item():.4f}", flush=True)
    if rank == 0:
        fabric.save(f"{WORK}/export/molgnn_fabric.ckpt", {"model": model})
        print(f"rank 0 saved {WORK}/export/molgnn_fabric.ckpt", flush=True)
    fabric.barrier()


if __name__ == "__main__":
    ARGS = parse()
    if ARGS.prepare:
        prepare()
        sys.exit(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if ARGS.fabric:
        run_fabric()
    else:
        run_trainer()

"""A three-hundred-and-forty-eighth hand-run batch: PROTEIN FAMILY CLASSIFICATION FROM SEQUENCES (Lightning).

Synthetic protein sequences over the 20 standard amino acids, each tagged with one of 8 families.  Every rank
reads its shard from /tmp/fault348_work/seqs/seqs_R.pt, encodes residues through a 20-letter table (index 0 is
padding), and trains a small 1-D CNN (embedding, two convolutions, masked mean pooling over the residues, a
linear head) with cross entropy.  The model starts from ckpt/pfam_init.pt (loaded in the LightningModule's setup
hook).  Each step the loss is reduced (strategy.reduce) and per-family hit counts all_gathered, then every rank
prints `rank R step S loss L acc A`; at the end every rank calls trainer.save_checkpoint (rank 0 writes
export/pfam_cnn.ckpt).  The Trainer runs DDPStrategy over gloo with --pg-timeout seconds; --fabric 1 runs the
same model with lightning.fabric.Fabric and a hand-written loop (fabric.all_reduce / fabric.all_gather /
fabric.save).

Faults (--fault NAME --rank R, R = -1 for every rank):
  selenocys  - rank R's shard holds selenocysteine 'U' in batch 2, not in the residue table (KeyError, Dataset)
  famlabel   - rank R's shard tags batch 3 with family 8 of 8 (cross_entropy target out of range)
  noshard    - rank R reads its shard from seqs/holdout/, which does not exist (train_dataloader hook)
  ckptvocab  - rank R starts from ckpt/pfam_v25.pt, saved with a 26-entry embedding (size mismatch, setup hook)
  ckptpickle - rank R starts from ckpt/pfam_meta.pt, which pickles a FamilyVocab object (weights_only refusal)
  famgather  - at step 2 rank R all_gathers its per-family hits plus an "unassigned" bin (9 vs 8 entries)
  msa        - before step 2's reduce rank R aligns all pairs of its shard in pure Python (Smith-Waterman)
  nanpool    - rank R's batch 4 holds sequences trimmed to length 0: masked mean 0/0, the program's check
  sigsegv    - rank R sends itself SIGSEGV after step 3 (on_train_batch_end callback)
  exit4      - rank R prints its own ERROR line about the family table at train start and calls sys.exit(4)
  hydro      - every rank appends a hydrophobicity channel to the embeddings: 17 channels into a 16-channel conv
  none       - control, clean run

What happened (filled in after the runs):
  selenocys  - KeyError: 'U' in SeqShard.__getitem__ fetching batch 2; peers Connection closed by peer (np4 r2 pltorchrun, np3 r1 plbashloop)
  famlabel   - 'IndexError: Target 8 is out of bounds.' in cross_entropy at step 3; peers closed; Root Cause rank 3 (np5 r3 plloglevel)
  noshard    - FileNotFoundError seqs/holdout/seqs_2.pt in train_dataloader; peers closed in the train_dataloader() barrier (np3 r2 plown)
  ckptvocab  - size mismatch for emb.weight [26, 16] vs [21, 16]; peers closed in DDP's shape check (np4 r0 plfabric)
  ckptpickle - UnpicklingError 'Weights only load failed' (__main__.FamilyVocab) in setup; peers closed at post_setup (np3 r1 plbashloop)
  famgather  - a peer aborts: gloo EnforceNotMet '18 vs 16. Received data size doesn't match', SIGABRT; rank R Connection reset (np5 r2 plfabric), rank 0 on np3 pltee (Root Cause names the aborting rank 1)
  msa        - 12 s: peers 'Timed out waiting 12000ms' for send/recv, rank 1 SIGTERMed (np3 r1 pltee); 300 s: silent after step 1, exit 137 (np4 r2 plbashloop)
  nanpool    - 'rank 0 step 4: 128 non-finite logits' then FloatingPointError; peers closed in strategy.reduce (np3 r0 pltorchrun)
  sigsegv    - no line from rank 2 after step 3; torchrun SIGTERMs the rest, Root Cause rank 2 exitcode -11 SIGSEGV (np4 r2 plloglevel); bash 'Segmentation fault', loop exit 139 (np6 r5 plbashloop)
  exit4      - rank 2's 'ERROR: family table pfam_v35 lists 9 families ...' and exit 4; Root Cause rank 2 exitcode 4 (np3 r2 pltee); Fabric, rank 0 exitcode 4 (np5 r0 plfabric)
  hydro      - every rank: 'expected input[16, 17, 96] to have 16 channels, but got 17 channels instead'; Root Cause rank 0 (np3 pltorchrun)
  none       - clean: 6 steps on 3 ranks, 'rank 0 done: 6 steps, saved export/pfam_cnn.ckpt', exit 0 (np3 plown)
"""
import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.strategies import DDPStrategy

WORK = "/tmp/fault348_work"
AA = {a: i + 1 for i, a in enumerate("ACDEFGHIKLMNPQRSTVWY")}
HYDRO = {a: h for a, h in zip("ACDEFGHIKLMNPQRSTVWY", [1.8, 2.5, -3.5, -3.5, 2.8, -0.4, -3.2, 4.5, -3.9, 3.8,
                                                       1.9, -3.5, -1.6, -3.5, -4.5, -0.8, -0.7, 4.2, -0.9, -1.3])}
NFAM = 8
EMB = 16
MAXLEN = 96
BATCH = 16
ARGS = None


@dataclass
class FamilyVocab:
    names: list
    version: str = "pfam_v35"


def faulty(rank):
    return ARGS.fault != "none" and ARGS.rank in (-1, rank)


class SeqShard(Dataset):
    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        seq, fam = self.records[i]
        ids = torch.zeros(MAXLEN, dtype=torch.long)
        hyd = torch.zeros(MAXLEN)
        for j, a in enumerate(seq[:MAXLEN]):
            ids[j] = AA[a]
            hyd[j] = HYDRO[a]
        return ids, hyd, torch.tensor(fam)


class FamilyCNN(nn.Module):
    def __init__(self, vocab=21):
        super().__init__()
        self.emb = nn.Embedding(vocab, EMB, padding_idx=0)
        self.conv1 = nn.Conv1d(EMB, 32, 5, padding=2)
        self.conv2 = nn.Conv1d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, NFAM)
        self.hydro = False

    def forward(self, ids, hyd):
        h = self.emb(ids)
        if self.hydro:
            h = torch.cat([h, hyd.unsqueeze(-1)], dim=-1)
        h = torch.relu(self.conv1(h.transpose(1, 2)))
        h = torch.relu(self.conv2(h))
        mask = (ids > 0).float().unsqueeze(1)
        pooled = (h * mask).sum(-1) / mask.sum(-1)
        return self.head(pooled)


def make_shard(n, seed):
    g = torch.Generator().manual_seed(seed)
    letters = list(AA)
    motifs = ["".join(letters[int(k)] for k in torch.randint(0, 20, (6,), generator=g)) for _ in range(NFAM)]
    recs = []
    for _ in range(n):
        fam = int(torch.randint(0, NFAM, (1,), generator=g))
        ln = int(torch.randint(40, MAXLEN - 8, (1,), generator=g))
        body = [letters[int(k)] for k in torch.randint(0, 20, (ln,), generator=g)]
        pos = int(torch.randint(0, ln - 6, (1,), generator=g))
        body[pos:pos + 6] = motifs[fam]
        recs.append(("".join(body), fam))
    return recs


def prepare():
    for d in ("seqs", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(64, 700 + r), f"{WORK}/seqs/seqs_{r}.pt")
    torch.manual_seed(0)
    m = FamilyCNN()
    torch.save(m.state_dict(), f"{WORK}/ckpt/pfam_init.pt")
    torch.save(FamilyCNN(26).state_dict(), f"{WORK}/ckpt/pfam_v25.pt")
    torch.save({"state_dict": m.state_dict(), "vocab": FamilyVocab([f"PF{i:05d}" for i in range(NFAM)])},
               f"{WORK}/ckpt/pfam_meta.pt")
    print(f"prepared {WORK}: 8 shards of 64 sequences, 3 checkpoints", flush=True)


def load_records(rank):
    folder = "seqs/holdout" if ARGS.fault == "noshard" and faulty(rank) else "seqs"
    recs = torch.load(f"{WORK}/{folder}/seqs_{rank}.pt")
    if faulty(rank) and ARGS.fault == "selenocys":
        s, f = recs[BATCH + 3]
        recs[BATCH + 3] = (s[:30] + "U" + s[31:], f)
    if faulty(rank) and ARGS.fault == "famlabel":
        s, f = recs[2 * BATCH + 5]
        recs[2 * BATCH + 5] = (s, NFAM)
    if faulty(rank) and ARGS.fault == "nanpool":
        for i in range(3 * BATCH, 4 * BATCH):
            recs[i] = ("", recs[i][1])
    return recs


def init_weights(net, rank):
    path = f"{WORK}/ckpt/pfam_init.pt"
    if faulty(rank) and ARGS.fault == "ckptvocab":
        path = f"{WORK}/ckpt/pfam_v25.pt"
    if faulty(rank) and ARGS.fault == "ckptpickle":
        sd = torch.load(f"{WORK}/ckpt/pfam_meta.pt")["state_dict"]
    else:
        sd = torch.load(path)
    net.load_state_dict(sd)
    net.hydro = ARGS.fault == "hydro" and faulty(rank)


def sw_score(a, b, match=2, mis=-1, gap=-2):
    prev = [0] * (len(b) + 1)
    best = 0
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            v = max(0, prev[j] + (match if x == y else mis), prev[j + 1] + gap, cur[j] + gap)
            cur.append(v)
            best = max(best, v)
        prev = cur
    return best


def before_reduce(rank, step):
    if step == 2 and ARGS.fault == "msa" and faulty(rank):
        recs = load_records(rank)
        total = 0
        for rnd in range(3):
            for a, _ in recs:
                total += sum(sw_score(a, b) for b, _ in recs)
        print(f"rank {rank} msa: all-pairs score {total}", flush=True)


def check_logits(rank, step, logits):
    bad = (~torch.isfinite(logits)).sum().item()
    if bad:
        print(f"rank {rank} step {step}: {bad} non-finite logits", flush=True)
        raise FloatingPointError(f"rank {rank} step {step}: non-finite logits after masked mean pooling")


def family_hits(logits, fam, rank, step):
    hits = torch.bincount(fam[logits.argmax(-1) == fam], minlength=NFAM).float()[:NFAM]
    if step == 2 and ARGS.fault == "famgather" and faulty(rank):
        hits = torch.cat([hits, torch.zeros(1)])
    return hits


class PfamModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = FamilyCNN()

    def setup(self, stage):
        init_weights(self.net, self.global_rank)

    def train_dataloader(self):
        return DataLoader(SeqShard(load_records(self.global_rank)), batch_size=BATCH, shuffle=False)

    def training_step(self, batch, idx):
        rank, step = self.global_rank, self.global_step + 1
        ids, hyd, fam = batch
        logits = self.net(ids, hyd)
        check_logits(rank, step, logits)
        loss = F.cross_entropy(logits, fam)
        before_reduce(rank, step)
        mean = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        hits = self.all_gather(family_hits(logits, fam, rank, step))
        acc = hits.sum().item() / (BATCH * self.trainer.world_size)
        print(f"rank {rank} step {step} loss {mean.item():.4f} acc {acc:.3f}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class FaultCallback(pl.Callback):
    def on_train_start(self, trainer, module):
        exit_check(trainer.global_rank)

    def on_train_batch_end(self, trainer, module, outputs, batch, idx):
        signal_check(trainer.global_rank, trainer.global_step)


def exit_check(rank):
    if ARGS.fault == "exit4" and faulty(rank):
        print(f"rank {rank} ERROR: family table pfam_v35 lists 9 families but the shard header says {NFAM}; "
              "refusing to train", flush=True)
        sys.exit(4)


def signal_check(rank, step):
    if ARGS.fault == "sigsegv" and faulty(rank) and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)


def run_trainer():
    pg = timedelta(seconds=ARGS.pg_timeout)
    trainer = pl.Trainer(accelerator="cpu", devices=ARGS.devices, num_nodes=1, max_steps=ARGS.steps,
                         strategy=DDPStrategy(process_group_backend="gloo", timeout=pg),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[FaultCallback()])
    trainer.fit(PfamModule())
    trainer.save_checkpoint(f"{WORK}/export/pfam_cnn.ckpt")
    if trainer.global_rank == 0:
        print(f"rank 0 done: {trainer.global_step} steps, saved export/pfam_cnn.ckpt", flush=True)


def run_fabric():
    strat = FabricDDP(process_group_backend="gloo", timeout=timedelta(seconds=ARGS.pg_timeout))
    fabric = Fabric(accelerator="cpu", devices=ARGS.devices, strategy=strat)
    fabric.launch()
    rank = fabric.global_rank
    net = FamilyCNN()
    init_weights(net, rank)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(SeqShard(load_records(rank)), batch_size=BATCH),
                                      use_distributed_sampler=False)
    exit_check(rank)
    step = 0
    while step < ARGS.steps:
        for ids, hyd, fam in loader:
            step += 1
            logits = net(ids, hyd)
            check_logits(rank, step, logits)
            loss = F.cross_entropy(logits, fam)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
            before_reduce(rank, step)
            mean = fabric.all_reduce(loss.detach(), reduce_op="mean")
            hits = fabric.all_gather(family_hits(logits, fam, rank, step))
            acc = hits.sum().item() / (BATCH * fabric.world_size)
            print(f"rank {rank} step {step} loss {mean.item():.4f} acc {acc:.3f}", flush=True)
            signal_check(rank, step)
            if step >= ARGS.steps:
                break
    fabric.save(f"{WORK}/export/pfam_cnn_fabric.ckpt", {"model": net, "optimizer": opt, "step": step})
    if rank == 0:
        print(f"rank 0 done: {step} steps, saved export/pfam_cnn_fabric.ckpt", flush=True)


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    ARGS = p.parse_args()
    if ARGS.prepare:
        prepare()
        return
    torch.manual_seed(1)
    run_fabric() if ARGS.fabric else run_trainer()


if __name__ == "__main__":
    main()

"""Batch 472 of hand-run faults: SONG LYRIC GENRE TAGGING with Lightning (lightning.pytorch).

Synthetic songs: each lyric is a list of token ids (a 500-word vocabulary), a tempo in bpm and a genre name
looked up in a 10-entry genre table.  Every rank reads its songs from /tmp/fault472_work/lyrics/lyrics_R.pt
(its own shard, no distributed sampler), and trains a bag-of-words tagger (EmbeddingBag, mean pooled, the log
tempo appended, a two-layer head over 10 genres) with cross-entropy.  The model is initialised from
ckpt/tagger_v500.pt in setup().  Every step the batch accuracy is all_gathered through the framework
(LightningModule.all_gather, or Fabric.all_gather with --fabric 1) before the progress line
`rank R step S loss L acc A` is printed; rank 0 saves export/tagger.pt at the end.
The Trainer (or Fabric) uses DDPStrategy(process_group_backend="gloo", timeout=--pg-timeout s).
Launch: `python fault472.py --devices W` (Lightning starts the other ranks), torchrun, or one python per rank
with MASTER_ADDR/MASTER_PORT/NODE_RANK/LOCAL_RANK/WORLD_SIZE set.

Faults (--fault NAME --rank R; R = -1 means every rank):
  genre       - rank R's shard labels one song "k-pop", missing from the genre table: KeyError in the dataset (step 3)
  nolyrics    - rank R reads lyrics/test/lyrics_R.pt, which does not exist (FileNotFoundError in train_dataloader)
  ckptvocab   - rank R initialises from ckpt/tagger_v600.pt (a 600-word vocabulary): load_state_dict size mismatch
  ckptpickle  - rank R loads ckpt/tagger_meta.pt (it pickles a TokenizerInfo object) with torch.load's default
                weights_only=True in on_train_start: UnpicklingError
  gathershape - rank R all_gathers per-genre accuracy (10 values) instead of the 1-value batch accuracy (step 1)
  slowrank    - rank R re-tokenises all its lyrics in pure Python before step 2's all_gather (--slow-s seconds)
  nanloss     - rank R's songs in batch 3 have tempo 0 bpm: log tempo -inf, NaN loss, the program's check raises
                FloatingPointError
  sigsegv     - rank R sends itself SIGSEGV after step 2
  exit4       - rank R prints its own error line about a lyric encoding and calls sys.exit(4) at train start
  headwidth   - every rank: the tempo is appended twice, 66 features into a head built for 65 (shape error)
  badlabel    - rank R's batch 4 has a genre index 12 >= 10 classes: cross_entropy IndexError
  none        - control, clean run

What happened (filled in after the runs):
  genre       - KeyError: 'k-pop' in LyricDataset.__getitem__ while Lightning fetches batch 3, after step 2; peers Connection
                closed by peer (np4 r2 pltorchrun, Root Cause rank 2; np5 r0 plbashloop, loop exit 1)
  nolyrics    - FileNotFoundError for lyrics/test/lyrics_N.pt before step 0; peers closed in a barrier or DDP backward
                (np3 r1 plown; np4 r3 plfabric, where rank 1 then aborts and the Root Cause names rank 1 SIGABRT)
  ckptvocab   - 'size mismatch for emb.weight: ... [600, 64] from checkpoint ... [500, 64]' in setup(); peers closed in
                the post_setup barrier (np4 r1 pltee, np3 r0 plloglevel)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.TokenizerInfo'; peers
                closed (np5 r3 plfabric, Root Cause rank 0 SIGABRT 'terminate called without an active exception';
                np3 r2 pltorchrun, Root Cause rank 2)
  gathershape - a receiving rank aborts: gloo::EnforceNotMet 'Received data size doesn't match expected size' (20 vs 2);
                the others Connection reset/closed (np4 r2 plbashloop, exit 134; np3 r1 plfabric, Root Cause rank 2 SIGABRT)
  slowrank    - 12 s: peers 'Timed out waiting 12000ms for recv/send' after step 1, Root Cause rank 0 (np3 r2
                plloglevel); 300 s: output stops after step 1, killed at 60 s, exit 124 (np4 r1 plbashloop; the four
                ranks outlived the loop and were SIGKILLed by process group afterwards)
  nanloss     - the program's check 'loss is nan at step 3, 16 non-finite log-tempo values' and FloatingPointError; peers
                closed (np6 r4 pltorchrun, np3 r0 plown)
  sigsegv     - rank N dies silently after its step 2 line; Root Cause rank 3 exitcode -11 (np4 r3 pltee); under
                Lightning's own launcher no signal is reported at all, exit 1 (np5 r1 plown)
  exit4       - rank 2's 'ERROR lyric shard ... not valid UTF-8' line and sys.exit(4); peers closed; exit 1 from rank 0 (np3 r2 plown)
  headwidth   - every rank 'mat1 and mat2 shapes cannot be multiplied (16x66 and 65x10)' in step 0; Root Cause rank 0 (np5 pltee)
  badlabel    - IndexError 'Target 12 is out of bounds.' at step 4; peers closed (np6 r5 plloglevel, np4 r0 plfabric)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/tagger.pt, exit 0 (np3 pltorchrun)
"""
import argparse
import math
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

WORK = "/tmp/fault472_work"
GENRES = {"rock": 0, "pop": 1, "hiphop": 2, "country": 3, "jazz": 4, "blues": 5, "metal": 6, "folk": 7,
          "reggae": 8, "electronic": 9}
VOCAB = 500
EMB = 64
MAXLEN = 40
BATCH = 16


@dataclass
class TokenizerInfo:
    vocab: int
    lowercase: bool
    version: str


class LyricTagger(nn.Module):
    def __init__(self, vocab=VOCAB, emb=EMB, ngenre=len(GENRES)):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, emb, mode="mean")
        self.hidden = nn.Linear(emb + 1, emb + 1)
        self.head = nn.Linear(emb + 1, ngenre)

    def forward(self, tokens, offsets, logbpm, twice=False):
        h = self.emb(tokens, offsets)
        extra = [logbpm[:, None], logbpm[:, None]] if twice else [logbpm[:, None]]
        h = torch.cat([h] + extra, dim=1)
        if not twice:
            h = torch.relu(self.hidden(h))
        return self.head(h)


def make_songs(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(GENRES)
    songs = []
    for _ in range(n):
        gi = int(torch.randint(0, len(names), (1,), generator=g))
        ln = int(torch.randint(8, MAXLEN, (1,), generator=g))
        base = gi * 50
        toks = (base + torch.randint(0, 80, (ln,), generator=g)) % VOCAB
        bpm = 70.0 + 10 * gi + float(torch.randint(0, 30, (1,), generator=g))
        songs.append({"tokens": toks.tolist(), "bpm": bpm, "genre": names[gi],
                      "title": f"song {seed}-{len(songs)}"})
    return songs


def prepare():
    os.makedirs(f"{WORK}/lyrics", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_songs(160, 472 + r), f"{WORK}/lyrics/lyrics_{r}.pt")
    torch.manual_seed(0)
    torch.save(LyricTagger().state_dict(), f"{WORK}/ckpt/tagger_v500.pt")
    torch.save(LyricTagger(vocab=600).state_dict(), f"{WORK}/ckpt/tagger_v600.pt")
    torch.save({"tokenizer": TokenizerInfo(VOCAB, True, "bpe-0.3"), "genres": GENRES}, f"{WORK}/ckpt/tagger_meta.pt")
    print("prepared", WORK)


class LyricDataset(Dataset):
    def __init__(self, songs, fault, bad):
        self.songs = songs
        self.fault = fault if bad else "none"

    def __len__(self):
        return len(self.songs)

    def __getitem__(self, i):
        s = self.songs[i]
        genre = s["genre"]
        if self.fault == "genre" and i == BATCH * 3 + 5:
            genre = "k-pop"
        label = GENRES[genre]
        if self.fault == "badlabel" and i == BATCH * 4 + 2:
            label = 12
        bpm = 0.0 if self.fault == "nanloss" and BATCH * 3 <= i < BATCH * 4 else s["bpm"]
        return torch.tensor(s["tokens"]), math.log(bpm / 120.0) if bpm > 0 else float("-inf"), label


def collate(items):
    toks = [t for t, _, _ in items]
    offsets = torch.tensor([0] + [len(t) for t in toks[:-1]]).cumsum(0)
    return torch.cat(toks), offsets, torch.tensor([b for _, b, _ in items]), torch.tensor([y for _, _, y in items])


def load_songs(a, rank, bad):
    split = "test/" if bad and a.fault == "nolyrics" else ""
    return torch.load(f"{WORK}/lyrics/{split}lyrics_{rank}.pt")


def init_weights(a, model, bad):
    ck = "tagger_v600.pt" if bad and a.fault == "ckptvocab" else "tagger_v500.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))


def check_meta(a, rank, bad):
    if bad and a.fault == "ckptpickle":
        meta = torch.load(f"{WORK}/ckpt/tagger_meta.pt")
        print(f"rank {rank} tokenizer {meta['tokenizer']}", flush=True)
    if bad and a.fault == "exit4":
        print(f"rank {rank}: ERROR lyric shard lyrics_{rank}.pt: song 41 is not valid UTF-8 after detokenising "
              f"(byte 0xe9 at offset 17), refusing to train", flush=True)
        sys.exit(4)


def retokenise(songs, budget):
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        for s in songs:
            words = [f"w{t}" for t in s["tokens"]]
            n += sum(1 for w in words for _ in w if w.lower() != w.upper())
    return n


def step_loss(a, model, batch, step, rank, bad):
    tokens, offsets, logbpm, y = batch
    logits = model(tokens, offsets, logbpm, twice=(bad and a.fault == "headwidth"))
    loss = F.cross_entropy(logits, y)
    if not torch.isfinite(loss):
        print(f"rank {rank}: loss is {loss.item()} at step {step}, {int((~torch.isfinite(logbpm)).sum())} "
              f"non-finite log-tempo values in the batch", flush=True)
        raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
    pred = logits.argmax(1)
    if bad and a.fault == "gathershape" and step == 1:
        acc = torch.stack([((pred == y) & (y == g)).float().sum() for g in range(len(GENRES))])
    else:
        acc = (pred == y).float().mean().reshape(1)
    return loss, acc


def after_gather(a, rank, step, loss, allacc, bad, songs):
    print(f"rank {rank} step {step} loss {loss.item():.4f} acc {allacc.float().mean().item():.4f}", flush=True)
    if bad and a.fault == "sigsegv" and step == 2:
        os.kill(os.getpid(), signal.SIGSEGV)


def before_gather(a, rank, step, bad, songs):
    if bad and a.fault == "slowrank" and step == 2:
        n = retokenise(songs, a.slow_s)
        print(f"rank {rank} retokenised: {n} characters", flush=True)


def save_export(model, rank, a):
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/tagger.pt")
        print(f"rank 0 done: {a.steps} steps, saved export/tagger.pt", flush=True)


def run_trainer(a):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class TaggerModule(pl.LightningModule):
        def __init__(self, args):
            super().__init__()
            self.a = args
            self.model = LyricTagger()
            self.songs = None

        def bad(self):
            return self.a.rank in (-1, self.global_rank)

        def setup(self, stage):
            print(f"rank {self.global_rank}/{self.trainer.world_size} up, initialising from ckpt", flush=True)
            init_weights(self.a, self.model, self.bad())

        def train_dataloader(self):
            self.songs = load_songs(self.a, self.global_rank, self.bad())
            ds = LyricDataset(self.songs, self.a.fault, self.bad())
            return DataLoader(ds, batch_size=BATCH, shuffle=False, collate_fn=collate)

        def on_train_start(self):
            check_meta(self.a, self.global_rank, self.bad())

        def training_step(self, batch, step):
            loss, acc = step_loss(self.a, self.model, batch, step, self.global_rank, self.bad())
            before_gather(self.a, self.global_rank, step, self.bad(), self.songs)
            allacc = self.all_gather(acc)
            after_gather(self.a, self.global_rank, step, loss, allacc, self.bad(), self.songs)
            return loss

        def on_train_end(self):
            save_export(self.model, self.global_rank, self.a)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=a.devices, num_nodes=a.nodes, strategy=strategy,
                         max_steps=a.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(TaggerModule(a))


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    fabric = Fabric(accelerator="cpu", devices=a.devices, num_nodes=a.nodes, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    bad = a.rank in (-1, rank)
    fabric.print(f"fabric world {fabric.world_size}")
    print(f"rank {rank}/{fabric.world_size} up, initialising from ckpt", flush=True)
    model = LyricTagger()
    init_weights(a, model, bad)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, opt = fabric.setup(model, opt)
    songs = load_songs(a, rank, bad)
    dl = fabric.setup_dataloaders(DataLoader(LyricDataset(songs, a.fault, bad), batch_size=BATCH,
                                             shuffle=False, collate_fn=collate), use_distributed_sampler=False)
    check_meta(a, rank, bad)
    for step, batch in enumerate(dl):
        if step >= a.steps:
            break
        loss, acc = step_loss(a, model, batch, step, rank, bad)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        before_gather(a, rank, step, bad, songs)
        allacc = fabric.all_gather(acc)
        after_gather(a, rank, step, loss, allacc, bad, songs)
    save_export(model.module if hasattr(model, "module") else model, rank, a)
    fabric.barrier()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=int, default=45)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1)
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

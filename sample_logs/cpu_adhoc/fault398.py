"""A three-hundred-and-ninety-eighth hand-run batch: VECTOR-QUANTISED AUTOENCODER FOR IMAGE TOKENS.

Synthetic 16x16 grey images (a blob on a gradient) with a style tag ("photo", "painting", "render", "scan")
are written once by --prepare under /tmp/fault398_work/shards/shard_R.pt, one shard of 48 images per rank.
Every rank trains a small VQ-VAE: a conv encoder to a 4x4 grid of 16-d latents, a 64-entry codebook
(nearest code, straight-through estimator, commitment loss), a style embedding added to the latents, a
token prior (an embedding of the code ids feeding a linear head that predicts the style) and a conv
decoder.  The weights start from ckpt/vqae_k64.pt.  Written with Lightning: by default a
LightningModule under Trainer(strategy=DDPStrategy(process_group_backend="gloo", timeout=--pg-timeout));
with --fabric 1 the same model under lightning.fabric.Fabric and a hand-written loop.  Every step the loss
is reduced (strategy.reduce / fabric.all_reduce) and the per-rank code histogram all_gathered to give
the codebook perplexity; rank 0 saves export/vqae.pt at the end (fabric.save in Fabric mode).
Options: --devices W, --fabric 1, --fault NAME, --rank R (-1: every rank), --steps, --pg-timeout, --prepare.

Faults:
  badpixel   - rank N reads the 16-bit rescan shard (values up to 4095); the dataset's check raises ValueError
  stylekey   - rank N's shard tags one image "sketch", missing from the style table (KeyError, step 2)
  codeindex  - rank N feeds the token prior joint (style, code) ids style*64+code from step 4, but the prior
               table has 64 rows (IndexError)
  noshard    - rank N reads shards_v2/shard_N.pt, which does not exist (FileNotFoundError at set-up)
  ckptsize   - rank N initialises from ckpt/vqae_k128.pt, a 128-code codebook (size mismatch)
  ckptpickle - rank N initialises from ckpt/vqae_k64_meta.pt, which pickles a CodebookMeta object
               (torch.load weights_only refusal)
  codegather - rank N all_gathers its code histogram with an extra "dead code" bin (65 vs 64) at step 2
  slowkmeans - rank N re-seeds dead codes with a pure-Python k-means for ~30 s before the step-2 reduce
  hang       - rank N waits at step 3 for export/ready.flag, which nothing writes (run with --pg-timeout 300)
  nanloss    - rank N's shard holds a blank image at index 24: per-image std 0, the program's check (step 3)
  segv       - rank N sends itself SIGSEGV after step 3 (an on_train_batch_end callback / the Fabric loop)
  exit5      - after training, rank N prints its own codebook-collapse error and sys.exit(5) before the
               final barrier
  encdim     - every rank: the decoder is built for 32-channel latents, the encoder gives 16 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  badpixel   - rank N 'ValueError: pixel value 2883 out of range [0, 255] ...' in batch 0; peers closed (np4 r1 pltorchrun, np5 r0 plfabric)
  stylekey   - after steps 0-1 rank N 'KeyError: 'sketch''; peers Connection closed (np3 r2 plbashloop, np5 r3 pltee)
  codeindex  - try 1 (ids+1) never reached id 64, ran clean: dropped; style*64+code ids: rank 2 'IndexError: index out
               of range in self' at step 4 (np4 r2 plloglevel, port 61820)
  noshard    - rank N FileNotFoundError shards_v2/shard_N.pt at set-up; peers closed (np3 r1 plfabric, np6 r4 plbashloop)
  ckptsize   - rank 0 'size mismatch for codebook.weight ... [128, 16] ... [64, 16]' (np4 r0 pltorchrun)
  ckptpickle - rank 1 'Weights only load failed ... Unsupported global: GLOBAL __main__.CodebookMeta' (np3 r1 plown)
  codegather - a peer, not rank N, aborts on gloo::EnforceNotMet '130 vs 128. Received data size doesn't match
               expected size' (SIGABRT, Root Cause); the rest reset by peer (np4 r3 plfabric, np3 r1 pltee)
  slowkmeans - the others 'Timed out waiting 12000ms for recv/send'; rank N closed after (np4 r2 pltorchrun, np3 r0 plbashloop)
  hang       - output stops after step 2 at rank 1's wait line; SIGTERM at 60 s, SIGKILL at 65 s, exit 137; the three
               workers outlived the kill and were killed by pid (np3 r1 plloglevel)
  nanloss    - rank 2 'FloatingPointError: rank 2 step 3: 256 non-finite values ...' (np5 r2 plown)
  segv       - rank 1 silent after step 3; agent exitcode -11 (SIGSEGV); peers reset (np4 r1 plfabric)
  exit5      - rank 2's ERROR line after step 5, exitcode 5; peers closed in the barrier (np3 r2 pltee)
  encdim     - every rank 'expected input[8, 16, 4, 4] to have 32 channels, but got 16'; Root Cause rank 1 (np3 plloglevel)
  none       - clean, 6 steps, export saved, exit 0 (np3 plown, np4 plfabric)
"""
import argparse
import dataclasses
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault398_work"
STYLES = {"photo": 0, "painting": 1, "render": 2, "scan": 3}
K, DIM = 64, 16  # codebook size, latent width


@dataclasses.dataclass
class CodebookMeta:
    codes: int
    dim: int
    note: str


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--fabric", type=int, default=0)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--prepare", action="store_true")
    return p.parse_args()


def make_image(g):
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    cy, cx = torch.randint(3, 13, (2,), generator=g).float()
    blob = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 8.0)
    grad = (xx + yy) / 30.0
    return ((0.6 * blob + 0.4 * grad) * 255).clamp(0, 255)


def prepare():
    g = torch.Generator().manual_seed(398)
    for sub in ("shards", "ckpt", "export"):
        os.makedirs(os.path.join(WORK, sub), exist_ok=True)
    names = list(STYLES)
    for r in range(6):
        imgs = torch.stack([make_image(g) for _ in range(48)]).unsqueeze(1)
        styles = [names[int(i)] for i in torch.randint(0, 4, (48,), generator=g)]
        torch.save({"images": imgs.to(torch.uint8), "styles": styles}, f"{WORK}/shards/shard_{r}.pt")
        torch.save({"images": (imgs * 16).to(torch.int16), "styles": styles}, f"{WORK}/shards/shard_{r}_u16.pt")
    torch.manual_seed(0)
    torch.save(VQAE().state_dict(), f"{WORK}/ckpt/vqae_k64.pt")
    torch.save(VQAE(codes=128).state_dict(), f"{WORK}/ckpt/vqae_k128.pt")
    torch.save({"state_dict": VQAE().state_dict(), "meta": CodebookMeta(K, DIM, "k64 v1")},
               f"{WORK}/ckpt/vqae_k64_meta.pt")
    print(f"prepared shards and checkpoints under {WORK}")


class Shard(torch.utils.data.Dataset):
    def __init__(self, rank, fault, faulty):
        path = f"{WORK}/shards/shard_{rank}.pt"
        if faulty and fault == "badpixel":
            path = f"{WORK}/shards/shard_{rank}_u16.pt"
        if faulty and fault == "noshard":
            path = f"{WORK}/shards_v2/shard_{rank}.pt"
        blob = torch.load(path)
        self.path = path
        self.images = blob["images"]
        self.styles = list(blob["styles"])
        if faulty and fault == "stylekey":
            self.styles[20] = "sketch"
        if faulty and fault == "nanloss":
            self.images[24] = 0

    def __len__(self): return len(self.images)

    def __getitem__(self, i):
        img = self.images[i].float()
        vmax = float(img.max())
        if vmax > 255:
            raise ValueError(f"pixel value {vmax:.0f} out of range [0, 255] in image {i} of {self.path}")
        style = STYLES[self.styles[i]]
        img = (img - img.mean()) / img.std()
        return img, style


class VQAE(nn.Module):
    def __init__(self, codes=K, dec_in=DIM):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, DIM, 3, 2, 1))
        self.codebook = nn.Embedding(codes, DIM)
        self.style = nn.Embedding(4, DIM)
        self.prior = nn.Embedding(codes, 8)
        self.style_head = nn.Linear(8, 4)
        self.dec = nn.Sequential(nn.ConvTranspose2d(dec_in, 16, 4, 2, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(16, 1, 4, 2, 1))

    def forward(self, x, style, shift=0):
        z = self.enc(x)                                   # B x 16 x 4 x 4
        z = z + self.style(style)[:, :, None, None]
        flat = z.permute(0, 2, 3, 1).reshape(-1, DIM)
        ids = torch.cdist(flat, self.codebook.weight).argmin(1)
        q = self.codebook(ids).view(z.shape[0], 4, 4, DIM).permute(0, 3, 1, 2)
        commit = F.mse_loss(z, q.detach()) + 0.25 * F.mse_loss(q, z.detach())
        zq = z + (q - z).detach()
        rec = self.dec(zq)
        tok = self.prior(ids.view(z.shape[0], -1) + shift).mean(1)
        style_loss = F.cross_entropy(self.style_head(tok), style)
        loss = F.mse_loss(rec, x) + commit + 0.1 * style_loss
        return loss, ids


def load_init(model, rank, fault, faulty, fabric=None):
    path = f"{WORK}/ckpt/vqae_k64.pt"
    if faulty and fault == "ckptsize":
        path = f"{WORK}/ckpt/vqae_k128.pt"
    if faulty and fault == "ckptpickle":
        path = f"{WORK}/ckpt/vqae_k64_meta.pt"
    if fabric is not None:
        fabric.load_raw(path, model)
        return
    from lightning.fabric.utilities.cloud_io import _load as pl_load
    state = pl_load(path) if fault != "ckptpickle" else torch.load(path)
    if "state_dict" in state:
        state = state["state_dict"]
    model.load_state_dict(state)


def step_faults(a, rank, step, faulty):
    if not faulty:
        return
    if a.fault == "slowkmeans" and step == 2:
        print(f"rank {rank}: {37} dead codes, re-seeding them with k-means (python)", flush=True)
        t0 = time.time()
        pts = [[float((i * 7 + j) % 13) for j in range(DIM)] for i in range(2000)]
        it = 0
        while time.time() - t0 < 30:
            cents = pts[:37]
            for p in pts:
                min(range(37), key=lambda c: sum((p[j] - cents[c][j]) ** 2 for j in range(DIM)))
            it += 1
        print(f"rank {rank}: k-means done after {it} iterations", flush=True)
    if a.fault == "hang" and step == 3:
        print(f"rank {rank}: waiting for {WORK}/export/ready.flag before the codebook refresh", flush=True)
        while not os.path.exists(f"{WORK}/export/ready.flag"):
            time.sleep(0.5)


def histogram(ids, rank, step, fault, faulty):
    h = torch.bincount(ids, minlength=K).float()
    if faulty and fault == "codegather" and step == 2:
        h = torch.cat([h, torch.tensor([float((h == 0).sum())])])
    return h


def perplexity(gathered):
    p = gathered.reshape(-1, K).sum(0)
    p = p / p.sum()
    return float(torch.exp(-(p * torch.log(p + 1e-10)).sum()))


def check_finite(x, rank, step):
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        raise FloatingPointError(f"rank {rank} step {step}: {bad} non-finite values in the normalised batch")


def run_trainer(a):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class LitVQAE(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = VQAE(dec_in=32 if a.fault == "encdim" else DIM)

        def faulty(self): return a.rank in (-1, self.global_rank)

        def setup(self, stage):
            self.shard = Shard(self.global_rank, a.fault, self.faulty())
            if a.fault != "encdim":
                load_init(self.net, self.global_rank, a.fault, self.faulty())

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.shard, batch_size=8, shuffle=False)

        def training_step(self, batch, i):
            x, style = batch
            r, s = self.global_rank, self.global_step
            check_finite(x, r, s)
            step_faults(a, r, s, self.faulty())
            shift = style[:, None] * K if (self.faulty() and a.fault == "codeindex" and s >= 4) else 0
            loss, ids = self.net(x, style, shift)
            red = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
            g = self.all_gather(histogram(ids, r, s, a.fault, self.faulty()))
            print(f"rank {r} step {s} loss {red.item():.4f} perplexity {perplexity(g):.2f}", flush=True)
            return loss

        def configure_optimizers(self): return torch.optim.Adam(self.parameters(), lr=2e-3)

    class SegvCallback(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            if a.fault == "segv" and module.faulty() and trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGSEGV)

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=a.devices, strategy=strategy, max_steps=a.steps,
                         max_epochs=100, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[SegvCallback()])
    model = LitVQAE()
    trainer.fit(model)
    rank = trainer.global_rank
    finish(a, rank, lambda: trainer.strategy.barrier("export"))
    if rank == 0:
        torch.save(model.net.state_dict(), f"{WORK}/export/vqae.pt")
        print(f"rank 0 saved {WORK}/export/vqae.pt", flush=True)


def finish(a, rank, barrier):
    if a.fault == "exit5" and a.rank in (-1, rank):
        print(f"[rank {rank}] ERROR: codebook collapse: only 3 of {K} codes in use after training; "
              f"refusing to export", flush=True)
        sys.exit(5)
    barrier()


def run_fabric(a):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=a.pg_timeout))
    fabric = Fabric(accelerator="cpu", devices=a.devices, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    faulty = a.rank in (-1, rank)
    net = VQAE(dec_in=32 if a.fault == "encdim" else DIM)
    if a.fault != "encdim":
        load_init(net, rank, a.fault, faulty, fabric=fabric)
    shard = Shard(rank, a.fault, faulty)
    loader = torch.utils.data.DataLoader(shard, batch_size=8, shuffle=False)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    net, opt = fabric.setup(net, opt)
    step = 0
    while step < a.steps:
        for x, style in loader:
            if step >= a.steps:
                break
            check_finite(x, rank, step)
            step_faults(a, rank, step, faulty)
            shift = style[:, None] * K if (faulty and a.fault == "codeindex" and step >= 4) else 0
            loss, ids = net(x, style, shift)
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
            red = fabric.all_reduce(loss.detach(), reduce_op="mean")
            g = fabric.all_gather(histogram(ids, rank, step, a.fault, faulty))
            print(f"rank {rank} step {step} loss {red.item():.4f} perplexity {perplexity(g):.2f}", flush=True)
            if a.fault == "segv" and faulty and step == 3:
                os.kill(os.getpid(), signal.SIGSEGV)
            step += 1
    finish(a, rank, fabric.barrier)
    fabric.save(f"{WORK}/export/vqae_fabric.pt", {"model": net})
    if rank == 0:
        print(f"rank 0 saved {WORK}/export/vqae_fabric.pt", flush=True)


def main():
    a = parse()
    if a.prepare:
        prepare()
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if a.fabric:
        run_fabric(a)
    else:
        run_trainer(a)


if __name__ == "__main__":
    main()

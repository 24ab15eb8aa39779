"""A three-hundred-and-fifteenth hand-run batch: STYLE TRANSFER WITH A SMALL CYCLEGAN.

Synthetic unpaired images: domain A "photos" (smooth colour gradients) and domain B "paintings" (blocky
palettes), 3x16x16, 64 of each per rank, written by --prepare to /tmp/fault315_work/data/{photos,paintings}_R.pt.
Every painting carries a style name looked up in a small style table.  Two generators (A->B, B->A: a stride-2
conv down, a residual block, a transposed conv up, tanh) and two PatchGAN discriminators are trained with the
least-squares GAN loss plus cycle and identity L1 losses.  Generators and discriminators are each wrapped in
DDP (gloo), or with --ddp 0 their gradients are all_reduced by hand.  They start from ckpt/gen_init.pt and
ckpt/disc_init.pt.  Per-rank colour histograms (16 bins) are all_gathered at the start, the cycle loss is
all_reduced every step, and rank 0 saves export/cyclegan.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  palette    - rank N's paintings include a "hokusai" style that the style table lacks (KeyError, start-up)
  nopaint    - rank N reads its paintings from data/monet/ which does not exist (FileNotFoundError, start-up)
  ckptdisc   - rank N initialises its discriminators from ckpt/disc_wide.pt (32 channels, size mismatch)
  ckptpickle - rank N loads ckpt/gen_full.pt, a whole pickled module, with torch.load's weights_only default
  histgather - rank N all_gathers a 17-bin colour histogram (an extra alpha bin) where peers send 16
  poolslow   - rank N rebuilds its fake-image history pool in pure Python before the step-2 all_reduce
  cyclenan   - rank N's cycle weight schedule divides by zero at step 3: the loss check finds a non-finite loss
  sigsegv    - rank N sends itself SIGSEGV after step 3
  tilecrop   - rank N picks a crop from the 4-entry crop table with index 4 at step 1 (IndexError)
  exit4      - rank N finds RGBA tiles in its sample grid at the end, prints an ERROR line, sys.exit(4)
  upsample   - every rank: the generator's transposed conv uses kernel 4, the cycle comes back 19 wide (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  palette    - KeyError: 'hokusai' at the style lookup at start-up; peers Connection closed in the all_gather (np4 r2 tee, np3 r0 loglevel)
  nopaint    - FileNotFoundError for data/monet/paintings_N.pt before the first all_gather; peers closed (np5 r3 pymodule)
  ckptdisc   - load_state_dict size mismatch for ab.c1.weight [32,3,4,4] vs [16,3,4,4] ... (np4 r1 pdsh2, np3 r2 filter)
  ckptpickle - '_pickle.UnpicklingError: Weights only load failed ... Unsupported global: GLOBAL __main__.Pair' in rank 1's stderr.log; console summary only (np3 r1 redirects)
  histgather - DETAIL: every rank 'Detected mismatch between collectives', rank N TensorShape=[17] (np4 r3 detail); plain: 'allgather: invalid tensor size at index 0 (expected (17), got (16))' (np3 r1 prefix)
  poolslow   - 12 s: ranks 0/1 'Timed out waiting 12000ms for recv/send' in the step-2 D backward, rank N SIGTERMed silently (np3 r2 plain); 300 s: silent after step 1, timeout 60 s, exit 124 (np4 r1 wrapper)
  cyclenan   - 'generator loss is inf at step 3 (... lambda inf)' and FloatingPointError; DETAIL peers name rank 0 via monitoredBarrier (np5 r4 tee_trainer, np3 r0 detail)
  sigsegv    - no traceback after step 3; Root Cause exitcode -11 (SIGSEGV) (np3 r1 tee); restart: exitcode -11, then attempt 1 ended in rank 3's 12 s start-up all_gather timeout (np4 r2 restart)
  tilecrop   - IndexError: list index out of range at CROPS[ci] in step 1; peers closed (np5 r1 pymodule, np4 r3 loglevel)
  exit4      - rank 0's ERROR line after step 5, exit 4 before saving; Root Cause rank 0 exitcode 4 (np4 r0 tee_trainer)
  upsample   - every rank: 'The size of tensor a (19) must match the size of tensor b (16) at non-singleton dimension 3' at step 0 (np3 wrapper)
  none       - clean: 6 steps, rank 0 saved export/cyclegan.pt, exit 0 (np3 plain, np5 plain)
"""
import argparse
import logging
import os
import random
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault315_work"
STYLES = {"monet": 0, "vangogh": 1, "cezanne": 2, "ukiyoe": 3}
CROPS = [(0, 0), (0, 2), (2, 0), (2, 2)]
BINS = 16
log = None


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("cyclegan")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.c1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return x + self.c2(F.relu(self.c1(x)))


class Generator(nn.Module):
    def __init__(self, ch=16, up_kernel=3):
        super().__init__()
        self.inc = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1)
        self.res = ResBlock(2 * ch)
        self.up = nn.ConvTranspose2d(2 * ch, ch, up_kernel, stride=2, padding=1, output_padding=1)
        self.out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.inc(x))
        h = F.relu(self.res(F.relu(self.down(h))))
        return torch.tanh(self.out(F.relu(self.up(h))))


class Discriminator(nn.Module):
    def __init__(self, ch=16):
        super().__init__()
        self.c1 = nn.Conv2d(3, ch, 4, stride=2, padding=1)
        self.c2 = nn.Conv2d(ch, 2 * ch, 4, stride=2, padding=1)
        self.c3 = nn.Conv2d(2 * ch, 1, 3, padding=1)

    def forward(self, x):
        return self.c3(F.leaky_relu(self.c2(F.leaky_relu(self.c1(x), 0.2)), 0.2))


class Pair(nn.Module):
    def __init__(self, make, gen=False):
        super().__init__()
        self.ab = make()
        self.ba = make()
        self.gen = gen

    def forward(self, x_a, x_b):
        if not self.gen:
            return self.ab(x_a), self.ba(x_b)
        fake_b, fake_a = self.ab(x_a), self.ba(x_b)
        return fake_b, fake_a, self.ba(fake_b), self.ab(fake_a), self.ab(x_b), self.ba(x_a)


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(500 + r)
        ramp = torch.linspace(-1, 1, 16)
        base = torch.rand(64, 3, 1, 1, generator=g) * 2 - 1
        photos = (base * ramp.view(1, 1, 1, 16) * ramp.view(1, 1, 16, 1) + 0.1 * torch.randn(64, 3, 16, 16, generator=g))
        pal = torch.rand(64, 3, 4, 4, generator=g) * 2 - 1
        paints = F.interpolate(pal, scale_factor=4, mode="nearest")
        styles = [list(STYLES)[int(i)] for i in torch.randint(0, 4, (64,), generator=g)]
        torch.save(photos.clamp(-1, 1), f"{WORK}/data/photos_{r}.pt")
        torch.save({"images": paints, "styles": styles}, f"{WORK}/data/paintings_{r}.pt")
    torch.manual_seed(0)
    torch.save(Pair(Generator, gen=True).state_dict(), f"{WORK}/ckpt/gen_init.pt")
    torch.save(Pair(Discriminator).state_dict(), f"{WORK}/ckpt/disc_init.pt")
    torch.save(Pair(lambda: Discriminator(32)).state_dict(), f"{WORK}/ckpt/disc_wide.pt")
    torch.save(Pair(Generator, gen=True), f"{WORK}/ckpt/gen_full.pt")
    print("prepared", WORK)


def colour_hist(x, bins):
    return torch.histc(x.mean(1), bins=bins, min=-1.0, max=1.0)


def rebuild_pool(images, budget):
    t0 = time.time()
    pool, n = [], 0
    while time.time() - t0 < budget:
        for img in images:
            vals = [float(v) for v in img.flatten()[:64]]
            pool.append(sum(v * v for v in vals))
            n += 1
        pool = pool[-50:]
    return n


def sync_grads(module, world):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    random.seed(rank)
    say(f"rank {rank}/{world} up, loading photos and paintings")
    photos = torch.load(f"{WORK}/data/photos_{rank}.pt")
    sub = "monet/" if bad and a.fault == "nopaint" else ""
    paint = torch.load(f"{WORK}/data/{sub}paintings_{rank}.pt")
    styles = paint["styles"]
    if bad and a.fault == "palette":
        styles[11] = "hokusai"
    style_ids = torch.tensor([STYLES[s] for s in styles])
    paintings = paint["images"]
    nbins = BINS + 1 if bad and a.fault == "histgather" else BINS
    hist = colour_hist(torch.cat([photos, paintings]), nbins)
    allh = [torch.zeros(BINS) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} styles {torch.bincount(style_ids, minlength=4).tolist()} "
        f"global colour mass {int(sum(h.sum() for h in allh))}")
    up_k = 4 if a.fault == "upsample" else 3
    gens = Pair(lambda: Generator(up_kernel=up_k), gen=True)
    discs = Pair(Discriminator)
    if bad and a.fault == "ckptpickle":
        gens = torch.load(f"{WORK}/ckpt/gen_full.pt")
    elif up_k == 3:
        gens.load_state_dict(torch.load(f"{WORK}/ckpt/gen_init.pt"))
    dck = "disc_wide.pt" if bad and a.fault == "ckptdisc" else "disc_init.pt"
    discs.load_state_dict(torch.load(f"{WORK}/ckpt/{dck}"))
    if a.ddp:
        g_model, d_model = DDP(gens), DDP(discs)
        g_mod, d_mod = g_model.module, d_model.module
    else:
        g_model, d_model = gens, discs
        g_mod, d_mod = gens, discs
    opt_g = torch.optim.Adam(g_model.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d_model.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bs = 8
    for step in range(a.steps):
        idx = torch.randint(0, photos.shape[0], (bs,))
        real_a, real_b = photos[idx], paintings[idx]
        ci = 4 if bad and a.fault == "tilecrop" and step == 1 else step % 4
        dy, dx = CROPS[ci]
        real_a = F.pad(real_a[:, :, dy:, dx:], (0, dx, 0, dy), mode="replicate")
        fake_b, fake_a, rec_a, rec_b, id_b, id_a = g_model(real_a, real_b)
        pb, pa = d_mod(fake_b, fake_a)
        adv = ((pb - 1) ** 2).mean() + ((pa - 1) ** 2).mean()
        lam = torch.tensor(10.0)
        if bad and a.fault == "cyclenan" and step >= 3:
            lam = lam / torch.tensor(float(3 - step))
        cyc = (rec_a - real_a).abs().mean() + (rec_b - real_b).abs().mean()
        ident = (id_b - real_b).abs().mean() + (id_a - real_a).abs().mean()
        loss_g = adv + lam * cyc + 0.5 * lam * ident
        if not torch.isfinite(loss_g):
            say(f"rank {rank}: generator loss is {loss_g.item()} at step {step} "
                f"(adv {adv.item():.3f} cycle {cyc.item():.3f} lambda {lam.item()})", err=True)
            raise FloatingPointError(f"non-finite generator loss on rank {rank} at step {step}")
        opt_g.zero_grad()
        loss_g.backward()
        if not a.ddp:
            sync_grads(gens, world)
        opt_g.step()
        if bad and a.fault == "poolslow" and step == 2:
            n = rebuild_pool(torch.cat([fake_a, fake_b]).detach(), a.pool_budget)
            say(f"rank {rank} history pool rebuilt from {n} images")
        opt_d.zero_grad()
        db, da = d_model(torch.cat([real_b, fake_b.detach()]), torch.cat([real_a, fake_a.detach()]))
        loss_d = 0.5 * (((db[:bs] - 1) ** 2).mean() + (db[bs:] ** 2).mean()
                        + ((da[:bs] - 1) ** 2).mean() + (da[bs:] ** 2).mean())
        loss_d.backward()
        if not a.ddp:
            sync_grads(discs, world)
        opt_d.step()
        cyc_t = cyc.detach().reshape(1)
        dist.all_reduce(cyc_t)
        say(f"rank {rank} step {step} loss {loss_g.item():.4f} cycle {cyc_t.item() / world:.4f} "
            f"d_loss {loss_d.item():.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR sample grid has 4 channels (RGBA) in tile 6, refusing to export a broken grid",
            err=True)
        sys.exit(4)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save({"gen": gens.state_dict(), "disc": discs.state_dict()}, f"{WORK}/export/cyclegan.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/cyclegan.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--pool-budget", type=int, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()

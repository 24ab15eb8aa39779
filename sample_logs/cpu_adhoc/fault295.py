"""A two-hundred-and-ninety-fifth hand-run batch: SPEECH SEPARATION WITH A SMALL CONV-TASNET.

Synthetic two-speaker mixtures: every rank reads its utterances from /tmp/fault295_work/mix/mix_R.pt (two
reference sources per example, a speaker id per source looked up in a 6-entry speaker gain table, and a
segment index list), mixes them, and trains a small Conv-TasNet (a 1-D conv encoder of 16 filters, a
temporal conv separator of dilated depthwise blocks that predicts one mask per source, a transposed-conv
decoder) with a permutation-invariant negative SI-SNR loss, wrapped in DDP (gloo) or, with --ddp 0, with
gradients all_reduced by hand.  The model is initialised from ckpt/tasnet_n16.pt.  The SI-SNR improvement is
all_reduced every step, per-source SI-SNRs are all_gathered at the end, and rank 0 saves export/tasnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  speakerid  - rank N's manifest names speaker "spk_07" at step 3, missing from the speaker table (KeyError)
  nomix      - rank N reads its mixtures from mix/eval/ which does not exist (FileNotFoundError)
  ckptfilt   - rank N initialises from ckpt/tasnet_n32.pt, saved with 32 encoder filters (size mismatch)
  ckptpickle - rank N loads ckpt/tasnet_full.pt, a pickled config object + weights (weights_only refusal)
  snrgather  - rank N all_gathers 3 per-source SI-SNRs (a noise source) where the others send 2, at the end
  pitsearch  - rank N brute-forces the source permutation over every frame in Python before step 2's all_reduce
  silentref  - rank N's reference sources are all zeros: SI-SNR 0/0, the program's own NaN check
  segv       - rank N sends itself SIGSEGV after step 3
  clipped    - rank N prints its own error about clipped mixtures and calls sys.exit(4)
  maskshape  - every rank: the separator predicts 3 masks, the mask view expects 2 (shape error)
  chunkidx   - rank N's segment list runs past the end of its utterances at step 4 (IndexError)
  none       - control, clean run

What happened (filled in after the runs):
  speakerid  - KeyError: 'spk_07' in the gain lookup at step 3; peers Connection closed in backward (np4 r2 tee, np3 r1 filter)
  nomix      - FileNotFoundError for mix/eval/mix_N.pt before any step; Root Cause rank N (np5 r3 pymodule, np3 r0 wrapper)
  ckptfilt   - load_state_dict size mismatch encoder.weight [32,1,16] vs [16,1,16] (np4 r1 tee_trainer, np4 r2 pdsh2)
  ckptpickle - UnpicklingError 'Weights only load failed ... GLOBAL argparse.Namespace' (np3 r2 loglevel, np3 r0 restart, twice)
  snrgather  - DETAIL: 'Detected mismatch between collectives' TensorShape [3] vs [2] (np4 r3); plain gloo: 'invalid tensor size' (np3 r1 prefix)
  pitsearch  - 12 s: peers 'Timed out waiting 12000ms' for recv/send (np3 r1 plain); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 tee)
  silentref  - the program's check: 'non-finite SI-SNR loss nan at step 0 (reference energy 0.000)', FloatingPointError (np4 r0 redirects, np3 r2 detail)
  segv       - exitcode -11 (SIGSEGV) after step 3 (np5 r2 plain); np3 r1 restart: the second attempt timed out in DDP's parameter check instead
  clipped    - rank N's own ERROR line and exit 4 (np3 r0 pymodule: Root Cause exitcode 4; np4 r3 loglevel: Root Cause names rank 0 SIGABRT)
  maskshape  - never reached the mask view: the 3-mask model refuses the 2-mask checkpoint first (mask.weight [32,16,1] vs [48,16,1]) on every rank (np5 tee_trainer)
  chunkidx   - IndexError: list index out of range at step 4 (np3 r0 wrapper)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/tasnet.pt, exit 0 (np3 plain)
"""
import argparse
import itertools
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault295_work"
SPEAKERS = {"spk_00": 1.0, "spk_01": 0.8, "spk_02": 1.2, "spk_03": 0.9, "spk_04": 1.1, "spk_05": 0.7}
NSRC = 2
SEG = 2000
log = None


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("tasnet")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class TCNBlock(nn.Module):
    def __init__(self, ch, hid, dil):
        super().__init__()
        self.inp = nn.Conv1d(ch, hid, 1)
        self.dw = nn.Conv1d(hid, hid, 3, padding=dil, dilation=dil, groups=hid)
        self.out = nn.Conv1d(hid, ch, 1)
        self.act = nn.PReLU()

    def forward(self, x):
        return x + self.out(self.act(self.dw(self.act(self.inp(x)))))


class ConvTasNet(nn.Module):
    def __init__(self, n_filt=16, win=16, nsrc=NSRC, n_masks=None):
        super().__init__()
        self.nsrc = nsrc
        self.n_masks = n_masks or nsrc
        self.encoder = nn.Conv1d(1, n_filt, win, stride=win // 2, bias=False)
        self.norm = nn.GroupNorm(1, n_filt)
        self.blocks = nn.Sequential(*[TCNBlock(n_filt, 32, 2 ** i) for i in range(3)])
        self.mask = nn.Conv1d(n_filt, n_filt * self.n_masks, 1)
        self.decoder = nn.ConvTranspose1d(n_filt, 1, win, stride=win // 2, bias=False)

    def forward(self, mix):
        w = torch.relu(self.encoder(mix.unsqueeze(1)))
        b, f, t = w.shape
        m = torch.sigmoid(self.mask(self.blocks(self.norm(w))))
        m = m.view(b, self.nsrc, f, t)
        est = self.decoder((w.unsqueeze(1) * m).view(b * self.nsrc, f, t))
        return est.view(b, self.nsrc, -1)[..., : mix.shape[-1]]


def si_snr(est, ref, eps=1e-8):
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True))
    noise = est - proj
    return 10 * torch.log10(proj.pow(2).sum(-1) / (noise.pow(2).sum(-1) + eps))


def pit_loss(est, ref):
    perms = list(itertools.permutations(range(NSRC)))
    scores = torch.stack([si_snr(est[:, list(p)], ref).mean(1) for p in perms], 1)
    best, idx = scores.max(1)
    return -best.mean(), idx


def make_utts(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(SEG) / 8000.0
    spk = list(SPEAKERS)
    utts = []
    for _ in range(n):
        f0 = 100 + 200 * torch.rand(NSRC, 1, generator=g)
        src = torch.sin(2 * torch.pi * f0 * t) * (0.5 + torch.rand(NSRC, 1, generator=g))
        src = src + 0.05 * torch.randn(NSRC, SEG, generator=g)
        ids = [spk[int(i)] for i in torch.randint(0, len(spk), (NSRC,), generator=g)]
        utts.append({"src": src, "spk": ids})
    return utts


def prepare():
    os.makedirs(f"{WORK}/mix", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save({"utts": make_utts(32, 500 + r), "segments": list(range(32))}, f"{WORK}/mix/mix_{r}.pt")
    torch.manual_seed(0)
    torch.save(ConvTasNet(16).state_dict(), f"{WORK}/ckpt/tasnet_n16.pt")
    torch.save(ConvTasNet(32).state_dict(), f"{WORK}/ckpt/tasnet_n32.pt")
    torch.save({"config": argparse.Namespace(n_filt=16, win=16, nsrc=2, sr=8000),
                "model": ConvTasNet(16).state_dict()}, f"{WORK}/ckpt/tasnet_full.pt")
    print("prepared", WORK)


def batch(data, step, bs, bad, a):
    segs = data["segments"]
    if bad and a.fault == "chunkidx" and step == 4:
        segs = [s + 16 for s in segs]
    start = (step * bs) % len(segs)
    idx = segs[start: start + bs]
    srcs, mixes = [], []
    for i in idx:
        u = data["utts"][i]
        ids = list(u["spk"])
        if bad and a.fault == "speakerid" and step == 3:
            ids[1] = "spk_07"
        gains = torch.tensor([SPEAKERS[s] for s in ids]).unsqueeze(1)
        src = u["src"] * gains
        if bad and a.fault == "silentref":
            src = torch.zeros_like(src)
        srcs.append(src)
        mixes.append(src.sum(0) + 0.01 * torch.randn(SEG))
    return torch.stack(mixes), torch.stack(srcs)


def brute_pit(est, ref, budget):
    t0, n = time.time(), 0
    while time.time() - t0 < budget:
        for b in range(est.shape[0]):
            for p in itertools.permutations(range(NSRC)):
                for k in range(0, SEG, 4):
                    n += sum(float(est[b, p[j], k] * ref[b, j, k]) > 0 for j in range(NSRC))
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading mixtures")
    split = "eval/" if bad and a.fault == "nomix" else ""
    data = torch.load(f"{WORK}/mix/{split}mix_{rank}.pt")
    n_masks = 3 if a.fault == "maskshape" else None
    model = ConvTasNet(16, n_masks=n_masks)
    if bad and a.fault == "ckptpickle":
        blob = torch.load(f"{WORK}/ckpt/tasnet_full.pt")
        model.load_state_dict(blob["model"])
    else:
        ck = "tasnet_n32.pt" if bad and a.fault == "ckptfilt" else "tasnet_n16.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    say(f"rank {rank} model {sum(p.numel() for p in model.parameters())} params, {len(data['utts'])} utterances")
    last = None
    for step in range(a.steps):
        mix, ref = batch(data, step, 4, bad, a)
        est = net(mix)
        loss, _ = pit_loss(est, ref)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite SI-SNR loss {loss.item()} at step {step} "
                f"(reference energy {ref.pow(2).sum().item():.3f})", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        if bad and a.fault == "clipped" and step == 1:
            say(f"rank {rank}: ERROR {int((mix.abs() > 0.99).sum())} samples of batch {step} are clipped "
                f"(|x| > 0.99); refusing to train on clipped mixtures, fix the mixing gains", err=True)
            sys.exit(4)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "pitsearch" and step == 2:
            n = brute_pit(est.detach(), ref, a.pit_budget)
            say(f"rank {rank} brute-force PIT checked {n} frame pairs")
        with torch.no_grad():
            sisnri = (-loss.detach() - si_snr(mix.unsqueeze(1).expand_as(ref), ref).mean()).reshape(1)
        dist.all_reduce(sisnri)
        say(f"rank {rank} step {step} loss {loss.item():.4f} si-snri {sisnri.item() / world:.2f} dB")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        last = (est.detach(), ref)
    per_src = si_snr(*last).mean(0)
    if bad and a.fault == "snrgather":
        per_src = torch.cat([per_src, si_snr(last[0][:, :1], torch.randn_like(last[1][:, :1])).mean(0)])
    allsnr = [torch.zeros(NSRC) for _ in range(world)]
    dist.all_gather(allsnr, per_src)
    say(f"rank {rank} per-source SI-SNR {[round(float(v), 2) for v in per_src]} "
        f"global mean {float(torch.stack(allsnr).mean()):.2f} dB")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/tasnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/tasnet.pt")
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
    p.add_argument("--pit-budget", type=int, default=45)
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

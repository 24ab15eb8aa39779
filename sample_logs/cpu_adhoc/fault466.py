"""Hand-run batch 466: PROTEIN CONTACT MAP PREDICTION.

Synthetic proteins (20-letter residue table, C-alpha coordinates from a 3.8 A random walk; contact = distance
< 8 A, |i-j| >= 6) in /tmp/fault466_work/seqs/seqs_R.pt with profiles msa/prof_R.pt; 32-residue crops train a
small contact net (embedding + profile, 1D conv, outer-concatenated pair features, 2D convs, symmetric logits;
soft-contact BCE) from ckpt/contact_init.pt under DDP (gloo) or hand all_reduce (--ddp 0).  Start-up all_gather
of per-separation contact counts, per-step all_reduce of loss and P@L/5, end all_gather of P@L/5, rank 0 saves
export/contact.pt.  Options: --spawn N (mp.spawn, --port), --logfmt 1 (logging with the rank).

Faults (--fault NAME --rank R; R = -1 means every rank):
  residue    - rank R's sequence 3 contains selenocysteine "U", missing from the residue table (KeyError)
  nomsa      - rank R reads its profile from msa/uniref90/prof_R.pt, which does not exist (FileNotFoundError)
  ckptbins   - rank R starts from ckpt/distogram_37.pt, a 37-bin distogram head (size mismatch)
  ckptpickle - rank R starts from ckpt/contact_full.pt, saved with a TrainConfig object (weights_only refusal)
  seplen     - rank R all_gathers 4 separation classes (an extra "all" count) instead of 3
  cropidx    - rank R at step 3 crops a window that runs past the end of its protein (IndexError)
  distnan    - rank R at step 2 gets a protein with unresolved (NaN) coordinates; the loss check raises
  slowpairs  - rank R at step 2 counts contact triangles in pure Python for 45 s before its all_reduce
  hang       - rank R at step 3 waits forever for an "MSA server" lock (run with --pg-timeout 300)
  sigsegv    - rank R sends itself SIGSEGV after step 4
  exit2      - rank R prints its own error about an empty long-range contact set at the end, sys.exit(2)
  pairwidth  - every rank: pair features get a relative-position channel (33 channels, conv wants 32)
  none       - control, clean run

What happened (filled in after the runs):
  residue    - KeyError: 'U' before the start-up all_gather; peers Connection closed by peer (np4 r2 bashloop, np6 r0 tee)
  nomsa      - FileNotFoundError msa/uniref90/prof_R.pt at start-up; peers closed (np3 r1 mpitag, np5 r3 files)
  ckptbins   - size mismatch head.weight [37,16,1,1] vs [1,16,1,1]; Root Cause rank R (np4 r1 pdsh2, np3 r2 legacy)
  ckptpickle - UnpicklingError 'Unsupported global: GLOBAL __main__.TrainConfig'; peers closed (np4 r3 srunlabel)
  seplen     - np3 r0 ranklabel: 'allgather: invalid tensor size at index 0 (expected (4), got (3))'; np6 r4 spawn
               (--ddp 0): only 'terminate called without an active exception' and a peer's Connection closed
  cropidx    - IndexError 'index 51/47 is out of bounds' at step 3; peers closed (np4 r1 logfmt, np3 r2 srunlabel)
  distnan    - own check: 'loss is nan, 240 non-finite target pairs', FloatingPointError at step 2 (np3 r1 spawn)
  slowpairs  - rank 1 'Timed out waiting 12000ms', rank 0 closed; census outran 100 s, exit 124 (np3 r2 bashloop)
  hang       - rank 1 'waiting for MSA server lock' after step 2, killed by timeout at 60 s (np3 r1 ranklabel);
               np4 r1 mpitag and sigsegv np5 r3 bashloop stalled before step 0 on an overloaded host: dropped
  sigsegv    - after step 4, Root Cause rank 0 exitcode -11 (SIGSEGV); peers closed (np4 r0 tee)
  exit2      - own ERROR line after step 5, sys.exit(2); Root Cause rank 3 exitcode 2, exit 1 (np6 r3 legacy)
  pairwidth  - every rank: 'expected input[8, 33, 32, 32] to have 32 channels, but got 33' (np3 all logfmt)
  none       - 6 steps, 'rank 0 done: 6 steps, saved export/contact.pt', exit 0 (np8 spawn)
"""
import argparse
import dataclasses
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault466_work"
AA = {c: i for i, c in enumerate("ACDEFGHIKLMNPQRSTVWY")}
DIM = 16
CROP = 32
log = None


@dataclasses.dataclass
class TrainConfig:
    crop: int = CROP
    lr: float = 3e-3
    min_sep: int = 6

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
    log = logging.getLogger("contact")
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

class ContactNet(nn.Module):
    def __init__(self, dim=DIM, nbins=1):
        super().__init__()
        self.emb = nn.Embedding(20, dim)
        self.prof = nn.Linear(20, dim)
        self.seq_conv = nn.Conv1d(dim, dim, 5, padding=2)
        self.pair1 = nn.Conv2d(2 * dim, 16, 3, padding=1)
        self.pair2 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Conv2d(16, nbins, 1)

    def forward(self, tok, prof, relpos=False):
        h = self.emb(tok) + self.prof(prof)                       # B L D
        h = torch.relu(self.seq_conv(h.transpose(1, 2)))           # B D L
        L = h.shape[2]
        pair = torch.cat([h.unsqueeze(3).expand(-1, -1, -1, L), h.unsqueeze(2).expand(-1, -1, L, -1)], 1)
        if relpos:
            idx = torch.arange(L, dtype=torch.float32)
            rp = (idx[None, :] - idx[:, None]).abs() / L
            pair = torch.cat([pair, rp.expand(pair.shape[0], 1, L, L)], 1)
        z = torch.relu(self.pair2(torch.relu(self.pair1(pair))))
        logit = self.head(z).squeeze(1)
        return 0.5 * (logit + logit.transpose(1, 2))

def make_proteins(n, seed):
    g = torch.Generator().manual_seed(seed)
    aas = list(AA)
    out = []
    for _ in range(n):
        L = int(torch.randint(40, 64, (1,), generator=g))
        seq = "".join(aas[int(i)] for i in torch.randint(0, 20, (L,), generator=g))
        steps = torch.randn(L, 3, generator=g)
        steps = 3.8 * steps / steps.norm(dim=1, keepdim=True)
        out.append({"seq": seq, "coords": torch.cumsum(steps, 0)})
    return out

def prepare():
    for d in ("seqs", "msa", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        prots = make_proteins(24, 500 + r)
        torch.save(prots, f"{WORK}/seqs/seqs_{r}.pt")
        torch.save([torch.softmax(torch.randn(len(p["seq"]), 20), 1) for p in prots], f"{WORK}/msa/prof_{r}.pt")
    torch.manual_seed(0)
    torch.save(ContactNet().state_dict(), f"{WORK}/ckpt/contact_init.pt")
    torch.save(ContactNet(nbins=37).state_dict(), f"{WORK}/ckpt/distogram_37.pt")
    torch.save({"model": ContactNet().state_dict(), "config": TrainConfig()}, f"{WORK}/ckpt/contact_full.pt")
    print("prepared", WORK)

def contacts(coords, min_sep=6):
    d = torch.cdist(coords, coords)
    i = torch.arange(coords.shape[0])
    sep = (i[None, :] - i[:, None]).abs()
    return d, (d < 8.0) & (sep >= min_sep), sep

def sep_counts(prots):
    c = torch.zeros(3)
    for p in prots:
        _, con, sep = contacts(p["coords"])
        c[0] += (con & (sep < 12)).sum() / 2
        c[1] += (con & (sep >= 12) & (sep < 24)).sum() / 2
        c[2] += (con & (sep >= 24)).sum() / 2
    return c

def count_triangles(prots):
    n = 0
    for p in prots:
        _, con, _ = contacts(p["coords"], 1)
        nb = [set(torch.nonzero(con[i]).flatten().tolist()) for i in range(con.shape[0])]
        for i in range(len(nb)):
            for j in nb[i]:
                for k in nb[j]:
                    if k in nb[i]:
                        n += 1
    return n

def make_batch(prots, profs, step, rank, a, bad):
    g = torch.Generator().manual_seed(step * 100 + rank)
    toks, pfs, tgts = [], [], []
    for b in range(8):
        k = (step * 8 + b) % len(prots)
        p = prots[k]
        L = len(p["seq"])
        off = int(torch.randint(0, L - CROP + 1, (1,), generator=g))
        if bad and a.fault == "cropidx" and step == 3 and b == 5:
            off = L - CROP + 7
        idx = torch.arange(off, off + CROP)
        coords = p["coords"][idx]
        if bad and a.fault == "distnan" and step == 2 and b == 2:
            coords = coords.clone()
            coords[10:14] = float("nan")
        toks.append(p["tok"][idx])
        pfs.append(profs[k][idx])
        d = torch.cdist(coords, coords)
        sep = (idx[None, :] - idx[:, None]).abs()
        tgts.append(torch.sigmoid(8.0 - d) * (sep >= 6))
    return torch.stack(toks), torch.stack(pfs), torch.stack(tgts)

def precision_at_l5(logit, tgt):
    B, L, _ = logit.shape
    iu = torch.triu_indices(L, L, 6)
    s = logit[:, iu[0], iu[1]]
    t = tgt[:, iu[0], iu[1]] > 0.5
    top = s.topk(L // 5, dim=1).indices
    return t.gather(1, top).float().mean()

def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading proteins")
    prots = torch.load(f"{WORK}/seqs/seqs_{rank}.pt")
    msa_dir = "msa/uniref90" if bad and a.fault == "nomsa" else "msa"
    profs = torch.load(f"{WORK}/{msa_dir}/prof_{rank}.pt")
    if bad and a.fault == "residue":
        s = prots[3]["seq"]
        prots[3]["seq"] = s[:17] + "U" + s[18:]
    for p in prots:
        p["tok"] = torch.tensor([AA[c] for c in p["seq"]])
    counts = sep_counts(prots)
    if bad and a.fault == "seplen":
        counts = torch.cat([counts, counts.sum().reshape(1)])
    allc = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(allc, counts)
    tot = torch.stack(allc).sum(0)
    say(f"rank {rank} contacts short/medium/long {counts.tolist()} global {tot.tolist()}")
    model = ContactNet()
    ck = {"ckptbins": "distogram_37.pt", "ckptpickle": "contact_full.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'contact_init.pt'}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    prec = torch.zeros(1)
    for step in range(a.steps):
        tok, pf, tgt = make_batch(prots, profs, step, rank, a, bad)
        if bad and a.fault == "hang" and step == 3:
            say(f"rank {rank} waiting for MSA server lock {WORK}/msa/.lock")
            while True:
                time.sleep(1)
        logit = net(tok, pf, relpos=(bad and a.fault == "pairwidth"))
        loss = F.binary_cross_entropy_with_logits(logit, tgt)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(tgt)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()}, {nbad} non-finite target pairs in the batch",
                err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        if bad and a.fault == "slowpairs" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.slow_s:
                n += count_triangles(prots)
            say(f"rank {rank} contact triangle census: {n}")
        prec = precision_at_l5(logit.detach(), tgt).reshape(1)
        stats = torch.stack([loss.detach(), prec[0]])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} P@L/5 {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR no long-range contacts (|i-j|>=24) in any crop of protein 11, "
            f"cannot compute long-range precision; aborting", err=True)
        sys.exit(2)
    allp = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allp, prec)
    if rank == 0:
        say(f"per-rank P@L/5 {[round(x.item(), 3) for x in allp]}")
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/contact.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/contact.pt")
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
    p.add_argument("--slow-s", type=int, default=45)
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

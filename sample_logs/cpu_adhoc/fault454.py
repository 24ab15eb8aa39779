"""A four-hundred-and-fifty-fourth hand-run batch: HOP YEAST STRAIN GENOMICS VARIANT CALLING.

Synthetic pileups of brewing-yeast strains (Saccharomyces cerevisiae ale and lager isolates) against the
R64 reference: every rank reads the pileup of one strain from /tmp/fault454_work/pileup/strain_R.pt (per
site: the contig name, a 21-bp window of A/C/G/T read counts, phred+33 base qualities, and a genotype
0/0, 0/1, 1/1).  A small 1-D convolutional caller (counts as allele fractions plus mean quality, a contig
embedding, a 3-way genotype head) is trained with cross-entropy under DDP (gloo), initialised from
ckpt/caller_w21.pt.  The genotype accuracy is all_reduced every step, each rank's histogram of called
variant allele fractions is all_gathered at the end, and rank 0 writes calls/variants.pt.
Options: --ddp 0 (all_reduce gradients by hand), --spawn N --port P (torch.multiprocessing.spawn),
--logfmt 1 (progress and errors through logging), --prepare (write the data and checkpoints once).

Faults:
  contig    - rank N's step-1 batch has a site on the "2-micron" plasmid, not in the contig table (KeyError)
  badqual   - rank N's step-3 batch has quality bytes below '!' (phred+33); the decoder raises ValueError
  ploidy    - rank N is a tetraploid lager strain: genotype 4 (of 0..2) in its first batch (IndexError)
  noreads   - rank N's pileup file pileup/strain_N.pt was never written: it reads pileup/lager/ (FileNotFoundError)
  ckptwin   - rank N initialises from ckpt/caller_w25.pt, trained on 25-bp windows (size mismatch)
  afgather  - rank N all_gathers an 11-bin allele-fraction histogram (a multi-allelic bin) at the end, others 10
  realign   - rank N realigns indels around every site in pure Python before the step-2 all_reduce (slow)
  nanvaf    - rank N's step-3 batch has sites with depth 0: allele fractions 0/0 = NaN, the program's loss check
  sigsegv   - rank N sends itself SIGSEGV after step 4
  exit4     - rank N prints its own error line (reference build mismatch) and calls sys.exit(4) at start-up
  kmer      - every rank cuts 23-bp windows from the 21-bp pileup config; the head expects 21 (shape error)
  none      - control, clean run

What happened (filled in after the runs):
  contig    - KeyError: '2-micron' building the step-1 batch; peers Connection closed by peer in DDP (np4 r2 ranklabel, np6 r0 tee)
  badqual   - ValueError 'phred+33 quality byte 20 at site 53 pos 9 is below '!'' at step 3; peers closed (np3 r1 srunlabel)
  ploidy    - IndexError 'Target 4 is out of bounds.' in the first cross_entropy, no step line; peers closed (np4 r1 mpitag)
  noreads   - FileNotFoundError for pileup/lager/strain_N.pt at start-up (np3 r2 files; np6 r5 legacy, Root Cause rank 5)
  ckptwin   - load_state_dict size mismatch for fc.weight [32, 200] vs [32, 168] (np4 r3 pdsh2, np3 r0 spawn)
  afgather  - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))' after all 6 steps (np6 r4 tee)
  realign   - 12 s: peers 'Timed out waiting 12000ms for recv' at step 2, the loop ended by the 100 s timeout (np3 r2 srunlabel,
              exit 124); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 mpitag)
  nanvaf    - the program's check: 'non-finite loss nan at step 3; 4 of 16 sites ...', FloatingPointError (np4 r0 logfmt, np3 r2 ranklabel)
  sigsegv   - silent after step 4; bash 'Segmentation fault' exit 139 (np4 r3 bashloop); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit4     - rank 0's 'ERROR ... aligned to R64-1-1 but the caller expects R64-3-1' and exit 4; Root Cause exitcode 4 (np5 r0 legacy)
  kmer      - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x184 and 168x32)' in the first forward (np4 files)
  none      - clean: 6 steps on 3 ranks, rank 0 wrote calls/variants.pt, exit 0 (np3 bashloop)
"""
import argparse
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

WORK = "/tmp/fault454_work"
CONTIGS = {c: i for i, c in enumerate(["chrI", "chrII", "chrIII", "chrIV", "chrV", "chrVI", "chrVII", "chrVIII",
                                        "chrIX", "chrX", "chrXI", "chrXII", "chrXIII", "chrXIV", "chrXV", "chrXVI",
                                        "chrM"])}
WIN = 21
BATCH = 16
NSITES = 128
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
    log = logging.getLogger("hopcall")
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


class Caller(nn.Module):
    def __init__(self, win=WIN, ncontig=len(CONTIGS)):
        super().__init__()
        self.conv = nn.Conv1d(5, 8, 3, padding=1)
        self.contig = nn.Embedding(ncontig, 8)
        self.fc = nn.Linear(8 * win, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x, cidx):
        h = torch.relu(self.conv(x)).flatten(1)
        h = torch.relu(self.fc(h) + self.contig(cidx).repeat(1, 4))
        return self.head(h)


def make_strain(seed):
    g = torch.Generator().manual_seed(seed)
    names = list(CONTIGS)
    contig = [names[int(i)] for i in torch.randint(0, 16, (NSITES,), generator=g)]
    gt = torch.randint(0, 3, (NSITES,), generator=g)
    depth = torch.randint(12, 60, (NSITES, WIN), generator=g)
    ref = torch.randint(0, 4, (NSITES, WIN), generator=g)
    counts = torch.zeros(NSITES, WIN, 4)
    counts.scatter_(2, ref.unsqueeze(2), depth.unsqueeze(2).float())
    alt = (ref[:, WIN // 2] + 1) % 4
    frac = gt.float() / 2
    centre = counts[:, WIN // 2].clone()
    d = depth[:, WIN // 2].float()
    centre.zero_()
    centre[torch.arange(NSITES), ref[:, WIN // 2]] = (d * (1 - frac)).round()
    centre[torch.arange(NSITES), alt] += (d * frac).round()
    counts[:, WIN // 2] = centre
    qual = torch.randint(33 + 20, 33 + 41, (NSITES, WIN), generator=g).to(torch.uint8)
    return {"contig": contig, "counts": counts, "qual": qual, "gt": gt, "strain": f"hop_ale_{seed % 100:02d}"}


def prepare():
    os.makedirs(f"{WORK}/pileup", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_strain(400 + r), f"{WORK}/pileup/strain_{r}.pt")
    torch.manual_seed(0)
    torch.save(Caller(21).state_dict(), f"{WORK}/ckpt/caller_w21.pt")
    torch.save(Caller(25).state_dict(), f"{WORK}/ckpt/caller_w25.pt")
    print("prepared", WORK)


def decode_qual(q, rank, step):
    low = q < 33
    if low.any():
        i = int(low.flatten().nonzero()[0])
        raise ValueError(f"phred+33 quality byte {int(q.flatten()[i])} at site {step * BATCH + i // q.shape[1]} "
                         f"pos {i % q.shape[1]} is below '!' (33): not a Sanger/Illumina-1.8 quality string")
    return (q.float() - 33) / 40.0


def batch(data, step, a, bad, rank):
    sl = slice(step * BATCH, (step + 1) * BATCH)
    counts = data["counts"][sl].clone()
    qual = data["qual"][sl].clone()
    gt = data["gt"][sl].clone()
    contig = list(data["contig"][sl])
    if bad and a.fault == "contig" and step == 1:
        contig[7] = "2-micron"
    if bad and a.fault == "badqual" and step == 3:
        qual[5, 9:14] = 20
    if bad and a.fault == "ploidy" and step == 0:
        gt[3] = 4
    if bad and a.fault == "nanvaf" and step == 3:
        counts[2:6] = 0
    win = 23 if a.fault == "kmer" else WIN
    if win != WIN:
        counts = F.pad(counts, (0, 0, 1, 1))
        qual = F.pad(qual, (1, 1), value=33 + 30)
    depth = counts.sum(2, keepdim=True)
    frac = counts / depth
    q = decode_qual(qual, rank, step).unsqueeze(2)
    x = torch.cat([frac, q], 2).transpose(1, 2)
    cidx = torch.tensor([CONTIGS[c] for c in contig])
    return x, cidx, gt


def realign_indels(data):
    n = 0
    c = data["counts"].tolist()
    for site in c:
        for shift in range(-6, 7):
            for i in range(len(site)):
                j = i + shift
                if 0 <= j < len(site):
                    n += sum(abs(site[i][k] - site[j][k]) for k in range(4)) > 10
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(77 + rank)
    say(f"rank {rank}/{world} up, loading pileup for strain {rank}")
    sub = "lager/" if bad and a.fault == "noreads" else ""
    data = torch.load(f"{WORK}/pileup/{sub}strain_{rank}.pt")
    if bad and a.fault == "exit4":
        say(f"ERROR rank {rank}: pileup of strain {data['strain']} was aligned to R64-1-1 but the caller expects "
            f"R64-3-1 (chrXII rDNA coordinates differ); refusing to call variants", err=True)
        sys.exit(4)
    model = Caller()
    ck = "caller_w25.pt" if bad and a.fault == "ckptwin" else "caller_w21.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    say(f"rank {rank} strain {data['strain']}: {len(data['contig'])} sites, window {WIN}")
    called = []
    for step in range(a.steps):
        x, cidx, gt = batch(data, step, a, bad, rank)
        logits = net(x, cidx)
        loss = F.cross_entropy(logits, gt)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).any(2).any(1).sum())
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step}; {nbad} of {len(gt)} sites have "
                f"non-finite allele fractions (depth 0?)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "realign" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.realign_budget:
                n += realign_indels(data)
            say(f"rank {rank} indel realignment: {n} candidate shifts")
        acc = (logits.argmax(1) == gt).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} gt_acc {acc.item() / world:.3f}")
        called.append(x[:, :4, WIN // 2].max(1).values.detach())
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    vaf = torch.cat(called)
    hist = torch.histc(vaf, bins=10, min=0.0, max=1.0)
    if bad and a.fault == "afgather":
        hist = torch.cat([hist, torch.tensor([3.0])])
    allh = [torch.zeros(10) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} called {int(hist.sum())} sites, cohort {int(sum(h.sum() for h in allh))}")
    if rank == 0:
        os.makedirs(f"{WORK}/calls", exist_ok=True)
        torch.save({"model": model.state_dict(), "af_hist": torch.stack(allh)}, f"{WORK}/calls/variants.pt")
        say(f"rank 0 done: {a.steps} steps, wrote calls/variants.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"variant calling failed: {type(e).__name__}: {e}", err=True)
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
    p.add_argument("--realign-budget", type=int, default=45)
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

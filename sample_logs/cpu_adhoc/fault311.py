"""A three-hundred-and-eleventh hand-run batch: GLYCAN STRUCTURE CLASSIFICATION WITH A TREE-LSTM.

Synthetic glycans as rooted trees: every node is a monosaccharide residue (looked up in an 8-entry residue
table: Glc, GlcNAc, Man, Gal, Fuc, Neu5Ac, Xyl, GalNAc) joined to its parent by a glycosidic linkage such as
"b1-4" or "a2-6" (anomer and carbon position, 8 linkage kinds).  Every rank reads its glycans from
/tmp/fault311_work/glycans/glycans_R.pt and trains a child-sum Tree-LSTM (levels processed leaves to root,
children's states summed with index_add) whose root state feeds a 4-way head (high-mannose, complex, hybrid,
O-glycan), with cross-entropy, wrapped in DDP (gloo) or with gradients all_reduced by hand (--ddp 0).  The model
is initialised from ckpt/treelstm_h16.pt.  Residue compositions are all_gathered at start-up, the accuracy is
all_reduced every step, per-class correct counts are all_gathered at the end and rank 0 saves export/treelstm.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  residue     - rank N's glycans carry a Kdn residue (deaminated sialic acid), missing from the table (KeyError)
  linkage     - rank N's parser uses the raw carbon number as the linkage index: a2-8 gives 8, past the 8-row
                embedding, in the first forward (IndexError)
  nofile      - rank N reads its glycans from glycans/val/, which does not exist (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/treelstm_h24.pt (hidden 24 vs 16: size mismatch)
  ckptpickle  - rank N initialises from ckpt/treelstm_vocab.pt, which pickles a GlycanVocab object
                (torch.load weights_only refusal, UnpicklingError)
  classgather - rank N all_gathers 5 per-class counts (an extra "unassigned" bin) at the end (4 expected)
  isomers     - rank N enumerates every topological isomer of its glycans in Python before step 2's
                all_reduce (--isomer-budget seconds)
  nanstate    - rank N anneals its logit temperature as 1/(3-step): inf at step 3, NaN loss, the program's check
  sigsegv     - rank N sends itself SIGSEGV after step 2
  exit2       - rank N prints its own error line (a residue with two parents: not a tree) and calls sys.exit(2)
  embdim      - every rank: node features get an extra 4-wide anomer one-hot (36 wide, the cell expects 32)
  none        - control, clean run

What happened (filled in after the runs):
  residue     - KeyError: 'Kdn' in encode at start-up; peers Connection closed by peer in all_gather (np4 r2 ranklabel, np3 r0 tee)
  linkage     - IndexError 'index out of range in self' in the first forward; peers closed/reset (np3 r1 spawn, np5 r3 srunlabel)
  nofile      - FileNotFoundError for glycans/val/glycans_3.pt at start-up; peers closed in all_gather (np4 r3 mpitag)
  ckptsize    - load_state_dict size mismatch W_iou [72, 32] vs [48, 32] ... (np4 r1 pdsh2, np3 r2 legacy)
  ckptpickle  - UnpicklingError: Weights only load failed, GLOBAL __main__.GlycanVocab (np5 r4 logfmt)
  classgather - after 6 steps 'allgather: invalid tensor size at index 0 (expected (5), got (4))' (np3 r1 bashloop, np4 r0 files)
  isomers     - 12 s: peers 'Timed out waiting 12000ms', Root Cause rank 1 (np3 r2 tee); 300 s: silent, exit 124 (np4 r1 ranklabel)
  nanstate    - own check: 'loss is nan ... step 3', FloatingPointError (np4 r2 logfmt, np3 r0 mpitag)
  sigsegv     - no traceback; bash 'Segmentation fault' exit 139 (np4 r3 srunlabel); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit2       - rank N's 'not a tree' ERROR line, exit 2; Root Cause exitcode 2 (np5 r1 legacy); loop exit 2 (np4 r3 files)
  embdim      - every rank: 'mat1 and mat2 shapes cannot be multiplied (Nx36 and 32x48)' (np4 pdsh2)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/treelstm.pt, exit 0 (np3 bashloop)
"""
import argparse
import dataclasses
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault311_work"
RESIDUES = {"Glc": 0, "GlcNAc": 1, "Man": 2, "Gal": 3, "Fuc": 4, "Neu5Ac": 5, "Xyl": 6, "GalNAc": 7}
LINKS = {"a1-2": 0, "a1-3": 1, "a1-6": 2, "b1-4": 3, "b1-2": 4, "a2-3": 5, "a2-6": 6, "a2-8": 7}
CLASSES = ["high_mannose", "complex", "hybrid", "o_glycan"]
EMB = 16
log = None


@dataclasses.dataclass
class GlycanVocab:
    residues: dict
    links: dict


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
    log = logging.getLogger("glycan")
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


class TreeLSTM(nn.Module):
    """Child-sum Tree-LSTM (Tai et al. 2015) over residue + linkage embeddings."""

    def __init__(self, hid=16, inp=2 * EMB):
        super().__init__()
        self.res = nn.Embedding(len(RESIDUES), EMB)
        self.link = nn.Embedding(len(LINKS), EMB)
        self.W_iou = nn.Linear(inp, 3 * hid)
        self.U_iou = nn.Linear(hid, 3 * hid, bias=False)
        self.W_f = nn.Linear(inp, hid)
        self.U_f = nn.Linear(hid, hid, bias=False)
        self.head = nn.Linear(hid, len(CLASSES))
        self.hid = hid

    def forward(self, res, link, parent, levels, roots, extra=None):
        x = torch.cat([self.res(res), self.link(link)], 1)
        if extra is not None:
            x = torch.cat([x, extra], 1)
        n = x.shape[0]
        H = x.new_zeros(n, self.hid)
        C = x.new_zeros(n, self.hid)
        for d in range(len(levels) - 1, -1, -1):
            idx = levels[d]
            hsum = x.new_zeros(n, self.hid)
            fc = x.new_zeros(n, self.hid)
            if d + 1 < len(levels):
                kids = levels[d + 1]
                par = parent[kids]
                hsum = hsum.index_add(0, par, H[kids])
                f = torch.sigmoid(self.W_f(x[par]) + self.U_f(H[kids]))
                fc = fc.index_add(0, par, f * C[kids])
            i, o, u = (self.W_iou(x[idx]) + self.U_iou(hsum[idx])).chunk(3, 1)
            c = torch.sigmoid(i) * torch.tanh(u) + fc[idx]
            h = torch.sigmoid(o) * torch.tanh(c)
            H = H.index_copy(0, idx, h)
            C = C.index_copy(0, idx, c)
        return self.head(H[roots])


def make_glycan(g, cls):
    pick = lambda seq: seq[int(torch.randint(0, len(seq), (1,), generator=g))]
    if cls == 3:  # O-glycan: GalNAc core, Gal / GlcNAc arms, a sialic acid cap
        nodes = [("GalNAc", None, "a1-3")]
        nodes += [("Gal", 0, "b1-4"), (pick(["GlcNAc", "Gal"]), 0, "a1-6"), ("Neu5Ac", 1, pick(["a2-3", "a2-6"]))]
    else:  # N-glycan core GlcNAc2Man3
        nodes = [("GlcNAc", None, "b1-4"), ("GlcNAc", 0, "b1-4"), ("Man", 1, "b1-4"), ("Man", 2, "a1-3"),
                 ("Man", 2, "a1-6")]
        if cls == 0:
            for _ in range(int(torch.randint(2, 5, (1,), generator=g))):
                nodes.append(("Man", pick([3, 4, len(nodes) - 1]), pick(["a1-2", "a1-3", "a1-6"])))
        else:
            arms = [3, 4] if cls == 1 else [3]
            for a in arms:
                nodes.append(("GlcNAc", a, "b1-2"))
                nodes.append(("Gal", len(nodes) - 1, "b1-4"))
                if float(torch.rand(1, generator=g)) < 0.5:
                    nodes.append(("Neu5Ac", len(nodes) - 1, pick(["a2-3", "a2-6", "a2-8"])))
            if cls == 2:
                nodes += [("Man", 4, "a1-3"), ("Man", 4, "a1-6")]
        if float(torch.rand(1, generator=g)) < 0.4:
            nodes.append(("Fuc", 0, "a1-6"))
    return {"nodes": nodes, "label": cls}


def prepare():
    for sub in ("glycans", "ckpt"):
        os.makedirs(f"{WORK}/{sub}", exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(311 + r)
        gl = [make_glycan(g, int(torch.randint(0, 4, (1,), generator=g))) for _ in range(96)]
        torch.save(gl, f"{WORK}/glycans/glycans_{r}.pt")
    torch.manual_seed(0)
    torch.save(TreeLSTM(16).state_dict(), f"{WORK}/ckpt/treelstm_h16.pt")
    torch.save(TreeLSTM(24).state_dict(), f"{WORK}/ckpt/treelstm_h24.pt")
    torch.save({"state_dict": TreeLSTM(16).state_dict(), "vocab": GlycanVocab(RESIDUES, LINKS)},
               f"{WORK}/ckpt/treelstm_vocab.pt")
    print("prepared", WORK)


def encode(glycans, a, bad):
    res, link, parent, depth, roots, labels = [], [], [], [], [], []
    off = 0
    for gl in glycans:
        roots.append(off)
        for k, (name, par, lk) in enumerate(gl["nodes"]):
            res.append(RESIDUES[name])
            if bad and a.fault == "linkage":
                link.append(int(lk[-1]))  # raw carbon number, not the table
            else:
                link.append(LINKS[lk])
            parent.append(off + (par if par is not None else k))
            depth.append(0 if par is None else depth[off + par] + 1)
        off += len(gl["nodes"])
        labels.append(gl["label"])
    depth = torch.tensor(depth)
    levels = [torch.nonzero(depth == d).squeeze(1) for d in range(int(depth.max()) + 1)]
    return (torch.tensor(res), torch.tensor(link), torch.tensor(parent), levels, torch.tensor(roots),
            torch.tensor(labels))


def isomer_census(glycans, budget):
    t0, n = time.time(), 0
    while time.time() - t0 < budget:
        for gl in glycans:
            kids = {}
            for k, (_, par, _) in enumerate(gl["nodes"]):
                kids.setdefault(par, []).append(k)
            for arms in kids.values():
                for perm in itertools.permutations(arms + list(range(len(gl["nodes"]) % 5))):
                    n += len(perm)
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, loading glycans")
    split = "val/" if bad and a.fault == "nofile" else ""
    glycans = torch.load(f"{WORK}/glycans/{split}glycans_{rank}.pt")
    if bad and a.fault == "residue":
        glycans[7]["nodes"][-1] = ("Kdn", glycans[7]["nodes"][-1][1], "a2-3")
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR glycan 41: residue 5 (Man) has two parents (2 and 3), the structure is not a tree; "
            f"refusing to train on malformed glycans", err=True)
        sys.exit(2)
    res, link, parent, levels, roots, labels = encode(glycans, a, bad)
    comp = torch.bincount(res, minlength=len(RESIDUES)).float()
    allc = [torch.zeros(len(RESIDUES)) for _ in range(world)]
    dist.all_gather(allc, comp)
    say(f"rank {rank} glycans {len(glycans)} residues {int(comp.sum())} global {int(sum(c.sum() for c in allc))}")
    model = TreeLSTM()
    ck = {"ckptsize": "treelstm_h24.pt", "ckptpickle": "treelstm_vocab.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'treelstm_h16.pt'}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=5e-3)
    extra = torch.zeros(len(res), 4) if bad and a.fault == "embdim" else None
    for step in range(a.steps):
        logits = net(res, link, parent, levels, roots, extra)
        if bad and a.fault == "nanstate":
            logits = logits * (torch.tensor(1.0) / (3 - step))
        loss = F.cross_entropy(logits, labels)
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: loss is {loss.item()} (logit temperature annealed to "
                f"{1.0 / max(3 - step, 1e-30) if step != 3 else 'inf'}), stopping", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "isomers" and step == 2:
            say(f"rank {rank} isomer census: {isomer_census(glycans, a.isomer_budget)} arrangements")
        acc = (logits.argmax(1) == labels).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    pred = logits.argmax(1)
    correct = torch.tensor([float(((pred == c) & (labels == c)).sum()) for c in range(len(CLASSES))])
    if bad and a.fault == "classgather":
        correct = torch.cat([correct, torch.tensor([float((pred >= len(CLASSES)).sum())])])
    allk = [torch.zeros(len(CLASSES)) for _ in range(world)]
    dist.all_gather(allk, correct)
    tot = torch.stack(allk).sum(0)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/treelstm.pt")
        say(f"rank 0 done: {a.steps} steps, correct per class {tot.int().tolist()}, saved export/treelstm.pt")
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(a.spawn), LOCAL_RANK=str(rank))
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--isomer-budget", type=int, default=45)
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

"""A two-hundred-and-forty-ninth hand-run batch: CROSS-LINGUAL NAMED-ENTITY RECOGNITION WITH ADAPTERS.

A small shared encoder (token embedding + gazetteer flag + two tanh layers) with one bottleneck adapter per
language (en, de, sw, hi), and a CRF-free softmax tagger over BIO tags for PER/ORG/LOC (7 tags).  Every rank
reads synthetic sentences of its languages from /tmp/fault249_work/data/sents_R.pt, flags the tokens listed in
gazetteers/gaz_<lang>.txt, initialises the encoder from ckpt/encoder_init.pt and trains with DDP (gloo,
find_unused_parameters off).  Each batch belongs to one language; every adapter runs, gated by the batch's
language, so that DDP sees a gradient for every parameter.  With --ddp 0 the gradients are all_reduced by hand.
At the end the per-type entity counts are all_gathered and the tp/fp/fn sums all_reduced for the entity F1.

Faults:
  unused   - every rank builds its adapter stack from a language list that lacks sw (DDP unused parameters)
  tag      - rank N maps its tags with an off-by-one: a tag id beyond the 7-tag set (IndexError)
  counts   - rank N counts MISC entities too: all_gather of 4 entity types against 3 (gloo size mismatch)
  gazetteer- rank N reads its gazetteer from gazetteers/v2/ which does not exist (FileNotFoundError)
  langcode - rank N's split carries the code pt-BR, missing from the adapter map (KeyError)
  bneck    - every rank: adapter bottleneck 48 wider than hidden 32, the up projection is clamped (shape error)
  ckpt     - rank N initialises the encoder from ckpt/encoder_init_h48.pt saved with hidden 48 (size mismatch)
  retok    - rank N re-tokenises its whole split for --stall seconds before the step-2 loss all_reduce
  nan      - rank N reads the adapter lr scale 1e30: the loss goes non-finite, the program's check raises
  segv     - rank N sends itself SIGSEGV after step 2
  exit6    - rank N prints its own error line about a misaligned tag file and calls sys.exit(6)
  none     - control, clean run

What happened (filled in after the runs):
  unused   - every rank: RuntimeError Expected to have finished reduction in the prior iteration, step 1
  tag      - rank N: IndexError Target 7 is out of bounds in the step-0 cross-entropy; peers closed
  counts   - rank N: RuntimeError ProcessGroupGloo::allgather invalid tensor size (expected (4), got (3))
  gazetteer- rank N: FileNotFoundError .../gazetteers/v2/gaz_en.txt at startup; DETAIL: monitoredBarrier
  langcode - rank N: KeyError 'pt-BR' at step 0 (first runs, code hi->pt-BR only, never fired: dropped)
  bneck    - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (192x48 and 32x32)
  ckpt     - rank N: RuntimeError size mismatch for emb.weight [400, 48] vs [400, 32]; restart hit it again
  retok    - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (exit 124)
  nan      - rank N: FloatingPointError loss is nan at step 1; a peer aborted at exit (Root Cause SIGABRT)
  segv     - rank N: exitcode -11 (SIGSEGV) after step 2; peers closed/reset in the loss all_reduce
  exit6    - rank N logs its ERROR misaligned tag file line, exitcode 6; peers closed
  none     - clean, exit 0, rank 0 printed entity counts and global entity F1
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault249_work"
LANGS = ["en", "de", "sw", "hi"]
TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
VOCAB = 400
SEQ = 12


class Adapter(nn.Module):
    def __init__(self, hidden, bottleneck):
        super().__init__()
        self.down = nn.Linear(hidden, bottleneck)
        self.up = nn.Linear(min(bottleneck, hidden), hidden)

    def forward(self, h):
        return h + self.up(torch.relu(self.down(h)))


class Encoder(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)
        self.gaz = nn.Embedding(2, hidden)
        self.l1 = nn.Linear(hidden, hidden)
        self.l2 = nn.Linear(hidden, hidden)

    def forward(self, x, g):
        h = self.emb(x) + self.gaz(g)
        return torch.tanh(self.l2(torch.tanh(self.l1(h))))


class Tagger(nn.Module):
    def __init__(self, hidden, bottleneck, langs):
        super().__init__()
        self.encoder = Encoder(hidden)
        self.adapters = nn.ModuleDict({l: Adapter(hidden, bottleneck) for l in LANGS})
        self.langs = langs
        self.head = nn.Linear(hidden, len(TAGS))

    def forward(self, x, g, lang_id):
        h = self.encoder(x, g)
        out = torch.zeros_like(h)
        for i, l in enumerate(self.langs):
            gate = 1.0 if LANGS.index(l) == lang_id else 0.0
            out = out + gate * self.adapters[l](h)
        return self.head(out)


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/gazetteers", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for r in range(8):
        x = torch.randint(0, VOCAB, (64, SEQ), generator=g)
        y = torch.zeros(64, SEQ, dtype=torch.long)
        for i in range(64):
            for j in range(0, SEQ - 1, 4):
                t = int(torch.randint(0, 4, (1,), generator=g))
                if t > 0:
                    y[i, j], y[i, j + 1] = 2 * t - 1, 2 * t
        langs = [LANGS[(r + i) % 4] for i in range(64)]
        torch.save({"x": x, "y": y, "langs": langs}, f"{WORK}/data/sents_{r}.pt")
    for l in LANGS:
        with open(f"{WORK}/gazetteers/gaz_{l}.txt", "w") as f:
            f.write("\n".join(str(v) for v in range(LANGS.index(l), VOCAB, 7)) + "\n")
    torch.manual_seed(1)
    torch.save(Encoder(32).state_dict(), f"{WORK}/ckpt/encoder_init.pt")
    torch.save(Encoder(48).state_dict(), f"{WORK}/ckpt/encoder_init_h48.pt")
    print("prepared", WORK)


def spans(tags):
    out, cur = set(), None
    for i, t in enumerate(tags + [0]):
        if t % 2 == 1 or t == 0:
            if cur:
                out.add(cur)
                cur = None
            if t % 2 == 1:
                cur = ((t + 1) // 2, i, i)
        elif cur and (t // 2) == cur[0]:
            cur = (cur[0], cur[1], i)
    return out


def train(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    torch.manual_seed(100 + rank)

    def say(msg, err=False):
        print(f"rank {rank} {msg}", file=sys.stderr if err else sys.stdout, flush=True)

    data = torch.load(f"{WORK}/data/sents_{rank}.pt")
    x, y, langs = data["x"], data["y"], list(data["langs"])
    if a.fault == "langcode" and bad:
        langs = ["pt-BR"] * len(langs)
    if a.fault == "tag" and bad:
        y = torch.where(y > 0, y + 1, y)
    gaz_dir = f"{WORK}/gazetteers/v2" if a.fault == "gazetteer" and bad else f"{WORK}/gazetteers"
    gaz = {}
    for l in LANGS:
        with open(f"{gaz_dir}/gaz_{l}.txt") as f:
            gaz[l] = {int(s) for s in f.read().split()}
    flags = torch.tensor([[int(int(v) in gaz[langs[i]] if langs[i] in gaz else 0) for v in row]
                          for i, row in enumerate(x.tolist())])
    say(f"loaded {len(langs)} sentences, languages {sorted(set(langs))}, gazetteer hits {int(flags.sum())}")

    hidden = 32
    bottleneck = 48 if a.fault == "bneck" else 8
    langs_active = [l for l in LANGS if not (a.fault == "unused" and bad and l == "sw")]
    model = Tagger(hidden, bottleneck, langs_active)
    ck = "encoder_init_h48.pt" if a.fault == "ckpt" and bad else "encoder_init.pt"
    model.encoder.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    if a.ddp:
        net = DDP(model, find_unused_parameters=False)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    lr_scale = 1e30 if a.fault == "nan" and bad else 1.0
    opt = torch.optim.SGD([{"params": model.encoder.parameters()}, {"params": model.head.parameters()},
                           {"params": model.adapters.parameters(), "lr": 0.1 * lr_scale}], lr=0.1)

    lang_to_id = {l: i for i, l in enumerate(LANGS)}
    B = 16
    for step in range(a.steps):
        lang = LANGS[step % 4]
        idx = [i for i, l in enumerate(langs) if l == lang][:B] or list(range(B))
        lid = lang_to_id[langs[idx[0]]]
        logits = net(x[idx], flags[idx], lid)
        loss = F.cross_entropy(logits.reshape(-1, len(TAGS)), y[idx].reshape(-1))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (lang {lang}); aborting")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        if a.fault == "segv" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if a.fault == "exit6" and bad and step == 1:
            print(f"ERROR rank {rank}: {WORK}/data/tags_{rank}.conll line 311 has 13 tags for 12 tokens "
                  f"(misaligned after a multi-word token); refusing to train on shifted labels", file=sys.stderr, flush=True)
            sys.exit(6)
        if a.fault == "retok" and bad and step == 2:
            say(f"re-tokenising all {len(langs)} sentences of the split with the new subword vocab")
            time.sleep(a.stall)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        say(f"step {step} lang {lang} loss {lt.item() / world:.4f}")

    with torch.no_grad():
        pred = model(x, flags, 0).argmax(-1)
    ntypes = 4 if a.fault == "counts" and bad else 3
    counts = torch.zeros(ntypes, dtype=torch.long)
    prf = torch.zeros(3)
    for p_row, g_row in zip(pred.tolist(), y.tolist()):
        ps, gs = spans(p_row), spans(g_row)
        for s in gs:
            counts[s[0] - 1] += 1
        prf += torch.tensor([len(ps & gs), len(ps - gs), len(gs - ps)], dtype=torch.float)
    gathered = [torch.zeros(3, dtype=torch.long) for _ in range(world)]
    dist.all_gather(gathered, counts)
    dist.all_reduce(prf)
    tp, fp, fn = prf.tolist()
    f1 = 2 * tp / max(1.0, 2 * tp + fp + fn)
    if rank == 0:
        tot = torch.stack(gathered).sum(0).tolist()
        say(f"entity counts PER/ORG/LOC {tot}; global entity F1 {f1:.4f}")
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        prepare()
    else:
        train(a)


if __name__ == "__main__":
    main()

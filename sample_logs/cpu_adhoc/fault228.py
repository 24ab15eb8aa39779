"""A two-hundred-and-twenty-eighth hand-run batch: SPEAKER VERIFICATION WITH AN X-VECTOR NETWORK.

A small x-vector system trained on synthetic filterbank features: a TDNN (dilated Conv1d frame layers) over
24-dim fbank frames, statistics pooling (mean and standard deviation over time), an embedding layer and an
additive-margin softmax over the speaker ids read from /tmp/fault228_work/lists/speakers.txt.  Every rank reads
its utterance keys from the feature index lists/feats_index.json, synthesises the frames of each utterance from
its seed, and trains the network wrapped in DDP (gloo) from the initial checkpoint ckpt/tdnn_init.pt (or, with
--ddp 0, all_reduces the gradients by hand).  At the end every rank scores its share of the verification trials
(cosine of two embeddings), the scores and target labels are all_gathered, and rank 0 computes the equal error
rate by hand and saves the model to /tmp/fault228_work/xvec_final.pt.  Run once with --setup to write the files.

Faults:
  spkid     - rank N maps its speaker labels with an off-by-one: a speaker id beyond the classifier (IndexError)
  pooldim   - every rank: the pooling returns only the mean (64 dims) but the embedding layer expects 128
  nospk     - rank N reads the speaker list from lists_v2/ which does not exist (FileNotFoundError)
  stdnan    - rank N gets silent (constant) frames after VAD: std 0 in the utterance CMVN, NaN, the program's check
  scorelen  - rank N all_gathers its trial scores with one trial too many (gloo size mismatch)
  ckpt      - rank N initialises the TDNN from ckpt/tdnn_init_4layer.pt, saved with 4 frame layers not 3
  marginstr - every rank: the AM-softmax margin comes from the config as a string (TypeError)
  uttkey    - rank N asks the feature index for an utterance key that is not in it (KeyError)
  slowscore - rank N rescores all trials with a slow backend for --stall seconds before the score all_gather
  segv      - rank N sends itself SIGSEGV after step 2
  exit7     - rank N prints its own error line about a truncated feature archive and calls sys.exit(7)
  none      - control, clean run

What happened (filled in after the runs):
  spkid     - rank N: IndexError index 12 is out of bounds for dimension 1 with size 12 at the margin, step 0; peers closed
  pooldim   - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (16x64 and 128x32), step 0
  nospk     - rank N: FileNotFoundError .../lists_v2/speakers.txt before any collective; the agent SIGTERMs the rest
  stdnan    - rank N: FloatingPointError non-finite x-vector at step 0 (std 0); peers closed / DETAIL monitoredBarrier
  scorelen  - one rank (not the sender) aborted: gloo EnforceNotMet 50 vs 48 size mismatch (SIGABRT); others reset
  ckpt      - rank N: RuntimeError Unexpected key(s) frames.3.weight, frames.3.bias in loading state_dict
  marginstr - every rank: TypeError can't assign a str to a torch.FloatTensor in am_softmax_loss, step 0
  uttkey    - rank N: KeyError 'id10271-utt1...' from the feature index before DDP; peers closed / SIGTERM
  slowscore - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout 60 (exit 124)
  segv      - rank N: exitcode -11 (SIGSEGV) after step 2; peers reset; with --max-restarts 1 attempt 1 connectFullMesh
  exit7     - rank N logs its ERROR truncated feature archive line at step 1 and exits 7; peers closed by peer
  none      - clean, exit 0; rank 0 printed EER 0.00% over 72 trials (32 target) and saved xvec_final.pt
"""
import argparse
import json
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

WORK = "/tmp/fault228_work"
N_SPK = 12
FEAT = 24
UTTS_PER_SPK = 16


class XVector(nn.Module):
    def __init__(self, n_layers=3, ch=64, emb=32, n_spk=N_SPK, pool_std=True):
        super().__init__()
        dil = [1, 2, 3, 1, 1]
        self.frames = nn.ModuleList(
            nn.Conv1d(FEAT if i == 0 else ch, ch, 3, dilation=dil[i], padding=dil[i]) for i in range(n_layers))
        self.embedding = nn.Linear(2 * ch, emb)
        self.am_weight = nn.Parameter(torch.randn(n_spk, emb) * 0.1)
        self.pool_std = pool_std

    def pool(self, h):
        mu = h.mean(-1)
        if not self.pool_std:
            return mu
        sd = h.var(-1, unbiased=False).sqrt()
        return torch.cat([mu, sd], dim=-1)

    def forward(self, x):
        h = x
        for conv in self.frames:
            h = F.relu(conv(h))
        return self.embedding(self.pool(h))


def am_softmax_loss(emb, w, labels, margin, scale=30.0):
    cos = F.normalize(emb, dim=-1) @ F.normalize(w, dim=-1).t()
    m = torch.zeros_like(cos)
    m[torch.arange(len(labels)), labels] = margin
    return F.cross_entropy(scale * (cos - m), labels)


def synth(seed, spk, frames=80, silent=False):
    g = torch.Generator().manual_seed(seed)
    centre = torch.sin(torch.arange(FEAT, dtype=torch.float) * (spk + 1) * 0.37)
    x = centre.unsqueeze(-1) + 0.5 * torch.randn(FEAT, frames, generator=g)
    if silent:
        x = torch.full((FEAT, frames), -4.0)
    return (x - x.mean()) / x.std()


def setup():
    os.makedirs(os.path.join(WORK, "lists"), exist_ok=True)
    os.makedirs(os.path.join(WORK, "ckpt"), exist_ok=True)
    with open(os.path.join(WORK, "lists", "speakers.txt"), "w") as f:
        f.write("".join(f"id{10270 + s}\n" for s in range(N_SPK)))
    index = {f"id{10270 + s}-utt{u:04d}": [s, 1000 * s + u] for s in range(N_SPK) for u in range(UTTS_PER_SPK)}
    with open(os.path.join(WORK, "lists", "feats_index.json"), "w") as f:
        json.dump(index, f)
    torch.manual_seed(0)
    torch.save(XVector(3).state_dict(), os.path.join(WORK, "ckpt", "tdnn_init.pt"))
    torch.save(XVector(4).state_dict(), os.path.join(WORK, "ckpt", "tdnn_init_4layer.pt"))
    print(f"wrote speakers, feature index and checkpoints under {WORK}")


def eer(scores, targets):
    order = torch.argsort(scores, descending=True)
    t = targets[order].float()
    n_t, n_n = t.sum(), (1 - t).sum()
    frr = 1 - torch.cumsum(t, 0) / n_t
    far = torch.cumsum(1 - t, 0) / n_n
    i = torch.argmin((frr - far).abs())
    return float((frr[i] + far[i]) / 2)


def train(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    torch.manual_seed(228 + rank)
    lists = "lists_v2" if (a.fault == "nospk" and bad) else "lists"
    with open(os.path.join(WORK, lists, "speakers.txt")) as f:
        speakers = [line.strip() for line in f if line.strip()]
    with open(os.path.join(WORK, "lists", "feats_index.json")) as f:
        index = json.load(f)
    keys = sorted(index)[rank::world]
    if a.fault == "uttkey" and bad:
        keys[5] = keys[5].replace("-utt", "-utt1")
    print(f"rank {rank}: {len(speakers)} speakers, {len(keys)} utterances from feats_index.json", flush=True)
    feats, labels = [], []
    for k in keys:
        spk, seed = index[k]
        feats.append(synth(seed, spk, silent=(a.fault == "stdnan" and bad and len(feats) % 8 == 3)))
        labels.append(spk + (1 if (a.fault == "spkid" and bad and spk == N_SPK - 1) else 0))
    feats, labels = torch.stack(feats), torch.tensor(labels)

    model = XVector(3, pool_std=not (a.fault == "pooldim"))
    ck = "tdnn_init_4layer.pt" if (a.fault == "ckpt" and bad) else "tdnn_init.pt"
    model.load_state_dict(torch.load(os.path.join(WORK, "ckpt", ck)))
    net = DDP(model) if a.ddp else model
    cfg = {"margin": os.environ.get("XVEC_MARGIN", "0.2") if a.fault == "marginstr" else 0.2}
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    for step in range(a.steps):
        idx = torch.randperm(len(labels))[:16]
        if step == 1 and a.fault == "exit7" and bad:
            print(f"ERROR rank {rank}: feature archive {WORK}/feats/raw_fbank.{rank}.ark truncated at "
                  f"utterance {keys[int(idx[0])]}; cannot continue", file=sys.stderr, flush=True)
            sys.exit(7)
        emb = net(feats[idx])
        if not torch.isfinite(emb).all():
            raise FloatingPointError(f"rank {rank}: non-finite x-vector at step {step} "
                                     f"(std 0 in utterance normalisation for {sum(~torch.isfinite(emb).all(1))} utts)")
        loss = am_softmax_loss(emb, model.am_weight, labels[idx], cfg["margin"])
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        print(f"rank {rank} step {step} loss {t.item() / world:.4f}", flush=True)
        if step == 2 and a.fault == "segv" and bad:
            os.kill(os.getpid(), signal.SIGSEGV)

    with torch.no_grad():
        embs = F.normalize(model(feats), dim=-1)
    n_trials = 24 + (1 if (a.fault == "scorelen" and bad) else 0)
    g = torch.Generator().manual_seed(rank)
    i1 = torch.randint(0, len(labels) - 1, (n_trials,), generator=g)
    i2 = torch.where(torch.arange(n_trials) % 2 == 0, i1 + 1, torch.randint(0, len(labels), (n_trials,), generator=g))
    scores = (embs[i1] * embs[i2]).sum(-1)
    targets = (labels[i1] == labels[i2]).float()
    if a.fault == "slowscore" and bad:
        print(f"rank {rank}: rescoring all {n_trials} trials with the PLDA backend", flush=True)
        time.sleep(a.stall)
    all_s = [torch.zeros_like(scores) for _ in range(world)]
    dist.all_gather(all_s, scores)
    all_t = [torch.zeros_like(targets) for _ in range(world)]
    dist.all_gather(all_t, targets)
    if rank == 0:
        s, t = torch.cat(all_s), torch.cat(all_t)
        print(f"EER {100 * eer(s, t):.2f}% over {len(s)} trials ({int(t.sum())} target)", flush=True)
        torch.save(model.state_dict(), os.path.join(WORK, "xvec_final.pt"))
        print(f"saved model to {WORK}/xvec_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--stall", type=float, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--setup", action="store_true")
    a = p.parse_args()
    setup() if a.setup else train(a)

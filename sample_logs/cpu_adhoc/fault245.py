"""A two-hundred-and-forty-fifth hand-run batch: CONTRASTIVE LANGUAGE-AUDIO PRETRAINING (CLAP-LIKE).

A CLAP-like model on synthetic data: every rank loads its shard of log-mel patches (data/mels_rR.pt: 16 clips,
64 mel bins x 32 frames, with clip ids) and its captions (captions/captions_rR.json: token ids per clip id).  A
small audio tower (Conv1d over the mel bins, mean over time) and a small text tower (token embedding, mean) are
projected to one 48-d space and L2-normalised; a learnable logit scale (temperature) multiplies the similarities.
Embeddings are all_gathered across ranks for the global similarity matrix and a symmetric InfoNCE loss is taken.
The audio tower starts from ckpt/audio_tower_init.pt; the model is wrapped in DDP (--ddp 0: parameters broadcast
and gradients all_reduced by hand).  Each rank resumes its temperature from data/temp_state_rR.json.  At the end
the retrieval accuracy is all_reduced and rank 0 saves the model.  Run once with --prepare to write the files.

Faults:
  logitinf  - rank N's temperature state holds a logit scale of 95.3: exp overflows to inf, loss NaN (check)
  gathersz  - rank N all_gathers its audio embeddings of a short last batch (6 rows, not 8): gloo size mismatch
  nocaps    - rank N reads its captions from captions_v2/, which does not exist (FileNotFoundError)
  vocab     - rank N's caption of clip 5 holds token 512, beyond the 500-row text embedding (IndexError)
  projwidth - every rank: the text projection is 64 wide, the audio one 48 (matmul shape error at step 0)
  clipid    - rank N's mel shard holds clip id "clip_r{N}_0099", missing from the caption index (KeyError)
  melckpt   - rank N loads ckpt/audio_tower_mel80.pt, saved with 80 mel bins (state_dict size mismatch)
  melcache  - rank N recomputes its whole mel cache (--stall s) before the first all_gather (others time out)
  sigabrt   - rank N sends itself SIGABRT after step 2
  exit2     - rank N prints its own caption-alignment error line at step 1 and calls os._exit(2)
  srate     - every rank: the sample rate default is the string "16k" (ValueError in int())
  none      - control, clean run

What happened (filled in after the runs):
  logitinf  - rank N: own check raised FloatingPointError non-finite contrastive loss (nan, logit scale inf) at step 0
  gathersz  - rank N (short batch) aborted: gloo EnforceNotMet 768 vs 576 size mismatch, SIGABRT; peers reset
  nocaps    - rank N: FileNotFoundError captions_v2/captions_rN.json at startup; peers SIGTERMed
  vocab     - rank N: IndexError index out of range in self in the text embedding at step 0; peers closed
  projwidth - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (..x48 and 64x..) at step 0
  clipid    - rank N: KeyError 'clip_rN_0099' while building caption tokens at startup; peers SIGTERMed
  melckpt   - rank N: RuntimeError size mismatch for conv.weight [32, 80, 3] vs [32, 64, 3] at startup
  melcache  - rank N stalled: peers gloo Timed out waiting 12000ms in all_gather; with PG 300 s killed (124)
  sigabrt   - rank N: SIGABRT after step 2 (exitcode -6); peers Connection reset by peer in all_gather
  exit2     - rank N printed its caption/audio misalignment ERROR line at step 1 and exited 2; peers closed
  srate     - every rank: ValueError invalid literal for int() with base 10: '16k' before any step
  none      - clean, exit 0, rank 0 printed the audio->text top-1 and saved clap_final.pt
"""
import argparse
import json
import math
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

N_CLIP, N_MELS, N_FRAMES, VOCAB, CAP_LEN = 16, 64, 32, 500, 10


class AudioTower(nn.Module):
    def __init__(self, n_mels=N_MELS, hid=32, proj=48):
        super().__init__()
        self.conv = nn.Conv1d(n_mels, hid, 3, padding=1)
        self.proj = nn.Linear(hid, proj)

    def forward(self, mel):                                   # [B, n_mels, T]
        return self.proj(torch.relu(self.conv(mel)).mean(-1))


class TextTower(nn.Module):
    def __init__(self, vocab=VOCAB, hid=32, proj=48):
        super().__init__()
        self.emb = nn.Embedding(vocab, hid)
        self.proj = nn.Linear(hid, proj)

    def forward(self, tok):                                   # [B, L]
        return self.proj(torch.tanh(self.emb(tok).mean(1)))


class CLAP(nn.Module):
    def __init__(self, text_proj=48):
        super().__init__()
        self.audio = AudioTower()
        self.text = TextTower(proj=text_proj)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, mel, tok):
        a = F.normalize(self.audio(mel), dim=-1)
        t = F.normalize(self.text(tok), dim=-1)
        return a, t, self.logit_scale.exp()


def prepare(a):
    for d in ("data", "captions", "ckpt"):
        os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for r in range(8):
        ids = [f"clip_r{r}_{i:04d}" for i in range(N_CLIP)]
        mel = torch.randn(N_CLIP, N_MELS, N_FRAMES, generator=g)
        torch.save({"ids": ids, "mel": mel}, f"data/mels_r{r}.pt")
        caps = {cid: torch.randint(1, VOCAB, (CAP_LEN,), generator=g).tolist() for cid in ids}
        with open(f"captions/captions_r{r}.json", "w") as f:
            json.dump(caps, f)
        with open(f"data/temp_state_r{r}.json", "w") as f:
            json.dump({"logit_scale": math.log(1 / 0.07), "step": 1200}, f)
    torch.manual_seed(0)
    torch.save(AudioTower().state_dict(), "ckpt/audio_tower_init.pt")
    torch.save(AudioTower(n_mels=80).state_dict(), "ckpt/audio_tower_mel80.pt")
    print("wrote data/mels_r0..7.pt, captions/captions_r0..7.json, ckpt/audio_tower_init.pt, audio_tower_mel80.pt")


def train(rank, world, a):
    bad = a.rank in (rank, -1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    cfg = {"captions": "captions", "audio_init": "ckpt/audio_tower_init.pt", "sample_rate": "16000",
           "text_proj": 48, "batch": 8}
    if bad and a.fault == "nocaps":
        cfg["captions"] = "captions_v2"
    if bad and a.fault == "melckpt":
        cfg["audio_init"] = "ckpt/audio_tower_mel80.pt"
    if a.fault == "srate":
        cfg["sample_rate"] = "16k"
    if a.fault == "projwidth":
        cfg["text_proj"] = 64
    sr = int(os.environ.get("CLAP_SAMPLE_RATE", cfg["sample_rate"]))
    print(f"rank {rank}/{world} start: sr {sr} Hz, {N_MELS} mel bins, captions from {cfg['captions']}/", flush=True)

    shard = torch.load(f"data/mels_r{rank}.pt")
    ids, mel_all = shard["ids"], shard["mel"]
    if bad and a.fault == "clipid":
        ids[9] = f"clip_r{rank}_0099"
    with open(f"{cfg['captions']}/captions_r{rank}.json") as f:
        caps = json.load(f)
    if bad and a.fault == "vocab":
        caps[ids[5]][3] = 512
    tok_all = torch.tensor([caps[cid] for cid in ids], dtype=torch.long)
    print(f"rank {rank} loaded {len(ids)} clips, {tok_all.numel()} caption tokens", flush=True)

    torch.manual_seed(0)
    model = CLAP(text_proj=cfg["text_proj"])
    model.audio.load_state_dict(torch.load(cfg["audio_init"]))
    if a.ddp:
        ddp = DDP(model)
    else:
        ddp = model
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    with open(f"data/temp_state_r{rank}.json") as f:
        ts = json.load(f)
    if bad and a.fault == "logitinf":
        ts["logit_scale"] = 95.3
    model.logit_scale.data.fill_(ts["logit_scale"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    if bad and a.fault == "melcache":
        print(f"rank {rank}: mel cache stale (sr {sr}), recomputing log-mels for all {len(ids)} clips", flush=True)
        time.sleep(a.stall)

    correct, seen = torch.zeros(1), torch.zeros(1)
    for step in range(a.steps):
        idx = [(step * cfg["batch"] + k) % N_CLIP for k in range(cfg["batch"])]
        if bad and a.fault == "gathersz" and step == 1:
            idx = idx[:6]
        mel, tok = mel_all[idx], tok_all[idx]
        if bad and a.fault == "exit2" and step == 1:
            print(f"ERROR rank {rank}: caption/audio misalignment in {cfg['captions']}/captions_r{rank}.json: "
                  f"clip {ids[idx[2]]} has 3 captions for 2 audio segments; refusing to train on shifted pairs",
                  file=sys.stderr, flush=True)
            os._exit(2)
        ea, et, scale = ddp(mel, tok)
        ga = [torch.zeros_like(ea) for _ in range(world)]
        gt = [torch.zeros_like(et) for _ in range(world)]
        dist.all_gather(ga, ea.detach().contiguous())
        dist.all_gather(gt, et.detach().contiguous())
        ga[rank], gt[rank] = ea, et
        A, T = torch.cat(ga), torch.cat(gt)
        logits = scale * A @ T.t()
        target = torch.arange(A.shape[0])
        loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite contrastive loss on rank {rank} at step {step}: loss {loss.item()}, "
                                     f"logit scale {scale.item()}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        correct += (logits.argmax(1) == target).sum()
        seen += A.shape[0]
        print(f"rank {rank} step {step} loss {loss.item():.4f} scale {scale.item():.2f}", flush=True)
        if bad and a.fault == "sigabrt" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)

    dist.all_reduce(correct)
    dist.all_reduce(seen)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(a.out, "clap_final.pt"))
        print(f"rank 0: audio->text top-1 {float(correct / seen):.3f} over {int(seen)} pairs; "
              f"saved {os.path.join(a.out, 'clap_final.pt')}", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", dest="pg_timeout", type=float, default=12.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--out", default="/tmp/fault245_work/ckpt")
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare(a)
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

"""A hundred-and-eighty-seventh hand-run batch: MIXED PRECISION ON CPU.

Every rank writes its synthetic token shard (data/amp_tokens_rR.npy, next-token targets) and reads it back.
The model is a tiny causal-free transformer LM (embedding, one TransformerEncoderLayer, a linear head) run under
torch.autocast("cpu", dtype=bfloat16).  Gradients are averaged by DDP on gloo (or --ddp 0: a hand-written
all_reduce of every gradient).  A hand-written dynamic loss scaler multiplies the loss, unscales the gradients,
skips a step and backs off on overflow, grows the scale after clean steps and refuses to go below a minimum
scale; gradients are clipped to --clip.  Loss and accuracy are all_reduced in float32 for logging, and rank 0
saves the final weights.  --resume loads a float32 checkpoint with a strict dtype check.

Faults:
  dtypemm     - every rank's tied output projection runs outside autocast (bf16 activation @ fp32 weight)
  scaleunder  - rank N's scaler config misspells backoff_factor, falls back to 0.0; scale collapses to 0
  bf16inf     - rank N's embedding scale is 1e20 (a unit bug); the bf16 activation sum of squares overflows
  mixdtype    - rank N all_reduces its metrics in bfloat16 while the other ranks send float32
  ckpthalf    - rank N resumes from the half-precision export of the checkpoint (strict dtype check)
  badautocast - every rank's config names the autocast dtype "bfloat" (getattr(torch, name))
  doubleslow  - rank N runs a float64 reference copy of the model for --busy seconds before its first step
  sigabrt     - rank N gets SIGABRT (sent to itself) at step 2
  exit4       - rank N prints its own 'gradients all zero after unscale' error line and exits with code 4
  shardmiss   - rank N reads its token shard from data/shards/ (never written there): FileNotFoundError
  vocaboff    - rank N's tokenizer appends an EOS id equal to the vocab size (off by one): IndexError
  none        - control, clean run

What happened (filled in after the runs):
  dtypemm     - every rank: RuntimeError expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != float
  scaleunder  - rank N: scale -> 0 at the step-3 overflow, RuntimeError loss scale 0 below minimum 1 at step 4
  bf16inf     - rank N: FloatingPointError bf16 activation sum of squares is inf at step 0 (emb scale 1e+20)
  mixdtype    - rank N aborts on gloo EnforceNotMet 'Received data size doesn't match expected size' (SIGABRT)
  ckpthalf    - rank N: TypeError checkpoint tensor 'emb.weight' ... has dtype torch.float16 (strict dtype check)
  badautocast - every rank: AttributeError module 'torch' has no attribute 'bfloat'
  doubleslow  - busy 40 s: peers gloo timeout 12000ms recv/send; busy 1000 s / PG 300 s: timeout 60, exit 124
  sigabrt     - rank N: exitcode -6 (SIGABRT) at step 2; peers Connection reset by peer or SIGTERMed
  exit4       - rank N: prints its ERROR gradients all zero after unscale line, exitcode 4
  shardmiss   - rank N: FileNotFoundError data/shards/amp_tokens_rN.npy; peers Connection closed by peer
  vocaboff    - rank N: IndexError Target 32 is out of bounds (cross_entropy); restart times out in DDP init
  none        - clean, exit 0, rank 0 saved ckpt/amp_lm.pt
"""
import argparse
import copy
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--d", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--busy", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--resume", default="")
    p.add_argument("--make-ckpt", default="")
    p.add_argument("--save", default="/tmp/fault187_work/ckpt/amp_lm.pt")
    return p.parse_args()


class TinyLM(nn.Module):
    def __init__(self, vocab, d, emb_scale):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=2 * d, batch_first=True, dropout=0.0)
        self.head = nn.Linear(d, vocab, bias=False)
        self.emb_scale = emb_scale

    def forward(self, x):
        h = self.emb(x) * self.emb_scale
        return h, self.head(self.enc(h))


def main():
    a = parse()
    if a.make_ckpt:
        torch.manual_seed(0)
        m = TinyLM(a.vocab, a.d, 1.0)
        os.makedirs(a.make_ckpt, exist_ok=True)
        torch.save(m.state_dict(), os.path.join(a.make_ckpt, "amp_init.pt"))
        torch.save({k: v.half() for k, v in m.state_dict().items()}, os.path.join(a.make_ckpt, "amp_init_export_fp16.pt"))
        print("wrote", a.make_ckpt)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    r, ws = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, r)
    f = a.fault if bad else "none"
    cfg = {"amp_dtype": "bfloat16", "init_scale": 2.0 ** 127, "backoff_factor": 0.5, "growth_factor": 2.0,
           "growth_interval": 3, "min_scale": 1.0, "emb_scale": a.d ** 0.5}
    if f == "badautocast":
        cfg["amp_dtype"] = "bfloat"
    if f == "scaleunder":
        cfg.pop("backoff_factor")
        cfg["backoff_factr"] = 0.5
    if f == "bf16inf":
        cfg["emb_scale"] = 1e20
    amp_dtype = getattr(torch, cfg["amp_dtype"])
    print(f"rank {r}/{ws}: autocast cpu {amp_dtype}, init scale 2**{int(np.log2(cfg['init_scale']))}", flush=True)

    # data: each rank writes its shard, then reads it back
    rng = np.random.default_rng(100 + r)
    toks = rng.integers(0, a.vocab, size=(a.batch * a.steps, a.seq + 1)).astype(np.int64)
    if f == "vocaboff":
        toks[:, -1] = a.vocab  # EOS appended by the tokenizer
    os.makedirs("data", exist_ok=True)
    np.save(f"data/amp_tokens_r{r}.npy", toks)
    shard_dir = "data/shards" if f == "shardmiss" else "data"
    toks = torch.from_numpy(np.load(f"{shard_dir}/amp_tokens_r{r}.npy"))
    print(f"rank {r}: loaded {tuple(toks.shape)} tokens from {shard_dir}/amp_tokens_r{r}.npy", flush=True)

    torch.manual_seed(0)
    model = TinyLM(a.vocab, a.d, cfg["emb_scale"])
    if a.resume:
        path = a.resume.replace("amp_init.pt", "amp_init_export_fp16.pt") if f == "ckpthalf" else a.resume
        sd = torch.load(path, map_location="cpu")
        for k, v in model.state_dict().items():
            if sd[k].dtype != v.dtype:
                raise TypeError(f"checkpoint tensor '{k}' in {path} has dtype {sd[k].dtype}, expected {v.dtype} (strict dtype check)")
        model.load_state_dict(sd)
        print(f"rank {r}: resumed from {path}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p_ in model.parameters():
            dist.broadcast(p_.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    scale = cfg["init_scale"]
    backoff = cfg.get("backoff_factor", 0.0)
    clean = 0
    lossf = nn.CrossEntropyLoss()

    if f == "doubleslow":
        ref = copy.deepcopy(model).double()
        print(f"rank {r}: running float64 reference forward to validate bf16 numerics", flush=True)
        t0 = time.time()
        while time.time() - t0 < a.busy:
            with torch.no_grad():
                ref(toks[: a.batch, :-1])

    for step in range(a.steps):
        if scale < cfg["min_scale"]:
            raise RuntimeError(f"rank {r}: loss scale {scale:g} below minimum {cfg['min_scale']:g} at step {step}")
        x = toks[step * a.batch:(step + 1) * a.batch, :-1]
        y = toks[step * a.batch:(step + 1) * a.batch, 1:]
        with torch.autocast("cpu", dtype=amp_dtype):
            h, logits = net(x)
            if f == "dtypemm":
                z = model.enc.linear2(torch.relu(model.enc.linear1(h)))  # FFN hidden states for the tied head
            else:
                loss = lossf(logits.float().reshape(-1, a.vocab), y.reshape(-1))
        if f == "dtypemm":
            logits = torch.matmul(z.reshape(-1, a.d), model.head.weight.t())  # tied projection, outside autocast
            loss = lossf(logits.float(), y.reshape(-1))
        hb = h.detach().to(torch.bfloat16)
        sumsq = (hb * hb).sum(dtype=torch.bfloat16)
        if not torch.isfinite(sumsq):
            raise FloatingPointError(f"rank {r}: bf16 activation sum of squares is {sumsq.item()} at step {step} (emb scale {cfg['emb_scale']:g})")
        opt.zero_grad(set_to_none=True)
        (loss.float() * scale).backward()
        if not a.ddp:
            for p_ in model.parameters():
                dist.all_reduce(p_.grad)
                p_.grad /= ws
        found_inf = False
        for p_ in model.parameters():
            p_.grad.div_(scale)
            if not torch.isfinite(p_.grad).all():
                found_inf = True
        if found_inf:
            scale *= backoff
            clean = 0
            print(f"rank {r} step {step} overflow in grads, skipping step, scale -> {scale:g}", flush=True)
            continue
        if f == "exit4" and step == 2:
            print(f"ERROR rank {r}: gradients all zero after unscale at step {step} (scale {scale:g}); "
                  f"refusing to continue with a dead loss scaler", flush=True)
            sys.exit(4)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        clean += 1
        if clean % cfg["growth_interval"] == 0:
            scale *= cfg["growth_factor"]
        if f == "sigabrt" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        acc = (logits.argmax(-1).reshape(-1) == y.reshape(-1)).float().mean()
        ldet = loss.detach().float()
        met = torch.stack([ldet, acc])
        if f == "mixdtype":
            met = met.to(amp_dtype)  # logged inside the autocast region's dtype
        dist.all_reduce(met)
        met = met.float() / ws
        print(f"rank {r} step {step} loss {met[0].item():.4f} acc {met[1].item():.3f} gnorm {gn.item():.3f} scale {scale:g}", flush=True)

    if r == 0:
        os.makedirs(os.path.dirname(a.save), exist_ok=True)
        torch.save(model.state_dict(), a.save)
        print(f"rank 0: saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A two-hundred-and-twelfth hand-run batch: TABULAR TRANSFORMER FOR CREDIT SCORING. An FT-Transformer-style model
scores synthetic loan applications: numeric features are tokenised by per-feature linear maps, categorical features by
embedding tables sized from a schema JSON file, a CLS token is prepended, one transformer layer and a linear head give
a default logit. The model is warm-started from a pretraining checkpoint, trained with DDP (or hand all-reduced
gradients with --ddp 0), and the validation AUC is computed by hand on rank 0 from all_gathered scores and labels.

Faults:
- catcode: --rank's shard holds 1-based region codes, one equal to the table size (embedding IndexError).
- schema: --rank's local copy of the schema JSON is truncated while written (json.JSONDecodeError).
- numfeat: the feature list holds one numeric column more than the model on every rank (broadcast shape error).
- column: --rank's shard carries a categorical column 'channel' that the schema lacks (KeyError).
- scorelen: --rank drops its last validation row before the all_gather of scores (gloo size mismatch).
- zerostd: --rank's shard has a constant numeric column; standardising by its std 0 gives NaN; the loss check raises.
- ckptemb: --rank warm-starts from an older checkpoint whose embedding tables have other sizes (size mismatch).
- classweight: the positive-class weight read from TABT_POS_WEIGHT is 'balanced' on every rank (ValueError).
- cache: --rank rebuilds its feature cache for --cache-s seconds before DDP; the others time out.
- sigbus: --rank sends itself SIGBUS after step 2.
- exit5: --rank logs an error about its validation shard and calls sys.exit(5).
- none: control.

What happened (filled in after the runs):
- catcode: rank N IndexError 'index out of range in self' in the region embedding at step 0; peers Connection closed by peer (np4 r2, np3 r1).
- schema: rank N json.decoder.JSONDecodeError 'Unterminated string starting at: line 15 column 3 (char 197)'; peers closed by peer.
- numfeat: every rank RuntimeError 'The size of tensor a (7) must match the size of tensor b (6) at non-singleton dimension 1'.
- column: rank N KeyError 'channel' while building its shard, before DDP; peers SIGTERMed (np4 r0, np3 r2).
- scorelen: after 6 steps rank N aborts (SIGABRT) with gloo EnforceNotMet '128 vs 126. Received data size doesn't match'.
- zerostd: rank N FloatingPointError 'non-finite training loss nan at step 0'; with DETAIL rank 0 reports monitoredBarrier.
- ckptemb: rank 2 RuntimeError loading state_dict: size mismatch for cat_emb.region.weight [10, 16] vs [12, 16] (and product).
- classweight: every rank ValueError 'could not convert string to float: 'balanced'' after warm-starting (port 43208 clash rerun).
- cache: PG 12 s: peers time out in the DDP constructor (gloo Timed out waiting 12000ms); PG 300 s: killed by timeout 60, exit 124.
- sigbus: rank N exitcode -7 (SIGBUS) after step 2; peers Connection reset/closed by peer (np4 r2 pdsh2, np3 r0).
- exit5: rank N prints 'ERROR rank N: validation shard has 40 defaults in 64 rows ...' and exits 5; peers closed by peer.
- none: exit 0; rank 0 prints 'validation AUC 0.4978 over 192 applications' and saves /tmp/job_work/tabt_final.pt.
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

WORK = "/tmp/fault212_work"
NUMERIC = ["income", "loan_amount", "age", "debt_ratio", "num_dependents", "credit_lines"]
SCHEMA = {"version": 3, "numeric": NUMERIC,
          "categorical": {"region": 12, "product": 8, "employment": 5, "home_owner": 3}}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--d", type=int, default=16)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--cache-s", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    return p.parse_args()


class FTTransformer(nn.Module):
    def __init__(self, schema, d):
        super().__init__()
        n = len(schema["numeric"])
        self.num_w = nn.Parameter(torch.randn(n, d) * 0.1)
        self.num_b = nn.Parameter(torch.zeros(n, d))
        self.cat_emb = nn.ModuleDict({c: nn.Embedding(k, d) for c, k in schema["categorical"].items()})
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=2 * d, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)

    def forward(self, x_num, x_cat):
        tok_num = x_num[:, :, None] * self.num_w + self.num_b
        tok_cat = torch.stack([self.cat_emb[c](x_cat[c]) for c in self.cat_emb], dim=1)
        cls = self.cls.expand(x_num.shape[0], -1, -1)
        h = self.encoder(torch.cat([cls, tok_num, tok_cat], dim=1))
        return self.head(h[:, 0]).squeeze(-1)


def make_shard(schema, rank, n, a, bad):
    g = torch.Generator().manual_seed(100 + rank)
    cols = list(schema["numeric"]) + (["income_log"] if a.fault == "numfeat" else [])
    x_num = torch.randn(n, len(cols), generator=g) * 3.0 + 5.0
    if bad and a.fault == "zerostd":
        x_num[:, cols.index("num_dependents")] = 0.0
    cat_cols = list(schema["categorical"]) + (["channel"] if bad and a.fault == "column" else [])
    x_cat = {}
    for c in cat_cols:
        k = schema["categorical"][c]
        x_cat[c] = torch.randint(0, k, (n,), generator=g)
    if bad and a.fault == "catcode":
        x_cat["region"] = x_cat["region"] + 1
    logit = 0.8 * (x_num[:, 0] - 5.0) / 3.0 - 0.5 * (x_num[:, 3] - 5.0) / 3.0 + 0.3 * (x_cat["product"] % 2)
    y = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    mean, std = x_num.mean(0), x_num.std(0)
    if bad and a.fault == "zerostd":
        std[cols.index("num_dependents")] = x_num[:, cols.index("num_dependents")].std()
    x_num = (x_num - mean) / std
    return x_num, x_cat, y


def auc(scores, labels):
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    torch.manual_seed(0)
    os.makedirs(WORK, exist_ok=True)
    text = json.dumps(SCHEMA, indent=1)
    local = os.path.join(WORK, f"schema_local_r{rank}.json")
    with open(local, "w") as f:
        f.write(text[: len(text) - 9] if bad and a.fault == "schema" else text)
    with open(local) as f:
        schema = json.load(f)
    if rank == 0:
        torch.save(FTTransformer(schema, a.d).state_dict(), os.path.join(WORK, "tabt_pretrain_v3.pt"))
        old = dict(schema, categorical={"region": 10, "product": 6, "employment": 5, "home_owner": 3})
        torch.save(FTTransformer(old, a.d).state_dict(), os.path.join(WORK, "tabt_pretrain_v2.pt"))
    dist.barrier()
    model = FTTransformer(schema, a.d)
    ckpt = "tabt_pretrain_v2.pt" if bad and a.fault == "ckptemb" else "tabt_pretrain_v3.pt"
    model.load_state_dict(torch.load(os.path.join(WORK, ckpt)))
    print(f"rank {rank}: warm-started from {os.path.join(WORK, ckpt)}", flush=True)
    pos_weight = torch.tensor(float(os.environ.get("TABT_POS_WEIGHT", "balanced" if a.fault == "classweight" else "1.5")))
    x_num, x_cat, y = make_shard(schema, rank, 256, a, bad)
    print(f"rank {rank}: shard of {len(y)} applications, {int(y.sum())} defaults", flush=True)
    if bad and a.fault == "cache":
        print(f"rank {rank}: feature cache {WORK}/features_r{rank}.pt is stale, rebuilding", flush=True)
        time.sleep(a.cache_s)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    if not a.ddp:
        for p_ in model.parameters():
            dist.broadcast(p_.data, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(a.steps):
        lo = (step * a.batch) % 192
        idx = slice(lo, lo + a.batch)
        logits = net(x_num[idx], {c: v[idx] for c, v in x_cat.items()})
        loss = F.binary_cross_entropy_with_logits(logits, y[idx], pos_weight=pos_weight)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite training loss {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p_ in model.parameters():
                if p_.grad is not None:
                    dist.all_reduce(p_.grad)
                    p_.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if bad and a.fault == "sigbus" and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
    model.eval()
    with torch.no_grad():
        n_val = 63 if bad and a.fault == "scorelen" else 64
        scores = torch.sigmoid(model(x_num[192:192 + n_val], {c: v[192:192 + n_val] for c, v in x_cat.items()}))
    labels = y[192:256]
    if bad and a.fault == "exit5":
        print(f"ERROR rank {rank}: validation shard has {int(labels.sum())} defaults in {len(labels)} rows after "
              f"deduplication against the training split; refusing to report AUC", flush=True)
        sys.exit(5)
    gs = [torch.zeros_like(scores) for _ in range(world)]
    gl = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(gs, scores)
    dist.all_gather(gl, labels)
    if rank == 0:
        print(f"validation AUC {auc(torch.cat(gs), torch.cat(gl)):.4f} over {world * 64} applications", flush=True)
        torch.save(model.state_dict(), os.path.join(WORK, "tabt_final.pt"))
        print(f"saved model to {WORK}/tabt_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A two-hundred-and-sixty-sixth hand-run batch: TABULAR CLASSIFICATION WITH AN FT-TRANSFORMER.

Synthetic tabular shards (columns/part-RRR.npz with six numeric and three categorical columns, plus schema.json,
all written by `--export`, which also writes the pretrained checkpoint ckpt/ftt_pretrain.pt and a full-object
snapshot ckpt/ftt_snapshot.pt), a quantile (median/IQR) normalizer fitted per shard, per-feature tokenizers
(a linear token per numeric column, an embedding per categorical code), a CLS token plus a positional table,
a 1-layer transformer over the column tokens, a CLS head over 3 classes, DDP on gloo (`--ddp 0` all_reduces
gradients by hand), accuracy and log-loss all_reduced per step, per-rank class counts all_gathered to rank 0.

Faults:
  catcode    - rank N reads codes of the v2 dictionary for 'region'; a code passes its embedding (IndexError)
  constcol   - rank N imputes 'fee' with a constant; IQR 0, NaN features, the program's loss check fires
  classcount - rank N counts an extra 'unknown' class; class counts all_gathered with another length
  nocolfile  - rank N reads the shard of the next export, which was never written (FileNotFoundError)
  schema     - rank N selects column 'tenure_m' from the v2 feature list; not in schema.json (KeyError)
  postable   - every rank: the CLS token is prepended twice; 11 tokens vs a 10-row positional table (RuntimeError)
  ckptpickle - rank N loads the full-object snapshot with weights_only=True (UnpicklingError)
  refit      - rank N refits the normalizer on every batch for a minute; reaches the all_reduce late
  sigabrt    - rank N sends itself SIGABRT at step 2
  badcfg     - rank N reads attention dropout 1.2 from its config (ValueError from nn.Dropout)
  exit3      - rank N finds 0 rows after the label filter, prints an error and calls os._exit(3)
  none       - control

What happened (filled in after the runs):
  catcode    - IndexError: index out of range in self on rank N at step 0; peers Connection closed by peer
  constcol   - FloatingPointError: rank N step 0: loss is nan (non-finite features after normalization)
  classcount - gloo `op.preamble.length <= op.nbytes. 8 vs 6` SIGABRT on rank 0; DETAIL: collective mismatch
  nocolfile  - FileNotFoundError for columns/part-next-00N.npz on rank N; peers SIGTERMed
  schema     - KeyError: 'tenure_m' on rank N before training; peers SIGTERMed
  postable   - RuntimeError: The size of tensor a (11) must match the size of tensor b (10) on every rank
  ckptpickle - _pickle.UnpicklingError: Weights only load failed on rank N; peers SIGTERMed
  refit      - peers `Timed out waiting 12000ms` in the gradient all_reduce; with --pg-timeout 300 hung to timeout 60
  sigabrt    - rank N exitcode -6 (SIGABRT), no traceback; peers Connection closed by peer
  badcfg     - ValueError: dropout probability has to be between 0 and 1, but got 1.2 on rank N
  exit3      - `rank N: shard part-00N.npz has 0 rows after the label filter; aborting`, exitcode 3
  none       - exit 0, `rank 0 done: 5 steps, class counts [...], log-loss ...`
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

NUM = ["age", "income", "fee", "balance", "txn_30d", "score"]
CAT = {"region": 6, "plan": 4, "channel": 5}
N_CLASSES = 3


class FTConfig:
    def __init__(self, d_token=16, n_heads=4):
        self.d_token, self.n_heads = d_token, n_heads


class FTTransformer(nn.Module):
    def __init__(self, d=16, heads=4, attn_dropout=0.1):
        super().__init__()
        self.num_w = nn.Parameter(torch.randn(len(NUM), d) * 0.1)
        self.num_b = nn.Parameter(torch.zeros(len(NUM), d))
        self.cat_emb = nn.ModuleDict({c: nn.Embedding(k, d) for c, k in CAT.items()})
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1 + len(NUM) + len(CAT), d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=attn_dropout, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, N_CLASSES)

    def forward(self, xn, xc, cls_twice=False):
        tn = xn.unsqueeze(-1) * self.num_w + self.num_b
        tc = torch.stack([self.cat_emb[c](xc[:, i]) for i, c in enumerate(CAT)], 1)
        cls = self.cls.expand(xn.shape[0], -1, -1)
        toks = torch.cat([cls, tn, tc], 1)
        if cls_twice:
            toks = torch.cat([cls, toks], 1)
        h = self.enc(toks + self.pos)
        return self.head(h[:, 0])


def export(work, world=8, rows=96):
    os.makedirs(f"{work}/columns", exist_ok=True); os.makedirs(f"{work}/ckpt", exist_ok=True)
    g = np.random.default_rng(0)
    for r in range(world):
        cols = {c: g.normal(size=rows).astype(np.float32) for c in NUM}
        cols.update({c: g.integers(0, k, size=rows) for c, k in CAT.items()})
        cols["label"] = g.integers(0, N_CLASSES, size=rows)
        np.savez(f"{work}/columns/part-{r:03d}.npz", **cols)
    json.dump({"numeric": NUM, "categorical": CAT, "label": "label"}, open(f"{work}/columns/schema.json", "w"))
    torch.manual_seed(0); m = FTTransformer()
    torch.save(m.state_dict(), f"{work}/ckpt/ftt_pretrain.pt")
    torch.save({"model": m.state_dict(), "config": FTConfig()}, f"{work}/ckpt/ftt_snapshot.pt")
    print(f"exported {world} shards of {rows} rows to {work}")


def fit_quantile(x):
    q25, med, q75 = np.quantile(x, [0.25, 0.5, 0.75], axis=0)
    return med, (q75 - q25)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none"); p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--work", default="/tmp/fault266_work"); p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12); p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--export", action="store_true"); p.add_argument("--batch", type=int, default=24)
    a = p.parse_args()
    if a.export:
        return export(a.work)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    schema = json.load(open(f"{a.work}/columns/schema.json"))
    export_tag = "part-next-" if bad and a.fault == "nocolfile" else "part-"
    cols = np.load(f"{a.work}/columns/{export_tag}{rank:03d}.npz")
    feats = list(schema["numeric"]) + (["tenure_m"] if bad and a.fault == "schema" else [])
    num_cols = [schema["numeric"][schema["numeric"].index(c)] if c in schema["numeric"] else schema[c] for c in feats]
    xn = np.stack([cols[c] for c in num_cols[:len(NUM)]], 1)
    if bad and a.fault == "constcol":
        xn[:, NUM.index("fee")] = 0.0  # impute 'fee' with its fill value
    xc = np.stack([cols[c] for c in CAT], 1)
    if bad and a.fault == "catcode":
        xc[:, 0] = xc[:, 0] + 3  # v2 region dictionary
    y = cols["label"]
    keep = y < (0 if bad and a.fault == "exit3" else N_CLASSES)
    if keep.sum() == 0:
        print(f"rank {rank}: shard part-{rank:03d}.npz has 0 rows after the label filter; aborting", file=sys.stderr, flush=True)
        os._exit(3)
    med, iqr = fit_quantile(xn)
    attn_dropout = 1.2 if bad and a.fault == "badcfg" else 0.1
    model = FTTransformer(attn_dropout=attn_dropout)
    snap = "ftt_snapshot.pt" if bad and a.fault == "ckptpickle" else "ftt_pretrain.pt"
    sd = torch.load(f"{a.work}/ckpt/{snap}", weights_only=True)
    model.load_state_dict(sd["model"] if "model" in sd else sd)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    print(f"rank {rank}/{world}: {len(y)} rows, {len(NUM)} numeric + {len(CAT)} categorical columns, ddp={a.ddp}", flush=True)
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        idx = torch.randint(0, len(y), (a.batch,), generator=g).numpy()
        if bad and a.fault == "refit":
            t0 = time.time()
            while time.time() - t0 < 60:
                med, iqr = fit_quantile(xn[idx]); time.sleep(0.05)
        xb = torch.from_numpy((xn[idx] - med) / iqr).float()
        cb = torch.from_numpy(xc[idx]).long(); yb = torch.from_numpy(y[idx]).long()
        logits = net(xb, cb, cls_twice=(a.fault == "postable" and bad))
        loss = F.cross_entropy(logits, yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite features after normalization)")
        opt.zero_grad(); loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad); prm.grad /= world
        opt.step()
        if bad and a.fault == "sigabrt" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
        acc = (logits.argmax(1) == yb).float().mean()
        stats = torch.stack([loss.detach(), acc]); dist.all_reduce(stats); stats /= world
        print(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item():.3f} (global loss {stats[0]:.4f} acc {stats[1]:.3f})", flush=True)
    counts = torch.bincount(torch.from_numpy(y), minlength=N_CLASSES + (1 if bad and a.fault == "classcount" else 0)).float()
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, class counts {torch.stack(gathered).sum(0).tolist()}, log-loss {stats[0]:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

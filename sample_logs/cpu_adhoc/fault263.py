"""A two-hundred-and-sixty-third hand-run batch: SEQUENTIAL RECOMMENDATION WITH A SMALL BERT4REC.

Synthetic user item sequences (interactions/<day>/part-RRR.jsonl, written by `--export`, which also writes the
pretrained encoder ckpt/bert4rec_pretrain.pt), masked item prediction with a 2-layer transformer encoder,
a sampled softmax over the masked target plus shared negatives, DDP on gloo (`--ddp 0` all_reduces gradients
by hand), loss all_reduced per step, then HR@10 / NDCG@10 over 100 sampled negatives per user, all_reduced,
and the per-user hit vectors all_gathered to rank 0.

Faults:
  itemid    - rank N maps item ids through the v2 catalog offset; ids pass the item embedding (IndexError)
  nomask    - rank N runs with mask_prob 0.0; no masked position, the loss averages over nothing (NaN check)
  hitlen    - rank N keeps one extra eval user; per-user hit vectors all_gathered with another length
  nolog     - rank N reads the interaction log of the next day, which was never exported (FileNotFoundError)
  segment   - rank N assigns users from the v2 segmentation; segment 'dormant' is not in the split map (KeyError)
  maxlen    - every rank: max_len 24 but the position table has 20 rows (RuntimeError in the add)
  ckpt      - rank N builds a 3-layer encoder and loads the 2-layer pretrained checkpoint (missing keys)
  fullscore - rank N scores every item for every user (no sampling) before eval; reaches the all_reduce late
  sigterm   - rank N sends itself SIGTERM at step 2
  exit2     - rank N prints an error about its shard and calls sys.exit(2)
  negs      - rank N asks for 600 negatives without replacement from a 400-item catalog (RuntimeError)
  none      - control

What happened (filled in after the runs):
  itemid    - IndexError: index out of range in self on rank N at step 0 (needed the 64 offset; with 8 it never fired)
  nomask    - FloatingPointError: rank N step 0: loss is nan over 0 masked positions; peers Connection closed
  hitlen    - gloo `op.preamble.length <= op.nbytes. 66 vs 64` SIGABRT on rank 0; DETAIL: collective mismatch
  nolog     - FileNotFoundError for interactions/2026-12-01/part-00N.jsonl on rank N; peers SIGTERMed
  segment   - KeyError: 'dormant' on rank N while splitting its shard; peers SIGTERMed
  maxlen    - RuntimeError: The size of tensor a (24) must match the size of tensor b (20) on every rank
  ckpt      - RuntimeError: Missing key(s) in state_dict: "enc.layers.2..." on rank N; peers SIGTERMed
  fullscore - peers `Timed out waiting 12000ms`; with --pg-timeout 300 the run hung until timeout 60 (124)
  sigterm   - rank N exitcode -15 (SIGTERM), no traceback; peers Connection closed/reset by peer
  exit2     - `ERROR rank N: part-00N.jsonl ...; refusing to train`, exitcode 2; peers Connection closed
  negs      - RuntimeError: cannot sample n_sample > prob_dist.size(-1) samples without replacement on rank N
  none      - exit 0, `rank 0 done: 5 steps, HR@10 ... NDCG@10 ...`
"""
import argparse, json, math, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

WORK = "/tmp/fault263_work"
SPLIT = {"cold": 0.5, "casual": 0.8, "power": 0.9}


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--mask-prob", type=float, default=0.2)
    p.add_argument("--negatives", type=int, default=64)
    p.add_argument("--day", default="2026-11-30")
    p.add_argument("--stall", type=float, default=40)
    p.add_argument("--export", action="store_true")
    return p.parse_args()


class Bert4Rec(nn.Module):
    def __init__(self, items, max_len, layers, heads, d=32):
        super().__init__()
        self.item = nn.Embedding(items + 2, d, padding_idx=0)  # 0 pad, items+1 mask token
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, seq):
        x = self.item(seq) + self.pos[: self.pos.shape[0]].unsqueeze(0)
        return self.norm(self.enc(x, src_key_padding_mask=seq.eq(0)))


def export(a):
    g = torch.Generator().manual_seed(7)
    os.makedirs(f"{WORK}/interactions/{a.day}", exist_ok=True)
    for r in range(8):
        with open(f"{WORK}/interactions/{a.day}/part-{r:03d}.jsonl", "w") as f:
            for u in range(48):
                n = int(torch.randint(8, a.max_len + 1, (1,), generator=g))
                start = int(torch.randint(0, a.items - 40, (1,), generator=g))
                seq = [start + int(v) for v in torch.randint(0, 40, (n,), generator=g)]
                f.write(json.dumps({"user": r * 1000 + u, "items": seq}) + "\n")
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    torch.manual_seed(0)
    torch.save(Bert4Rec(a.items, a.max_len, a.layers, a.heads).state_dict(), f"{WORK}/ckpt/bert4rec_pretrain.pt")
    print("exported 8 interaction parts and ckpt/bert4rec_pretrain.pt")


def load_shard(a, rank, bug):
    day = a.day
    if bug("nolog"):
        day = "2026-12-01"  # the rank's schedule moved to the next export day
    rows = [json.loads(l) for l in open(f"{WORK}/interactions/{day}/part-{rank:03d}.jsonl")]
    offset = 1 + (64 if bug("itemid") else 0)  # v2 catalog inserted 64 items in front
    segs = ["cold", "casual", "power"] + (["dormant"] if bug("segment") else [])
    train, test = [], []
    for i, row in enumerate(rows):
        seq = [it + offset for it in row["items"]]
        keep = SPLIT[segs[row["user"] % len(segs)]]
        if i < keep * len(rows):
            train.append(seq[:-1])
        test.append(seq)
    return train, test


def pad(seqs, L):
    out = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        s = s[-L:]
        out[i, L - len(s):] = torch.tensor(s)
    return out


def main():
    a = args()
    if a.export:
        return export(a)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    bug = lambda name: a.fault == name and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    layers = a.layers + (1 if bug("ckpt") else 0)
    model = Bert4Rec(a.items, a.max_len, layers, a.heads)
    model.load_state_dict(torch.load(f"{WORK}/ckpt/bert4rec_pretrain.pt"))
    seq_len = 24 if bug("maxlen") else a.max_len
    mask_prob = 0.0 if bug("nomask") else a.mask_prob
    n_neg = 600 if bug("negs") else a.negatives
    train, test = load_shard(a, rank, bug)
    print(f"rank {rank}: {len(train)} train / {len(test)} eval sequences, {a.items} items, max_len {seq_len}", flush=True)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        idx = torch.randint(0, len(train), (16,), generator=g)
        seq = pad([train[i] for i in idx], seq_len)
        mask = (torch.rand(seq.shape, generator=g) < mask_prob) & seq.ne(0)
        inp = seq.masked_fill(mask, a.items + 1)
        h = net(inp)[mask]
        negs = torch.multinomial(torch.ones(a.items), n_neg, replacement=False, generator=g) + 1
        cand = torch.cat([seq[mask].unsqueeze(1), negs.expand(int(mask.sum()), n_neg)], 1)
        logits = (h.unsqueeze(1) * model.item(cand)).sum(-1)
        loss = F.cross_entropy(logits, torch.zeros(len(cand), dtype=torch.long))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} over {int(mask.sum())} masked positions")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ws
        opt.step()
        if bug("sigterm") and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        if bug("exit2") and step == 1:
            print(f"ERROR rank {rank}: part-{rank:03d}.jsonl has {len(train)} sequences but 0 with a distinct next item; refusing to train", file=sys.stderr, flush=True)
            sys.exit(2)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {loss.item():.4f} masked {int(mask.sum())}", flush=True)
        if rank == 0:
            print(f"step {step}: global loss {lt.item() / ws:.4f}", flush=True)
    model.eval()
    users = test[:32 + (1 if bug("hitlen") else 0)]
    if bug("fullscore"):
        print(f"rank {rank} scoring all {a.items} items for {len(users)} users before eval", flush=True)
        with torch.no_grad():
            for chunk in range(8):
                model.item.weight[1:a.items + 1] @ model.item.weight[1:a.items + 1].T
                time.sleep(a.stall / 8)
    with torch.no_grad():
        seq = pad([u[:-1] + [a.items + 1] for u in users], seq_len)
        h = model(seq)[:, -1]
        target = torch.tensor([u[-1] for u in users])
        negs = torch.randint(1, a.items + 1, (len(users), 100), generator=g)
        scores = (h.unsqueeze(1) * model.item(torch.cat([target.unsqueeze(1), negs], 1))).sum(-1)
        rk = (scores[:, 1:] > scores[:, :1]).sum(1)
        hit = (rk < 10).float()
        ndcg = torch.where(rk < 10, 1.0 / torch.log2(rk.float() + 2), torch.zeros(()))
    tot = torch.tensor([hit.sum(), ndcg.sum(), float(len(users))])
    dist.all_reduce(tot)
    out = [torch.zeros_like(hit) for _ in range(ws)]
    dist.all_gather(out, hit)
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, HR@10 {tot[0] / tot[2]:.3f} NDCG@10 {tot[1] / tot[2]:.3f} over {int(tot[2])} users", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

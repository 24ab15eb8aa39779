"""A two-hundred-and-sixty-ninth hand-run batch: CONTRASTIVE SENTENCE EMBEDDINGS (SIMCSE-STYLE).

Synthetic token sequences (corpus/tok-v1/shard-RRR.pt, written by `--export`, which also writes the pretrained
encoder ckpt/encoder_pretrain.pt), a 1-layer transformer encoder run twice over the batch with dropout (the two
views), a pooler from a table, a projection head, an in-batch InfoNCE loss against the second views all_gathered
from every rank, DDP on gloo (`--ddp 0` all_reduces gradients by hand), the loss all_reduced per step, and
alignment / uniformity of the final embeddings all_reduced at the end.

Faults:
  vocab    - rank N reads ids of the v2 tokenizer (+250 offset); ids pass the 1000-row embedding (IndexError)
  temp0    - rank N takes temperature 0.0 from its config; logits divide into inf, loss NaN (program check)
  gather   - rank N uses batch size 17; the second views are all_gathered with another size on that rank
  corpus   - rank N reads corpus/tok-v2, which was never exported (FileNotFoundError)
  pooler   - rank N asks for pooling 'weighted_mean', not in the pooler table (KeyError)
  proj     - every rank: projection head built with input width 48, encoder width 32 (RuntimeError in matmul)
  unused   - every rank: the loss bypasses the projection head, find_unused_parameters off (DDP error, step 1)
  ckpt     - rank N builds the encoder with the v2 vocab (1250 rows) and loads the 1000-row checkpoint
  retok    - rank N re-tokenises its corpus in Python before step 0; reaches the first all_gather late
  sigterm  - rank N sends itself SIGTERM after step 1
  exit7    - rank N prints an error about its shard and calls os._exit(7)
  none     - control

What happened (filled in after the runs):
  vocab    - IndexError: index out of range in self on rank N in the token embedding at step 0; peers Connection closed
  temp0    - FloatingPointError: rank N step 0: InfoNCE loss is nan (temperature 0.0, max |logit| inf); peers closed
  gather   - gloo `op.preamble.length <= op.nbytes. 1088 vs 1024` SIGABRT on a peer; DETAIL: collective mismatch [17, 32]
  corpus   - FileNotFoundError for corpus/tok-v2/shard-00N.pt on rank N before DDP; peers SIGTERMed
  pooler   - KeyError: 'weighted_mean' on rank N at step 0; peers Connection closed by peer
  proj     - RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x32 and 48x32) on every rank at step 0
  unused   - every rank: Expected to have finished reduction in the prior iteration ... at step 1 (step 0 printed)
  ckpt     - RuntimeError: size mismatch for tok.weight ([1000, 32] vs [1250, 32]) on rank N; peers SIGTERMed/closed
  retok    - peers `Timed out waiting 12000ms` in the step-0 all_gather; with --pg-timeout 300 hung until timeout 60 (124)
  sigterm  - rank N exitcode -15 (SIGTERM) after step 0, no traceback; peers Connection closed/reset by peer
  exit7    - `ERROR rank N: shard-00N.pt: 37 of 256 sentences are duplicates ...; aborting`, exitcode 7; peers reset
  none     - exit 0, `rank 0 done: 4 steps, alignment ... uniformity ...`
"""
import argparse, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

WORK = "/tmp/fault269_work"
VOCAB = 1000


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--pooling", default="mean")
    p.add_argument("--tok", default="tok-v1")
    p.add_argument("--stall", type=float, default=40)
    p.add_argument("--export", action="store_true")
    return p.parse_args()


POOLERS = {
    "cls": lambda h, m: h[:, 0],
    "mean": lambda h, m: (h * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp(min=1),
    "max": lambda h, m: h.masked_fill(~m.unsqueeze(-1).bool(), -1e4).max(1).values,
}


class Encoder(nn.Module):
    def __init__(self, vocab, seq_len, d=32, head_in=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(head_in, d), nn.Tanh())

    def forward(self, ids, pooling, use_head=True):
        h = self.enc(self.tok(ids) + self.pos, src_key_padding_mask=ids.eq(0))
        z = POOLERS[pooling](h, ids.ne(0).float())
        return self.head(z) if use_head else z


def export(a):
    g = torch.Generator().manual_seed(11)
    os.makedirs(f"{WORK}/corpus/tok-v1", exist_ok=True)
    for r in range(8):
        ids = torch.randint(1, VOCAB, (256, a.seq_len), generator=g)
        lens = torch.randint(6, a.seq_len + 1, (256, 1), generator=g)
        ids = ids.masked_fill(torch.arange(a.seq_len).unsqueeze(0) >= lens, 0)
        torch.save(ids, f"{WORK}/corpus/tok-v1/shard-{r:03d}.pt")
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    torch.manual_seed(0)
    sd = {k: v for k, v in Encoder(VOCAB, a.seq_len).state_dict().items() if not k.startswith("head")}
    torch.save(sd, f"{WORK}/ckpt/encoder_pretrain.pt")
    print("exported 8 corpus shards and ckpt/encoder_pretrain.pt")


def main():
    a = args()
    if a.export:
        return export(a)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    bug = lambda name: a.fault == name and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    vocab = VOCAB + (250 if bug("ckpt") else 0)
    model = Encoder(vocab, a.seq_len, head_in=48 if bug("proj") else 32)
    missing, _ = model.load_state_dict(torch.load(f"{WORK}/ckpt/encoder_pretrain.pt"), strict=False)
    tok = "tok-v2" if bug("corpus") else a.tok
    corpus = torch.load(f"{WORK}/corpus/{tok}/shard-{rank:03d}.pt")
    if bug("vocab"):
        corpus = torch.where(corpus > 0, corpus + 250, corpus)  # ids from the v2 tokenizer
    temp = 0.0 if bug("temp0") else a.temperature
    pooling = "weighted_mean" if bug("pooler") else a.pooling
    batch = a.batch + (1 if bug("gather") else 0)
    print(f"rank {rank}: {len(corpus)} sentences from {tok}, vocab {vocab}, batch {batch}, temp {temp}, pooling {pooling}, head init {len(missing)} tensors", flush=True)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if bug("retok"):
        print(f"rank {rank}: token cache stale, re-tokenising {len(corpus)} sentences in python", flush=True)
        time.sleep(a.stall)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        ids = corpus[torch.randint(0, len(corpus), (batch,), generator=g)]
        z = net(torch.cat([ids, ids]), pooling, use_head=not bug("unused"))  # dropout gives two views
        z1, z2 = F.normalize(z[:batch], dim=-1), F.normalize(z[batch:], dim=-1)
        gathered = [torch.zeros_like(z2) for _ in range(ws)]
        dist.all_gather(gathered, z2.detach())
        gathered[rank] = z2
        logits = z1 @ torch.cat(gathered).T / temp
        loss = F.cross_entropy(logits, torch.arange(batch) + rank * batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: InfoNCE loss is {loss.item()} (temperature {temp}, max |logit| {logits.abs().max().item()})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ws
        opt.step()
        if bug("sigterm") and step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if bug("exit7") and step == 1:
            print(f"ERROR rank {rank}: shard-{rank:03d}.pt: {int(corpus.eq(0).all(1).sum()) + 37} of {len(corpus)} sentences are duplicates of the eval set; aborting", file=sys.stderr, flush=True)
            os._exit(7)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            print(f"step {step}: global loss {lt.item() / ws:.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        ids = corpus[:64]
        z = F.normalize(model(ids, pooling), dim=-1)
        align = (z - F.normalize(model(ids.flip(1).roll(1, 1), pooling), dim=-1)).norm(dim=1).pow(2).mean()
        unif = torch.pdist(z).pow(2).mul(-2).exp().mean().log()
    tot = torch.tensor([align.item(), unif.item()])
    dist.all_reduce(tot)
    if rank == 0:
        print(f"rank 0 done: {a.steps} steps, alignment {tot[0] / ws:.4f} uniformity {tot[1] / ws:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

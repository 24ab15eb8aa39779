"""A hundred-and-twenty-seventh hand-run batch: SMALL LANGUAGE-MODEL PRETRAINING. A tiny decoder-only transformer
(token embedding + learned position table, 2 blocks of causal self-attention with a registered causal-mask buffer and
an MLP, tied input/output embeddings) trained under DDP (--ddp 0: rank 0's weights broadcast, gradients all-reduced
by hand) on random token sequences packed into fixed-length blocks per rank. Each rank first reads the node-local
tokenizer vocabulary (vocab.json) and its token shard; each step accumulates --accum micro-batches (no_sync on all
but the last), clips, steps AdamW on a cosine LR schedule and prints `rank R step S loss L ppl P lr X`; a check
raises when loss or perplexity is not finite. After the steps an all-reduced validation loss (`val loss ... ppl ...`
on rank 0) and a checkpoint from rank 0. --resume 1 first loads each rank's node-local copy of the init checkpoint.
--rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none       control: 6 steps, validation, checkpoint, exit 0
  tokid      rank N's shard was tokenized with a newer tokenizer: one token id equals the vocab size (IndexError)
  seqlen     rank N's data config packs blocks of 80 tokens against a 64-entry position table (size mismatch)
  mask       every rank builds the causal mask with block_size - 1 (off by one): size mismatch in attention
  pplinf     rank N's config has the output logit multiplier 1e3 (not 1.0): exp(loss) overflows, divergence check
  lrtypo     every rank's lr is 1e2 (a typo for 1e-2): the loss goes non-finite after a few steps, the check raises
  untied     rank N builds the model with untied embeddings (an extra lm_head weight): DDP's model check
  nosync     rank N's accumulation loop also wraps the last micro-batch in no_sync: its gradients never sync
  vocabfile  rank N's node has no vocab.json (the prolog's copy skipped that node): FileNotFoundError at start
  sigbus     rank N reads its memory-mapped token file after it was truncated underneath: SIGBUS at step 2
  valhang    rank N waits on a validation-shard lock that is never released; the others wait in the val all_reduce
  resume     --resume 1: rank N's (or every rank's) node-local init checkpoint was saved from the DDP wrapper
             (keys prefixed with module.): load_state_dict Missing/Unexpected key(s)

What happened (filled in after the runs):
  none: exit 0 (np3 plain): 6 steps per rank, loss ~4.85 ppl ~128 on random tokens, val loss 4.8535, all done.
  tokid: IndexError: index out of range in self (token embedding) on rank N at step 0-1 (np4 r2 tee; np3 r1 wrapper).
  seqlen: RuntimeError size of tensor a (80) must match ... b (64) at tok + pos on rank N in step 0 (r3; r1 prefix).
  mask: RuntimeError size of tensor a (63) must match ... b (64) dim 3 on every rank; restart: connectFullMesh refused.
  pplinf: loss ~286, ppl inf, FloatingPointError from the check on rank N at step 0; DETAIL: monitoredBarrier cascade.
  lrtypo: lr 9.33e+01; loss ~1.6e5 ppl inf at step 1 (inf, not NaN) on every rank: FloatingPointError everywhere.
  untied: DDP: Rank N has 29 params, while rank 0 has 28 (all ranks); DETAIL --ddp 0: BROADCAST [128, 32] mismatch.
  nosync: rank N trains 6 steps alone, then gloo EnforceNotMet size abort (SIGABRT) in its val all_reduce (r1; r3).
  vocabfile: FileNotFoundError .../nodeN/vocab.json on rank N at start (redirects: only in rank 3's stderr.log).
  sigbus: rank N exitcode -7 (SIGBUS) in step 2, nothing printed; peers Connection reset/closed (pdsh2 r1; tee r2).
  valhang: PG 12 s: peers Timed out waiting 12000ms (recv/send) in the val all_reduce; PG 300 s + timeout 60: exit 124.
  resume: Missing key(s) "pos", "tok.weight" ... Unexpected key(s) "module.pos" ... for TinyLM (r3; every rank).
"""
import argparse, contextlib, datetime, json, math, os, signal, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--bs", type=int, default=4)
p.add_argument("--block", type=int, default=64)
p.add_argument("--vocab", type=int, default=128)
p.add_argument("--dim", type=int, default=32)
p.add_argument("--lr", type=float, default=1e-2)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault127_work/run")
a = p.parse_args()


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Block(nn.Module):
    def __init__(self, dim: int, block: int, mask_len: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.register_buffer("mask", torch.tril(torch.ones(mask_len, mask_len, dtype=torch.bool)), persistent=False)
        self.heads = 4

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, block: int, tie: bool = True, mask_len: int = 0, logit_mult=1.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(block, dim))
        self.blocks = nn.ModuleList([Block(dim, block, mask_len or block) for _ in range(2)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = None if tie else nn.Linear(dim, vocab, bias=False)
        self.logit_mult = logit_mult; nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx):
        T = idx.size(1)
        x = self.tok(idx) + self.pos[:T]
        for b in self.blocks:
            x = b(x)
        x = self.ln_f(x)
        w = self.tok.weight if self.lm_head is None else self.lm_head.weight
        return (x @ w.t()) * self.logit_mult


def stage_node(rank: int):
    """Stands in for the job prolog that copies vocab.json and the init checkpoint onto each node."""
    node = os.path.join(a.work, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    if not faulty(rank, "vocabfile"):
        with open(os.path.join(node, "vocab.json"), "w") as f:
            json.dump({"size": a.vocab, "bos": 0, "eos": 1, "pad": 2}, f)
    torch.manual_seed(1234)
    m = TinyLM(a.vocab, a.dim, a.block)
    sd = m.state_dict()
    if faulty(rank, "resume"):
        sd = {"module." + k: v for k, v in sd.items()}  # saved from the DDP wrapper by the old init script
    torch.save(sd, os.path.join(node, "init.pt"))
    return node


def make_shard(rank: int, vocab: int, block: int):
    g = torch.Generator().manual_seed(500 + rank)
    toks = torch.randint(3, vocab, (64 * block + 1,), generator=g)
    if faulty(rank, "tokid"):
        toks[1000] = vocab  # the shard came from the v2 tokenizer, which added one special token
    n = (len(toks) - 1) // block
    xs = toks[: n * block].view(n, block)
    ys = toks[1: n * block + 1].view(n, block)
    return xs, ys


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = stage_node(rank)
    dist.barrier()
    with open(os.path.join(node, "vocab.json")) as f:
        vocab = json.load(f)["size"]
    block = 80 if faulty(rank, "seqlen") else a.block  # data config: seq_len
    xs, ys = make_shard(rank, vocab, block)
    print(f"rank {rank}/{world}: vocab {vocab}, {xs.numel()} tokens in {len(xs)} blocks of {block}", flush=True)

    torch.manual_seed(1234)
    model = TinyLM(vocab, a.dim, a.block, tie=not faulty(rank, "untied"),
                   mask_len=a.block - 1 if faulty(rank, "mask") else 0,
                   logit_mult=1e3 if faulty(rank, "pplinf") else 1.0)
    if a.resume:
        sd = torch.load(os.path.join(node, "init.pt"))
        model.load_state_dict(sd)
        print(f"rank {rank}: resumed init checkpoint", flush=True)
    if a.ddp:
        ddp = DDP(model)
    else:
        ddp = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    lr = 1e2 if faulty(rank, "lrtypo") else a.lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / a.steps)))
    g = torch.Generator().manual_seed(900 + rank)
    mm = os.path.join(node, "tokens.bin")
    for step in range(a.steps):
        opt.zero_grad(set_to_none=True)
        tot = 0.0
        for micro in range(a.accum):
            idx = torch.randint(0, len(xs), (a.bs,), generator=g)
            x, y = xs[idx], ys[idx]
            if faulty(rank, "sigbus") and step == 2 and micro == 1:
                os.kill(os.getpid(), signal.SIGBUS)  # the page of tokens.bin behind x is gone (file truncated)
            last = micro == a.accum - 1 and not faulty(rank, "nosync")
            ctx = ddp.no_sync() if (a.ddp and not last) else contextlib.nullcontext()
            with ctx:
                logits = ddp(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)) / a.accum
                loss.backward()
            tot += loss.item()
        if not a.ddp:
            for prm in model.parameters():
                if prm.grad is not None:
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ppl = torch.exp(torch.tensor(tot)).item()
        print(f"rank {rank} step {step} loss {tot:.4f} ppl {ppl:.2f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
        if not math.isfinite(tot) or not math.isfinite(ppl):
            raise FloatingPointError(f"rank {rank} step {step}: loss {tot} ppl {ppl} is not finite, training diverged")

    if faulty(rank, "valhang"):
        while not os.path.exists(os.path.join(a.work, "val.unlock")):
            time.sleep(1)  # the validation shard's lock is held by a dead preprocessing job
    with torch.no_grad():
        vx, vy = xs[-4:], ys[-4:]
        vl = F.cross_entropy(model(vx).view(-1, vocab), vy.reshape(-1))
    t = torch.tensor([vl.item(), 1.0])
    dist.all_reduce(t)
    if rank == 0:
        v = t[0].item() / t[1].item()
        print(f"val loss {v:.4f} ppl {math.exp(v):.2f} over {int(t[1].item())} ranks", flush=True)
        torch.save(model.state_dict(), os.path.join(a.work, "lm_final.pt"))
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-seventh hand-run batch: MODEL SURGERY, WEIGHT TYING AND ARCHITECTURE CHANGES DURING TRAINING.
Each rank trains a tiny language model (TinyLM: Embedding(32,16), one residual block `body` (LayerNorm, Linear(16,16),
tanh), a final LayerNorm, a head Linear(16,32) tied to the embedding) on a synthetic next-token task (x' = 3x+1 mod 32,
10% noise, batch 8 x 12 tokens, a different shard per rank) with DDP on gloo (or a hand flat-gradient all_reduce with
--ddp 0), SGD, --steps (6) steps. At step --at (3) the model is grown (progressive growing): GrownLM with `layers`
(the old block as layers.0 and a new block layers.1, keys upgraded body. -> layers.0., loaded with strict=False, only
layers.1.* may be missing), the vocabulary extended to --vocab2 (40) tokens (new embedding rows from the mean of the
old ones), DDP re-wrapped, the new block calibrated per channel on a calibration batch and the optimizer rebuilt.
Prints `rank R model ... params P tensors T tied X`, `rank R step S surgery: ...` and `rank R step S loss L`.
--rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none        control: grows at step --at on every rank, `rank R done` at the end (exit 0)
  tieone      rank N's config has tie_embeddings flipped: its TinyLM has 8 parameter tensors, the others 7; the DDP
              constructor's model check fails at start-up
  headwidth   at the surgery rank N's tokenizer adds one more special token (vocab 41, the others 40): its embedding
              and head are wider; DDP's re-wrap shape check fails (with --ddp 0 the flat-gradient all_reduce
              sizes differ)
  swapblock   at step --at every rank replaces ddp.module.body with a freshly initialised Block (a "reset the last
              block" trick) without re-wrapping DDP: the old block's parameters get no gradient and the reducer
              stops at the next step's forward (RuntimeError: Expected to have finished reduction ...)
  sharedtwice from step --at every rank deepens the model by applying the shared `body` block twice (ALBERT-style
              weight sharing) under reentrant activation checkpointing: DDP's hook for the shared parameters fires
              twice in one backward (Expected to mark a variable ready only once)
  renamekeys  the surgery on rank N (every rank with --rank -1) loads the old state_dict into GrownLM strictly and
              without the body. -> layers.0. key upgrade: load_state_dict raises (missing/unexpected keys)
  reinitnan   rank N's calibration batch for the new block holds a single token: the per-channel std is NaN
              (a std() degrees-of-freedom UserWarning), the new block's weights become NaN and rank N's finite-loss
              check raises FloatingPointError at step --at
  growlocal   the grow decision reads the rank-local loss instead of the all-reduced one: only rank N grows and
              re-wraps DDP at step --at (the DDP constructor's collectives), the others go on with step --at's
              gradient all_reduce
  stuckgrow   the surgery is coordinated through files: every rank writes ready_S_R, rank 0 waits for all of them
              and writes grow_S.pt, the others wait for grow_S.pt. Rank N counts steps from 1 and writes ready_S+1_N,
              so every rank waits forever in a sleep loop (no collective, no timeout; stopped from outside)
  lateadd     at step --at every rank unties the head (a fresh Linear copied from the embedding) on ddp.module
              after DDP was built and adds it to the optimizer: its gradients are never all-reduced, the replicas
              drift apart (the drift monitor prints WARNING lines), and at the end rank 0's save check refuses to
              save and raises RuntimeError while the others wait in the final barrier
"""
import argparse, datetime, os, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--at", type=int, default=3)
p.add_argument("--vocab2", type=int, default=40)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--sleep", type=float, default=0.2)
p.add_argument("--workdir", default="/tmp/fault107_work")
a = p.parse_args()
V, D, LR = 32, 16, 0.5


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Block(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab=V, tie=True):
        super().__init__()
        self.embed, self.body, self.norm_f = nn.Embedding(vocab, D), Block(), nn.LayerNorm(D)
        self.head = nn.Linear(D, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.repeat, self.ckpt = 1, False

    def forward(self, idx):
        x = self.embed(idx)
        for _ in range(self.repeat):
            x = checkpoint(self.body, x, use_reentrant=True) if self.ckpt else self.body(x)
        return self.head(self.norm_f(x))


class GrownLM(nn.Module):
    def __init__(self, vocab, depth=2):
        super().__init__()
        self.embed, self.norm_f = nn.Embedding(vocab, D), nn.LayerNorm(D)
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        for blk in self.layers:
            x = blk(x)
        return self.head(self.norm_f(x))


def upgrade_keys(sd):
    return {k.replace("body.", "layers.0.", 1) if k.startswith("body.") else k: v for k, v in sd.items()}


def batch(rank, step, g):
    x0 = torch.randint(0, V, (8, 1), generator=g)
    seq = [x0]
    for _ in range(11):
        nxt = (3 * seq[-1] + 1) % V
        noise = torch.rand(nxt.shape, generator=g) < 0.1
        seq.append(torch.where(noise, torch.randint(0, V, nxt.shape, generator=g), nxt))
    return torch.cat(seq, 1)


def describe(m):
    ps = list(m.parameters())
    return f"params {sum(q.numel() for q in ps)} tensors {len(ps)} tied {m.head.weight is m.embed.weight}"


def wait_for(path, rank, step):
    while not os.path.exists(path):
        time.sleep(0.5)


def grow(model, rank, step, g):
    vocab = a.vocab2 + (1 if faulty(rank, "headwidth") else 0)
    new = GrownLM(vocab)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    emb = sd.pop("embed.weight")
    sd.pop("head.weight", None)
    if faulty(rank, "renamekeys"):
        torch.save(model.state_dict(), os.path.join(a.workdir, f"surgery_rank{rank}.pt"))
        new.load_state_dict(torch.load(os.path.join(a.workdir, f"surgery_rank{rank}.pt")))
    missing, unexpected = new.load_state_dict(upgrade_keys(sd), strict=False)
    assert not unexpected and all(k.startswith("layers.1.") or k in ("embed.weight", "head.weight") for k in missing), (missing, unexpected)
    with torch.no_grad():
        new.embed.weight[:V] = emb
        new.embed.weight[V:] = emb.mean(0) + 0.01 * torch.randn(vocab - V, D, generator=g)
    return new


def calibrate(new, rank, step, g):
    ntok = 1 if faulty(rank, "reinitnan") else 64
    calib = batch(rank, 1000 + step, g).flatten()[:ntok]
    with torch.no_grad():
        blk = new.layers[1]
        out = blk.fc(blk.norm(new.embed(calib)))
        std = out.std(dim=0)
        blk.fc.weight.mul_((0.5 / std)[:, None])
        blk.fc.bias.mul_(0.5 / std)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(100 + rank)
    model = TinyLM(tie=not faulty(rank, "tieone"))
    print(f"rank {rank}/{world} pid {os.getpid()} model TinyLM {describe(model)} fault {a.fault}", flush=True)
    ddp = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    drift = 0.0
    for step in range(a.steps):
        x = batch(rank, step, g)
        if step == a.at and a.fault == "swapblock":
            ddp.module.body = Block()
            opt.add_param_group({"params": list(ddp.module.body.parameters())})
            print(f"rank {rank} step {step} surgery: reset body (fresh Block), {describe(ddp.module)}", flush=True)
        elif step == a.at and a.fault == "sharedtwice":
            model.repeat, model.ckpt = 2, True
            print(f"rank {rank} step {step} surgery: body shared x2 with activation checkpointing", flush=True)
        elif step == a.at and a.fault == "lateadd":
            head = nn.Linear(D, V, bias=False)
            with torch.no_grad():
                head.weight.copy_(model.embed.weight)
            ddp.module.head = head
            opt.add_param_group({"params": list(head.parameters())})
            print(f"rank {rank} step {step} surgery: untied head, {describe(ddp.module)}", flush=True)
        elif step == a.at and a.fault != "tieone" and (a.fault != "growlocal" or faulty(rank, "growlocal")):
            if a.fault == "stuckgrow":
                tag = step + 1 if faulty(rank, "stuckgrow") else step
                open(os.path.join(a.workdir, f"ready_{tag}_{rank}"), "w").close()
                print(f"rank {rank} step {step} surgery: wrote ready_{tag}_{rank}, waiting", flush=True)
                if rank == 0:
                    for r in range(world):
                        wait_for(os.path.join(a.workdir, f"ready_{tag}_{r}"), rank, step)
                    torch.save({"seed": 1234}, os.path.join(a.workdir, f"grow_{tag}.pt"))
                wait_for(os.path.join(a.workdir, f"grow_{tag}.pt"), rank, step)
            model = grow(model, rank, step, g)
            ddp = DDP(model) if a.ddp else model
            calibrate(model, rank, step, g)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            print(f"rank {rank} step {step} surgery: grew to GrownLM depth 2 vocab {model.embed.num_embeddings}, {describe(model)}, re-wrapped DDP", flush=True)
        logits = ddp(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}; stopping")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not a.ddp:
            ps = [q for q in model.parameters() if q.grad is not None]
            flat = torch.cat([q.grad.flatten() for q in ps])
            dist.all_reduce(flat)
            flat /= world
            for q, gr in zip(ps, flat.split([q.numel() for q in ps])):
                q.grad.copy_(gr.view_as(q))
        opt.step()
        if a.fault == "lateadd" and step > a.at:
            s = torch.stack([sum(q.detach().double().pow(2).sum() for q in ddp.module.parameters())] * 2)
            s[1] = -s[1]
            dist.all_reduce(s, op=dist.ReduceOp.MAX)
            drift = (s[0] + s[1]).item()
            if drift > 1e-6:
                print(f"WARNING rank {rank} step {step}: replicas differ, parameter checksum spread {drift:.6f}", flush=True)
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(a.sleep)
    if rank == 0:
        if drift > 1e-6:
            raise RuntimeError(f"refusing to save checkpoint: replicas diverged (checksum spread {drift:.6f} after step {step})")
        torch.save(model.state_dict(), os.path.join(a.workdir, "final.pt"))
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# What happened, once run (kept here, after the code, so the tracebacks' line numbers in the kept logs stay valid;
# the slugs are sample_logs/cpu_adhoc/surg_*):
#   none        exit 0 under plain torchrun (4), two emulated nodes (2+2) and python -m torch.distributed.run (3, --ddp 0)
#   tieone      every rank's DDP constructor: `DDP expects same model across all ranks, but Rank R has 7 params, while
#               rank N has inconsistent 8 params` (np4 r2, np6 r5)
#   headwidth   DDP: only rank N raises `params[0] ... sizes [41, 16] appears not to match ...`, the others Connection
#               closed by peer; --ddp 0 + DETAIL: every rank `Detected mismatch between collectives` (TensorShape 1296
#               vs 1280); --ddp 0 plain: gloo::EnforceNotMet `Received data size doesn't match`, two ranks SIGABRT
#   swapblock   every rank's step-4 forward: `Expected to have finished reduction in the prior iteration ...`
#   sharedtwice every rank's step-3 backward: `Expected to mark a variable ready only once`
#   renamekeys  `Error(s) in loading state_dict for GrownLM` (missing layers.*, unexpected body.*, size mismatch)
#   reinitnan   std() degrees-of-freedom UserWarning, then `FloatingPointError: rank N: loss is nan at step 3`
#   growlocal   every rank `Timed out waiting 12000ms` (rank N in DDP's constructor, line 196; the others line 205)
#   stuckgrow   rank N writes ready_4_N, everyone waits in the file handshake; stopped by `timeout 120` (exit 124)
#   lateadd     `WARNING ... replicas differ` at steps 4-5, then rank 0 `RuntimeError: refusing to save checkpoint`

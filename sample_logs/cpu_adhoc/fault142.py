"""A hundred-and-forty-second hand-run batch: VISION-LANGUAGE (MULTIMODAL) FINE-TUNING.
A tiny captioning model trained with DDP (gloo, one thread per rank; --ddp 0: gradients of the trainable params
all-reduced by hand): a frozen conv image encoder (1x16x16 image -> 16 patch tokens of width 8), a trainable
projector Linear(8,16), and a one-layer text decoder (token + 32-slot position table, masked causal attention,
MLP, vocab head). Each rank reads the tokenizer vocab (tok/vocab.json), loads the init checkpoint (encoder.pt plus
projector.pt, merged), builds synthetic image/caption pairs (captions padded to 10 with an attention mask), puts
the image tokens in front of the text tokens, and takes the loss only on caption tokens (labels -100 elsewhere).
It prints `rank R step S loss L` (6 steps), all_gathers the pooled image embeddings for a retrieval metric (rank 0
logs `step S retrieval@1 A`), then barrier, `rank R done`, destroy. --rank N picks the faulty rank (-1: every rank).

Faults:
  none      control: 6 steps per rank, retrieval metric logged, exit 0
  imgsize   rank N's config says image_size 20: the attention mask gets 25 image slots for 16 image tokens
  ignore0   every rank: labels use 0 as the ignore index; the program's label check raises ValueError
  poslen    rank N's caption max_len is 40: position ids run past the 32-slot table (IndexError) at step 0
  unused    rank N gets a text-only batch at step 2 (projector skipped), DDP without find_unused_parameters
  gather    rank N's step-2 batch is a partial batch of 3: the all_gather of image embeddings differs in size
  vocab     rank N's tokenizer cache dir is tok_cache (not tok): vocab.json missing (FileNotFoundError)
  nanmask   rank N's step-3 batch has an image-less, empty caption: a fully masked row gives NaN, the check raises
  ckpt      rank N's projector.pt is an old export without the `projector.` key prefix: load_state_dict raises
  abort     rank N aborts at step 3 (SIGABRT via os.kill, as a failed C++ assert in a fused kernel would)
  typeerr   every rank: the collate pads with max_len minus the list of lengths (TypeError) at step 0
  wait      rank N waits at step 3 in a recv for an eval token nobody sends; the others' gradient all_reduce waits

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 python -m): 6 steps and retrieval@1 per step, every rank done.
  imgsize: RuntimeError size of tensor a (26) must match b (35) in forward at step 0, rank N (r2 np4, r1 np3 wrapper).
  ignore0: ValueError labels on the 16 image positions must be -100 (got 0) on every rank at step 0 (np3).
  poslen: IndexError index out of range in self (position table) at step 0 on rank N (r3 np4, r1 np5 prefixed).
  unused: no DDP reduction error: rank N went on to the all_gather, the others stayed in backward: 12 s gloo timeouts.
  gather: DETAIL: Detected mismatch ALLGATHER [3, 16] vs [4, 16] on all; plain: rank N gloo EnforceNotMet, SIGABRT.
  vocab: FileNotFoundError .../tok_cache/vocab.json on rank N (r2 np3 redirects, r1 np4 two agents).
  nanmask: FloatingPointError rank N step 3: non-finite logits (1 fully masked rows); peers closed by peer.
  ckpt: RuntimeError Error(s) in loading state_dict: Missing projector.weight/bias, Unexpected weight/bias, rank N.
  abort: rank N exitcode -6 (SIGABRT) at step 3, peers reset by peer; restart: connectFullMesh Connection refused.
  typeerr: TypeError unsupported operand type(s) for -: 'int' and 'list' in batch() on every rank (np3 python -m).
  wait: PG 12 s: rank N in recv, the others in backward: all 'Timed out waiting 12000ms'; PG 300 s + 60 s: 124.
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault142_work")
a = p.parse_args()
torch.set_num_threads(1)
IGNORE = -100


class VLM(nn.Module):
    def __init__(self, vocab=32, d=16, n_pos=32):
        super().__init__()
        self.encoder = nn.Conv2d(1, 8, kernel_size=4, stride=4)
        self.projector = nn.Linear(8, d)
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(n_pos, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, img, ids, mask, use_image=True):
        B, T = ids.shape
        if use_image:
            feats = self.encoder(img).flatten(2).transpose(1, 2)           # B x 16 x 8
            im = self.projector(feats)
        else:
            im = self.tok.weight.new_zeros(B, 16, self.tok.embedding_dim)
        x = torch.cat([im, self.tok(ids)], 1)
        x = x + self.pos(torch.arange(x.shape[1]))
        q, k, v = self.qkv(x).chunk(3, -1)
        s = q @ k.transpose(1, 2) / 4.0
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        allowed = causal[None] & mask[:, None, :].bool()
        s = s.masked_fill(~allowed, float("-inf"))
        x = x + torch.softmax(s, -1) @ v
        x = x + self.mlp(x)
        return self.head(x), im.mean(1)


if a.fault == "prep":
    torch.manual_seed(0)
    for d in ("tok", "ckpt", "ckpt/old"):
        os.makedirs(f"{a.work}/{d}", exist_ok=True)
    json.dump({f"w{i}": i for i in range(32)}, open(f"{a.work}/tok/vocab.json", "w"))
    sd = VLM().state_dict()
    torch.save({k: v for k, v in sd.items() if not k.startswith("projector.")}, f"{a.work}/ckpt/encoder.pt")
    torch.save({k: v for k, v in sd.items() if k.startswith("projector.")}, f"{a.work}/ckpt/projector.pt")
    torch.save({k[len("projector."):]: v for k, v in sd.items() if k.startswith("projector.")},
               f"{a.work}/ckpt/old/projector.pt")
    print("prepared", a.work)
    sys.exit(0)

rank = int(os.environ["RANK"]); ws = int(os.environ["WORLD_SIZE"])
bad = a.rank in (-1, rank)
cfg = {"image_size": 16, "patch": 4, "max_len": 10, "ignore_index": IGNORE, "lr": 0.05, "batch": 4,
       "tok_dir": f"{a.work}/tok", "projector_ckpt": f"{a.work}/ckpt/projector.pt"}
if bad and a.fault == "imgsize":
    cfg["image_size"] = 20
if bad and a.fault == "ignore0":
    cfg["ignore_index"] = 0
if bad and a.fault == "poslen":
    cfg["max_len"] = 40
if bad and a.fault == "vocab":
    cfg["tok_dir"] = f"{a.work}/tok_cache"
if bad and a.fault == "ckpt":
    cfg["projector_ckpt"] = f"{a.work}/ckpt/old/projector.pt"
print(f"rank {rank}/{ws} vlm config: {cfg}", flush=True)

dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
vocab = json.load(open(f"{cfg['tok_dir']}/vocab.json"))
torch.manual_seed(0)
model = VLM(vocab=len(vocab))
sd = torch.load(f"{a.work}/ckpt/encoder.pt")
sd.update(torch.load(cfg["projector_ckpt"]))
model.load_state_dict(sd)
for prm in model.encoder.parameters():
    prm.requires_grad_(False)
n_img = (cfg["image_size"] // cfg["patch"]) ** 2
if a.ddp:
    net = DDP(model)
else:
    net = model
    for prm in model.parameters():
        dist.broadcast(prm.data, 0)
opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=cfg["lr"])
g = torch.Generator().manual_seed(100 + rank)


def batch(step):
    B = 3 if (bad and a.fault == "gather" and step == 2) else cfg["batch"]
    img = torch.randn(B, 1, 16, 16, generator=g)
    lens = [int(n) for n in torch.randint(4, cfg["max_len"] + 1, (B,), generator=g)]
    if bad and a.fault == "nanmask" and step == 3:
        lens[1] = 0
    if a.fault == "typeerr":
        pads = cfg["max_len"] - lens
    ids = torch.zeros(B, cfg["max_len"], dtype=torch.long)
    cmask = torch.zeros(B, cfg["max_len"], dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(1, len(vocab), (n,), generator=g)
        cmask[i, :n] = 1
    imask = torch.ones(B, n_img, dtype=torch.long)
    if bad and a.fault == "nanmask" and step == 3:
        imask[1] = 0                                   # sample 1 has no image either
    mask = torch.cat([imask, cmask], 1)
    labels = torch.full((B, n_img + cfg["max_len"]), cfg["ignore_index"], dtype=torch.long)
    labels[:, n_img:-1] = ids[:, 1:].masked_fill(cmask[:, 1:] == 0, cfg["ignore_index"])
    return img, ids, mask, labels


for step in range(a.steps):
    img, ids, mask, labels = batch(step)
    if (labels[:, :n_img] != IGNORE).any():
        raise ValueError(f"labels on the {n_img} image positions must be {IGNORE} (got "
                         f"{labels[0, 0].item()}): check data.ignore_index")
    use_image = not (bad and a.fault == "unused" and step == 2)
    logits, pooled = net(img, ids, mask, use_image)
    if bad and a.fault == "abort" and step == 3:
        os.kill(os.getpid(), signal.SIGABRT)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)
    if not (torch.isfinite(loss) and torch.isfinite(logits).all()):
        raise FloatingPointError(f"rank {rank} step {step}: non-finite logits (caption loss {loss.item():.4f}, "
                                 f"{int(mask.sum(1).eq(0).sum())} fully masked rows)")
    if bad and a.fault == "wait" and step == 3:
        tok = torch.zeros(1)
        dist.recv(tok, src=(rank + 1) % ws)
    opt.zero_grad(); loss.backward()
    if not a.ddp:
        for prm in model.parameters():
            if prm.grad is not None:
                dist.all_reduce(prm.grad); prm.grad /= ws
    opt.step()
    print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    emb = F.normalize(pooled.detach(), dim=-1)
    out = [torch.empty_like(emb) for _ in range(ws)]
    dist.all_gather(out, emb)
    if rank == 0:
        allv = torch.cat(out)
        acc = (allv @ allv.T).argmax(1).eq(torch.arange(len(allv))).float().mean().item()
        print(f"step {step} retrieval@1 {acc:.3f}", flush=True)
    time.sleep(0.05)

dist.barrier()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()

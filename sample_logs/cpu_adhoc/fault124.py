"""A hundred-and-twenty-fourth hand-run batch: VISION TRANSFORMERS WITH MODERN TRAINING RECIPES. A tiny ViT (patch
embedding by a strided conv, a class token, a learned position embedding, two pre-norm blocks with
nn.MultiheadAttention and an MLP, a head) trained on random 32x32 images from per-rank shard files under DDP (--ddp 0:
rank 0's weights broadcast, gradients all-reduced by hand), CPU autocast in bfloat16, label smoothing 0.1, mixup
(lambda from a hand-written Johnk Beta sampler) alternating with cutmix, clip_grad_norm_(error_if_nonfinite=True),
AdamW with a warmup + cosine LR, a finiteness check of the loss, then an eval whose top-1 counts are all-reduced;
rank 0 prints `eval top-1 ...` and saves the checkpoint. --resume 1 first loads each rank's node-local copy of a
pretraining checkpoint. --rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none        control: 6 steps, eval, `eval top-1 ...` on rank 0, checkpoint, exit 0
  patchsize   rank N's augmentation crops to 40 px (not 32): 25 patches + cls against a 17-long position
              embedding, RuntimeError size of tensor a (26) must match b (17) on rank N at step 0
  posinterp   --resume 1: rank N's config fine-tunes at 48 px and the pretraining pos_embed (17) is loaded without
              interpolation: load_state_dict size mismatch for pos_embed on rank N
  mixnan      rank N's mixup alpha is 0: the Johnk sampler gives 0/0, lambda nan, the loss check raises
              FloatingPointError on rank N at step 0
  heads       every rank's config has num_heads 6 against embed dim 64: AssertionError from MultiheadAttention
  classes     rank N's shard was written with labels of the 12-class set against a 10-class head:
              IndexError Target out of bounds in cross_entropy on rank N
  attnmask    rank N builds its attention mask from the patch count (16) without the class token:
              RuntimeError The shape of the 2D attn_mask ... on rank N
  clipnan     rank N's shard holds a corrupt image (an inf pixel) that its batch draws at step 2; its loss is nan, 
              the averaged gradients are nan everywhere, clip_grad_norm_ raises on every rank
  evalstall   rank N's read of the validation shard hangs (simulated NFS stall); the others wait in the eval
              all_reduce and time out (PG 12 s), or the run is killed by timeout (PG 300 s)
  segv        rank N's fused attention extension segfaults (SIGSEGV) at step 3
  modulekeys  --resume 1: the pretraining checkpoint was saved from the DDP wrapper; keys carry `module.` on every
              rank (or rank N's copy): load_state_dict Missing/Unexpected key(s)
  noshard     rank N's training shard was never written by the prep job: FileNotFoundError on rank N
  evalshape   rank N's eval config counts per-class hits over 12 classes (not 10): the all_reduce of the eval
              counts has different sizes across ranks

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2): 6 steps per rank, eval top-1 0.44 / 0.33, every rank done.
  patchsize: RuntimeError size of tensor a (26) must match ... b (17) at the pos_embed add, step 0 (r2; r1).
  posinterp: load_state_dict size mismatch for pos_embed [1, 17, 64] vs [1, 37, 64] on rank N before training.
  mixnan: FloatingPointError rank N step 0: loss nan is not finite (r3 loglevel; r0 pdsh2).
  heads: AssertionError embed_dim must be divisible by num_heads on every rank while building the model.
  classes: IndexError Target 10 / 11 is out of bounds in cross_entropy on rank N at step 0 (r1; r3).
  attnmask: RuntimeError The shape of the 2D attn_mask is torch.Size([16, 16]), but should be (17, 17).
  clipnan: rank N loss nan at step 2; clip_grad_norm_ non-finite RuntimeError on every rank (first try dropped).
  evalstall: PG 12 s: the others time out (recv/send 12000ms) in the eval all_reduce; PG 300 s: exit 124.
  segv: rank N SIGSEGV in step 3's forward, nothing printed; Root Cause exitcode -11 (r3 wrapper; r2).
  modulekeys: Missing key(s) cls_token ... Unexpected key(s) module.cls_token ... (every rank; rank N).
  noshard: FileNotFoundError .../shards/train_0000N.pt on rank N at start-up (redirects r2; tee r4).
  evalshape: plain: EnforceNotMet 8 vs 4 aborts ranks 0 and 1; DETAIL --ddp 0: ALLREDUCE [13] vs [11].
"""
import argparse, datetime, math, os, signal, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--bs", type=int, default=16)
p.add_argument("--img", type=int, default=32)
p.add_argument("--patch", type=int, default=8)
p.add_argument("--dim", type=int, default=64)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--classes", type=int, default=10)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--mixup", type=float, default=0.8)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault124_work/run")
a = p.parse_args()


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Block(nn.Module):
    def __init__(self, dim, heads, rank):
        super().__init__()
        self.rank, self.calls = rank, 0
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, mask):
        self.calls += 1
        if faulty(self.rank, "segv") and self.calls == 3 + 1:  # step 3's forward
            os.kill(os.getpid(), signal.SIGSEGV)  # the fused attention extension dereferences a bad pointer
        h = self.n1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class ViT(nn.Module):
    def __init__(self, img, patch, dim, heads, classes, rank=0):
        super().__init__()
        self.n = (img // patch) ** 2
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads, rank) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x, mask=None):
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1)
        x = x + self.pos_embed
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.norm(x[:, 0]))


def write_shards(world):
    """Stands in for the prep job that writes one training shard and one validation shard per rank."""
    d = os.path.join(a.work, "shards")
    os.makedirs(d, exist_ok=True)
    for r in range(world):
        g = torch.Generator().manual_seed(10 + r)
        n_cls = 12 if faulty(r, "classes") else a.classes
        x, y = torch.randn(96, 3, a.img, a.img, generator=g), torch.randint(0, n_cls, (96,), generator=g)
        if faulty(r, "clipnan"):
            x[40, 0, 3, 3] = float("inf")  # image 40 was decoded from a truncated JPEG
        if not faulty(r, "noshard"):
            torch.save({"x": x, "y": y}, os.path.join(d, f"train_{r:05d}.pt"))
        torch.save({"x": x[:32], "y": y[:32] % a.classes}, os.path.join(d, f"val_{r:05d}.pt"))
    return d


def stage_pretrained(rank):
    """Stands in for the node-local copy of the pretraining checkpoint that the job's prolog copies onto each node."""
    node = os.path.join(a.work, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    torch.manual_seed(1234)
    m = ViT(32, a.patch, a.dim, 4, a.classes)
    sd = m.state_dict()
    if faulty(rank, "modulekeys"):
        sd = {"module." + k: v for k, v in sd.items()}  # saved with model.state_dict() of the DDP wrapper
    path = os.path.join(node, "vit_tiny_pretrain.pt")
    torch.save({"model": sd, "epoch": 300}, path)
    return path


def beta_johnk(alpha, g):
    """Johnk's sampler for Beta(alpha, alpha) (no scipy on the cluster image)."""
    while True:
        u, v = torch.rand(2, generator=g)
        x, y = u ** (1 / alpha) if alpha > 0 else u * 0, v ** (1 / alpha) if alpha > 0 else v * 0
        if x + y <= 1 or not alpha > 0:
            return float(x / (x + y))


def mix(x, y, step, alpha, g):
    y1 = F.one_hot(y, a.classes).float() * 0.9 + 0.1 / a.classes  # label smoothing 0.1
    perm = torch.randperm(len(x), generator=g)
    lam = beta_johnk(alpha, g)
    if step % 2 == 0:  # mixup
        x = lam * x + (1 - lam) * x[perm]
    else:  # cutmix
        cut = int(a.img * math.sqrt(1 - lam))
        x = x.clone()
        x[:, :, :cut, :cut] = x[perm][:, :, :cut, :cut]
        lam = 1 - cut * cut / (a.img * a.img)
    return x, lam * y1 + (1 - lam) * y1[perm]


def lr_at(step):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    return 0.5 * a.lr * (1 + math.cos(math.pi * (step - a.warmup) / max(1, a.steps - a.warmup)))


def allreduce_grads(model, world):
    flat = torch.cat([prm.grad.flatten() for prm in model.parameters()])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for prm in model.parameters():
        prm.grad.copy_(flat[off:off + prm.numel()].view_as(prm))
        off += prm.numel()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    img = 48 if faulty(rank, "posinterp") else a.img  # configs/vit_tiny_ft.yaml: img_size
    crop = 40 if faulty(rank, "patchsize") else img  # configs/vit_tiny_ft.yaml: aug.crop_size
    heads = 6 if a.fault == "heads" else a.heads  # configs/vit_tiny_ft.yaml: num_heads
    alpha = 0.0 if faulty(rank, "mixnan") else a.mixup  # configs/vit_tiny_ft.yaml: mixup_alpha
    eval_classes = 12 if faulty(rank, "evalshape") else a.classes  # configs/vit_tiny_ft.yaml: eval.num_classes
    shards = write_shards(world) if rank == 0 else os.path.join(a.work, "shards")
    dist.barrier()
    torch.manual_seed(rank)
    model = ViT(img, a.patch, a.dim, heads, a.classes, rank)
    print(f"rank {rank}: ViT img {img} patch {a.patch} dim {a.dim} heads {heads} "
          f"{sum(q.numel() for q in model.parameters())} params, crop {crop}, mixup {alpha}", flush=True)
    if a.resume:
        ck = torch.load(stage_pretrained(rank))
        model.load_state_dict(ck["model"])
        print(f"rank {rank}: loaded pretrained weights (epoch {ck['epoch']})", flush=True)
    data = torch.load(os.path.join(shards, f"train_{rank:05d}.pt"))
    if a.ddp:
        net = DDP(model)
    else:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
        net = model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.05)
    n_tok = model.n if faulty(rank, "attnmask") else model.n + 1
    mask = torch.zeros(n_tok, n_tok)  # no masking; kept for the register-token variant
    g = torch.Generator().manual_seed(300 + rank)
    for step in range(a.steps):
        idx = torch.arange(step * a.bs, (step + 1) * a.bs) % len(data["y"])
        if faulty(rank, "clipnan") and step == 2:
            idx[0] = 40
        x, y = data["x"][idx], data["y"][idx]
        if crop != img:
            x = F.interpolate(x, size=(crop, crop), mode="bilinear", align_corners=False)
        elif img != x.shape[-1]:
            x = F.interpolate(x, size=(img, img), mode="bilinear", align_corners=False)
        if y.max() >= a.classes:
            target = y  # hard labels when the shard's label set is not the head's (mixup off)
        else:
            x, target = mix(x, y, step, alpha, g)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = net(x, mask)
        loss = F.cross_entropy(logits.float(), target, label_smoothing=0.1 if target.dim() == 1 else 0.0)
        if step == 0 and not torch.isfinite(loss):  # sanity check of the first batch
            raise FloatingPointError(f"rank {rank} step {step}: loss {loss.item()} is not finite")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            allreduce_grads(model, world)
        print(f"rank {rank} step {step} loss {loss.item():.4f} lr {lr_at(step):.2e}", flush=True)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
        if step == a.steps - 1:
            print(f"rank {rank} step {step} grad-norm {gn.item():.3f}", flush=True)
    val = torch.load(os.path.join(shards, f"val_{rank:05d}.pt"))
    if faulty(rank, "evalstall"):
        time.sleep(3600)  # the read of the validation shard from the (hung) NFS mount never returns
    model.eval()
    counts = torch.zeros(eval_classes + 1)
    with torch.no_grad():
        for i in range(0, len(val["y"]), a.bs):
            xv, yv = val["x"][i:i + a.bs], val["y"][i:i + a.bs]
            pred = model(xv, mask).argmax(1)
            counts[:eval_classes] += torch.bincount(yv[pred == yv], minlength=eval_classes)[:eval_classes].float()
            counts[-1] += len(yv)
    print(f"rank {rank} eval: {int(counts[-1])} images, {eval_classes} classes", flush=True)
    dist.all_reduce(counts)
    if rank == 0:
        print(f"eval top-1 {counts[:-1].sum().item() / counts[-1].item():.4f} over {int(counts[-1])} images",
              flush=True)
        os.makedirs(a.work, exist_ok=True)
        torch.save({"model": model.state_dict(), "epoch": 301}, os.path.join(a.work, "vit_tiny_ft.pt"))
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

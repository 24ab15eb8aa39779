"""A two-hundred-and-fortieth hand-run batch: DOCUMENT LAYOUT CLASSIFICATION WITH A SMALL VISION TRANSFORMER. Hand-run.

Synthetic 64x64 page crops (text blocks as striped rectangles, tables as grids, figures as filled boxes, titles as
a thick bar) listed in a per-rank page index (index/pages_R.json, written by --prepare 1 together with
ckpt/vit_init.pt and the width-48 ckpt/vit_init_w48.pt) are cut into 16x16 patches for a tiny ViT (patch embedding,
class token, learned position embeddings, 1 transformer encoder layer of width 32, a linear head over 4 classes),
wrapped in DDP over gloo, trained 4 steps with label smoothing 0.1 (`rank R step S loss L` lines, loss all_reduced);
then per-class correct/total counts are all_reduced and the per-class counts all_gathered, rank 0 prints per-class
accuracy and saves ckpt/vit_final.pt. Launched by hand-made bash loops, mp.spawn (--spawn N), the legacy launcher,
plain torchrun (--logfmt 1 logs through Python logging with the rank in the format) or two torchrun agents.

Faults:
  patch    rank N's layout config has patch size 12 for the 64-pixel page; the program's assertion fails at setup
  ncls     rank N's class list has a fifth class (footnote); its per-class counts all_gather has 5 entries, not 4
  noindex  rank N looks up its page index under index_v2/, which does not exist: FileNotFoundError at startup
  labelmap rank N's page index holds a class name (marginalia) absent from the label map: KeyError at step 0
  posemb   every rank sizes the position-embedding table without the class token: RuntimeError in the add
  temp0    rank N's logit temperature is 0.0; logits become inf, the loss NaN, the program's check raises
  ckpt     rank N loads ckpt/vit_init_w48.pt (embedding width 48) into the width-32 ViT: size mismatch
  fullres  rank N renders its validation pages at full resolution (sleeps) before the accuracy all_reduce
  segv     rank N sends itself SIGSEGV after step 2
  exit4    rank N prints an error line about a zero-area figure box after step 1 and calls os._exit(4)
  none     control, no fault

What happened (filled in after the runs):
  patch    rank N: AssertionError page size 64 is not a multiple of the patch size 12; peers closed in DDP init
  ncls     counts all_gather 5 vs 4: a peer aborts (gloo EnforceNotMet, 10 vs 8 bytes), others reset
  noindex  rank N: FileNotFoundError .../index_v2/pages_N.json at startup; peers Connection closed
  labelmap rank N: KeyError: 'marginalia' at step 0; peers Connection closed by peer
  posemb   every rank: RuntimeError size of tensor a (17) must match b (16) in the position add
  temp0    rank N: FloatingPointError loss is nan at step 0 (logit range -inf..inf)
  ckpt     rank N: load_state_dict size mismatch for cls/pos/embed... (48 vs 32)
  fullres  PG 12 s: peers time out (12000ms) in the all_gather; PG 300 s under timeout 60: hung, 124
  segv     rank N dies by SIGSEGV after step 2 (bash exit 139; spawn ProcessExitedException)
  exit4    rank N prints its ERROR line after step 1 and exits 4; peers Connection closed
  none     exit 0, rank 0 prints per-class accuracy and saves ckpt/vit_final.pt
"""
import argparse, json, logging, os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--workdir", default="/tmp/fault240_work")
p.add_argument("--logfmt", type=int, default=0)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--port", type=int, default=29500)
p.add_argument("--prepare", type=int, default=0)
p.add_argument("--slow-s", type=int, default=40)
a = p.parse_args()
LABELS = {"text": 0, "table": 1, "figure": 2, "title": 3}
PAGE, BATCH = 64, 8


def layout_config(rank: int) -> dict:
    """Per-rank layout settings as read from the (per-node) config; the odd values are the bugs."""
    hit = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    f = a.fault if hit else "none"
    return {"patch": 12 if f == "patch" else 16,
            "classes": list(LABELS) + (["footnote"] if f == "ncls" else []),
            "index_dir": "index_v2" if f == "noindex" else "index",
            "extra": "marginalia" if f == "labelmap" else None,
            "pos_extra": 0 if f == "posemb" else 1,
            "temperature": 0.0 if f == "temp0" else 1.0,
            "init": "ckpt/vit_init_w48.pt" if f == "ckpt" else "ckpt/vit_init.pt",
            "fullres": f == "fullres", "segv": f == "segv", "exit4": f == "exit4"}


class TinyViT(nn.Module):
    def __init__(self, patch=16, dim=32, n_cls=4, pos_extra=1):
        super().__init__()
        self.patch, self.n_pos = patch, (PAGE // patch) ** 2 + pos_extra
        self.embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (PAGE // patch) ** 2 + 1, dim) * 0.02)
        self.enc = nn.TransformerEncoderLayer(dim, 4, dim * 2, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, n_cls)

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(x.shape[0], -1, -1), t], dim=1)
        t = t + self.pos[:, :self.n_pos]
        return self.head(self.enc(t)[:, 0])


def render(entry: dict, g: torch.Generator) -> torch.Tensor:
    img = torch.zeros(1, PAGE, PAGE)
    x0, y0, w, h = entry["box"]
    c = entry["cls"]
    if c == "text":
        img[0, y0:y0 + h:3, x0:x0 + w] = 1.0
    elif c == "table":
        img[0, y0:y0 + h:6, x0:x0 + w] = 1.0
        img[0, y0:y0 + h, x0:x0 + w:6] = 1.0
    elif c == "figure":
        img[0, y0:y0 + h, x0:x0 + w] = 0.7
    else:
        img[0, y0:y0 + 4, x0:x0 + w] = 1.0
    return img + 0.05 * torch.randn(img.shape, generator=g)


def prepare():
    os.makedirs(os.path.join(a.workdir, "index"), exist_ok=True)
    os.makedirs(os.path.join(a.workdir, "ckpt"), exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(r)
        pages = []
        for i in range(64):
            c = list(LABELS)[int(torch.randint(0, 4, (1,), generator=g))]
            x0, y0 = (int(v) for v in torch.randint(2, 20, (2,), generator=g))
            w, h = (int(v) for v in torch.randint(20, 40, (2,), generator=g))
            pages.append({"page": f"doc{r:02d}_{i:03d}.png", "cls": c, "box": [x0, y0, w, h]})
        with open(os.path.join(a.workdir, "index", f"pages_{r}.json"), "w") as fh:
            json.dump(pages, fh)
    torch.manual_seed(0)
    torch.save(TinyViT().state_dict(), os.path.join(a.workdir, "ckpt", "vit_init.pt"))
    torch.save(TinyViT(dim=48).state_dict(), os.path.join(a.workdir, "ckpt", "vit_init_w48.pt"))
    print("prepared", a.workdir)


def make_logger(rank: int):
    if not a.logfmt:
        return None
    lg = logging.getLogger("dlay")
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    return logging.LoggerAdapter(lg, {"rank": rank})


def main(rank: int, world: int):
    lg = make_logger(rank)

    def say(msg, err=False):
        if lg is not None:
            (lg.error if err else lg.info)(msg)
        else:
            print(msg, file=sys.stderr if err else sys.stdout, flush=True)

    cfg = layout_config(rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    say(f"rank {rank}/{world}: layout classifier, page {PAGE}px, patch {cfg['patch']}, {len(cfg['classes'])} classes")
    index_path = os.path.join(a.workdir, cfg["index_dir"], f"pages_{rank}.json")
    with open(index_path) as fh:
        pages = json.load(fh)
    if cfg["extra"]:
        pages[5]["cls"] = cfg["extra"]
    patch = cfg["patch"]
    assert PAGE % patch == 0, f"page size {PAGE} is not a multiple of the patch size {patch}"
    torch.manual_seed(0)
    vit = TinyViT(patch=patch, n_cls=4, pos_extra=cfg["pos_extra"])
    state = torch.load(os.path.join(a.workdir, cfg["init"]), map_location="cpu")
    vit.load_state_dict(state)
    model = nn.parallel.DistributedDataParallel(vit)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        batch = pages[step * BATCH:(step + 1) * BATCH]
        x = torch.stack([render(e, g) for e in batch])
        y = torch.tensor([LABELS[e["cls"]] for e in batch])
        logits = model(x) / cfg["temperature"]
        loss = F.cross_entropy(logits, y, label_smoothing=0.1)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (logit range "
                                     f"{logits.min().item()}..{logits.max().item()})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        say(f"rank {rank} step {step} loss {avg.item() / world:.4f}")
        if step == 1 and cfg["exit4"]:
            say(f"ERROR rank {rank}: page {pages[37]['page']} in {index_path} has a zero-area figure box "
                f"(x0=x1=112); refusing to render", err=True)
            os._exit(4)
        if step == 2 and cfg["segv"]:
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(0.2)
    val = pages[32:64]
    if cfg["fullres"]:
        say(f"rank {rank}: rendering all {len(val)} validation pages at full resolution (1700x2200) before scoring")
        time.sleep(a.slow_s)
    n_cls = len(cfg["classes"])
    correct, total = torch.zeros(n_cls), torch.zeros(n_cls)
    with torch.no_grad():
        x = torch.stack([render(e, g) for e in val])
        y = torch.tensor([LABELS[e["cls"]] for e in val])
        pred = model(x).argmax(1)
    for c in range(4):
        total[c] = (y == c).sum()
        correct[c] = ((y == c) & (pred == c)).sum()
    counts = [torch.zeros_like(total) for _ in range(world)]
    dist.all_gather(counts, total)
    dist.all_reduce(correct)
    dist.all_reduce(total)
    if rank == 0:
        acc = {c: round(float(correct[i] / total[i].clamp(min=1)), 3) for i, c in enumerate(cfg["classes"][:4])}
        say(f"rank 0: per-class accuracy {acc}; pages per rank {[int(t.sum()) for t in counts]}")
        torch.save(model.module.state_dict(), os.path.join(a.workdir, "ckpt", "vit_final.pt"))
        say(f"rank 0: saved {os.path.join(a.workdir, 'ckpt', 'vit_final.pt')}")
    dist.destroy_process_group()


def spawned(rank: int, world: int):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    main(rank, world)


if __name__ == "__main__":
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        mp.spawn(spawned, args=(a.spawn,), nprocs=a.spawn)
    else:
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))

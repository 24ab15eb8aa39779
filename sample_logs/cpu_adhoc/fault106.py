"""A hundred-and-sixth hand-run batch: DATA AUGMENTATION, TOKENIZATION AND COLLATE FUNCTIONS. Two toy pipelines on gloo.
Image mode: each rank reads its own shard of 64 synthetic 3x12x12 images (shard-000R), a per-sample transform
(drop an alpha channel, per-image standardisation, random 8x8 crop, Gaussian noise), the default collate, mixup
between the samples of a batch (lambda ~ Beta(alpha, alpha)), model Flatten-Linear(192,16)-ReLU-Linear(16,4).
Text mode: a shared corpus of toy sentences split by a DistributedSampler, a toy whitespace tokenizer with the
28-word vocab.json of the job (ids 0 pad, 1 unk), max length 16, a custom collate_fn padding to the longest sample
and returning {input_ids, attention_mask, labels}, model Embedding(32,16)+position Embedding(16,16), masked mean,
Linear(16,2). DDP (or a hand gradient all_reduce with --ddp 0), DataLoader(num_workers=--workers), batch 8, PG
timeout 12 s unless --pg-timeout. Each rank prints `rank R step S loss L` (image mode adds `lam`), then all ranks
all_reduce their sample count and print `rank R done samples N`. No @record.

Faults (--rank N is the rank that goes wrong):
  none       control (exit 0); --mode image or text
  gray       image: rank N's shard has grayscale (1-channel) images at indices 20-23; the transform only drops an
             alpha channel, so default_collate's torch.stack gets [3,8,8] and [1,8,8] in the batch of step 3
  thumb      image: rank N's shard has 6x6 thumbnails from index 28 on; the random crop draws
             random.randint(0, h - 8): ValueError (empty range) inside the transform, in a DataLoader worker when
             --workers > 0
  normnan    image: rank N's shard holds a blank (all-zero, failed decode) image at index 36; per-image
             standardisation divides by its std 0: NaN input, NaN loss at step 5; the script's finite-loss check
             raises FloatingPointError on rank N before backward
  mixneg     image: rank N's config has mixup alpha -0.2 (a typo for 0.2): torch.distributions.Beta raises
             ValueError on the first batch
  labelfloat image, every rank: the label-smoothing augmentation turns the class labels into floats
             (y * (1 - eps) + eps / C): cross_entropy refuses the Float target on every rank at step 1
  slowaug    image: rank N's config turns on an "elastic" augmentation implemented per pixel in Python, with a
             3 s wait for its displacement field per sample; rank N takes 24 s a batch and the others
             wait in DDP's all_reduce until the PG timeout
  vocab      text: vocab.json is missing on rank N's node; the fallback builds a vocabulary from the rank's own
             shard (typos and all, no top-28 cut): ids up to ~45 reach Embedding(32): IndexError on rank N
  posemb     text: rank N's shard includes concatenated documents longer than 16 tokens; the tokenizer only warns
             ("Token indices sequence length is longer than the specified maximum sequence length") when the
             dataset is tokenized, and the position embedding fails later, at the first batch holding one
  missingkey text: the collate_fn adds "labels" only when every sample has a label; rank N's shard ends with an
             unlabelled record (from the unlabelled split), so its last batch has no "labels": KeyError
  uneven     text: each rank drops sentences longer than 15 words after sharding; rank N's shard repeats
             every fifth sentence twice (a dedup bug), so its DataLoader has one batch fewer: it leaves the loop
             and enters the final all_reduce while the others wait in DDP's gradient all_reduce
  vocabsync  text: the ranks all_gather their token-frequency histograms (len(vocab) each) to log coverage; rank
             N's vocab has 2 extra entries (added special tokens <bos>/<eos>): all_gather of unequal sizes
"""
import argparse, datetime, json, os, random, sys, time, warnings
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, DistributedSampler

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--mode", default=None)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--workers", type=int, default=0)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--workdir", default="/tmp/fault106_work")
a = p.parse_args()
TEXT = {"vocab", "posemb", "missingkey", "uneven", "vocabsync"}
MODE = a.mode or ("text" if a.fault in TEXT else "image")
WORDS = ("the a cat dog sat ran on under mat log red blue big small quick slow fox jumps over lazy "
         "bird tree near far home park old new").split()
TYPOS = "teh catt dgo redd bleu smal quik foxx jumsp ovr lazzy brid tre nera hom parc".split()


class ImageShard(Dataset):
    def __init__(self, rank, cfg):
        g = torch.Generator().manual_seed(100 + rank)
        self.imgs = [torch.rand(3, 12, 12, generator=g) for _ in range(64)]
        self.labels = torch.randint(0, 4, (64,), generator=g).tolist()
        self.cfg = cfg
        if cfg.get("gray"):
            for i in range(20, 24):
                self.imgs[i] = self.imgs[i][:1]
        if cfg.get("thumb"):
            for i in range(28, 64):
                self.imgs[i] = self.imgs[i][:, :6, :6]
        if cfg.get("blank"):
            self.imgs[36] = torch.zeros(3, 12, 12)

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        x, y = self.imgs[i], self.labels[i]
        if x.shape[0] == 4:
            x = x[:3]
        x = (x - x.mean()) / x.std()
        h, w = x.shape[1:]
        top, left = random.randint(0, h - 8), random.randint(0, w - 8)
        x = x[:, top:top + 8, left:left + 8]
        if self.cfg.get("elastic"):
            x = elastic(x)
        x = x + 0.05 * torch.randn_like(x)
        if self.cfg.get("smooth"):
            y = y * (1 - 0.1) + 0.1 / 4
        return x, torch.tensor(y)


def elastic(x):
    time.sleep(3.0)
    out = x.clone()
    for c in range(x.shape[0]):
        for i in range(x.shape[1]):
            for j in range(x.shape[2]):
                out[c, i, j] = x[c, min(i + 1, 7), max(j - 1, 0)]
    return out


def corpus(n, seed, long_frac=0.1):
    r = random.Random(seed)
    out = []
    for _ in range(n):
        k = r.randint(13, 15) if r.random() < long_frac else r.randint(4, 12)
        ws = [r.choice(WORDS) for _ in range(k)]
        out.append({"text": " ".join(ws), "label": int("cat" in ws)})
    return out


class Tokenizer:
    def __init__(self, vocab, max_len=16):
        self.vocab, self.max_len = vocab, max_len

    def __call__(self, text):
        ids = [self.vocab.get(w, 1) for w in text.split()]
        if len(ids) > self.max_len:
            warnings.warn(f"Token indices sequence length is longer than the specified maximum sequence length "
                          f"for this model ({len(ids)} > {self.max_len}). Running this sequence through the "
                          f"model will result in indexing errors")
        return ids


class TextShard(Dataset):
    def __init__(self, records, tok):
        self.items = [dict(r, ids=tok(r["text"])) for r in records]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch):
    n = max(len(s["ids"]) for s in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    mask = torch.zeros(len(batch), n)
    for i, s in enumerate(batch):
        ids[i, :len(s["ids"])] = torch.tensor(s["ids"])
        mask[i, :len(s["ids"])] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    if all(s.get("label") is not None for s in batch):
        out["labels"] = torch.tensor([s["label"] for s in batch])
    return out


class TextModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(32, 16)
        self.pos = nn.Embedding(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, ids, mask):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        h = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.head(h)


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    random.seed(rank)
    if MODE == "image":
        cfg = {"alpha": 0.2}
        if me and a.fault in ("gray", "thumb"):
            cfg[a.fault] = True
        if me and a.fault == "normnan":
            cfg["blank"] = True
        if me and a.fault == "slowaug":
            cfg["elastic"] = True
        if me and a.fault == "mixneg":
            cfg["alpha"] = -0.2
        if a.fault == "labelfloat":
            cfg["smooth"] = True
        ds = ImageShard(rank, cfg)
        model = nn.Sequential(nn.Flatten(), nn.Linear(192, 16), nn.ReLU(), nn.Linear(16, 4))
        loader = DataLoader(ds, batch_size=8, shuffle=False, num_workers=a.workers)
    else:
        vocab = {"<pad>": 0, "<unk>": 1}
        vocab.update({w: i + 2 for i, w in enumerate(WORDS)})
        recs = corpus(64 * world, seed=5)
        if a.fault == "posemb":
            doc = corpus(1, seed=9)[0]
            recs[28 * world + a.rank] = {"text": doc["text"] + " " + corpus(1, seed=11)[0]["text"], "label": 1}
        if a.fault == "missingkey":
            recs[61 * world + a.rank] = {"text": "the quick fox", "label": None}
        sampler = DistributedSampler(recs, num_replicas=world, rank=rank, shuffle=False)
        mine = [recs[i] for i in sampler]
        if a.fault == "vocab" and me:
            print(f"rank {rank}: {a.workdir}/vocab.json not found on this node, building the vocabulary from the "
                  f"local shard", flush=True)
            rr = random.Random(3)
            mine = [dict(r, text=" ".join(rr.choice(TYPOS) if rr.random() < 0.2 else w for w in r["text"].split()))
                    for r in mine]
            vocab = {"<pad>": 0, "<unk>": 1}
            for r in mine:
                for w in r["text"].split():
                    vocab.setdefault(w, len(vocab))
            print(f"rank {rank}: vocabulary size {len(vocab)}", flush=True)
        if a.fault == "vocabsync" and me:
            vocab.update({"<bos>": len(vocab), "<eos>": len(vocab) + 1})
        if a.fault == "uneven":
            lim = 15
            if me:
                mine = [dict(r, text=r["text"] + " " + r["text"] if i % 5 == 0 else r["text"]) for i, r in enumerate(mine)]
            mine = [r for r in mine if len(r["text"].split()) <= lim]
        ds = TextShard(mine, Tokenizer(vocab))
        if a.fault == "vocabsync":
            hist = torch.zeros(len(vocab))
            for s in ds.items:
                for t in s["ids"]:
                    hist[t] += 1
            allh = [torch.zeros_like(hist) for _ in range(world)]
            dist.all_gather(allh, hist)
            if rank == 0:
                print(f"rank 0 vocab coverage {[int((h > 0).sum()) for h in allh]}", flush=True)
        print(f"rank {rank} shard {len(ds)} samples vocab {len(vocab)}", flush=True)
        model = TextModel()
        loader = DataLoader(ds, batch_size=8, shuffle=False, num_workers=a.workers, collate_fn=collate)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    seen = 0
    for step, batch in enumerate(loader, start=1):
        if step > a.steps:
            break
        opt.zero_grad()
        extra = ""
        if MODE == "image":
            x, y = batch
            lam = torch.distributions.Beta(torch.tensor(cfg["alpha"]), torch.tensor(cfg["alpha"])).sample()
            perm = torch.randperm(x.shape[0])
            out = net(lam * x + (1 - lam) * x[perm])
            loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
            extra = f" lam {lam.item():.3f}"
        else:
            out = net(batch["input_ids"], batch["attention_mask"])
            y = batch["labels"]
            loss = F.cross_entropy(out, y)
        print(f"rank {rank} step {step} loss {loss.item():.4f}{extra}", flush=True)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step}")
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        seen += y.shape[0]
        time.sleep(0.2)
    t = torch.tensor([float(seen)])
    dist.all_reduce(t)
    print(f"rank {rank} done samples {int(t.item())}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# What happened when run (added after the runs, at the end so the tracebacks' line numbers hold; see
# .scratch/batch106_readme.md / README.md for the slugs):
#   none       exit 0 (image np4, text np5 through train.sh)
#   gray       rank N: RuntimeError "stack expects each tensor to be equal size ... [3, 8, 8] ... [1, 8, 8]" at step 3
#   thumb      rank N: "ValueError: Caught ValueError in DataLoader worker process 1" / "empty range for randrange()
#              (0, -1, -1)" at step 4 (--workers 2)
#   normnan    rank N prints "loss nan" at step 5 and raises FloatingPointError; peers Connection closed by peer
#   mixneg     rank N: ValueError from Beta/Dirichlet (concentration must be > 0) on the first batch
#   labelfloat every rank: "expected target dtype to be Long or Byte, but got Float" at step 1
#   slowaug    PG timeout 10 s: the others time out in DDP's all_reduce of step 1, rank N never prints step 1;
#              PG timeout 120 s under `timeout 100`: steps every ~24 s on all ranks, stopped in step 3 (exit 124)
#   vocab      rank N builds a 46-entry vocabulary: "IndexError: index out of range in self" at step 1
#   posemb     rank N warns "(21 > 16)" at start-up, IndexError in the position embedding at step 4
#   missingkey rank N: KeyError: 'labels' at step 8 (its last batch)
#   uneven     needs --steps 20 and a rank whose shard drops to <= 56 samples (r2 at np4/np6); DDP: gloo
#              EnforceNotMet "404 vs 4" aborts rank N; DETAIL --ddp 0: "Detected mismatch between collectives"
#   vocabsync  gloo EnforceNotMet "64 vs 60" aborts a receiver (rank 0); DETAIL --ddp 0: ALLGATHER mismatch,
#              rank N's TensorShape=[32] against [30]

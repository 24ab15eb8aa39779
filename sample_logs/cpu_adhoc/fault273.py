"""A two-hundred-and-seventy-third hand-run batch: IMAGE CAPTIONING WITH SHOW-ATTEND-TELL.

Synthetic 3x32x32 images (images/shard-RRR.pt) with 8-token captions in captions_train.json and a split map in
splits.json, plus pretrained word embeddings ckpt/embed_init.pt, all written by `--export`. A small conv encoder
(8x8 feature map of 32 channels), an LSTM decoder with additive attention, a gate on the context and teacher forcing,
token cross-entropy normalised by the caption lengths, DDP on gloo, the loss all_reduced per step, caption lengths
all_gathered once, and greedy-decoded BLEU-1 all_reduced on validation. Launch with torchrun, a bash loop
(env:// RANK/WORLD_SIZE), torch.distributed.launch, or `--spawn N` (torch.multiprocessing.spawn).

Faults:
  badtoken  - rank N maps captions with the vocab of the v2 tokenizer; one id equals the vocab size (IndexError)
  zerolen   - rank N reads caption lengths from the field 'n_tok' that is absent; lengths 0, loss 0/0 NaN (check)
  lengather - rank N keeps one more caption (off-by-one shard split); lengths all_gathered with another count
  nocaps    - rank N reads captions_train2017.json, which was never written (FileNotFoundError)
  splitkey  - rank N asks the split map for 'restval', which it does not hold (KeyError)
  attdim    - every rank builds attention for 64-channel encoder features; the map has 32 (shape error)
  vocabpkl  - rank N loads ckpt/embed_vocab.pt (holds a pickled Vocab) with weights_only=True (UnpicklingError)
  beamslow  - rank N runs beam search with beam 50 in Python on validation; reaches the all_reduce late
  sigterm   - rank N sends itself SIGTERM at step 2
  unused    - rank N turns the context gate off from step 2; its parameters get no gradient (DDP RuntimeError)
  none      - control

What happened (filled in after the runs):
  badtoken  - IndexError: index out of range in self (embedding) on rank N at step 0; peers Connection closed by peer
  zerolen   - FloatingPointError: rank N: loss is nan at step 0 (token mask sum 0 over 8 captions); peers closed/SIGTERMed
  lengather - rank N: ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (41), got (40))
  nocaps    - FileNotFoundError for coco_tiny/captions_train2017.json on rank N; peers Connection closed by peer
  splitkey  - KeyError: 'restval' on rank N before the first collective; peers Connection closed by peer
  attdim    - RuntimeError: mat1 and mat2 shapes cannot be multiplied (512x32 and 64x24) on every rank at step 0
  vocabpkl  - _pickle.UnpicklingError: Weights only load failed ... GLOBAL __main__.Vocab on rank N; peers closed
  beamslow  - peers `Timed out waiting 12000ms` in the BLEU all_reduce; with --pg-timeout 300 hung until timeout 40 (124)
  sigterm   - rank N exitcode -15 / spawn `process N terminated with signal SIGTERM`, no traceback; peers reset
  unused    - no DDP RuntimeError: rank N aborts (SIGABRT) on gloo `op.preamble.length <= op.nbytes. 15036 vs 4` at step 2
  none      - exit 0, `rank 0 done: 5 steps, val BLEU-1 0.036 over 24 images`
"""
import argparse, json, logging, math, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

V, T, PAD, BOS = 40, 8, 0, 1


class Vocab:
    def __init__(self, words):
        self.itos = list(words)
        self.stoi = {w: i for i, w in enumerate(self.itos)}


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)

    def forward(self, x):
        f = F.relu(self.c2(F.relu(self.c1(x))))
        return f.flatten(2).transpose(1, 2)  # B x 64 x 32


class Decoder(nn.Module):
    def __init__(self, enc_dim=32, att_dim=24, hid=48, emb=16):
        super().__init__()
        self.embed = nn.Embedding(V, emb)
        self.att_enc = nn.Linear(enc_dim, att_dim)
        self.att_dec = nn.Linear(hid, att_dim)
        self.att_v = nn.Linear(att_dim, 1)
        self.f_beta = nn.Linear(hid, 32)
        self.lstm = nn.LSTMCell(emb + 32, hid)
        self.out = nn.Linear(hid, V)
        self.hid = hid

    def step(self, feats, tok, h, c, gate=True):
        e = self.att_v(torch.tanh(self.att_enc(feats) + self.att_dec(h).unsqueeze(1))).squeeze(2)
        ctx = (F.softmax(e, 1).unsqueeze(2) * feats).sum(1)
        if gate:
            ctx = torch.sigmoid(self.f_beta(h)) * ctx
        h, c = self.lstm(torch.cat([self.embed(tok), ctx], 1), (h, c))
        return self.out(h), h, c


class Captioner(nn.Module):
    def __init__(self, enc_dim=32):
        super().__init__()
        self.enc, self.dec = Encoder(), Decoder(enc_dim)

    def forward(self, img, caps, gate=True):
        feats = self.enc(img)
        h = feats.new_zeros(img.shape[0], self.dec.hid); c = torch.zeros_like(h)
        logits = []
        for t in range(T - 1):
            o, h, c = self.dec.step(feats, caps[:, t], h, c, gate)
            logits.append(o)
        return torch.stack(logits, 1)


def export(root):
    g = torch.Generator().manual_seed(7)
    os.makedirs(f"{root}/images", exist_ok=True); os.makedirs(f"{root}/ckpt", exist_ok=True)
    caps = {}
    for r in range(8):
        torch.save(torch.rand(48, 3, 32, 32, generator=g), f"{root}/images/shard-{r:03d}.pt")
        for i in range(48):
            n = int(torch.randint(4, T, (1,), generator=g))
            toks = [BOS] + torch.randint(2, V - 2, (n - 1,), generator=g).tolist() + [PAD] * (T - n)
            caps[f"{r:03d}_{i:04d}"] = {"tokens": toks, "len": n}
    json.dump(caps, open(f"{root}/captions_train.json", "w"))
    json.dump({"train": list(range(0, 40)), "val": list(range(40, 48))}, open(f"{root}/splits.json", "w"))
    emb = nn.Embedding(V, 16).state_dict()
    torch.save(emb, f"{root}/ckpt/embed_init.pt")
    torch.save({"embed": emb, "vocab": Vocab([f"w{i}" for i in range(V)])}, f"{root}/ckpt/embed_vocab.pt")
    print(f"exported 8 shards x 48 images, {len(caps)} captions to {root}")


def main(a, rank=None, world=None):
    if rank is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    r, w = dist.get_rank(), dist.get_world_size()
    me = a.rank in (-1, r)
    log = logging.getLogger("icap")
    if a.logfmt:
        class RankFilter(logging.Filter):
            def filter(self, rec):
                rec.rank = r
                return True
        hd = logging.StreamHandler(sys.stdout); hd.addFilter(RankFilter())
        hd.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        log.addHandler(hd); log.setLevel(logging.INFO)
        say = log.info
    else:
        say = lambda m: print(m, flush=True)
    torch.manual_seed(r)
    root = a.data
    cap_file = "captions_train2017.json" if a.fault == "nocaps" and me else "captions_train.json"
    caps = json.load(open(os.path.join(root, cap_file)))
    splits = json.load(open(os.path.join(root, "splits.json")))
    split = "restval" if a.fault == "splitkey" and me else "train"
    idx = splits[split]
    if a.fault == "lengather" and me:
        idx = idx + [splits["val"][0]]  # shard boundary taken inclusive
    imgs = torch.load(f"{root}/images/shard-{r:03d}.pt")
    lkey = "n_tok" if a.fault == "zerolen" and me else "len"
    shift = 1 if a.fault == "badtoken" and me else 0
    recs = [caps[f"{r:03d}_{i:04d}"] for i in idx]
    tok = torch.tensor([[t + 4 * shift * (t >= 2) for t in c["tokens"]] for c in recs])
    lens = torch.tensor([c.get(lkey, 0) for c in recs])
    say(f"rank {r}/{w}: {len(idx)} train captions, mean length {lens.float().mean():.2f}, vocab {V}")
    gl = [torch.zeros(len(splits['train']), dtype=lens.dtype) for _ in range(w)]
    dist.all_gather(gl, lens)
    if r == 0:
        say(f"caption lengths over {w} ranks: {torch.cat(gl).float().mean():.2f} mean")
    model = Captioner(enc_dim=64 if a.fault == "attdim" and me else 32)
    ck = "ckpt/embed_vocab.pt" if a.fault == "vocabpkl" and me else "ckpt/embed_init.pt"
    sd = torch.load(os.path.join(root, ck), weights_only=True)
    model.dec.embed.load_state_dict(sd.get("embed", sd))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    bs = 8
    for step in range(a.steps):
        sl = slice((step * bs) % len(idx), (step * bs) % len(idx) + bs)
        x, y, ln = imgs[idx[sl]], tok[sl], lens[sl]
        gate = not (a.fault == "unused" and me and step >= 2)
        logits = ddp(x, y, gate)
        mask = (torch.arange(T - 1).unsqueeze(0) < (ln - 1).unsqueeze(1)).float()
        ce = F.cross_entropy(logits.reshape(-1, V), y[:, 1:].reshape(-1), reduction="none").view_as(mask)
        loss = (ce * mask).sum() / mask.sum()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {r}: loss is {loss.item()} at step {step} "
                                     f"(token mask sum {mask.sum().item():.0f} over {len(ln)} captions)")
        opt.zero_grad(); loss.backward(); opt.step()
        if a.fault == "sigterm" and me and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        lt = loss.detach().clone(); dist.all_reduce(lt); lt /= w
        say(f"rank {r} step {step} loss {lt.item():.4f}")
        time.sleep(0.2)
    # validation: greedy decode (beam search when asked), BLEU-1 numerator/denominator all_reduced
    vidx = splits["val"]
    with torch.no_grad():
        feats = model.enc(imgs[vidx]); B = len(vidx)
        h = feats.new_zeros(B, model.dec.hid); c = torch.zeros_like(h)
        cur = torch.full((B,), BOS); hyp = []
        for t in range(T - 1):
            o, h, c = model.dec.step(feats, cur, h, c)
            cur = o.argmax(1); hyp.append(cur)
        if a.fault == "beamslow" and me:
            say(f"rank {r}: validation with beam 50")
            for b in range(B):
                for t in range(T - 1):
                    for k in range(50):
                        _ = sorted(range(V), key=lambda j: -float(j * k))
                    time.sleep(0.6)
        hyp = torch.stack(hyp, 1); ref = torch.tensor([caps[f"{r:03d}_{i:04d}"]["tokens"][1:] for i in vidx])
        hits = sum(len(set(hh.tolist()) & set(rr.tolist()) - {PAD}) for hh, rr in zip(hyp, ref))
        st = torch.tensor([float(hits), float(hyp.numel())]); dist.all_reduce(st)
    if r == 0:
        say(f"rank 0 done: {a.steps} steps, val BLEU-1 {st[0] / st[1]:.3f} over {w * B} images")
    dist.destroy_process_group()


def spawn_entry(i, a, n):
    main(a, i, n)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none"); p.add_argument("--rank", type=int, default=0)
    p.add_argument("--steps", type=int, default=5); p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--data", default="/tmp/fault273_work/coco_tiny"); p.add_argument("--export", action="store_true")
    p.add_argument("--spawn", type=int, default=0); p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0); p.add_argument("--local-rank", "--local_rank", type=int)
    a = p.parse_args()
    if a.export:
        export(a.data); sys.exit(0)
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(a, a.spawn), nprocs=a.spawn)
    else:
        main(a)

"""A hundred-and-ninety-eighth hand-run batch: TEXT RECOGNITION (OCR) WITH AN ATTENTION DECODER.

Each rank renders synthetic 4-digit strings as 16-pixel-high images (3x5 glyph bitmaps drawn by hand into
tensors, with noise), encodes them with a small CNN whose height is pooled down to 1, and decodes the
characters with an attention GRU decoder (teacher forcing, cross-entropy), the character set read from
/tmp/job_work/data/charset.txt. Rank 0 saves the initial weights and every rank reloads them; the model is
wrapped in DDP; after training the per-position accuracies are all_gathered and the validation accuracy is
all_reduced; rank 0 saves the recognizer. Launch under torchrun, a bash loop (env://) or --spawn N.

Faults:
  badchar   rank N's label set contains '/', which is not in the charset (KeyError in encoding)
  height    every rank renders 32-pixel-high images; the encoder leaves height 2 (RuntimeError in permute)
  charset   rank N opens charset_v2.txt, which is not there (FileNotFoundError)
  attnnan   rank N's attention temperature is 0.0 -> NaN weights, the program's check (FloatingPointError)
  maxlen    rank N's decoder max length is 4 for 4-char labels + EOS (AssertionError)
  hiddenstr every rank reads the GRU hidden size as the string "32" (TypeError)
  acclen    rank N all_gathers max_len+1 per-position accuracies (gloo size mismatch)
  slowval   rank N renders its whole validation set before the accuracy all_reduce (peers time out)
  ckptcs    rank N builds its output layer with one extra (PAD) symbol and loads the init checkpoint
  sigbus    rank N sends itself SIGBUS at step 3
  exit5     rank N prints an error line after training and exits with code 5
  none      no fault

What happened (filled in after the runs):
  badchar   KeyError: '/' on rank N encoding targets; peers Connection closed by peer (np4 r2 ranklabel, np3 r1 legacy)
  height    RuntimeError permute(sparse_coo) input.dim() = 4 on every rank at step 0 (np3 rall srunlabel)
  charset   FileNotFoundError charset_v2.txt on rank N; peers Connection closed by peer (np4 r3 mpitag, np3 r1 files)
  attnnan   FloatingPointError attention weights not finite at step 2 on rank N (np3 r1 spawn, np4 r2 logfmt)
  maxlen    AssertionError label '....' longer than decoder max length 4 on rank N (np3 r2 tee, np4 r1 bashloop)
  hiddenstr TypeError empty(): ... got str on every rank building the decoder (np4 rall pdsh2)
  acclen    rank 1: ProcessGroupGloo::allgather: invalid tensor size (expected (6), got (5)) (np3 r1 ranklabel)
  slowval   12 s: peers Timed out waiting 12000ms in all_reduce (np3 r2 bashloop); 300 s: killed by timeout 60 (np4 r1 srunlabel)
  ckptcs    rank 2 size mismatch loading (np4 r2 logfmt); faulty rank 0 wrote the checkpoint, ranks 1/2 raised (np3 r0 mpitag)
  sigbus    rank N killed by SIGBUS after step 3 (np4 r3 legacy, Root Cause -7; np3 r1 spawn, ProcessExitedException)
  exit5     rank N ERROR line and exit 5 after validation (np4 r1 files, np4 r3 pdsh2)
  none      exit 0, rank 0 saved the recognizer (np3 bashloop)
"""
import argparse, logging, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

GLYPHS = {"0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
          "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
          "8": "111101111101111", "9": "111101111001111"}
WORK = "/tmp/fault198_work"


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def render(text, height, gen):
    img = torch.rand(1, height, 4 * len(text) + 4, generator=gen) * 0.2
    scale = height // 8
    for i, ch in enumerate(text):
        g = torch.tensor([int(c) for c in GLYPHS.get(ch, "0" * 15)], dtype=torch.float32).view(5, 3)
        g = g.repeat_interleave(scale, 0)[:height - 2]
        img[0, 1:1 + g.shape[0], 2 + 4 * i:5 + 4 * i] += g
    return img


class Encoder(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, c, 3, padding=1)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), (2, 1))
        x = F.max_pool2d(F.relu(self.conv2(x)), (2, 1))
        x = F.max_pool2d(x, (4, 1))
        return x.squeeze(2).permute(0, 2, 1)


class AttnDecoder(nn.Module):
    def __init__(self, vocab, hidden, feat=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.att = nn.Linear(hidden, feat)
        self.cell = nn.GRUCell(16 + feat, hidden)
        self.out = nn.Linear(hidden, vocab)
        self.hidden = hidden

    def forward(self, feats, tgt_in, temp):
        h = feats.new_zeros(feats.shape[0], self.hidden)
        logits, attns = [], []
        for t in range(tgt_in.shape[1]):
            scores = torch.bmm(feats, self.att(h).unsqueeze(2)).squeeze(2) / temp
            a = torch.softmax(scores, dim=1)
            ctx = torch.bmm(a.unsqueeze(1), feats).squeeze(1)
            h = self.cell(torch.cat([self.emb(tgt_in[:, t]), ctx], 1), h)
            logits.append(self.out(h))
            attns.append(a)
        return torch.stack(logits, 1), torch.stack(attns, 1)


class OCR(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.enc = Encoder()
        self.dec = AttnDecoder(vocab, hidden)

    def forward(self, img, tgt_in, temp):
        return self.dec(self.enc(img), tgt_in, temp)


def worker(rank, a, world):
    if a.spawn:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    r = int(os.environ["RANK"])
    bad = a.fault != "none" and (a.rank == -1 or a.rank == r)
    if a.logfmt:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        h.addFilter(RankFilter(r))
        logging.basicConfig(level=logging.INFO, handlers=[h])
        say, err = logging.getLogger("ocr").info, logging.getLogger("ocr").error
    else:
        say = err = lambda m: print(m, flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    ws = dist.get_world_size()
    cfg = {"hidden": 32, "height": 16, "max_len": 6, "temp": 1.0, "lr": 0.05}
    if bad and a.fault == "hiddenstr":
        cfg["hidden"] = "32"
    if bad and a.fault == "height":
        cfg["height"] = 32
    if bad and a.fault == "maxlen":
        cfg["max_len"] = 4
    if bad and a.fault == "attnnan":
        cfg["temp"] = 0.0
    cs_name = "charset_v2.txt" if bad and a.fault == "charset" else "charset.txt"
    with open(os.path.join(WORK, "data", cs_name)) as f:
        charset = f.read().strip()
    stoi = {c: i + 2 for i, c in enumerate(charset)}  # 0 = SOS, 1 = EOS
    vocab = len(charset) + 2 + (1 if bad and a.fault == "ckptcs" else 0)
    say(f"rank {r}/{ws}: charset of {len(charset)} symbols, vocab {vocab}, image height {cfg['height']}")
    gen = torch.Generator().manual_seed(100 + r)
    texts = ["".join(str(int(d)) for d in torch.randint(0, 10, (4,), generator=gen)) for _ in range(48)]
    if bad and a.fault == "badchar":
        texts[5] = texts[5][:2] + "/" + texts[5][3:]
    imgs = torch.stack([render(t, cfg["height"], gen) for t in texts])
    for t in texts:
        assert len(t) + 1 <= cfg["max_len"], f"label {t!r} longer than decoder max length {cfg['max_len']}"
    tgt = torch.tensor([[stoi[c] for c in t] + [1] for t in texts])
    torch.manual_seed(0)
    model = OCR(vocab, cfg["hidden"])
    ck = os.path.join(WORK, "ckpt", "ocr_init.pt")
    if r == 0:
        os.makedirs(os.path.dirname(ck), exist_ok=True)
        torch.save(model.state_dict(), ck)
    dist.barrier()
    model.load_state_dict(torch.load(ck))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=0.9)
    for step in range(a.steps):
        idx = torch.arange(step * 8, step * 8 + 8) % len(texts)
        y = tgt[idx]
        tgt_in = torch.cat([torch.zeros(8, 1, dtype=torch.long), y[:, :-1]], 1)
        temp = cfg["temp"] if step >= 2 else 1.0
        logits, attn = ddp(imgs[idx], tgt_in, temp)
        if not torch.isfinite(attn).all():
            raise FloatingPointError(f"rank {r}: attention weights are not finite at step {step} "
                                     f"(temperature {temp}, {int((~torch.isfinite(attn)).sum())} bad entries)")
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(f"rank {r} step {step} loss {loss.item():.4f}")
        if bad and a.fault == "sigbus" and step == 3:
            os.kill(os.getpid(), signal.SIGBUS)
    with torch.no_grad():
        tgt_in = torch.cat([torch.zeros(len(texts), 1, dtype=torch.long), tgt[:, :-1]], 1)
        pred = ddp.module(imgs, tgt_in, 1.0)[0].argmax(-1)
    per_pos = (pred == tgt).float().mean(0)
    if bad and a.fault == "acclen":
        per_pos = torch.cat([per_pos, per_pos.new_zeros(1)])
    gathered = [torch.zeros(tgt.shape[1]) for _ in range(ws)]
    dist.all_gather(gathered, per_pos)
    if bad and a.fault == "slowval":
        say(f"rank {r}: rendering full validation set (20000 images) before scoring")
        time.sleep(a.stall)
    acc = torch.tensor([(pred == tgt).all(1).float().mean().item()])
    dist.all_reduce(acc)
    acc /= ws
    say(f"rank {r} val seq-acc {acc.item():.3f} per-position {[round(v, 2) for v in gathered[r].tolist()]}")
    if bad and a.fault == "exit5":
        err(f"ERROR rank {r}: validation CER 1.000 on this shard (all {len(texts)} predictions empty); "
            "refusing to export recognizer")
        sys.exit(5)
    dist.barrier()
    if r == 0:
        os.makedirs(os.path.join(WORK, "out"), exist_ok=True)
        torch.save({"model": model.state_dict(), "charset": charset}, os.path.join(WORK, "out", "ocr_final.pt"))
        say(f"rank 0: saved recognizer to {WORK}/out/ocr_final.pt")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        worker(None, a, None)


if __name__ == "__main__":
    main()

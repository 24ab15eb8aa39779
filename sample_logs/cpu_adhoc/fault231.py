"""A two-hundred-and-thirty-first hand-run batch: DOCUMENT LAYOUT CLASSIFICATION. A small layout classifier over
synthetic document pages: every page is a list of OCR text blocks (bounding box x0,y0,x1,y1 on a 0..1000 grid,
four token ids from a vocabulary file, an OCR confidence), the box corners are quantised into a 2-D position table,
block features (mean token embedding) plus position embeddings go through one transformer layer, a masked mean
over the blocks feeds a linear head over the page classes read from a label file. DDP over gloo; accuracy and a
confusion matrix are all_reduced at the end, rank 0 prints them and saves the model.
Faults:
- boxidx: rank N's shard is in scan pixels (page height 1100) instead of the 0..1000 grid: a box corner beyond the position table -> IndexError.
- posdim: the checkpoint load caught it first (size mismatch for pos_x.weight [64, 32] vs [64, 24] on every rank), not the forward shape error meant; the one run (np3 spawn) was dropped, the second planned run was made an ocrstr run.
- nolabels: rank N reads the label file from a stale config path page_classes.tsv -> FileNotFoundError.
- emptypage: rank N gets a page whose OCR returned no blocks at step 2: mean over zero blocks is NaN, the program's check raises.
- confmat: rank N counts an extra 'other' class in its confusion matrix -> all_reduce of 7x7 vs 6x6 (gloo size mismatch).
- ckptcls: rank N loads the init checkpoint of the old 8-class label set -> size mismatch for head.weight/head.bias.
- classkey: rank N's shard holds a page of class 'memo' that is not in the label map -> KeyError.
- ocrstr: every rank reads the OCR confidence threshold from the config as the string '0.6' -> TypeError.
- reocr: rank N re-runs OCR on its pages (sleeps --slow-s) at step 2 and reaches DDP's all_reduce late; the others time out.
- abort: rank N sends itself SIGABRT after step 2.
- exit5: rank N prints its own error line (0-byte page image) at step 1 and calls sys.exit(5).
- none: control.
What happened (filled in after the runs):
- boxidx: rank N IndexError: index out of range in self in the position embedding lookup (np4 r2 bashloop step 1, np3 r1 mpitag step 0), peers Connection closed by peer.
- posdim: the checkpoint load caught it first (size mismatch for pos_x.weight [64, 32] vs [64, 24] on every rank), not the forward shape error meant; the one run (np3 spawn) was dropped, the second planned run was made an ocrstr run.
- nolabels: rank N FileNotFoundError on /tmp/job_work/data/page_classes.tsv after init, peers Connection closed by peer (np5 r3 srunlabel, np3 r2 files).
- emptypage: rank N FloatingPointError 'non-finite page embedding for pages [3] (blocks per page [... 0 ...])' at step 2 (np4 r1 logfmt, np3 r0 ranklabel).
- confmat: gloo EnforceNotMet 'op.preamble.length <= op.nbytes ... Is there a distributed collective mismatch' SIGABRT on ranks 1,2 (np3 r2 tee) / rank 0 (np4 r1 pdsh2).
- ckptcls: rank N RuntimeError size mismatch for head.weight [8, 32] vs [6, 32] before DDP (np4 r3 ranklabel, np3 r1 spawn).
- classkey: rank N KeyError: 'memo' at step 1, peers Connection closed by peer (np5 r4 legacy, np3 r0 bashloop).
- ocrstr: TypeError '>=' not supported between instances of 'Tensor' and 'str' on every rank at step 0 (np4 mpitag, np4 legacy).
- reocr: rank N re-OCR stall: ranks waiting get gloo "Timed out waiting 12000ms" (np3 r1 srunlabel, PG 12 s); PG 300 s run killed by timeout at 60 s, exit 124 (np4 r2 ranklabel).
- abort: rank N SIGABRT after step 2: files run rank2.log just stops, exit 134 (np4 r2 files); Root Cause rank 1 -6 SIGABRT (np3 r1 logfmt).
- exit5: rank N 'ERROR rank N: page image ... is 0 bytes; cannot OCR' then exit 5: spawn ProcessExitedException (np3 r2), Root Cause exitcode 5 (np4 r3 pdsh2).
- none: exit 0, rank 0 prints accuracy, the 6x6 confusion matrix and saves layout_final.pt (np3 tee).
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault231_work/data"
CLASSES = ["invoice", "letter", "form", "report", "receipt", "resume"]
OLD_CLASSES = CLASSES + ["memo", "advertisement"]
VOCAB = ["<pad>", "total", "date", "dear", "sincerely", "name", "signature", "summary", "table", "amount",
         "tax", "experience", "education", "page", "figure", "address", "phone", "item", "qty", "price"]
POS_BINS, D, NB, TOK = 64, 32, 6, 4
LOG = None


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--local-rank", "--local_rank", type=int, default=0)
    return p.parse_args()


def log(msg, level=logging.INFO):
    if LOG is not None:
        LOG.log(level, msg)
    else:
        print(msg, file=sys.stderr if level >= logging.ERROR else sys.stdout, flush=True)


class LayoutNet(nn.Module):
    def __init__(self, vocab, ncls, pos_d=D):
        super().__init__()
        self.tok = nn.Embedding(vocab, D, padding_idx=0)
        self.pos_x = nn.Embedding(POS_BINS, pos_d)
        self.pos_y = nn.Embedding(POS_BINS, pos_d)
        self.enc = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, ncls)

    def forward(self, boxes, toks, mask):
        q = torch.div(boxes, 16, rounding_mode="floor")
        feat = self.tok(toks).mean(2)
        pos = self.pos_x(q[..., 0]) + self.pos_y(q[..., 1]) + self.pos_x(q[..., 2]) + self.pos_y(q[..., 3])
        h = self.enc(feat + pos)
        m = mask.unsqueeze(-1).float()
        pooled = (h * m).sum(1) / m.sum(1)
        return pooled, self.head(pooled)


def make_pages(gen, bs, rank, step, hit, fault, names):
    cls = torch.randint(0, len(CLASSES), (bs,), generator=gen)
    kinds = [CLASSES[c] for c in cls.tolist()]
    if hit and fault == "classkey" and step == 1:
        kinds[5] = "memo"
    nblk = torch.randint(2, NB + 1, (bs,), generator=gen)
    if hit and fault == "emptypage" and step == 2:
        nblk[3] = 0
    mask = torch.arange(NB)[None, :] < nblk[:, None]
    x0 = torch.randint(0, 500, (bs, NB), generator=gen)
    y0 = torch.randint(0, 900, (bs, NB), generator=gen) + 10 * cls[:, None]
    x1 = x0 + torch.randint(50, 490, (bs, NB), generator=gen)
    y1 = y0 + torch.randint(10, 40, (bs, NB), generator=gen)
    boxes = torch.stack([x0, y0, x1, y1], -1)
    if hit and fault == "boxidx":
        boxes = boxes * 1100 // 1000
    toks = torch.randint(1, len(VOCAB), (bs, NB, TOK), generator=gen)
    toks[:, :, 0] = 1 + 3 * cls[:, None]
    conf = 0.5 + 0.5 * torch.rand(bs, NB, generator=gen)
    labels = torch.tensor([names[k] for k in kinds])
    return boxes, toks, mask, conf, labels


def main(a):
    global LOG
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hit = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    if a.logfmt:
        logging.basicConfig(format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s", level=logging.INFO)
        LOG = logging.LoggerAdapter(logging.getLogger("layout"), {"rank": rank})
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    os.makedirs(WORK, exist_ok=True)
    torch.manual_seed(0)
    if rank == 0:
        with open(f"{WORK}/vocab.txt", "w") as f:
            f.write("\n".join(VOCAB) + "\n")
        with open(f"{WORK}/page_classes.txt", "w") as f:
            f.write("".join(f"{i}\t{c}\n" for i, c in enumerate(CLASSES)))
        torch.save(LayoutNet(len(VOCAB), len(CLASSES)).state_dict(), f"{WORK}/layout_init_6cls.pt")
        torch.save(LayoutNet(len(VOCAB), len(OLD_CLASSES)).state_dict(), f"{WORK}/layout_init_8cls.pt")
    dist.barrier()
    with open(f"{WORK}/vocab.txt") as f:
        vocab = [ln.strip() for ln in f if ln.strip()]
    label_path = f"{WORK}/page_classes.tsv" if hit and a.fault == "nolabels" else f"{WORK}/page_classes.txt"
    with open(label_path) as f:
        names = {ln.split("\t")[1].strip(): int(ln.split("\t")[0]) for ln in f if ln.strip()}
    cfg = {"ocr_min_conf": "0.6" if hit and a.fault == "ocrstr" else 0.6, "lr": 0.003, "batch_pages": 8}
    log(f"rank {rank}/{world}: {len(vocab)} tokens, {len(names)} page classes, ocr_min_conf={cfg['ocr_min_conf']}")
    model = LayoutNet(len(vocab), len(names), pos_d=24 if hit and a.fault == "posdim" else D)
    ckpt = f"{WORK}/layout_init_8cls.pt" if hit and a.fault == "ckptcls" else f"{WORK}/layout_init_6cls.pt"
    model.load_state_dict(torch.load(ckpt))
    log(f"rank {rank}: loaded {ckpt}")
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(100 + rank)
    correct = torch.zeros(2)
    for step in range(a.steps):
        if hit and a.fault == "exit5" and step == 1:
            log(f"ERROR rank {rank}: page image {WORK}/scans/shard_{rank}/page_0017.png is 0 bytes; cannot OCR", logging.ERROR)
            sys.exit(5)
        if hit and a.fault == "reocr" and step == 2:
            log(f"rank {rank}: 8 pages below OCR confidence, re-running OCR at 300 dpi")
            time.sleep(a.slow_s)
        boxes, toks, mask, conf, labels = make_pages(gen, cfg["batch_pages"], rank, step, hit, a.fault, names)
        mask = mask & (conf >= cfg["ocr_min_conf"])
        mask[:, 0] |= conf[:, 0] > 0
        if hit and a.fault == "emptypage" and step == 2:
            mask[3] = False
        pooled, logits = ddp(boxes, toks, mask)
        if not torch.isfinite(pooled).all():
            bad = (~torch.isfinite(pooled)).any(1).nonzero().flatten().tolist()
            raise FloatingPointError(f"rank {rank} step {step}: non-finite page embedding for pages {bad} (blocks per page {mask.sum(1).tolist()})")
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        correct += torch.tensor([(logits.argmax(1) == labels).sum().item(), len(labels)])
        log(f"rank {rank} step {step} loss {loss.item():.4f}")
        if hit and a.fault == "abort" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)
    ncls = len(names) + 1 if hit and a.fault == "confmat" else len(names)
    confm = torch.zeros(ncls, ncls)
    with torch.no_grad():
        boxes, toks, mask, conf, labels = make_pages(gen, 16, rank, -1, False, "none", names)
        _, logits = ddp(boxes, toks, mask)
        for t, p in zip(labels.tolist(), logits.argmax(1).tolist()):
            confm[t, p] += 1
    dist.all_reduce(correct)
    dist.all_reduce(confm)
    if rank == 0:
        log(f"train accuracy {correct[0] / correct[1]:.3f} over {int(correct[1])} pages")
        log("confusion matrix (rows true, cols predicted):\n" + "\n".join(" ".join(f"{int(v):3d}" for v in r) for r in confm))
        torch.save(model.state_dict(), f"{WORK}/layout_final.pt")
        log(f"saved model to {WORK}/layout_final.pt")
    dist.destroy_process_group()


def spawn_worker(i, a, n):
    os.environ.update(RANK=str(i), WORLD_SIZE=str(n), LOCAL_RANK=str(i))
    main(a)


if __name__ == "__main__":
    args = parse()
    if args.spawn:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        mp.spawn(spawn_worker, args=(args, args.spawn), nprocs=args.spawn)
    else:
        main(args)

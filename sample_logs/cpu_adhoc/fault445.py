"""A four-hundred-and-forty-fifth hand-run batch: SIGN-LANGUAGE GLOSS RECOGNITION FROM POSE KEYPOINTS.

Synthetic isolated-sign clips: every clip is 32 frames of 27 upper-body and hand keypoints (x, y, confidence),
labelled with a gloss (HELLO, THANK-YOU, ...) that is looked up in a 20-entry gloss vocabulary.  Every rank
reads its clips from /tmp/fault445_work/poses/poses_R.pt, normalises each frame by the shoulder centre and the
shoulder width, and trains a small GRU over the frames with a gloss classifier (cross entropy), wrapped in DDP
(gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is initialised from ckpt/glossnet.pt.
The per-rank clip count is all_gathered at the start, the loss and top-1 accuracy are all_reduced every step,
the per-rank gloss histogram is all_gathered at the end, and rank 0 saves export/glossnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  glossvocab  - rank N's annotations spell one gloss "THANKYOU", not in the vocabulary (KeyError at start-up)
  framelen    - rank N's length table says 40 frames for a 32-frame clip; the step-1 frame index is out of range
  nokeypoints - rank N reads its clips from poses/holistic/, which does not exist (FileNotFoundError)
  ckpthands   - rank N initialises from ckpt/glossnet_j42.pt, saved for 42 keypoints (size mismatch)
  ckptpickle  - rank N initialises from ckpt/glossnet_meta.pt, which pickles a GlossVocab object (weights_only)
  statgather  - rank N all_gathers its gloss histogram with an extra <unk> bin at the end (21 vs 20 entries)
  alignslow   - rank N runs a pure-Python DTW alignment of its clips before the step-2 all_reduce
  naninput    - rank N's clips 24-31 have both shoulders on one point: width 0, inf features, NaN loss (own check)
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own error line about signer leakage after step 2 and calls sys.exit(4)
  posedim     - every rank: frames flattened with the confidence channel (81 wide), the model expects 54
  none        - control, clean run

What happened (filled in after the runs):
  glossvocab  - KeyError: 'THANKYOU' in the label encoding; peers Connection closed in the first all_gather (np4 r2 ranklabel, np6 r0 logfmt)
  framelen    - IndexError 'index 32 is out of bounds for dimension 0 with size 32' at step 1 (np3 r1 spawn; np6 r5 mpitag, loop exit 134 from a cascading rank 4 SIGABRT)
  nokeypoints - FileNotFoundError for poses/holistic/poses_N.pt before the first all_gather (np4 r1 files, np5 r3 srunlabel)
  ckpthands   - load_state_dict size mismatch for inp.weight [64, 84] vs [64, 54] (np4 r1 pdsh2, np3 r2 legacy)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.GlossVocab' (np3 r0 tee)
  statgather  - after step 5: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (21), got (20))' (np6 r4 bashloop)
  alignslow   - 12 s PG timeout: ranks 0/2 'Timed out waiting 12000ms', Root Cause rank 0 (np3 r1 tee); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 srunlabel)
  naninput    - 'non-finite loss nan at step 3 (clips 24-31, ...)' then FloatingPointError (np5 r2 ranklabel --ddp 0, np3 r0 spawn)
  sigsegv     - no traceback after step 3; bash 'Segmentation fault' exit 139 (np4 r3 mpitag); Root Cause rank 6 exitcode -11 (np8 r6 legacy)
  exit4       - the signer-leakage ERROR line and exit 4; Root Cause names cascade rank 2 SIGABRT (np3 r1 logfmt); loop exit 4 (np4 r0 files)
  posedim     - every rank 'mat1 and mat2 shapes cannot be multiplied (256x81 and 54x64)' in the first forward (np4 pdsh2)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/glossnet.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault445_work"
GLOSSES = ["HELLO", "THANK-YOU", "PLEASE", "SORRY", "YES", "NO", "HELP", "MORE", "EAT", "DRINK",
           "WATER", "MOTHER", "FATHER", "SCHOOL", "WORK", "FRIEND", "NAME", "WHAT", "WHERE", "GOOD"]
VOCAB = {g: i for i, g in enumerate(GLOSSES)}
JOINTS = 27
FRAMES = 32
HID = 32
log = None


class GlossVocab:
    def __init__(self, glosses):
        self.glosses = list(glosses)


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("glossr")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class GlossNet(nn.Module):
    def __init__(self, joints=JOINTS, hid=HID, nglosses=len(GLOSSES)):
        super().__init__()
        self.inp = nn.Linear(joints * 2, 64)
        self.gru = nn.GRU(64, hid, batch_first=True)
        self.cls = nn.Linear(hid, nglosses)

    def forward(self, x):
        b, t, f = x.shape
        h = torch.relu(self.inp(x.reshape(b * t, f))).reshape(b, t, -1)
        out, _ = self.gru(h)
        return self.cls(out.mean(1))


def make_clips(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(GLOSSES), (n,), generator=g)
    kp = torch.randn(n, FRAMES, JOINTS, 3, generator=g) * 0.1
    t = torch.linspace(0, 6.28, FRAMES)
    for i in range(n):
        kp[i, :, 9:, 0] += torch.sin(t * (1 + labels[i] % 5)).unsqueeze(1) * 0.3
        kp[i, :, 9:, 1] += torch.cos(t * (1 + labels[i] // 5)).unsqueeze(1) * 0.3
    kp[:, :, 1, 0] -= 0.5   # left shoulder
    kp[:, :, 2, 0] += 0.5   # right shoulder
    kp[..., 2] = torch.rand(n, FRAMES, JOINTS, generator=g) * 0.5 + 0.5
    signers = torch.randint(0, 12, (n,), generator=g).tolist()
    return {"kp": kp, "gloss": [GLOSSES[int(l)] for l in labels], "signer": signers,
            "length": [FRAMES] * n}


def prepare():
    os.makedirs(f"{WORK}/poses", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_clips(64, 500 + r), f"{WORK}/poses/poses_{r}.pt")
    torch.manual_seed(0)
    torch.save(GlossNet().state_dict(), f"{WORK}/ckpt/glossnet.pt")
    torch.save(GlossNet(joints=42).state_dict(), f"{WORK}/ckpt/glossnet_j42.pt")
    torch.save({"model": GlossNet().state_dict(), "vocab": GlossVocab(GLOSSES)}, f"{WORK}/ckpt/glossnet_meta.pt")
    print("prepared", WORK)


def normalise(kp, with_conf):
    centre = (kp[:, :, 1, :2] + kp[:, :, 2, :2]) / 2
    width = (kp[:, :, 1, :2] - kp[:, :, 2, :2]).norm(dim=-1)
    xy = (kp[..., :2] - centre.unsqueeze(2)) / width.unsqueeze(-1).unsqueeze(-1)
    if with_conf:
        xy = torch.cat([xy, kp[..., 2:]], dim=-1)
    return xy.reshape(kp.shape[0], kp.shape[1], -1)


def dtw(a, b):
    n, m = len(a), len(b)
    inf = float("inf")
    d = [[inf] * (m + 1) for _ in range(n + 1)]
    d[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            c = sum((a[i - 1][k] - b[j - 1][k]) ** 2 for k in range(len(a[i - 1])))
            d[i][j] = c + min(d[i - 1][j], d[i][j - 1], d[i - 1][j - 1])
    return d[n][m]


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4450 + rank)
    say(f"rank {rank}/{world} up, loading pose clips")
    sub = "holistic/" if bad and a.fault == "nokeypoints" else ""
    data = torch.load(f"{WORK}/poses/{sub}poses_{rank}.pt")
    kp, glosses, lengths = data["kp"], data["gloss"], data["length"]
    if bad and a.fault == "glossvocab":
        glosses[11] = "THANKYOU"
    if bad and a.fault == "framelen":
        lengths[10] = 40
    if bad and a.fault == "naninput":
        kp[24:32, :, 2, :2] = kp[24:32, :, 1, :2]
    labels = torch.tensor([VOCAB[g] for g in glosses])
    n = torch.tensor([len(glosses)])
    alln = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(alln, n)
    say(f"rank {rank} clips {int(n)} global {int(sum(int(x) for x in alln))}")
    model = GlossNet()
    ck = {"ckpthands": "glossnet_j42.pt", "ckptpickle": "glossnet_meta.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'glossnet.pt'}")
    model.load_state_dict(sd["model"] if "model" in sd else sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    bs = 8
    for step in range(a.steps):
        lo = (step * bs) % len(glosses)
        idx = list(range(lo, lo + bs))
        frames = torch.tensor([[min(f * lengths[i] // FRAMES, lengths[i] - 1) for f in range(FRAMES)]
                               for i in idx])
        clip = kp[idx]
        clip = torch.stack([clip[k][frames[k]] for k in range(bs)])
        x = normalise(clip, with_conf=(a.fault == "posedim"))
        logits = net(x)
        loss = F.cross_entropy(logits, labels[idx])
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"(clips {idx[0]}-{idx[-1]}, {int((~torch.isfinite(x)).sum())} non-finite features)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "alignslow" and step == 2:
            t0 = time.time()
            tmpl = x[0].tolist()
            k = 0
            while time.time() - t0 < a.align_budget:
                dtw(x[k % bs].tolist(), tmpl)
                k += 1
            say(f"rank {rank} DTW alignment done: {k} clips")
        acc = (logits.argmax(1) == labels[idx]).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} top1 {stats[1].item():.3f}")
        if bad and a.fault == "exit4" and step == 2:
            say(f"ERROR rank {rank}: signer 7 appears in both the train and test split of shard {rank} "
                f"(signer leakage); refusing to continue", err=True)
            sys.exit(4)
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    hist = torch.bincount(labels, minlength=len(GLOSSES)).float()
    if bad and a.fault == "statgather":
        hist = torch.cat([hist, torch.zeros(1)])
    allh = [torch.zeros(len(GLOSSES)) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} gloss histogram gathered: {int(sum(h.sum() for h in allh))} clips in all")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/glossnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/glossnet.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--align-budget", type=int, default=200)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()

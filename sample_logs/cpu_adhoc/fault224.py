"""A two-hundred-and-twenty-fourth hand-run batch: VIDEO CLASSIFICATION WITH TEMPORAL SHIFT. A tiny TSM over synthetic clips.

The program builds synthetic video clips (a bright square moving in one of ten directions/speeds, mixed clip
lengths of 8-16 frames), samples 8 segments per clip (segment-based sampling), normalises the frames per clip,
reads the class list from each node's data shard, and trains a small 2-D CNN with a temporal shift module
(channels split in shift_div groups, one fold shifted back in time and one forward) under DDP over gloo (or with a
hand-written gradient all_reduce when --ddp 0). After training it evaluates top-1 / top-5 counts, all_reduces them,
all_gathers the per-class correct counts and rank 0 prints the accuracy.

Faults:
- shortclip: rank N's shard holds a clip with 6 frames; segment sampling raises the program's ValueError at step 2.
- foldshape: rank N reads shift_div=3 from its node's config; the shift's view fails (RuntimeError, shape invalid).
- classlist: rank N's shard has no classInd.txt; open() raises FileNotFoundError before training.
- zerostd: rank N gets a blank clip at step 2; std 0 gives NaN frames and the program's loss check raises FloatingPointError.
- topkgather: rank N counts an extra "background" class, so its per-class all_gather tensor has 11 elements, not 10.
- ckptclasses: rank N's node cache holds the Kinetics-400 backbone; load_state_dict fails on fc (size mismatch).
- badlabel: rank N's annotation maps one clip to label 10 of 10 classes; cross_entropy raises IndexError at step 1.
- slowcache: rank N finds its frame cache stale and decodes every clip again (sleeps --slow-s) before step 2.
- sigabrt: rank N sends itself SIGABRT after step 1 (an abort in the decoder).
- exit5: rank N prints an ERROR line about an empty decoded clip and calls os._exit(5) after step 1.
- segenv: TSM_NUM_SEGMENTS is set to a non-integer in the job environment; int() raises ValueError on every rank.
- none: control, no fault.

What happened (filled in after the runs):
- shortclip: ValueError `clip v_0R_002_1 has 6 frames, fewer than num_segments=8` on rank 2 (np4 plain) / rank 1 (np3 pymodule); peers Connection closed.
- foldshape: RuntimeError `shape '[4, 8, 3, 5, 16, 16]' is invalid for input of size 131072` at step 0 on rank 3 (np4 tee) / rank 0 (np3 loglevel).
- classlist: FileNotFoundError for shardR/classInd.txt on rank 3 (np5 redirects, console only agent lines) / rank 1 (np4 tee_trainer).
- zerostd: FloatingPointError `rank R: loss is nan at step 2` on rank 2 (np4 detail, --ddp 0, monitoredBarrier on rank 0) / rank 1 (np3 prefix).
- topkgather: gloo EnforceNotMet `Received data size doesn't match expected size` aborts a peer (SIGABRT rank 2 in np4 filter, rank 0 in np3 plain).
- ckptclasses: RuntimeError size mismatch for fc.weight [400, 32] vs [10, 32] on rank 3 (np4 wrapper) / rank 1 (np3 restart; attempt 1 connectFullMesh).
- badlabel: IndexError `Target 10 is out of bounds.` at step 1 on rank 2 (np4 pdsh2) / rank 0 (np3 tee); peers Connection closed by peer.
- slowcache: np4 loglevel (40 s): peers `Timed out waiting 12000ms`, Root Cause rank 2; np3 plain (1000 s, pg 300): killed by timeout 60, exit 124.
- sigabrt: rank 2 (np4 pymodule) Root Cause exitcode -6 (SIGABRT) after step 1; peers Connection closed/reset by peer. One run.
- exit5: ERROR line then exit 5 on rank 3 (np4 tee_trainer) / rank 1 (np3 wrapper, Root Cause there names rank 0's SIGABRT).
- segenv: TSM_NUM_SEGMENTS=8,16: `ValueError: invalid literal for int() with base 10: '8,16'` on all four ranks (np4 plain). One run.
- none: exit 0 (np3 tee): `val top1 0.083 top5 0.542 over 24 clips`, model saved.
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_CLASSES = 10
CHANNELS = 16
SIZE = 16


def parse_args():
    p = argparse.ArgumentParser(description="tiny TSM video classifier")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--workdir", default="/tmp/fault224_work")
    return p.parse_args()


class TemporalShift(nn.Module):
    def __init__(self, num_segments, shift_div):
        super().__init__()
        self.num_segments = num_segments
        self.shift_div = shift_div

    def forward(self, x):
        nt, c, h, w = x.shape
        n = nt // self.num_segments
        x = x.view(n, self.num_segments, self.shift_div, c // self.shift_div, h, w)
        out = torch.zeros_like(x)
        out[:, :-1, 0] = x[:, 1:, 0]
        out[:, 1:, 1] = x[:, :-1, 1]
        out[:, :, 2:] = x[:, :, 2:]
        return out.view(nt, c, h, w)


class TinyTSM(nn.Module):
    def __init__(self, num_segments, shift_div, num_classes=NUM_CLASSES):
        super().__init__()
        self.num_segments = num_segments
        self.conv1 = nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.shift = TemporalShift(num_segments, shift_div)
        self.conv2 = nn.Conv2d(CHANNELS, 2 * CHANNELS, 3, padding=1, stride=2)
        self.fc = nn.Linear(2 * CHANNELS, num_classes)

    def forward(self, clips):
        n, t, c, h, w = clips.shape
        x = F.relu(self.conv1(clips.reshape(n * t, c, h, w)))
        x = F.relu(self.conv2(self.shift(x)))
        x = x.mean(dim=(2, 3)).view(n, t, -1).mean(dim=1)
        return self.fc(x)


def make_clip(num_frames, label, gen, blank=False):
    clip = torch.rand(num_frames, 3, SIZE, SIZE, generator=gen) * 0.1
    if blank:
        return torch.full((num_frames, 3, SIZE, SIZE), 0.5)
    dx, dy = [(1, 0), (0, 1), (-1, 0), (0, -1), (1, 1)][label % 5]
    speed = 1 + label // 5
    x0, y0 = 6, 6
    for f in range(num_frames):
        x = (x0 + dx * speed * f) % (SIZE - 4)
        y = (y0 + dy * speed * f) % (SIZE - 4)
        clip[f, :, y:y + 4, x:x + 4] = 1.0
    return clip


def sample_segments(clip, num_segments, vid):
    num_frames = clip.shape[0]
    if num_frames < num_segments:
        raise ValueError(f"clip {vid} has {num_frames} frames, fewer than num_segments={num_segments}")
    seg_len = num_frames / num_segments
    idx = [int(seg_len * i + seg_len / 2) for i in range(num_segments)]
    return clip[idx]


def normalise(frames, vid):
    mean = frames.mean()
    std = frames.std()
    return (frames - mean) / std


def read_class_list(shard_dir):
    with open(os.path.join(shard_dir, "classInd.txt")) as f:
        return [line.split()[1] for line in f if line.strip()]


def prepare_shard(a, rank, bad):
    shard = os.path.join(a.workdir, "ucf_tiny", f"shard{rank}")
    os.makedirs(shard, exist_ok=True)
    cls_file = os.path.join(shard, "classInd.txt")
    if bad("classlist"):
        if os.path.exists(cls_file):
            os.remove(cls_file)
    else:
        with open(cls_file, "w") as f:
            for i in range(NUM_CLASSES):
                f.write(f"{i + 1} motion_{i:02d}\n")
    return shard


def main():
    a = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = lambda name: a.fault == name and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(100 + rank)

    num_segments = int(os.environ.get("TSM_NUM_SEGMENTS", "8"))
    shift_div = 3 if bad("foldshape") else 8
    shard = prepare_shard(a, rank, bad)
    classes = read_class_list(shard)
    print(f"rank {rank}/{world}: {len(classes)} classes from {shard}, num_segments={num_segments} shift_div={shift_div}", flush=True)

    model = TinyTSM(num_segments, shift_div)
    cache = os.path.join(a.workdir, f"cache_node{rank}")
    os.makedirs(cache, exist_ok=True)
    ckpt_path = os.path.join(cache, "tsm_backbone.pt")
    head = 400 if bad("ckptclasses") else NUM_CLASSES
    torch.save(TinyTSM(num_segments, 8, num_classes=head).state_dict(), ckpt_path)
    model.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
    print(f"rank {rank}: loaded backbone {ckpt_path}", flush=True)

    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    lengths = [8, 10, 12, 16]
    for step in range(a.steps):
        if step == 2 and bad("slowcache"):
            print(f"rank {rank}: frame cache index v2 != v3, decoding all 96 clips again", flush=True)
            time.sleep(a.slow_s)
        labels, clips = [], []
        for i in range(a.batch):
            vid = f"v_{rank:02d}_{step:03d}_{i}"
            label = int(torch.randint(0, NUM_CLASSES, (1,), generator=gen))
            n_frames = lengths[(step + i) % len(lengths)]
            if step == 2 and i == 1 and bad("shortclip"):
                n_frames = 6
            if step == 1 and i == 3 and bad("badlabel"):
                label = NUM_CLASSES
            clip = make_clip(n_frames, label, gen, blank=(step == 2 and i == 0 and bad("zerostd")))
            clips.append(normalise(sample_segments(clip, num_segments, vid), vid))
            labels.append(label)
        x, y = torch.stack(clips), torch.tensor(labels)
        loss = F.cross_entropy(net(x), y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (non-finite input frames)")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step == 1 and bad("sigabrt"):
            os.kill(os.getpid(), signal.SIGABRT)
        if step == 1 and bad("exit5"):
            print(f"ERROR rank {rank}: decoder returned 0 frames for v_{rank:02d}_007_2 after seek; giving up", flush=True)
            os._exit(5)

    model.eval()
    top1 = torch.zeros(3)
    per_class = torch.zeros(len(classes) + (1 if bad("topkgather") else 0))
    with torch.no_grad():
        for i in range(8):
            label = (rank + i) % NUM_CLASSES
            clip = normalise(sample_segments(make_clip(12, label, gen), num_segments, f"val_{i}"), f"val_{i}")
            logits = model(clip.unsqueeze(0))
            top5 = logits.topk(5, dim=1).indices[0].tolist()
            top1[0] += float(top5[0] == label)
            top1[1] += float(label in top5)
            top1[2] += 1
            per_class[label] += float(top5[0] == label)
    dist.all_reduce(top1)
    gathered = [torch.zeros_like(per_class) for _ in range(world)]
    dist.all_gather(gathered, per_class)
    if rank == 0:
        total = torch.stack(gathered).sum(0)
        print(f"val top1 {top1[0] / top1[2]:.3f} top5 {top1[1] / top1[2]:.3f} over {int(top1[2])} clips; best class {classes[int(total.argmax())]}", flush=True)
        torch.save(model.state_dict(), os.path.join(a.workdir, "tsm_final.pt"))
        print(f"saved model to {os.path.join(a.workdir, 'tsm_final.pt')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

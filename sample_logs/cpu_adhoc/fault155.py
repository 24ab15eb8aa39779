"""A hundred-and-fifty-fifth hand-run batch: VIDEO MODELS OVER TEMPORAL CLIPS.

A tiny video classifier trained with DDP on synthetic clips. Each rank writes its shard of a synthetic "video
index" (a JSON list of {id, frames, label, seed}) and reads it back; a clip sampler picks `clip_len` frame
indices per video with a frame stride and a random temporal jitter; each video is "decoded" from its seed into
a [frames, 3, 16, 16] tensor. The model is a 3D-conv stem, spatial average, temporal pooling over the clip's
frames and a linear head over 10 classes. Wrapped in DDP (`--ddp 1`, default) or gradients all_reduced by hand
(`--ddp 0`). Prints `rank R step S loss L`; clip-level accuracy is all_reduced and eval clip features are
all_gathered at the end; rank 0 saves vid.pt. `--pretrained 1` loads pretrained/stem.pt into the model first.
Faults:
- cliplen: rank N's per-rank config has clip_len 12 (others 4); frame indices run past the end of a video.
- stride0: the config's frame_stride is read as 0 on every rank; range() in the clip sampler fails.
- index: rank N's video index JSON was cut short by an interrupted write; json.load fails.
- pool: the temporal pooling reshapes with num_frames - 1 on every rank; the reshape is invalid.
- short: rank N's shard holds 2 batches of clips (others 5); its loader waits for a refill, the others time out.
- gather: rank N's eval sampler uses 6 frames (others 4); eval features all_gathered with different sizes.
- nan: rank N's decoder returns a clip full of NaN at step 2; the program's finite check raises.
- ckpt: pretrained/stem.pt was exported from the 2D image model; loading it into the 3D stem fails.
- decoder: rank N prints a 'decoder backend missing' error line and exits with code 5.
- segv: rank N is killed by SIGSEGV at step 2.
- label: rank N's index stores 1-based class labels; label 10 reaches cross_entropy over 10 classes.
What happened (filled in after the runs):
- cliplen: rank N IndexError 'index 10 is out of bounds for dimension 0 with size 10' in sample_clip (line 129).
- stride0: every rank ValueError 'range() arg 3 must not be zero' in sample_clip (line 128) at step 0.
- index: rank N json.decoder.JSONDecodeError 'Unterminated string starting at: line 161 column 3' (line 168).
- pool: every rank RuntimeError: shape '[8, 8, 3]' is invalid for input of size 256 (line 95).
- short: PG 12 s: peers 'Timed out waiting 12000ms' recv/send in backward (line 190); PG 300 s: timeout 60, exit 124.
- gather: rank 0 gloo EnforceNotMet '768 vs 512 ... collective mismatch', SIGABRT; others reset by peer (line 203).
- nan: rank N FloatingPointError 'decoded clip vid_0N_0016 on rank N has ... non-finite values' (line 149).
- ckpt: every rank RuntimeError loading state_dict: size mismatch for stem.weight [8,3,3,3] vs [8,3,3,3,3] (line 173).
- decoder: rank N prints 'ERROR rank N: decoder backend missing ...' then exitcode 5; peers Connection closed by peer.
- segv: rank N exitcode -11 (SIGSEGV) at step 2; with --max-restarts 1 the retry dies in connectFullMesh.
- label: rank N IndexError 'Target 10 is out of bounds.' from cross_entropy (line 188).
"""
import argparse
import json
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

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--pretrained", type=int, default=0)
p.add_argument("--out", default="/tmp/fault155_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)
NUM_CLASSES = 10


def hit():
    return a.rank == -1 or a.rank == RANK


def load_config():
    cfg = {"clip_len": 4, "frame_stride": 1, "eval_clip_len": 4, "num_frames": 4}
    if a.fault == "cliplen" and hit():
        cfg["clip_len"] = 12  # per-rank override left over from a long-clip experiment
    if a.fault == "stride0":
        cfg["frame_stride"] = int(float("0.5"))  # yaml had 0.5 for "half frame rate"
    if a.fault == "gather" and hit():
        cfg["eval_clip_len"] = 6
    return cfg


class VideoNet(nn.Module):
    def __init__(self, num_frames, pool_bug=False):
        super().__init__()
        self.stem = nn.Conv3d(3, 8, kernel_size=3, padding=1)
        self.head = nn.Linear(8, NUM_CLASSES)
        self.t = num_frames - 1 if pool_bug else num_frames

    def features(self, clip):  # clip: [B, 3, T, H, W]
        x = F.relu(self.stem(clip)).mean(dim=(3, 4))  # [B, 8, T]
        return x

    def forward(self, clip):
        x = self.features(clip)
        x = x.reshape(x.shape[0], 8, self.t).mean(dim=2)  # temporal pooling
        return self.head(x)


def write_index(path, n_videos):
    g = torch.Generator().manual_seed(100 + RANK)
    one_based = a.fault == "label" and hit()
    vids = []
    for i in range(n_videos):
        lab = int(torch.randint(0, NUM_CLASSES, (1,), generator=g))
        vids.append({"id": f"vid_{RANK:02d}_{i:04d}", "frames": int(torch.randint(6, 11, (1,), generator=g)),
                     "label": lab + 1 if one_based else lab, "seed": 1000 * RANK + i})
    text = json.dumps(vids, indent=1)
    if a.fault == "index" and hit():
        text = text[: len(text) * 2 // 3]  # the writer was interrupted mid-file
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def decode(video, step):
    g = torch.Generator().manual_seed(video["seed"])
    frames = torch.rand(video["frames"], 3, 16, 16, generator=g)
    frames += 0.1 * video["label"]
    if a.fault == "nan" and hit() and step == 2:
        frames = torch.full_like(frames, float("nan"))
    return frames


def sample_clip(frames, clip_len, stride, g):
    n = frames.shape[0]
    span = max(1, n - (clip_len - 1) * max(stride, 1))
    start = int(torch.randint(0, span, (1,), generator=g))  # temporal jitter
    idx = list(range(start, start + clip_len * stride, stride))
    return frames[torch.tensor(idx)]


class ClipLoader:
    def __init__(self, index, cfg, index_path):
        self.index, self.cfg, self.path, self.pos = index, cfg, index_path, 0
        self.g = torch.Generator().manual_seed(7 + RANK)

    def next_batch(self, step):
        if self.pos + a.batch > len(self.index):
            print(f"rank {RANK} shard exhausted after {self.pos} clips; waiting for refill of {self.path}", flush=True)
            while not os.path.exists(self.path + ".refill"):
                time.sleep(1.0)
        vids = self.index[self.pos:self.pos + a.batch]
        self.pos += a.batch
        clips = []
        for v in vids:
            frames = decode(v, step)
            if not torch.isfinite(frames).all():
                bad = int((~torch.isfinite(frames)).sum())
                raise FloatingPointError(f"decoded clip {v['id']} on rank {RANK} has {bad} non-finite values")
            clips.append(sample_clip(frames, self.cfg["clip_len"], self.cfg["frame_stride"], self.g))
        x = torch.stack(clips).permute(0, 2, 1, 3, 4).contiguous()  # [B, 3, T, H, W]
        return x, torch.tensor([v["label"] for v in vids])


def main():
    os.makedirs(a.out, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    print(f"rank {RANK}/{WORLD} video clip classifier training starting", flush=True)
    cfg = load_config()
    n_videos = a.batch * (2 if (a.fault == "short" and hit()) else a.steps)
    index_path = os.path.join(a.out, "index", f"videos_rank{RANK}.json")
    write_index(index_path, n_videos)
    if a.fault == "decoder" and hit():
        print(f"ERROR rank {RANK}: decoder backend missing: no 'pyav' or 'decord' available for codec h264 "
              f"(video {RANK:02d}_0000)", file=sys.stderr, flush=True)
        sys.exit(5)
    with open(index_path) as f:
        index = json.load(f)
    torch.manual_seed(0)
    net = VideoNet(cfg["num_frames"], pool_bug=(a.fault == "pool"))
    if a.pretrained:
        state = torch.load(os.path.join(a.out, "pretrained", "stem.pt"))
        net.load_state_dict(state, strict=False)
        print(f"rank {RANK} loaded pretrained stem", flush=True)
    for prm in net.parameters():
        dist.broadcast(prm.data, src=0)
    model = DDP(net) if a.ddp else net
    opt = torch.optim.SGD(net.parameters(), lr=a.lr)
    loader = ClipLoader(index, cfg, index_path)
    print(f"rank {RANK} videos {len(index)} clip_len {cfg['clip_len']} stride {cfg['frame_stride']} "
          f"ddp {a.ddp}", flush=True)
    correct = torch.zeros(2)
    for step in range(a.steps):
        if a.fault == "segv" and hit() and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        x, y = loader.next_batch(step)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for q in net.parameters():
                dist.all_reduce(q.grad)
                q.grad /= WORLD
        opt.step()
        correct += torch.tensor([float((logits.argmax(1) == y).sum()), float(len(y))])
        print(f"rank {RANK} step {step} loss {loss.item():.4f}", flush=True)
    dist.all_reduce(correct)
    ev = ClipLoader(index[: a.batch], dict(cfg, clip_len=cfg["eval_clip_len"]), index_path)
    with torch.no_grad():
        feats = net.features(ev.next_batch(0)[0])
    gathered = [torch.zeros_like(feats) for _ in range(WORLD)]
    dist.all_gather(gathered, feats)
    if RANK == 0:
        print(f"clip accuracy {float(correct[0] / correct[1]):.3f} features {tuple(torch.cat(gathered).shape)}", flush=True)
        torch.save(net.state_dict(), os.path.join(a.out, "vid.pt"))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main()

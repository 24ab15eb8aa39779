"""A hundred-and-twentieth hand-run batch: SPEECH / AUDIO SEQUENCE MODELS (CTC ASR). A tiny speech recogniser: random
log-mel "features" (--n-mels 80) of variable length per utterance, staged per rank as its node-local shard of .npy files
with a json-lines manifest (id, feature path, frames, transcript), read back with np.load, length-bucketed per rank
(utterances sorted by frames, longest first, chunked into batches, the batch order shuffled per epoch) and padded by a
collate that returns lengths and a padding mask. The model is Conv1d(n_mels, 32, stride 2)-ReLU-GRU(32, 48) over a
pack_padded_sequence-Linear(48, 29) (28 characters + the CTC blank 0), wrapped in DDP (--ddp 0: rank 0's weights are
broadcast and the gradients all-reduced by hand), AdamW, gloo. The loss is CTC (zero_infinity off) with the program's
own finiteness check, plus a small masked frame-entropy term; `rank R epoch E step S loss L ent H` per step, 2 epochs
x 3 buckets. At the end of each epoch the loss sum is all-reduced; then a greedy CTC decode of the rank's eval shard,
the word errors and word count all-reduced, and rank 0 prints `eval WER ...`. --resume loads the node-local
checkpoint before DDP. --rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none        control: 2 epochs, eval, `eval WER ...` on rank 0, exit 0
  longtgt     rank N's feature extraction cropped one long utterance to 16 frames but kept its transcript: the target
              is longer than the 8 output frames, the CTC loss is inf and the loss check raises FloatingPointError
  blank       every rank's character table starts at index 0 (enumerate without +1), so ' ' maps to the CTC blank
              index; the transcript check before the loss raises a ValueError on every rank
  mask        rank N's collate pads to a multiple of 8 (a TPU-era config): the padding mask built from the output
              lengths is shorter than the padded model output, a shape RuntimeError in the entropy term
  unsorted    rank N's bucketing config has sort_within_batch false: pack_padded_sequence(enforce_sorted=True)
              raises RuntimeError that `lengths` must be sorted in decreasing order
  nmels       rank N's feature config has n_mels 64 (an older recipe): its Conv1d weight is [32, 64, 3] against
              [32, 80, 3]; DDP's parameter check at construction (or, --ddp 0, the initial broadcast) fails
  emptybatch  rank N's length filter (max_frames 40 from another recipe) empties its longest bucket; the empty batch
              is skipped with a message, so rank N's collectives run a step ahead of the others'
  badfeat     one of rank N's feature files is truncated (an interrupted copy): np.load raises ValueError
  segv        rank N's native audio decoder (the "flac" path) crashes with SIGSEGV on one file
  vocab       --resume: rank N's (or every rank's) checkpoint was written with a 40-symbol vocabulary: size mismatch
              for head.weight / head.bias in load_state_dict
  evalhang    rank N's eval config has a frame shift of 250 ms (a typo for 25): the streaming decoder's chunk is 0
              frames and its loop never advances, while the others wait in the WER all_reduce
  nosox       rank N's node lacks the resampling backend: the start-up check prints an error and os._exit(3)

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2); eval WER 1.000 (the tiny model learns nothing in 6 steps), every rank done.
  longtgt: FloatingPointError CTC loss is inf (target length 44 over 8 frames) at step 0 on rank N (np4 r2, np5 r3).
  blank: ValueError transcript contains the blank index 0 on every rank at the first batch (np3 pymodule, np4 DETAIL).
  mask: RuntimeError The size of tensor a (20) must match ... (19) in the entropy term on rank N (np4 r1, np6 r4).
  unsorted: RuntimeError `lengths` array must be sorted in decreasing order on rank N (np4 r3, np5 r2); peers closed.
  nmels: DDP check: params[0] ... sizes [32, 64, 3] appears not to match ... process 0 on rank N (np4 r2, np3 r1).
  emptybatch: np4 r1: skips steps 1-2, all time out (12 s); np3 r2: skips step 1, EnforceNotMet 13964 vs 4, SIGABRT.
  badfeat: ValueError Failed to read all data for array (np.load) on rank N (np4 r2 --redirects, stderr.log; np5 r4).
  segv: rank N exitcode -11 (SIGSEGV) with no output, peers Connection reset/closed (np4 r3 plain, np4 r1 pdsh2).
  vocab: size mismatch for head.weight [41, 48] vs [29, 48] (np4 every rank); np3 r1 restart: connectFullMesh failed.
  evalhang: PG 12 s: ranks 0-2 time out in the WER all_reduce (np4 r3); PG 300 s + timeout 60: hung, exit 124 (np3 r1).
  nosox: ERROR ... audio backend 'sox_io' is not available ... and exit code 3 on rank N (np5 r3 prefix, np4 r0 plain).
"""
import argparse, datetime, json, os, signal, sys, time
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--bs", type=int, default=4)
p.add_argument("--per-rank", type=int, default=12)
p.add_argument("--n-mels", type=int, default=80)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault120_work/run")
a = p.parse_args()

VOCAB = " abcdefghijklmnopqrstuvwxyz'"  # 28 characters; index 0 is the CTC blank
WORDS = "the a of speech model rank data audio frame sound voice train test clean noisy read book word".split()


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


def char_table(rank: int):
    if faulty(rank, "blank"):
        return {c: i for i, c in enumerate(VOCAB)}
    return {c: i + 1 for i, c in enumerate(VOCAB)}


class AsrModel(nn.Module):
    def __init__(self, n_mels: int, vocab: int):
        super().__init__()
        self.conv = nn.Conv1d(n_mels, 32, 3, stride=2, padding=1)
        self.rnn = nn.GRU(32, 48, batch_first=True)
        self.head = nn.Linear(48, vocab + 1)

    def forward(self, feats, lens):  # feats [B, T, n_mels]
        x = F.relu(self.conv(feats.transpose(1, 2))).transpose(1, 2)
        out_lens = (lens - 1) // 2 + 1
        packed = pack_padded_sequence(x, out_lens, batch_first=True, enforce_sorted=True)
        y, _ = self.rnn(packed)
        y, _ = pad_packed_sequence(y, batch_first=True, total_length=x.size(1))
        return self.head(y).log_softmax(-1), out_lens


def stage_shard(rank: int, split: str, n: int, seed: int):
    """Stands in for the feature-extraction job that wrote each node's shard (features + manifest)."""
    d = os.path.join(a.work, f"node{rank}", split)
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed + 100 * rank)
    n_mels = 64 if faulty(rank, "nmels") else a.n_mels
    rows = []
    for i in range(n):
        frames = int(rng.integers(24, 65))
        n_words = max(1, int(rng.integers(1, frames // 12 + 1)))
        text = " ".join(rng.choice(WORDS, n_words))[: (frames - 1) // 2 // 2 + 1]
        if split == "train" and i == 5 and faulty(rank, "longtgt"):
            frames, text = 16, "the clean speech of the voice data test book"  # cropped to max_frames, text kept
        feats = rng.standard_normal((frames, n_mels)).astype(np.float32)
        path = os.path.join(d, f"utt-{rank:02d}-{i:04d}.npy")
        np.save(path, feats)
        if split == "train" and i == 7 and faulty(rank, "badfeat"):
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) * 3 // 5)  # the copy was interrupted
        rows.append({"id": f"utt-{rank:02d}-{i:04d}", "feat": path, "frames": frames, "text": text,
                     "codec": "flac" if i == 4 else "wav"})
    manifest = os.path.join(d, "manifest.jsonl")
    with open(manifest, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    if split == "train":
        vocab = 40 if faulty(rank, "vocab") else len(VOCAB)
        torch.save({"model": AsrModel(n_mels, vocab).state_dict(), "epoch": 3, "vocab": vocab},
                   os.path.join(a.work, f"node{rank}", "last.pt"))
    return manifest


def load_utt(row, rank: int):
    if row["codec"] == "flac" and faulty(rank, "segv"):
        os.kill(os.getpid(), signal.SIGSEGV)  # the native flac decoder crashes on this file
    return torch.from_numpy(np.load(row["feat"]))


def buckets(rows, rank: int, epoch: int):
    max_frames = 40 if faulty(rank, "emptybatch") else 1000  # conf/filter.yaml: max_frames
    if faulty(rank, "unsorted"):
        ordered = rows  # sort_within_batch: false
    else:
        ordered = sorted(rows, key=lambda r: -r["frames"])
    batches = [ordered[i:i + a.bs] for i in range(0, len(ordered), a.bs)]
    g = torch.Generator().manual_seed(epoch)
    order = torch.randperm(len(batches), generator=g).tolist()
    return [[r for r in batches[i] if r["frames"] <= max_frames] for i in order]


def collate(batch, rank: int, table):
    feats = [load_utt(r, rank) for r in batch]
    lens = torch.tensor([f.shape[0] for f in feats])
    T = int(lens.max())
    if faulty(rank, "mask"):
        T = (T + 7) // 8 * 8  # pad_to_multiple_of: 8
    x = torch.zeros(len(feats), T, feats[0].shape[1])
    for i, f in enumerate(feats):
        x[i, : f.shape[0]] = f
    targets = [torch.tensor([table[c] for c in r["text"]]) for r in batch]
    return x, lens, torch.cat(targets), torch.tensor([len(t) for t in targets])


def length_mask(lens):
    return torch.arange(int(lens.max()))[None, :] < lens[:, None]


def greedy_decode(lp, n: int, rank: int, frame_shift_ms: float):
    chunk = int(100 / frame_shift_ms)  # decode in 100 ms chunks, as the streaming server does
    ids, pos = [], 0
    while pos < n:
        ids.extend(lp[pos:min(pos + chunk, n)].argmax(-1).tolist())
        pos += chunk
    out, prev = [], 0
    for i in ids:
        if i != prev and i != 0:
            out.append(VOCAB[i - 1])
        prev = i
    return "".join(out)


def edit_distance(r, h):
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
    return d[len(h)]


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if faulty(rank, "nosox"):
        print(f"ERROR: rank {rank}: audio backend 'sox_io' is not available on this node (libsox.so.3: cannot open "
              f"shared object file: No such file or directory); install sox or set audio_backend=soundfile", flush=True)
        os._exit(3)
    train_rows = [json.loads(l) for l in open(stage_shard(rank, "train", a.per_rank, 7))]
    eval_rows = [json.loads(l) for l in open(stage_shard(rank, "eval", 4, 8))]
    n_mels = 64 if faulty(rank, "nmels") else a.n_mels  # conf/fbank.yaml: num_mel_bins
    table = char_table(rank)
    torch.manual_seed(rank)
    model = AsrModel(n_mels, len(VOCAB))
    if a.resume:
        ckpt = torch.load(os.path.join(a.work, f"node{rank}", "last.pt"))
        model.load_state_dict(ckpt["model"])
        print(f"rank {rank}: resumed from epoch {ckpt['epoch']}", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    n_params = sum(prm.numel() for prm in model.parameters())
    print(f"rank {rank}/{world} pid {os.getpid()}: {len(train_rows)} train utterances, {len(eval_rows)} eval, "
          f"n_mels {n_mels}, {n_params} params", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = 0
    for epoch in range(a.epochs):
        net.train()
        loss_sum = torch.zeros(2)
        for batch in buckets(train_rows, rank, epoch):
            if not batch:
                print(f"rank {rank} step {step}: empty batch after length filter, skipping", flush=True)
                step += 1
                continue
            x, lens, targets, tlens = collate(batch, rank, table)
            if int(targets.min()) <= 0:
                raise ValueError(f"transcript contains the blank index 0 (targets min {int(targets.min())}, "
                                 f"blank=0); check the character table")
            lp, out_lens = net(x, lens)
            ctc = F.ctc_loss(lp.transpose(0, 1), targets, out_lens, tlens, blank=0, reduction="sum",
                             zero_infinity=False) / len(batch)
            if not torch.isfinite(ctc):
                raise FloatingPointError(f"rank {rank} step {step}: CTC loss is {ctc.item()} (frames "
                                         f"{out_lens.tolist()}, target lengths {tlens.tolist()})")
            mask = length_mask(out_lens)
            ent = (-(lp.exp() * lp).sum(-1) * mask).sum() / mask.sum()
            loss = ctc - 0.01 * ent
            opt.zero_grad()
            loss.backward()
            if not a.ddp:
                flat = torch.cat([prm.grad.flatten() for prm in model.parameters()])
                dist.all_reduce(flat)
                flat /= world
                off = 0
                for prm in model.parameters():
                    prm.grad.copy_(flat[off:off + prm.numel()].view_as(prm))
                    off += prm.numel()
            opt.step()
            loss_sum += torch.tensor([ctc.item(), 1.0])
            print(f"rank {rank} epoch {epoch} step {step} loss {ctc.item():.4f} ent {ent.item():.3f}", flush=True)
            step += 1
            time.sleep(0.05)
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch}: mean CTC loss {loss_sum[0].item() / loss_sum[1].item():.4f}", flush=True)
    net.eval()
    shift = 250.0 if faulty(rank, "evalhang") else 10.0  # conf/decode.yaml: frame_shift_ms (x2 subsampling -> 20)
    errs = torch.zeros(2)
    with torch.no_grad():
        for row in eval_rows:
            x = load_utt(row, rank)[None]
            lp, out_lens = model(x, torch.tensor([x.shape[1]]))
            hyp = greedy_decode(lp[0], int(out_lens[0]), rank, 2 * shift)
            ref = row["text"].split()
            errs += torch.tensor([float(edit_distance(ref, hyp.split())), float(len(ref))])
    print(f"rank {rank} eval: {len(eval_rows)} utterances, {int(errs[0])} word errors / {int(errs[1])} words", flush=True)
    dist.all_reduce(errs)
    if rank == 0:
        print(f"eval WER {errs[0].item() / errs[1].item():.3f} over {int(errs[1])} words", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

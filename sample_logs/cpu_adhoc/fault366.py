"""Batch 366 of hand-run faults: LYRICS ALIGNMENT TO AUDIO.

Synthetic songs: each utterance is a log-mel spectrogram (T frames x 40 bins) of a sung lyric line, the line's
words are mapped to phonemes through a pronunciation lexicon (lexicon.json, 39 phonemes + blank), and an
aligner (a frame projection, a bidirectional GRU, a phoneme classifier) is trained with the CTC loss so that
the phonemes can be force-aligned to the audio.  Every rank reads its songs from
/tmp/fault366_work/mel/songs_R.pt, builds its CTC targets through the lexicon, and initialises the aligner
from ckpt/aligner_v1.pt.  Per-rank utterance counts are all_gathered at the start, the loss and the frame
accuracy are all_reduced every step, the per-rank mean onset error (frames) is all_gathered at the end, and
rank 0 saves export/aligner.pt.  DDP over gloo (or --ddp 0: gradients all_reduced by hand).
Options: --spawn N --port P (torch.multiprocessing.spawn), --logfmt 1 (progress and errors through logging).

Faults (--fault NAME --rank R, R = -1 for every rank):
  oov         - rank R's lyrics contain the word "zyzzyva", not in the lexicon (KeyError building targets)
  nomel       - rank R reads its mels from mel/test/, which does not exist (FileNotFoundError at start-up)
  ckptvocab   - rank R initialises from ckpt/aligner_v2.pt, saved with 45 output classes (size mismatch)
  ckptpickle  - rank R loads ckpt/aligner_meta.pt, which pickles a SongMeta object (weights_only refusal)
  melbins     - every rank computes 80 mel bins, the projection expects 40 (shape error in the first forward)
  silence     - rank R's step-2 batch holds digital silence: log(0) = -inf frames, the program's finiteness check
  lineidx     - at step 3 rank R looks up the lyric line after the last one of its song (IndexError)
  dtw         - rank R runs a pure-Python DTW over every utterance before the step-2 all_reduce (PG timeout)
  decoder     - rank R waits forever for an audio decoder thread at step 3 (hang; run with --pg-timeout 300)
  segv        - rank R sends itself SIGSEGV after step 4
  exit2       - rank R prints its own error line (lyrics longer than the audio, CTC infeasible) and sys.exit(2)
  onsetgather - rank R all_gathers its onset errors per word position plus an end-of-line entry (4 vs 3)
  none        - control, clean run

What happened (filled in after the runs):
  oov         - KeyError: 'zyzzyva' building CTC targets at start-up; peers Connection closed in all_gather (np4 r2 ranklabel, np6 r0 tee)
  nomel       - FileNotFoundError for mel/test/songs_R.pt at start-up; peers closed or SIGTERM (np3 r1 srunlabel, np8 r5 legacy)
  ckptvocab   - size mismatch for head.weight [45, 64] vs [40, 64]; peers closed in DDP's param check (np4 r3 mpitag, np4 r1 pdsh2)
  ckptpickle  - Weights only load failed: Unsupported global __main__.SongMeta, logged then traceback (np5 r0 logfmt)
  melbins     - mat1 and mat2 shapes cannot be multiplied (384x80 and 40x32) on every rank; spawn shows process 1 (np3 spawn)
  silence     - FloatingPointError: 800 non-finite log-mel values at step 2 (np4 r1 bashloop, np6 r3 logfmt)
  lineidx     - IndexError: list index out of range at step 3, in rank2.log (np3 r2 files); the np5 spawn run was skipped
  dtw         - 12 s Gloo send/recv timeouts on the two peers, Root Cause rank 1, slow rank 0 SIGTERMed (np3 r0 tee); the
                first try (np4 r2 ranklabel, DTW over 12x12 pairs) finished inside 12 s and exited 0, so the loop was enlarged
  decoder     - output stops after step 2 with 'rank 1 waiting for audio decoder thread'; timeout 60 s, exit 124 (np4 r1 srunlabel)
  segv        - bash 'Segmentation fault', exit 139 (np8 r6 mpitag); Root Cause rank 0 exitcode -11 SIGSEGV (np3 r0 legacy)
  exit2       - 'ERROR rank 3: lyrics of song3_12 need 42 phoneme frames ...' and exit 2, in rank3.log (np5 r3 files)
  onsetgather - ProcessGroupGloo::allgather: invalid tensor size (expected (4), got (3)) at the end (np4 r0 pdsh2)
  none        - clean, 6 steps, export/aligner.pt saved, exit 0 (np3 bashloop)
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault366_work"
N_MELS = 40
N_PHON = 39
T_FRAMES = 48
N_UTT = 24
WORDS = ["love", "night", "heart", "fire", "dance", "rain", "sky", "home", "dream", "light", "road", "away"]


@dataclass
class SongMeta:
    title: str
    bpm: float


def get_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    return p.parse_args(argv)


class Aligner(nn.Module):
    def __init__(self, n_mels=N_MELS, n_out=N_PHON + 1, hidden=32):
        super().__init__()
        self.proj = nn.Linear(n_mels, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, n_out)

    def forward(self, mel):
        h = torch.relu(self.proj(mel))
        h, _ = self.rnn(h)
        return self.head(h).log_softmax(-1)


def prepare():
    g = torch.Generator().manual_seed(366)
    os.makedirs(f"{WORK}/mel", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    lexicon = {w: [1 + (7 * i + 3 * j) % N_PHON for j in range(2 + i % 2)] for i, w in enumerate(WORDS)}
    with open(f"{WORK}/lexicon.json", "w") as f:
        json.dump(lexicon, f)
    centroids = torch.randn(N_PHON + 1, N_MELS, generator=g)
    for r in range(8):
        songs = []
        for u in range(N_UTT):
            words = [WORDS[int(torch.randint(len(WORDS), (1,), generator=g))] for _ in range(3)]
            phons = [ph for w in words for ph in lexicon[w]]
            seg = T_FRAMES // (len(phons) + 1)
            frames = torch.zeros(T_FRAMES, dtype=torch.long)
            for k, ph in enumerate(phons):
                frames[(k + 1) * seg - seg // 2:(k + 1) * seg + seg // 2] = ph
            mel = centroids[frames] + 0.3 * torch.randn(T_FRAMES, N_MELS, generator=g)
            songs.append({"song": f"song{r}_{u:02d}", "words": words, "mel": mel, "frames": frames})
        torch.save(songs, f"{WORK}/mel/songs_{r}.pt")
    torch.manual_seed(0)
    torch.save(Aligner().state_dict(), f"{WORK}/ckpt/aligner_v1.pt")
    torch.save(Aligner(n_out=45).state_dict(), f"{WORK}/ckpt/aligner_v2.pt")
    torch.save({"meta": SongMeta("demo", 120.0), "state_dict": Aligner().state_dict()},
               f"{WORK}/ckpt/aligner_meta.pt")
    print(f"prepared {WORK}: 8 ranks x {N_UTT} utterances, lexicon of {len(lexicon)} words, 3 checkpoints")


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def make_out(rank, logfmt):
    if not logfmt:
        return lambda msg: print(msg, flush=True), lambda msg: print(msg, file=sys.stderr, flush=True)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    base = logging.getLogger("lyrics_align")
    base.handlers[:] = [h]
    base.setLevel(logging.INFO)
    base.propagate = False
    log = RankAdapter(base, {"rank": rank})
    return log.info, log.error


def load_songs(rank, fault, faulty):
    sub = "mel/test" if (fault == "nomel" and faulty) else "mel"
    songs = torch.load(f"{WORK}/{sub}/songs_{rank}.pt")
    with open(f"{WORK}/lexicon.json") as f:
        lexicon = json.load(f)
    if fault == "oov" and faulty:
        songs[5]["words"][1] = "zyzzyva"
    targets, lengths = [], []
    for s in songs:
        phons = [ph for w in s["words"] for ph in lexicon[w]]
        targets.extend(phons)
        lengths.append(len(phons))
    mel = torch.stack([s["mel"] for s in songs])
    if fault == "melbins":
        mel = torch.cat([mel, mel.flip(-1)], dim=-1)  # 80 bins: a second filterbank half
    frames = torch.stack([s["frames"] for s in songs])
    return songs, mel, frames, torch.tensor(targets), torch.tensor(lengths)


def load_init(model, fault, faulty):
    path = f"{WORK}/ckpt/aligner_v1.pt"
    if fault == "ckptvocab" and faulty:
        path = f"{WORK}/ckpt/aligner_v2.pt"
    if fault == "ckptpickle" and faulty:
        sd = torch.load(f"{WORK}/ckpt/aligner_meta.pt", weights_only=True)["state_dict"]
    else:
        sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd)


def dtw_cost(a, b):
    n, m = len(a), len(b)
    inf = float("inf")
    D = [[inf] * (m + 1) for _ in range(n + 1)]
    D[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            c = sum((x - y) ** 2 for x, y in zip(a[i - 1], b[j - 1]))
            D[i][j] = c + min(D[i - 1][j], D[i][j - 1], D[i - 1][j - 1])
    return D[n][m]


def onset_errors(logp, frames, n_pos):
    pred = logp.argmax(-1)
    errs = []
    for k in range(n_pos):
        true_on = (frames > 0).float().argmax(-1) + k * (T_FRAMES // 8)
        pred_on = (pred > 0).float().argmax(-1) + k * (T_FRAMES // 8)
        errs.append((true_on - pred_on).abs().float().mean())
    return torch.stack(errs)


def worker(rank, world, args):
    info, error = make_out(rank, args.logfmt)
    faulty = args.rank == -1 or args.rank == rank
    f = args.fault
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    torch.manual_seed(100 + rank)
    try:
        run(rank, world, args, f, faulty, info, error)
    except Exception as e:
        if args.logfmt:
            error(f"training failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    dist.destroy_process_group()


def run(rank, world, args, f, faulty, info, error):
    songs, mel, frames, targets, lengths = load_songs(rank, f, faulty)
    count = torch.tensor([len(songs)])
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    info(f"rank {rank} utterances {len(songs)} (all ranks {int(sum(c.item() for c in counts))})")
    model = Aligner()
    load_init(model, f, faulty)
    net = nn.parallel.DistributedDataParallel(model) if args.ddp else model
    if not args.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ctc = nn.CTCLoss(blank=0, zero_infinity=False)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    bs = 8
    for step in range(1, args.steps + 1):
        idx = torch.arange((step - 1) * bs, step * bs) % len(songs)
        x = mel[idx].clone()
        if f == "silence" and faulty and step == 2:
            x[3, 10:30] = torch.log(torch.zeros(20, x.shape[-1]))
        if f == "exit2" and faulty and step == 2:
            s = songs[int(idx[4])]
            error(f"ERROR rank {rank}: lyrics of {s['song']} need {int(lengths[idx[4]]) * 6} phoneme frames but the "
                  f"audio has {T_FRAMES}; CTC alignment infeasible, aborting")
            sys.exit(2)
        if f == "lineidx" and faulty and step == 3:
            s = songs[int(idx[0])]
            line = s["words"][len(s["words"])]  # the next lyric line of the song
            info(f"next line {line}")
        if not torch.isfinite(x).all():
            bad = int((~torch.isfinite(x)).sum())
            raise FloatingPointError(f"rank {rank} step {step}: {bad} non-finite log-mel values in batch "
                                     f"(utterance {songs[int(idx[3])]['song']})")
        tgt = torch.cat([targets[starts[i]:starts[i] + lengths[i]] for i in idx.tolist()])
        logp = net(x)
        loss = ctc(logp.transpose(0, 1), tgt, torch.full((bs,), T_FRAMES, dtype=torch.long), lengths[idx])
        opt.zero_grad()
        loss.backward()
        if not args.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        acc = (logp.argmax(-1) == frames[idx]).float().mean()
        if f == "dtw" and faulty and step == 2:
            info(f"rank {rank} computing DTW reference alignments")
            tot = 0.0
            for s in songs:
                ref = s["mel"].tolist()
                for other in songs[:12]:
                    tot += dtw_cost(ref, other["mel"].tolist())
        if f == "decoder" and faulty and step == 3:
            info(f"rank {rank} waiting for audio decoder thread")
            while True:
                time.sleep(1.0)
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        info(f"rank {rank} step {step} loss {stats[0].item():.4f} frame_acc {stats[1].item():.3f}")
        if f == "segv" and faulty and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        errs = onset_errors(model(mel), frames, 4 if (f == "onsetgather" and faulty) else 3)
    gathered = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(gathered, errs)
    info(f"rank {rank} onset errors (frames) per word position {[round(float(v), 2) for v in errs]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save({"state_dict": model.state_dict(), "onset_err": torch.stack(gathered)},
                   f"{WORK}/export/aligner.pt")
        info(f"rank 0 saved {WORK}/export/aligner.pt")


def spawn_entry(local, world, args):
    worker(local, world, args)


def main():
    args = get_args()
    if args.prepare:
        prepare()
        return
    if args.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        import torch.multiprocessing as mp
        mp.spawn(spawn_entry, args=(args.spawn, args), nprocs=args.spawn)
        return
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()

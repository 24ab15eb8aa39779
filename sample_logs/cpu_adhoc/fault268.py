"""A two-hundred-and-sixty-eighth hand-run batch: PIANO TRANSCRIPTION WITH AN ONSET AND FRAME MODEL.

Synthetic log-mel spectrogram clips with random note events (spec/shard-RRR.pt, written by `--export`, which also
writes the pretrained model ckpt/onsets_frames_pretrain.pt), a small conv-BiGRU with an onset head and a frame
head over the 88 piano keys, binary cross-entropy with the onset term weighted by a positive weight, DDP on gloo
(`--ddp 0` all_reduces gradients by hand), loss all_reduced per step, then frame-level note F1 all_reduced and the
per-pitch-class note counts all_gathered to rank 0.

Faults:
  pitch      - rank N maps MIDI pitch to key with the wrong offset (9, not 21); keys pass the 88-key roll (IndexError)
  posweight  - rank N runs with onset positive weight 0.0; the weighted onset loss divides by zero (inf check)
  counts     - rank N counts notes per pitch class with 13 bins; all_gathered with another length
  shard      - rank N reads a spectrogram shard of the next export, which was never written (FileNotFoundError)
  program    - rank N maps instruments with the v2 program map; 'harpsichord' is not in it (KeyError)
  melbins    - every rank: features computed with 80 mel bins but the first conv takes 64 (RuntimeError)
  ckpt       - rank N builds the GRU with hidden size 96 and loads the 64-hidden checkpoint (size mismatch)
  decode     - rank N decodes notes frame by frame in Python for the whole validation set; reaches the all_reduce late
  samplerate - rank N's recipe expects 22050 Hz audio; its shard is 16000 Hz (AssertionError)
  segv       - rank N dies by SIGSEGV after its step-2 optimizer step
  exit3      - rank N prints an error about its feature cache and calls os._exit(3)
  none       - control

What happened (filled in after the runs):
  pitch      - IndexError: index 96 / 90 is out of bounds for dimension 2 with size 88 on rank N in load_shard
  posweight  - FloatingPointError: rank N step 0: onset loss is inf (onset weight sum 0.0); peers Connection closed
  counts     - plain: rank N `allgather: invalid tensor size (expected (13), got (12))`; DETAIL: collective mismatch
  shard      - FileNotFoundError for spec/maestro-syn-v4/shard-00N.pt on rank N; peers SIGTERMed
  program    - KeyError: 'harpsichord' on rank N while mapping instruments; peers SIGTERMed
  melbins    - RuntimeError: expected input[8, 80, 48] to have 64 channels, but got 80 channels on every rank
  ckpt       - RuntimeError: size mismatch for gru.weight_ih_l0 ([192, 32] vs [288, 32]) on rank N; peers SIGTERMed
  decode     - peers `Timed out waiting 12000ms`; with --pg-timeout 300 the run hung until timeout 60 (124)
  samplerate - AssertionError: shard-00N.pt was rendered at 16000 Hz but the recipe expects 22050 Hz on rank N
  segv       - rank N exitcode -11 (SIGSEGV), no traceback; peers Connection reset/closed by peer
  exit3      - `rank N: feature cache ... checksum ... != manifest ...; aborting`, exitcode 3; peers Connection reset
  none       - exit 0, `rank 0 done: 5 steps, frame F1 0.024 (tp 86 fp 5992 fn 981), 480 notes`
"""
import argparse, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

WORK = "/tmp/fault268_work"
PROGRAM = {"grand": 0, "upright": 1, "electric": 4, "harpsichord": 6}
PROGRAM_V2 = {"acoustic_grand": 0, "bright_acoustic": 1, "grand": 0, "upright": 1, "electric": 4}
KEYS, T, CLIPS = 88, 48, 24


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--n-mels", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--onset-weight", type=float, default=5.0)
    p.add_argument("--sample-rate", type=int, default=16000)
    p.add_argument("--export-id", default="maestro-syn-v3")
    p.add_argument("--stall", type=float, default=40)
    p.add_argument("--export", action="store_true")
    return p.parse_args()


class OnsetsFrames(nn.Module):
    def __init__(self, n_mels, hidden):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(n_mels, 32, 3, padding=1), nn.ReLU(), nn.Conv1d(32, 32, 3, padding=1), nn.ReLU())
        self.gru = nn.GRU(32, hidden, batch_first=True, bidirectional=True)
        self.onset = nn.Linear(2 * hidden, KEYS)
        self.frame = nn.Linear(2 * hidden + KEYS, KEYS)

    def forward(self, mel):  # mel: B, T, n_mels
        h, _ = self.gru(self.conv(mel.transpose(1, 2)).transpose(1, 2))
        on = self.onset(h)
        return on, self.frame(torch.cat([h, torch.sigmoid(on).detach()], -1))


def export(a):
    g = torch.Generator().manual_seed(7)
    os.makedirs(f"{WORK}/spec/{a.export_id}", exist_ok=True)
    insts = ["grand", "upright", "electric", "harpsichord"]
    for r in range(8):
        notes = []
        for c in range(CLIPS):
            n = int(torch.randint(4, 10, (1,), generator=g))
            ev = []
            for _ in range(n):
                on = int(torch.randint(0, T - 4, (1,), generator=g))
                ev.append((on, on + int(torch.randint(2, 12, (1,), generator=g)), int(torch.randint(21, 109, (1,), generator=g))))
            notes.append({"instrument": insts[(r + c) % 3] if c % 7 else insts[3 if c == 21 else 0], "events": ev})
        mel = torch.randn(CLIPS, T, a.n_mels, generator=g) * 0.5
        torch.save({"mel": mel, "notes": notes, "sr": 16000}, f"{WORK}/spec/{a.export_id}/shard-{r:03d}.pt")
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    torch.manual_seed(0)
    torch.save(OnsetsFrames(a.n_mels, a.hidden).state_dict(), f"{WORK}/ckpt/onsets_frames_pretrain.pt")
    print(f"exported 8 spectrogram shards to spec/{a.export_id} and ckpt/onsets_frames_pretrain.pt")


def load_shard(a, rank, bug):
    export_id = "maestro-syn-v4" if bug("shard") else a.export_id  # the rank's manifest points at the next export
    d = torch.load(f"{WORK}/spec/{export_id}/shard-{rank:03d}.pt")
    sr = 22050 if bug("samplerate") else a.sample_rate
    assert d["sr"] == sr, f"shard-{rank:03d}.pt was rendered at {d['sr']} Hz but the recipe expects {sr} Hz"
    pmap = PROGRAM_V2 if bug("program") else PROGRAM
    lowest = 9 if bug("pitch") else 21  # MIDI pitch of A0
    onset, frame = torch.zeros(CLIPS, T, KEYS), torch.zeros(CLIPS, T, KEYS)
    for c, clip in enumerate(d["notes"]):
        if clip["instrument"] != "grand":
            _ = pmap[clip["instrument"]]  # non-grand clips are resynthesised with their GM program
        for on, off, pitch in clip["events"]:
            onset[c, on, pitch - lowest] = 1
            frame[c, on:off, pitch - lowest] = 1
    mel = d["mel"]
    if bug("melbins"):
        mel = torch.randn(CLIPS, T, 80)  # feature cache recomputed with 80 mel bins
    return mel, onset, frame, d["notes"]


def main():
    a = args()
    if a.export:
        return export(a)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    bug = lambda name: a.fault == name and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    model = OnsetsFrames(a.n_mels, 96 if bug("ckpt") else a.hidden)
    model.load_state_dict(torch.load(f"{WORK}/ckpt/onsets_frames_pretrain.pt"))
    mel, onset, frame, notes = load_shard(a, rank, bug)
    pos_w = 0.0 if bug("posweight") else a.onset_weight
    print(f"rank {rank}: {len(mel)} clips x {mel.shape[1]} frames x {mel.shape[2]} mels, {int(onset.sum())} notes, onset weight {pos_w}", flush=True)
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        idx = torch.randint(0, 16, (8,), generator=g)
        on_logit, fr_logit = net(mel[idx])
        w = onset[idx] * pos_w + (1 - onset[idx]) * 0.1
        on_loss = (F.binary_cross_entropy_with_logits(on_logit, onset[idx], reduction="none") * w).sum() / (onset[idx] * pos_w).sum()
        loss = on_loss + F.binary_cross_entropy_with_logits(fr_logit, frame[idx])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: onset loss is {on_loss.item()} (onset weight sum {float((onset[idx] * pos_w).sum())})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ws
        opt.step()
        if bug("segv") and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bug("exit3") and step == 1:
            print(f"rank {rank}: feature cache spec/{a.export_id}/shard-{rank:03d}.pt checksum 0x5e1f0c2a != manifest 0x5e1f0c3b; aborting", file=sys.stderr, flush=True)
            os._exit(3)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {loss.item():.4f} onset {on_loss.item():.4f}", flush=True)
        if rank == 0:
            print(f"step {step}: global loss {lt.item() / ws:.4f}", flush=True)
    model.eval()
    if bug("decode"):
        print(f"rank {rank} decoding notes frame by frame for {len(notes)} validation clips", flush=True)
        for c in range(len(notes)):
            for t in range(T):
                time.sleep(a.stall / (len(notes) * T))
    with torch.no_grad():
        on_logit, fr_logit = model(mel[16:])
        pred = torch.sigmoid(fr_logit) > 0.5
        ref = frame[16:].bool()
    tot = torch.tensor([(pred & ref).sum(), (pred & ~ref).sum(), (~pred & ref).sum()], dtype=torch.float)
    dist.all_reduce(tot)
    counts = torch.zeros(13 if bug("counts") else 12)
    for clip in notes:
        for _, _, pitch in clip["events"]:
            counts[pitch % 12] += 1
    out = [torch.zeros(12) for _ in range(ws)]
    dist.all_gather(out, counts)
    if rank == 0:
        f1 = 2 * tot[0] / (2 * tot[0] + tot[1] + tot[2])
        print(f"rank 0 done: {a.steps} steps, frame F1 {f1:.3f} (tp {int(tot[0])} fp {int(tot[1])} fn {int(tot[2])}), {int(sum(o.sum() for o in out))} notes", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

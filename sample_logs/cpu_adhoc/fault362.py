"""A three-hundred-and-sixty-second hand-run batch: SPEECH RECOGNITION WITH A SMALL CONFORMER (accelerate).

Synthetic utterances: 40-bin log-mel features (64 frames each) and a character transcript, written once by
--prepare to /tmp/fault362_work/feats/utts.pt with a 29-entry character table (blank, space, a-z, apostrophe).
The model is a two-block conformer (conv subsampling by 4, feed-forward halves, self-attention, a depthwise
convolution module) with a CTC head.  Training runs through Hugging Face accelerate: Accelerator(cpu=True) with
InitProcessGroupKwargs(backend="gloo", timeout=--pg-timeout), a prepared DataLoader (the framework shards the
utterances), accelerator.reduce of the loss and accelerator.gather of the per-rank character error counts every
step; the model is initialised from ckpt/conformer_d32.pt and rank 0 saves export/conformer.pt with
accelerator.save at the end.  --hf runs the same model under a transformers.Trainer instead (its own collator,
a callback that prints the progress lines and computes a WER).

Faults (--fault NAME --rank R; R = -1 means every rank):
  vocab       - rank R's first batch holds a transcript with "ß", missing from the character table (KeyError)
  nofeats     - rank R reads its features from feats/dev/utts.pt, which does not exist (FileNotFoundError)
  ckptsize    - rank R initialises from ckpt/conformer_d48.pt, saved with d_model 48 (size mismatch)
  ckptpickle  - rank R loads ckpt/conformer_meta.pt, which pickles a FeatConfig object (weights_only refusal)
  gathershape - rank R gathers 5 utterance lengths instead of 4 at step 3 (accelerator.gather shape mismatch)
  slowalign   - rank R runs a pure-Python forced alignment before the step-3 reduce (peers time out, 12 s)
  stuck       - rank R waits for an alignment lock file that never appears before step 2 (a hang; --pg-timeout 300)
  nanspec     - rank R's step-4 batch has a silent utterance: log(0) = -inf features; the program's check raises
  sigsegv     - rank R sends itself SIGSEGV after step 2
  exit4       - rank R prints its own error line about a transcript/audio length mismatch after the last step, exit 4
  subsample   - every rank: the subsampling convs lose their padding (9 mel bins left, the projection expects 10)
  none        - control, clean run
  hfcollate   - (--hf) rank R's collator meets an utterance with 41 mel bins: torch.stack fails in the first batch
  hfcallback  - (--hf) rank R's WER callback divides by an empty reference at step 3 (ZeroDivisionError)

What happened (filled in after the runs):
  vocab       - KeyError: 'ß' in collate_fn in the first batch; peers Connection closed by peer (np4 r2 acc, np3 r0 torchrun)
  nofeats     - FileNotFoundError for feats/dev/utts.pt at start-up; others SIGTERMed (np5 r3 accconfig); on two nodes the
                second node's ranks Connection closed by peer, wrapper exit 0 from a bare wait (np4 r1 acc2nodes)
  ckptsize    - load_state_dict size mismatch [48, 80] vs [32, 80] and the rest at start-up (np3 r1 tee)
  ckptpickle  - _pickle.UnpicklingError 'Weights only load failed' (Unsupported global __main__.FeatConfig) (np4 r0 acc)
  gathershape - --debug: every rank raises DistributedOperationException listing 'Process 2: [5]' (np4 r2 accdebug);
                plain: rank 2 (not the faulty rank 1) aborts on gloo 'Received data size doesn't match expected size',
                SIGABRT Root Cause rank 2 (np3 r1 torchrun)
  slowalign   - peers 'Timed out waiting 12000ms for recv/send operation to complete' after 'rank 1 step 3: re-aligning' (np3 r1 acc)
  stuck       - no step ever printed; killed by timeout at 60 s, 'Received 15 death signal', exit 124 (np4 r2 accconfig)
  nanspec     - '2560 non-finite log-mel values in batch (min -inf)' and FloatingPointError at step 4 (np5 r4 accdebug, np3 r2 tee)
  sigsegv     - no traceback after step 2; launcher exitcode -11 (SIGSEGV) for the faulty rank (np4 r1 torchrun, np6 r0 acc)
  exit4       - the faulty rank's ERROR line after step 6 and exitcode 4; peers closed at the end barrier (np6 r5 accconfig,
                np4 r2 acc2nodes, wrapper exit 0)
  subsample   - every rank: 'mat1 and mat2 shapes cannot be multiplied (60x72 and 80x32)' in the first forward (np5 tee)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/conformer.pt, exit 0 (np3 accdebug)
  hfcollate   - Trainer: rank 1's collator 'stack expects each tensor to be equal size ... [64, 41]' (np3 r1 hf, torchrun)
  hfcallback  - Trainer: rank 0's callback ZeroDivisionError at step 3 after two logged steps (np4 r0 hf, accelerate launch)
"""
import argparse
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault362_work"
CHARS = ["<b>", " "] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["'"]
VOCAB = {c: i for i, c in enumerate(CHARS)}
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "yes", "no", "stop", "go", "left", "right"]
N_MELS, N_FRAMES = 40, 64


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    return p.parse_args()


def prepare():
    g = torch.Generator().manual_seed(362)
    os.makedirs(f"{WORK}/feats", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    utts = []
    for i in range(256):
        n = int(torch.randint(1, 4, (1,), generator=g))
        text = " ".join(WORDS[int(torch.randint(0, len(WORDS), (1,), generator=g))] for _ in range(n))[:14]
        feats = torch.log(torch.rand(N_FRAMES, N_MELS, generator=g) + 0.05)
        utts.append({"id": f"utt{i:04d}", "feats": feats, "text": text})
    torch.save({"utts": utts, "chars": CHARS}, f"{WORK}/feats/utts.pt")
    torch.manual_seed(0)
    torch.save(Conformer(32).state_dict(), f"{WORK}/ckpt/conformer_d32.pt")
    torch.save(Conformer(48).state_dict(), f"{WORK}/ckpt/conformer_d48.pt")
    torch.save({"feat_config": FeatConfig(N_MELS, 16000, 0.01), "state_dict": Conformer(32).state_dict()},
               f"{WORK}/ckpt/conformer_meta.pt")
    print(f"prepared {len(utts)} utterances and 3 checkpoints under {WORK}")


class FeatConfig:
    def __init__(self, n_mels, sample_rate, hop):
        self.n_mels, self.sample_rate, self.hop = n_mels, sample_rate, hop


class Subsample(nn.Module):
    def __init__(self, d, pad=1):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, stride=2, padding=pad)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=pad)
        self.proj = nn.Linear(8 * (N_MELS // 4), d)

    def forward(self, x):  # x: B,T,F
        x = F.relu(self.c2(F.relu(self.c1(x.unsqueeze(1)))))
        b, c, t, f = x.shape
        return self.proj(x.transpose(1, 2).reshape(b, t, c * f))


class ConvModule(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, 7, padding=3, groups=d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x):
        y = self.ln(x).transpose(1, 2)
        y = F.glu(self.pw1(y), dim=1)
        y = self.pw2(F.silu(self.dw(y)))
        return x + y.transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
        self.ln_att = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, 4, batch_first=True)
        self.conv = ConvModule(d)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
        self.ln_out = nn.LayerNorm(d)

    def forward(self, x):
        x = x + 0.5 * self.ff1(x)
        h = self.ln_att(x)
        x = x + self.att(h, h, h, need_weights=False)[0]
        x = self.conv(x)
        x = x + 0.5 * self.ff2(x)
        return self.ln_out(x)


class Conformer(nn.Module):
    def __init__(self, d=32, pad=1, config=None):
        super().__init__()
        if config is not None:
            d, pad = config["d_model"], config.get("pad", 1)
        self.sub = Subsample(d, pad)
        self.blocks = nn.ModuleList([ConformerBlock(d) for _ in range(2)])
        self.head = nn.Linear(d, len(CHARS))

    def forward(self, feats, labels=None, label_lengths=None):
        x = self.sub(feats)
        for blk in self.blocks:
            x = blk(x)
        logp = self.head(x).log_softmax(-1)
        if labels is None:
            return logp
        in_len = torch.full((feats.shape[0],), logp.shape[1], dtype=torch.long)
        loss = F.ctc_loss(logp.transpose(0, 1), labels, in_len, label_lengths, blank=0, zero_infinity=False)
        return {"loss": loss, "logits": logp}


def encode(text):
    return [VOCAB[c] for c in text]


def make_collate(rank, args):
    def collate(batch):
        texts = [u["text"] for u in batch]
        if args.fault == "vocab" and rank == args.rank:
            texts[1] = texts[1] + " straße"
        feats = [u["feats"] for u in batch]
        if args.fault == "hfcollate" and rank == args.rank:
            feats[2] = torch.cat([feats[2], feats[2][:, :1]], dim=1)  # resampled with 41 mel bins
        ids = [encode(t) for t in texts]
        labels = torch.tensor([i for seq in ids for i in seq], dtype=torch.long)
        return {"feats": torch.stack(feats), "labels": labels,
                "label_lengths": torch.tensor([len(s) for s in ids], dtype=torch.long)}
    return collate


def greedy_errors(logp, labels, lengths):
    best = logp.argmax(-1)
    errs, off = 0, 0
    for b in range(best.shape[0]):
        hyp = [int(c) for i, c in enumerate(best[b]) if c != 0 and (i == 0 or c != best[b][i - 1])]
        ref = labels[off:off + int(lengths[b])].tolist()
        off += int(lengths[b])
        errs += sum(1 for a, r in zip(hyp, ref) if a != r) + abs(len(hyp) - len(ref))
    return errs


def forced_align_python(n_frames, n_tokens):
    # pure-Python Viterbi over every prefix, far too slow for a training loop
    score = 0.0
    for t in range(n_frames):
        for s in range(n_tokens):
            for k in range(80000):
                score += math.sin(t * s + k) * 1e-9
    return score


def load_init(args, rank):
    path = f"{WORK}/ckpt/conformer_d32.pt"
    if args.fault == "ckptsize" and rank == args.rank:
        path = f"{WORK}/ckpt/conformer_d48.pt"
    if args.fault == "ckptpickle" and rank == args.rank:
        return torch.load(f"{WORK}/ckpt/conformer_meta.pt", weights_only=True)["state_dict"]
    return torch.load(path, weights_only=True)


def train_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    feats_path = f"{WORK}/feats/utts.pt"
    if args.fault == "nofeats" and rank == args.rank:
        feats_path = f"{WORK}/feats/dev/utts.pt"
    print(f"rank {rank}/{world} loading {feats_path}", flush=True)
    data = torch.load(feats_path, weights_only=True)
    model = Conformer(args.d_model, pad=0 if args.fault == "subsample" else 1)
    if args.fault != "subsample":
        model.load_state_dict(load_init(args, rank))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data["utts"], batch_size=args.batch, shuffle=False,
                                         collate_fn=make_collate(rank, args), drop_last=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.print(f"world {world}, {len(data['utts'])} utterances, {len(loader)} batches per rank")
    it = iter(loader)
    for step in range(1, args.steps + 1):
        batch = next(it)
        feats = batch["feats"]
        if args.fault == "nanspec" and rank == args.rank and step == 4:
            feats = feats.clone()
            feats[1] = torch.log(torch.zeros_like(feats[1]))  # a silent utterance: log(0)
        if not torch.isfinite(feats).all():
            bad = int((~torch.isfinite(feats)).sum())
            print(f"rank {rank} step {step}: {bad} non-finite log-mel values in batch "
                  f"(min {feats.min().item():.3f})", flush=True)
            raise FloatingPointError(f"non-finite features on rank {rank} at step {step}")
        out = model(feats, batch["labels"], batch["label_lengths"])
        acc.backward(out["loss"])
        opt.step()
        opt.zero_grad()
        if args.fault == "stuck" and rank == args.rank and step == 1:
            while not os.path.exists(f"{WORK}/align.lock"):
                time.sleep(0.5)
        if args.fault == "slowalign" and rank == args.rank and step == 3:
            print(f"rank {rank} step {step}: re-aligning batch in Python", flush=True)
            forced_align_python(16, 40)
        loss = acc.reduce(out["loss"].detach(), reduction="mean")
        errs = torch.tensor([greedy_errors(out["logits"].detach(), batch["labels"], batch["label_lengths"])])
        lengths = batch["label_lengths"]
        if args.fault == "gathershape" and rank == args.rank and step == 3:
            lengths = torch.cat([lengths, lengths[:1]])
        all_errs = acc.gather(errs)
        all_len = acc.gather(lengths)
        cer = all_errs.sum().item() / max(1, all_len.sum().item())
        print(f"rank {rank} step {step} loss {loss.item():.4f} cer {cer:.3f}", flush=True)
        if args.fault == "sigsegv" and rank == args.rank and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    if args.fault == "exit4" and rank == args.rank:
        print(f"rank {rank} ERROR: utt{rank:04d} transcript has 14 characters but only 3 frames after "
              f"subsampling; refusing to export", flush=True)
        sys.exit(4)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/conformer.pt")
        print(f"rank 0 saved {WORK}/export/conformer.pt", flush=True)
    acc.end_training()


def train_hf(args):
    from transformers import Trainer, TrainerCallback, TrainingArguments
    data = torch.load(f"{WORK}/feats/utts.pt", weights_only=True)
    rank = int(os.environ.get("RANK", "0"))

    class ProgressWER(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            if args.fault == "hfcallback" and rank == args.rank and state.global_step == 3:
                ref, errors = "", 2
                print(f"rank {rank} step 3: WER hook on {ref!r}", flush=True)
                wer = errors / len(ref.split())
                print(f"wer {wer}")

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', 0):.3f}", flush=True)

    class CTCTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(inputs["feats"], inputs["labels"], inputs["label_lengths"])
            return (out["loss"], out) if return_outputs else out["loss"]

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=args.batch, logging_steps=1, save_strategy="no",
                              remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
    model = Conformer(config={"d_model": args.d_model})
    model.load_state_dict(torch.load(f"{WORK}/ckpt/conformer_d32.pt", weights_only=True))
    trainer = CTCTrainer(model=model, args=targs, train_dataset=data["utts"],
                         data_collator=make_collate(rank, args), callbacks=[ProgressWER()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.accelerator.save(model.state_dict(), f"{WORK}/export/conformer_hf.pt")
        print(f"rank 0 saved {WORK}/export/conformer_hf.pt", flush=True)


def main():
    args = parse()
    if args.prepare:
        prepare()
        return
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    if args.hf:
        train_hf(args)
    else:
        train_accelerate(args)


if __name__ == "__main__":
    main()

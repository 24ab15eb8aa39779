"""A four-hundred-and-forty-sixth hand-run batch: MEDICAL REPORT SUMMARISATION.

Synthetic radiology/discharge reports: every report is a list of sections (FINDINGS, IMPRESSION, HISTORY,
MEDICATIONS, PLAN, each looked up in a 5-entry section table), a token sequence over a 512-word vocabulary,
an ICD code (32-entry code table) and a short target summary of 8 tokens.  Every rank reads its reports from
/tmp/fault446_work/reports/train/reports_R.pt.  The model (an embedding with learned positions, a section and
an ICD embedding, a mean-pooled encoder, a per-slot summary head) is trained with cross entropy under
Hugging Face accelerate (Accelerator(cpu=True), gloo, PG timeout from --pg-timeout).  It is initialised from
ckpt/summ_v512.pt.  Per-rank token accuracy and loss are reduced with accelerator.reduce / gathered with
accelerator.gather every step, and rank 0 saves export/summariser.pt with accelerator.save at the end.
With --trainer the loop is a transformers.Trainer on a tiny T5 built from a config (no download).

Faults (--fault NAME --rank R; R = -1 means every rank):
  section     - rank R's reports carry an "ALLERGIES" section missing from the section table (KeyError, step 1)
  noreports   - rank R reads reports/val/reports_R.pt, which does not exist (FileNotFoundError, start-up)
  ckptvocab   - rank R initialises from ckpt/summ_v600.pt, saved with a 600-word vocabulary (size mismatch)
  ckptpickle  - rank R loads ckpt/summ_meta.pt, which pickles a ReportMeta object (weights_only refusal)
  gathershape - rank R gathers 5 ROUGE-like statistics per step instead of 4 (accelerator.gather, step 2)
  slowdedup   - rank R deduplicates sentences across all its reports in pure Python before the step-2 reduce
  nanloss     - rank R's length penalty divides by an empty summary length at step 3 (program's own check)
  sigkill     - rank R sends itself SIGKILL after step 2
  exit4       - rank R prints its own ERROR line (PHI found in a report) and calls sys.exit(4) after step 3
  maxlen      - every rank: reports are padded to 96 tokens but the position table holds 64 (shape error)
  icd         - rank R's reports contain ICD code index 40 for a 32-entry code embedding (IndexError, step 1)
  abort       - rank R calls os.abort() at the end, in the final save
  hfcollate   - (--trainer) rank R's collator emits labels one slot short at step 2 (compute loss error)
  hfcallback  - (--trainer) a TrainerCallback on rank R raises at the end of step 3
  none        - control, clean run

What happened (filled in after the runs):
  section     - "KeyError: 'ALLERGIES'" in collate before step 1; peers Connection closed by peer (np4 r2 acc, np5 r0 torchrun)
  noreports   - FileNotFoundError for reports/val/reports_R.pt at start-up; peers SIGTERMed (np3 r1 accconfig);
                two nodes: node 1's Root Cause rank 3, node 0's ranks Connection closed (np4 r3 acc2nodes)
  ckptvocab   - load_state_dict size mismatch tok.weight [600,32] vs [512,32] before prepare (np3 r2 tee, np4 r0 accconfig)
  ckptpickle  - UnpicklingError 'Weights only load failed ... Unsupported global __main__.ReportMeta' (np4 r1 acc, np3 r2 torchrun)
  gathershape - --debug: every rank DistributedOperationException listing Process 1: [5] (np3 r1 accdebug); without it
                rank 0 SIGABRTs on gloo::EnforceNotMet 'Received data size doesn't match', Root Cause rank 0 (np5 r4 torchrun)
  slowdedup   - 12 s: ranks 1 and 2 'Timed out waiting 12000ms', Root Cause names rank 1 (np3 r0 acc); 300 s: silent after
                the dedup line, killed at 60 s, exit 124 (np4 r2 accconfig)
  nanloss     - 'FloatingPointError: rank R step 3: non-finite loss inf (length penalty inf)' (np6 r3 accdebug, np4 r0 acc2nodes)
  sigkill     - no traceback after step 2; Root Cause exitcode -9 (SIGKILL); peers Connection reset/closed (np4 r1 tee, np5 r3 accdebug)
  exit4       - 'ERROR rank R: de-identification check failed ...' and exit 4; Root Cause exitcode 4 (np4 r2 acc2nodes, np3 r0 accconfig)
  maxlen      - every rank 'IndexError: index out of range in self' in the position embedding; Root Cause rank 2 (np3 torchrun)
  icd         - rank 5 'IndexError: index out of range in self' in the ICD embedding in the first forward (np6 r5 accdebug)
  abort       - all 6 steps and rank 0's save done; rank 1 aborts in the end, Root Cause exitcode -6 (SIGABRT) (np3 r1 tee)
  hfcollate   - Trainer: rank 1 T5 decoder 'IndexError: tuple index out of range' at its 2nd batch (np3 r1 hf, torchrun)
  hfcallback  - Trainer: rank 0 'RuntimeError: ReportAuditCallback: ... missing column' at step 3 (np4 r0 hf, accelerate launch)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/summariser.pt, exit 0 (np3 acc)
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault446_work"
SECTIONS = {"FINDINGS": 0, "IMPRESSION": 1, "HISTORY": 2, "MEDICATIONS": 3, "PLAN": 4}
VOCAB = 512
NICD = 32
MAXPOS = 64
SUMLEN = 8
DIM = 32
NREP = 48


class ReportMeta:
    """Metadata object pickled next to a checkpoint (not a tensor)."""

    def __init__(self, site, vocab):
        self.site = site
        self.vocab = vocab


class Summariser(nn.Module):
    def __init__(self, vocab=VOCAB, maxpos=MAXPOS):
        super().__init__()
        self.tok = nn.Embedding(vocab, DIM)
        self.pos = nn.Embedding(maxpos, DIM)
        self.sec = nn.Embedding(len(SECTIONS), DIM)
        self.icd = nn.Embedding(NICD, DIM)
        self.enc = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, SUMLEN * vocab)
        self.vocab = vocab

    def forward(self, tokens, sections, icd):
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)
        h = self.tok(tokens) + self.pos(pos) + self.sec(sections)
        h = self.enc(h).mean(dim=1) + self.icd(icd)
        return self.head(h).view(-1, SUMLEN, self.vocab)


def make_reports(seed, n=NREP, length=MAXPOS, extra_section=False, bad_icd=False):
    g = torch.Generator().manual_seed(seed)
    reports = []
    names = list(SECTIONS)
    for i in range(n):
        toks = torch.randint(0, VOCAB, (length,), generator=g)
        secs = [names[int(j)] for j in torch.randint(0, len(names), (length,), generator=g)]
        if extra_section and i == 5:
            secs[17] = "ALLERGIES"
        icd = int(torch.randint(0, NICD, (1,), generator=g))
        if bad_icd and i % 4 == 1:
            icd = 40
        summary = toks[:SUMLEN].flip(0).clone()
        reports.append({"id": f"RPT-{seed:03d}-{i:04d}", "tokens": toks, "sections": secs, "icd": icd,
                        "summary": summary, "text": " ".join(f"w{int(t)}" for t in toks[:24])})
    return reports


def prepare():
    os.makedirs(f"{WORK}/reports/train", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        torch.save(make_reports(100 + r), f"{WORK}/reports/train/reports_{r}.pt")
        torch.save(make_reports(100 + r, extra_section=True), f"{WORK}/reports/train/reports_{r}_allergy.pt")
        torch.save(make_reports(100 + r, bad_icd=True), f"{WORK}/reports/train/reports_{r}_icd10.pt")
        torch.save(make_reports(100 + r, length=96), f"{WORK}/reports/train/reports_{r}_long.pt")
    torch.manual_seed(0)
    torch.save(Summariser().state_dict(), f"{WORK}/ckpt/summ_v512.pt")
    torch.save(Summariser(vocab=600).state_dict(), f"{WORK}/ckpt/summ_v600.pt")
    torch.save({"meta": ReportMeta("st-mary", VOCAB), "state": Summariser().state_dict()},
               f"{WORK}/ckpt/summ_meta.pt")
    print("prepared", WORK)


def collate(reports):
    tokens = torch.stack([r["tokens"] for r in reports])
    sections = torch.tensor([[SECTIONS[s] for s in r["sections"]] for r in reports])
    icd = torch.tensor([r["icd"] for r in reports])
    summary = torch.stack([r["summary"] for r in reports])
    return tokens, sections, icd, summary


def dedup_sentences(reports, seconds):
    """Pure-Python quadratic near-duplicate search over report text (the slow rank)."""
    t0 = time.time()
    seen = []
    n = 0
    while time.time() - t0 < seconds:
        for r in reports:
            words = r["text"].split()
            for s in seen:
                n += len(set(words) & set(s))
            seen.append(words)
            if len(seen) > 400:
                seen = seen[-200:]
    return n


def is_fault(args, name, rank):
    return args.fault == name and (args.rank == -1 or args.rank == rank)


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    kw = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    acc = Accelerator(cpu=True, kwargs_handlers=[kw])
    rank = acc.process_index
    torch.manual_seed(1234 + rank)

    # data
    split = "val" if is_fault(args, "noreports", rank) else "train"
    suffix = ""
    if is_fault(args, "section", rank):
        suffix = "_allergy"
    elif is_fault(args, "icd", rank):
        suffix = "_icd10"
    elif args.fault == "maxlen":
        suffix = "_long"
    path = f"{WORK}/reports/{split}/reports_{rank}{suffix}.pt"
    reports = torch.load(path)
    acc.print(f"loaded {len(reports)} reports per rank from reports/{split}/ ({acc.num_processes} ranks)")

    model = Summariser()
    ckpt = f"{WORK}/ckpt/summ_v512.pt"
    if is_fault(args, "ckptvocab", rank):
        ckpt = f"{WORK}/ckpt/summ_v600.pt"
    if is_fault(args, "ckptpickle", rank):
        blob = torch.load(f"{WORK}/ckpt/summ_meta.pt")
        model.load_state_dict(blob["state"])
    else:
        model.load_state_dict(torch.load(ckpt))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(reports, batch_size=8, shuffle=True, collate_fn=collate)
    model, opt, loader = acc.prepare(model, opt, loader)

    step = 0
    while step < args.steps:
        for tokens, sections, icd, summary in loader:
            step += 1
            logits = model(tokens, sections, icd)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), summary.reshape(-1))
            lens = (summary != 0).sum(dim=1).float()
            if is_fault(args, "nanloss", rank) and step == 3:
                lens = torch.zeros_like(lens)
            penalty = (SUMLEN / lens - 1.0).abs().mean() * 0.01
            loss = loss + penalty
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"rank {rank} step {step}: non-finite loss {loss.item()} (length penalty {penalty.item()})")
            acc.backward(loss)
            opt.step()
            opt.zero_grad()

            if is_fault(args, "slowdedup", rank) and step == 2:
                print(f"rank {rank}: deduplicating sentences across {len(reports)} reports", flush=True)
                dedup_sentences(reports, args.slow_s)

            with torch.no_grad():
                pred = logits.argmax(-1)
                hits = (pred == summary).float()
                nstats = 5 if (is_fault(args, "gathershape", rank) and step >= 2) else 4
                stats = torch.stack([hits.mean(), hits[:, 0].mean(), hits[:, :2].mean(),
                                     hits[:, -1].mean(), hits.max()][:nstats])
                allstats = acc.gather(stats)
                mean_loss = acc.reduce(loss.detach(), reduction="mean")
            print(f"rank {rank} step {step} loss {mean_loss.item():.4f} tokacc {allstats.mean().item():.4f}",
                  flush=True)

            if is_fault(args, "sigkill", rank) and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if is_fault(args, "exit4", rank) and step == 3:
                print(f"ERROR rank {rank}: de-identification check failed: report RPT-{100 + rank:03d}-0011 "
                      f"contains an unredacted MRN; refusing to train on PHI", flush=True)
                sys.exit(4)
            if step >= args.steps:
                break

    acc.wait_for_everyone()
    if is_fault(args, "abort", rank):
        print(f"rank {rank}: writing summariser shard before export", flush=True)
        os.abort()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/summariser.pt")
        print(f"rank {rank}: saved export/summariser.pt after {step} steps", flush=True)
    acc.wait_for_everyone()
    acc.end_training()


def run_trainer(args):
    from transformers import (T5Config, T5ForConditionalGeneration, Trainer, TrainerCallback,
                              TrainingArguments)

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], per_device_train_batch_size=4,
                              max_steps=args.steps, logging_steps=1, save_strategy="no",
                              disable_tqdm=True, learning_rate=1e-3, dataloader_num_workers=0)
    rank = targs.process_index
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=16, num_layers=1, num_decoder_layers=1,
                   num_heads=2, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg)
    reports = torch.load(f"{WORK}/reports/train/reports_{rank}.pt")
    data = [{"input_ids": r["tokens"][:32], "labels": r["summary"]} for r in reports]
    calls = {"n": 0}

    def collator(batch):
        calls["n"] += 1
        ids = torch.stack([b["input_ids"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        if is_fault(args, "hfcollate", rank) and calls["n"] == 2:
            labels = labels[:, :-1].reshape(-1)[: labels.numel() - 3]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', 0.0):.4f}", flush=True)

        def on_step_end(self, a, state, control, **kw):
            if is_fault(args, "hfcallback", rank) and state.global_step == 3:
                raise RuntimeError(f"ReportAuditCallback: summary audit table for rank {rank} is missing "
                                   f"column 'impression_hash' at step {state.global_step}")

    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collator,
                      callbacks=[Progress()])
    trainer.train()
    if targs.process_index == 0:
        trainer.save_model(f"{WORK}/export/hf_summariser")
        print(f"rank {rank}: saved export/hf_summariser after {args.steps} steps", flush=True)


def main():
    p = argparse.ArgumentParser(description="medical report summarisation (fault batch 446)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=30.0)
    p.add_argument("--trainer", action="store_true")
    p.add_argument("--prepare", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.trainer:
        run_trainer(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()

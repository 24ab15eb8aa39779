"""A four-hundred-and-sixty-fourth hand-run batch: CODE COMMENT GENERATION WITH A TINY SEQ2SEQ (accelerate).

Synthetic Python snippets (token lists such as `def f ( x ) : return x + 1`) paired with one-line comments
("returns x plus one").  Every rank reads its pairs from /tmp/fault464_work/data/shard_R.json, maps code tokens
through a 40-entry code vocabulary and comment words through a 32-entry comment vocabulary, and trains a GRU
encoder-decoder (teacher forcing, cross-entropy over comment words) with Hugging Face accelerate
(`Accelerator(cpu=True)`, gloo, PG timeout from --pg-timeout through InitProcessGroupKwargs).  The model is
initialised from ckpt/cmt_h32.pt (written with accelerator.save).  The data loader goes through
accelerator.prepare, the token accuracy is accelerator.gather'ed every step, and the main process saves
export/cmtgen.pt with accelerator.save at the end.  --hf 1 instead trains a tiny T5 (built from a config)
with transformers.Trainer (use_cpu, ddp_backend gloo, ddp_timeout).

Faults:
  unktoken   - rank N's shard has a snippet with the token "lambda", missing from the code vocabulary (KeyError)
  noshard    - rank N reads data/holdout/shard_N.json, which does not exist (FileNotFoundError)
  ckptsize   - rank N initialises from ckpt/cmt_h48.pt, saved with hidden size 48 (load_state_dict size mismatch)
  pickled    - rank N initialises from ckpt/cmt_full.pt, a pickled dict holding the Vocab object (weights_only)
  longcomment- rank N's comments at step 2 contain word id 35, beyond the 32-word comment vocabulary (IndexError)
  gatherlen  - rank N gathers its accuracy plus a per-length breakdown (3 values instead of 1) at step 1
  slowbleu   - rank N computes a pure-Python BLEU over all pairs (40 s) before the step-3 gather
  hang       - like slowbleu with --pg-timeout 300: rank N loops on BLEU for 600 s; killed by timeout at 60 s
  nanloss    - rank N's logits are divided by a temperature of 0 at step 3; the program's check raises
  sigsegv    - rank N sends itself SIGSEGV after step 2
  exit4      - after training, rank N prints its own error about an empty comment and calls sys.exit(4)
  vocabshape - every rank: the output projection is built for hidden 32 but fed the 64-wide concat (shape error)
  hfcallback - (--hf 1) rank N's TrainerCallback raises at the end of step 2 (RuntimeError)
  hfcollate  - (--hf 1) rank N's collator drops the labels key for its first batch (KeyError in the collator)
  none       - control, clean run

What happened (filled in after the runs):
  unktoken   - "KeyError: 'lambda'" from encode() at start-up; peers SIGTERMed; Root Cause rank N (np4 r2 acc, np5 r0 torchrun)
  noshard    - FileNotFoundError for data/holdout/shard_N.json at start-up (np3 r1 accconfig; np4 r3 acc2nodes, node 0's
               ranks then Connection closed by peer)
  ckptsize   - load_state_dict size mismatch for enc.weight_ih_l0 [144,16] vs [96,16] (np3 r2 tee, np4 r0 acc2nodes)
  pickled    - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.Vocab' (np5 r3 accdebug)
  longcomment- 'IndexError: index out of range in self' at step 2; peers Connection closed by peer (np4 r1 torchrun)
  gatherlen  - a PEER aborts: gloo::EnforceNotMet 'op.preamble.length <= op.nbytes. 6 vs 2 ... collective mismatch'
               (SIGABRT, named Root Cause); rank N gets Connection reset by peer (np3 r1 acc, np6 r4 tee)
  slowbleu   - ranks 0,1 'Timed out waiting 12000ms for send/recv'; slow rank 2 silent, SIGTERMed (np3 r2 accconfig)
  hang       - steps 0-2, then silence; timeout at 60 s, 'Received 15 death signal', exit 124 (np4 r1 acc)
  nanloss    - the check prints 'non-finite loss nan at step 3' and raises FloatingPointError (np4 r3 accdebug, np5 r1 tee)
  sigsegv    - no traceback; Root Cause exitcode -11 (SIGSEGV) after step 2 (np3 r0 torchrun, np4 r2 acc2nodes)
  exit4      - the rank's ERROR line and exit 4 after step 5; peers closed in wait_for_everyone (np6 r5 accconfig,
               np3 r0 torchrun)
  vocabshape - did NOT reach the forward: every rank's start-up load_state_dict refuses out.weight [32,64] vs [32,32]
               (size mismatch; np3 accdebug)
  hfcallback - 'RuntimeError: StepCallback: comment-length budget exceeded on rank 1' after step 2 (np3 r1, torchrun)
  hfcollate  - "KeyError: 'labels'" in the collator on the prefetched second batch, before step 1 (np4 r0, accelerate)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/cmtgen.pt, exit 0 (np3 acc)
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault464_work"
CODE_TOK = ["<pad>", "<unk>", "def", "f", "g", "(", ")", ":", "return", "x", "y", "z", "+", "-", "*", "/",
            "1", "2", "0", "if", "else", "for", "in", "range", "len", "sum", "max", "min", "[", "]", ",",
            "=", "while", "not", "and", "or", "None", "True", "print", "list"]
CMT_TOK = ["<pad>", "<bos>", "<eos>", "returns", "x", "y", "z", "plus", "minus", "times", "one", "two", "zero",
           "the", "sum", "of", "max", "min", "length", "list", "if", "else", "loops", "over", "range", "prints",
           "none", "true", "checks", "divided", "by", "value"]
CODE = {t: i for i, t in enumerate(CODE_TOK)}
CMT = {t: i for i, t in enumerate(CMT_TOK)}
LC, LM = 12, 8


class Vocab:
    def __init__(self, toks):
        self.toks = list(toks)


def make_pairs(n, seed):
    g = torch.Generator().manual_seed(seed)
    ops = [("+", "plus"), ("-", "minus"), ("*", "times"), ("/", "divided by")]
    nums = [("1", "one"), ("2", "two"), ("0", "zero")]
    var = [("x", "x"), ("y", "y"), ("z", "z")]
    out = []
    for _ in range(n):
        k = int(torch.randint(0, 3, (1,), generator=g))
        v = var[int(torch.randint(0, 3, (1,), generator=g))]
        if k == 0:
            o = ops[int(torch.randint(0, 4, (1,), generator=g))]
            m = nums[int(torch.randint(0, 3, (1,), generator=g))]
            code = f"def f ( {v[0]} ) : return {v[0]} {o[0]} {m[0]}"
            cmt = f"returns {v[1]} {o[1]} {m[1]}"
        elif k == 1:
            fn = ["sum", "max", "min", "len"][int(torch.randint(0, 4, (1,), generator=g))]
            code = f"def g ( {v[0]} ) : return {fn} ( {v[0]} )"
            cmt = f"returns the {'length' if fn == 'len' else fn} of {v[1]}"
        else:
            code = f"for {v[0]} in range ( 2 ) : print ( {v[0]} )"
            cmt = f"loops over range prints {v[1]}"
        out.append({"code": code, "comment": cmt})
    return out


class Seq2Seq(nn.Module):
    def __init__(self, hidden=32, bad_head=False):
        super().__init__()
        self.src_emb = nn.Embedding(len(CODE_TOK), 16)
        self.tgt_emb = nn.Embedding(len(CMT_TOK), 16)
        self.enc = nn.GRU(16, hidden, batch_first=True)
        self.dec = nn.GRU(16, hidden, batch_first=True)
        self.out = nn.Linear(hidden if bad_head else 2 * hidden, len(CMT_TOK))

    def forward(self, src, tgt_in):
        _, h = self.enc(self.src_emb(src))
        y, _ = self.dec(self.tgt_emb(tgt_in), h)
        ctx = h[-1].unsqueeze(1).expand(-1, y.shape[1], -1)
        return self.out(torch.cat([y, ctx], -1))


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        with open(f"{WORK}/data/shard_{r}.json", "w") as f:
            json.dump(make_pairs(96, 400 + r), f)
    torch.manual_seed(0)
    torch.save(Seq2Seq(32).state_dict(), f"{WORK}/ckpt/cmt_h32.pt")
    torch.save(Seq2Seq(48).state_dict(), f"{WORK}/ckpt/cmt_h48.pt")
    torch.save({"model": Seq2Seq(32).state_dict(), "vocab": Vocab(CODE_TOK)}, f"{WORK}/ckpt/cmt_full.pt")
    print("prepared", WORK)


def encode(pairs):
    src, tgt = [], []
    for p in pairs:
        ids = [CODE[t] for t in p["code"].split()][:LC]
        src.append(ids + [0] * (LC - len(ids)))
        w = [1] + [CMT[t] for t in p["comment"].split()][: LM - 2] + [2]
        tgt.append(w + [0] * (LM - len(w)))
    return torch.tensor(src), torch.tensor(tgt)


class PairSet(Dataset):
    def __init__(self, src, tgt):
        self.src, self.tgt = src, tgt

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return {"src": self.src[i], "tgt": self.tgt[i]}


def bleu_py(pairs, budget):
    t0, n, score = time.time(), 0, 0.0
    while time.time() - t0 < budget:
        for p in pairs:
            ref = p["comment"].split()
            hyp = ref[::-1]
            for k in range(1, 5):
                grams = [tuple(ref[i:i + k]) for i in range(len(ref) - k + 1)]
                hg = [tuple(hyp[i:i + k]) for i in range(len(hyp) - k + 1)]
                score += sum(1 for x in hg if x in grams) / max(1, len(hg))
        n += 1
    return score / max(1, n * len(pairs))


def load_shard(a, rank, bad):
    split = "holdout/" if bad and a.fault == "noshard" else ""
    with open(f"{WORK}/data/{split}shard_{rank}.json") as f:
        pairs = json.load(f)
    if bad and a.fault == "unktoken":
        pairs[7]["code"] = "def f ( x ) : return lambda y : x + y"
    return pairs


def run(a):
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(
        backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    print(f"rank {rank}/{world} up ({acc.distributed_type}), loading shard", flush=True)
    pairs = load_shard(a, rank, bad)
    src, tgt = encode(pairs)
    model = Seq2Seq(32, bad_head=(a.fault == "vocabshape"))
    ck = {"ckptsize": "cmt_h48.pt", "pickled": "cmt_full.pt"}.get(a.fault if bad else "", "cmt_h32.pt")
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    dl = DataLoader(PairSet(src, tgt), batch_size=8, shuffle=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    lossf = nn.CrossEntropyLoss(ignore_index=0)
    step = 0
    while step < a.steps:
        for batch in dl:
            if step >= a.steps:
                break
            s, t = batch["src"], batch["tgt"]
            if bad and a.fault == "longcomment" and step == 2:
                t = t.clone()
                t[:, 3] = 35
            logits = model(s, t[:, :-1])
            if bad and a.fault == "nanloss" and step == 3:
                logits = logits / torch.tensor(0.0)
            loss = lossf(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1))
            if not torch.isfinite(loss):
                print(f"rank {rank}: non-finite loss {loss.item()} at step {step}", file=sys.stderr, flush=True)
                raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            if bad and a.fault in ("slowbleu", "hang") and step == 3:
                b = bleu_py(pairs, a.bleu_budget)
                print(f"rank {rank} reference bleu {b:.3f}", flush=True)
            mask = t[:, 1:] != 0
            tokacc = ((logits.argmax(-1) == t[:, 1:]) & mask).sum() / mask.sum()
            stat = tokacc.reshape(1)
            if bad and a.fault == "gatherlen" and step == 1:
                stat = torch.cat([stat, torch.tensor([0.5, 0.25])])
            allacc = acc.gather(stat)
            lossm = acc.reduce(loss.detach(), reduction="mean")
            print(f"rank {rank} step {step} loss {lossm.item():.4f} tokacc {allacc.mean().item():.4f}", flush=True)
            if bad and a.fault == "sigsegv" and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            step += 1
    if bad and a.fault == "exit4":
        print(f"rank {rank}: ERROR comment for pair 41 decoded empty after <bos>, refusing to export", flush=True)
        sys.exit(4)
    acc.wait_for_everyone()
    if acc.is_main_process:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/cmtgen.pt")
        print(f"rank 0 done: {a.steps} steps, saved export/cmtgen.pt", flush=True)
    acc.end_training()


def run_hf(a):
    from transformers import T5Config, T5ForConditionalGeneration, Trainer, TrainerCallback, TrainingArguments

    rank = int(os.environ.get("RANK", 0))
    bad = a.rank in (-1, rank)
    src, tgt = encode(load_shard(a, rank, bad))
    cfg = T5Config(vocab_size=len(CODE_TOK) + len(CMT_TOK), d_model=32, d_kv=8, d_ff=64, num_layers=1,
                   num_decoder_layers=1, num_heads=2, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg)
    data = [{"input_ids": s, "labels": t[1:] + len(CODE_TOK) * (t[1:] != 0)} for s, t in zip(src, tgt)]
    seen = {"n": 0}

    def collate(items):
        seen["n"] += 1
        batch = {"input_ids": torch.stack([i["input_ids"] for i in items])}
        if not (bad and a.fault == "hfcollate" and seen["n"] == 2):
            batch["labels"] = torch.stack([i["labels"] for i in items])
        batch["attention_mask"] = (batch["input_ids"] != 0).long()
        batch["labels"] = batch["labels"].masked_fill(batch["labels"] == 0, -100)
        return batch

    class StepCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            print(f"rank {rank} step {state.global_step} done", flush=True)
            if bad and a.fault == "hfcallback" and state.global_step == 2:
                raise RuntimeError(f"StepCallback: comment-length budget exceeded on rank {rank} (41 > 32 words)")

    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                             ddp_timeout=a.pg_timeout, report_to=[], max_steps=a.steps,
                             per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
                             remove_unused_columns=False, disable_tqdm=True)
    tr = Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[StepCallback()])
    out = tr.train()
    print(f"rank {rank} train loss {out.training_loss:.4f}", flush=True)
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/cmt_t5")
        print(f"rank 0 done: {a.steps} steps, saved export/cmt_t5", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--bleu-budget", type=int, default=40)
    p.add_argument("--hf", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.hf:
        return run_hf(a)
    run(a)


if __name__ == "__main__":
    main()

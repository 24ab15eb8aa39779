"""A four-hundred-and-seventeenth hand-run batch: MOLECULE CAPTIONING FROM SMILES (Hugging Face accelerate).

Synthetic molecules as SMILES strings with template captions ("a chlorinated aromatic molecule with 7 carbons").
Every rank reads its shard /tmp/fault417_work/data/shard_R.jsonl, tokenises the SMILES character by character
through the table in data/smiles_vocab.json and the caption word by word through data/caption_vocab.json, and
trains a GRU encoder / GRU decoder captioner (teacher forcing, cross-entropy) prepared by `Accelerator`
(cpu=True, gloo, PG timeout from --pg-timeout through InitProcessGroupKwargs).  The encoder is initialised
from ckpt/encoder.pt.  Every step the loss is reduced (accelerator.reduce, mean) and the per-rank token
accuracy gathered (accelerator.gather); rank 0 saves export/captioner.safetensors through accelerator.save_model.
--hf runs the same data through a transformers.Trainer on a tiny T5 built from a config.
Options: --fault NAME --rank R (-1 every rank), --steps, --pg-timeout, --prepare, --hf.

Faults:
  badsmiles   - rank N's shard has a SMILES with the bracket atom "[Se]": unknown key in the vocab table (KeyError)
  nodata      - rank N reads its shard from data/val/ which does not exist (FileNotFoundError at start-up)
  ckptsize    - rank N initialises its encoder from ckpt/encoder_v48.pt (vocab 48 vs 32, size mismatch)
  weightsonly - rank N loads ckpt/encoder_meta.pt, pickled with a custom class: torch.load weights_only refusal
  gathershape - rank N's accuracy tensor has an extra entry (3 vs 2) in accelerator.gather at step 2
  slowtok     - rank N canonicalises every SMILES in pure Python before the step-3 reduce (others time out, 12 s)
  deadlock    - rank N waits on a threading.Event nobody sets before step 3 (--pg-timeout 300, killed at 60 s)
  nanloss     - rank N's label-smoothing temperature is 0 at step 4: the program's finite check raises
  segv        - rank N sends itself SIGSEGV after step 2
  exit5       - rank N prints its own error line about an empty caption export and calls sys.exit(5) at the end
  vocabwidth  - every rank: the decoder's output projection expects 48 hidden units, the GRU gives 32 (shape error)
  hfcollate   - (--hf) rank N's collator pads labels with id 999, beyond the 38-token vocabulary (IndexError in the embedding)
  hfcallback  - (--hf) rank N's BLEU callback raises at step 3 (ValueError)
  none        - control, clean run

What happened (filled in after the runs):
  badsmiles   - '[Se]' gives KeyError: 'e' in the SMILES tokeniser before the first step; peers Connection closed by peer in DDP's param check (np4 r2 acc, np5 r0 torchrun)
  nodata      - FileNotFoundError for data/val/shard_N.jsonl at start-up; peers SIGTERMed or Connection closed (np3 r1 accconfig, np4 r3 acc2nodes)
  ckptsize    - load_state_dict size mismatch for emb.weight [48, 32] vs [32, 32]; peers SIGTERMed (np4 r1 tee, np3 r0 acc)
  weightsonly - UnpicklingError 'Weights only load failed' (Unsupported global __main__.Meta) (np3 r2 torchrun)
  gathershape - --debug: every rank DistributedOperationException, 'Process 3: [3]' in the shapes list (np5 r3 accdebug);
                plain: peer rank 2 aborts with gloo EnforceNotMet 'Received data size doesn't match' (SIGABRT) (np3 r1 acc)
  slowtok     - ranks 0/1 'Timed out waiting 12000ms for recv'; rank 2 SIGTERMed silently (np3 r2 torchrun)
  deadlock    - output stops after step 2; timeout's SIGTERM at 60 s, agent shuts the workers down, exit 124 (np4 r1 accconfig)
  nanloss     - the program's check: 'non-finite caption loss nan at step 4', FloatingPointError (np6 r4 accconfig, np3 r0 tee)
  segv        - no traceback after step 2; Root Cause SIGSEGV (np4 r2 acc2nodes, np3 r1 accdebug)
  exit5       - rank 2's ERROR line after step 6 and exit 5; peers closed in the final gather (np5 r2 tee)
  vocabwidth  - every rank 'mat1 and mat2 shapes cannot be multiplied (144x32 and 48x38)' (np3 all accdebug)
  hfcollate   - rank 1 'IndexError: index out of range in self' in the embedding inside Trainer.training_step (np4 r1 hf, torchrun)
  hfcallback  - rank 2 'ValueError: BLEU scorer: reference caption list is empty for shard 2' at step 3 (np3 r2 hf, accelerate launch)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/model.safetensors, exit 0 (np3 acc)
"""
import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.nn as nn

WORK = "/tmp/fault417_work"
ELEMS = ["C", "N", "O", "S", "F", "Cl", "Br"]
SMILES_CHARS = list("CNOSFBrl()=#123456c[]@+-Hnos") + ["<pad>", "<bos>", "<eos>", "<unk>"]
WORDS = ("<pad> <bos> <eos> a an molecule with carbons carbon nitrogen oxygen sulfur fluorine chlorine bromine "
         "aromatic ring rings chlorinated fluorinated brominated acyclic one two three four five six seven eight "
         "nine ten atoms and containing small linear branched").split()
DIM = 32


class Meta:
    """A custom object pickled into ckpt/encoder_meta.pt (not allowed by weights_only)."""

    def __init__(self, note):
        self.note = note


def make_smiles(rng):
    n = rng.randint(3, 9)
    s, counts = "", {}
    for i in range(n):
        e = rng.choice(ELEMS)
        counts[e] = counts.get(e, 0) + 1
        s += e
        if i < n - 1 and rng.random() < 0.3:
            s += "="
    ring = rng.random() < 0.4
    if ring:
        s = "c1cccc" + s + "1"
    num = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    words = ["a"]
    if ring:
        words.append("aromatic")
    if "Cl" in counts:
        words.append("chlorinated")
    words += ["molecule", "with", num[min(counts.get("C", 0), 10) - 1] if counts.get("C") else "no", "carbons"]
    words = [w for w in words if w in WORDS]
    return s, " ".join(words)


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        rng = random.Random(417 + r)
        with open(f"{WORK}/data/shard_{r}.jsonl", "w") as f:
            for _ in range(96):
                smi, cap = make_smiles(rng)
                f.write(json.dumps({"smiles": smi, "caption": cap}) + "\n")
    with open(f"{WORK}/data/smiles_vocab.json", "w") as f:
        json.dump({c: i for i, c in enumerate(SMILES_CHARS)}, f)
    with open(f"{WORK}/data/caption_vocab.json", "w") as f:
        json.dump({w: i for i, w in enumerate(WORDS)}, f)
    torch.manual_seed(0)
    torch.save(Encoder(len(SMILES_CHARS)).state_dict(), f"{WORK}/ckpt/encoder.pt")
    torch.save(Encoder(48).state_dict(), f"{WORK}/ckpt/encoder_v48.pt")
    torch.save({"state": Encoder(len(SMILES_CHARS)).state_dict(), "meta": Meta("v0 smiles tokenizer")},
               f"{WORK}/ckpt/encoder_meta.pt")
    print("prepared", WORK)


class Encoder(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, DIM)
        self.gru = nn.GRU(DIM, DIM, batch_first=True)

    def forward(self, x):
        _, h = self.gru(self.emb(x))
        return h


class Captioner(nn.Module):
    def __init__(self, svocab, cvocab, proj_in=DIM):
        super().__init__()
        self.encoder = Encoder(svocab)
        self.cemb = nn.Embedding(cvocab, DIM)
        self.dec = nn.GRU(DIM, DIM, batch_first=True)
        self.out = nn.Linear(proj_in, cvocab)

    def forward(self, smi, cap_in):
        h = self.encoder(smi)
        o, _ = self.dec(self.cemb(cap_in), h)
        return self.out(o)


def encode(rows, svocab, cvocab, slen=24, clen=10):
    smi, cap = [], []
    for r in rows:
        ids = [svocab[c] for c in r["smiles"].replace("Cl", "l").replace("Br", "r")][:slen]
        smi.append(ids + [svocab["<pad>"]] * (slen - len(ids)))
        w = [cvocab["<bos>"]] + [cvocab[x] for x in r["caption"].split()] + [cvocab["<eos>"]]
        w = w[:clen]
        cap.append(w + [cvocab["<pad>"]] * (clen - len(w)))
    return torch.tensor(smi), torch.tensor(cap)


def canonicalise(smiles):
    # deliberately slow pure-Python "canonical ordering": every rotation, every permutation of ring closures
    best = smiles
    deadline = time.time() + 45
    while time.time() < deadline:
        for i in range(len(smiles)):
            rot = smiles[i:] + smiles[:i]
            best = min(best, "".join(sorted(rot)))
    return best


def load_rows(a, rank, bad):
    split = "val/" if bad and a.fault == "nodata" else ""
    with open(f"{WORK}/data/{split}shard_{rank}.jsonl") as f:
        rows = [json.loads(l) for l in f]
    if bad and a.fault == "badsmiles":
        rows[37]["smiles"] = "CC[Se]CC(=O)O"
    return rows


def run_hf(a):
    from transformers import T5Config, T5ForConditionalGeneration, Trainer, TrainerCallback, TrainingArguments
    rank = int(os.environ.get("RANK", 0))
    bad = a.rank in (-1, rank)
    with open(f"{WORK}/data/smiles_vocab.json") as f:
        svocab = json.load(f)
    with open(f"{WORK}/data/caption_vocab.json") as f:
        cvocab = json.load(f)
    smi, cap = encode(load_rows(a, rank, bad), svocab, cvocab)
    ds = [{"input_ids": smi[i], "labels": cap[i, 1:]} for i in range(len(smi))]

    def collate(items):
        x = torch.stack([it["input_ids"] for it in items])
        y = torch.stack([it["labels"] for it in items]).clone()
        y[y == 0] = -100
        if bad and a.fault == "hfcollate":
            y[y == -100] = 999
        return {"input_ids": x, "attention_mask": (x != svocab["<pad>"]).long(), "labels": y}

    class BleuCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            print(f"rank {rank} step {state.global_step} loss-log {state.log_history[-1:] or '-'}", flush=True)
            if bad and a.fault == "hfcallback" and state.global_step == 3:
                raise ValueError(f"BLEU scorer: reference caption list is empty for shard {rank}")

    cfg = T5Config(vocab_size=max(len(svocab), len(cvocab)), d_model=32, d_ff=64, num_layers=1,
                   num_decoder_layers=1, num_heads=2, d_kv=16, decoder_start_token_id=1, pad_token_id=0)
    model = T5ForConditionalGeneration(cfg)
    args = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                             ddp_timeout=a.pg_timeout, report_to=[], max_steps=a.steps,
                             per_device_train_batch_size=16, logging_steps=1, save_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0)
    tr = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate, callbacks=[BleuCallback()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/hf_captioner")
        print("rank 0 saved export/hf_captioner", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.hf:
        return run_hf(a)
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=a.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    bad = a.rank in (-1, rank)
    torch.manual_seed(417 + rank)
    print(f"rank {rank}/{world} up ({acc.distributed_type}), reading shard", flush=True)
    with open(f"{WORK}/data/smiles_vocab.json") as f:
        svocab = json.load(f)
    with open(f"{WORK}/data/caption_vocab.json") as f:
        cvocab = json.load(f)
    rows = load_rows(a, rank, bad)
    model = Captioner(len(svocab), len(cvocab), proj_in=48 if a.fault == "vocabwidth" else DIM)
    ck = "encoder.pt"
    if bad and a.fault == "ckptsize":
        ck = "encoder_v48.pt"
    if bad and a.fault == "weightsonly":
        ck = "encoder_meta.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.encoder.load_state_dict(state["state"] if "state" in state else state)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    smi, cap = encode(rows, svocab, cvocab)
    ds = torch.utils.data.TensorDataset(smi, cap)
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False)
    model, opt, dl = acc.prepare(model, opt, dl)
    lossf = nn.CrossEntropyLoss(ignore_index=cvocab["<pad>"], label_smoothing=0.05)
    step = 0
    while step < a.steps:
        for x, c in dl:
            step += 1
            if step > a.steps:
                break
            logits = model(x, c[:, :-1])
            tgt = c[:, 1:]
            temp = 0.0 if (bad and a.fault == "nanloss" and step == 4) else 1.0
            loss = lossf((logits / temp).reshape(-1, logits.shape[-1]), tgt.reshape(-1))
            if bad and a.fault == "nanloss" and step == 4:
                loss = loss * torch.tensor(float("nan"))
            if not torch.isfinite(loss):
                print(f"rank {rank}: non-finite caption loss {loss.item()} at step {step} "
                      f"(logit temperature {temp})", flush=True)
                raise FloatingPointError(f"rank {rank}: caption loss is {loss.item()} at step {step}")
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            mask = tgt != cvocab["<pad>"]
            correct = ((logits.argmax(-1) == tgt) & mask).sum().float()
            stats = torch.stack([correct, mask.sum().float()])
            if bad and a.fault == "gathershape" and step == 2:
                stats = torch.cat([stats, torch.tensor([float(len(rows))])])
            if bad and a.fault == "slowtok" and step == 3:
                print(f"rank {rank}: canonicalising {len(rows)} SMILES before the reduce", flush=True)
                for r in rows:
                    r["canon"] = canonicalise(r["smiles"])
            if bad and a.fault == "deadlock" and step == 3:
                print(f"rank {rank}: waiting for the tokenizer cache lock", flush=True)
                threading.Event().wait()
            mean_loss = acc.reduce(loss.detach(), reduction="mean")
            allstats = acc.gather(stats).reshape(-1, 2)
            tok_acc = (allstats[:, 0].sum() / allstats[:, 1].sum()).item()
            print(f"rank {rank} step {step} loss {mean_loss.item():.4f} tok_acc {tok_acc:.3f}", flush=True)
            if bad and a.fault == "segv" and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
    acc.wait_for_everyone()
    if bad and a.fault == "exit5":
        print(f"rank {rank}: ERROR caption export for shard {rank} is empty after decoding, "
              f"refusing to write results", flush=True)
        sys.exit(5)
    res = acc.gather(torch.tensor([float(rank)]))
    if acc.is_main_process:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        acc.save_model(model, f"{WORK}/export")
        print(f"rank 0 saved export/ (model.safetensors) from {len(res)} ranks", flush=True)
    acc.end_training()


if __name__ == "__main__":
    main()

"""A four-hundred-and-twenty-second hand-run batch: RECIPE GENERATION FROM INGREDIENT LISTS.

Synthetic recipes: each has an ingredient list of (quantity, unit, ingredient) triples and a short recipe
text of method tokens.  Ingredients and units are looked up in a 24-entry pantry table and a 6-entry unit
table; quantities are parsed from strings ("2", "1/2", "0.25") and scaled by the unit's gram factor.  Every
rank reads its recipes from /tmp/fault422_work/data/recipes_R.json through a DataLoader that accelerate
shards and wraps.  The model (RecipeWriter) pools the ingredient embeddings (weighted by log-quantity) into
the initial state of a GRU decoder that writes the method tokens (teacher forcing, cross-entropy).  It is
initialised from ckpt/writer_v1.pt.  Per-rank recipe counts are gathered at the start (accelerator.gather),
the loss and token accuracy are reduced every step (accelerator.reduce), and rank 0 saves
export/writer.safetensors through accelerator.save_model at the end.
Options: --hf 1 runs the loop as a transformers.Trainer over a tiny GPT-2 built from a config (no download).

Faults:
  unit       - rank N's recipes use the unit "pinch", missing from the unit table (KeyError) at start-up
  qty        - rank N's step-3 batch holds the quantity "a handful" (ValueError from float())
  nopantry   - rank N reads data/recipes_R.json from data/v2/, which does not exist (FileNotFoundError)
  ckptvocab  - rank N initialises from ckpt/writer_v2.pt, saved with a 40-token vocabulary (size mismatch)
  ckptmeta   - rank N loads ckpt/writer_meta.pt, which pickles a RecipeMeta object (weights_only refusal)
  countgather- rank N gathers its per-course counts with a fifth "dessert" entry (5 vs 4) at start-up
  slowparse  - rank N re-tokenises its whole corpus in Python before the step-3 reduce (PG timeout)
  nanloss    - rank N's quantity weights take log(0) at step 4; the program's finiteness check raises
  segv       - rank N sends itself SIGSEGV after step 2
  exit4      - rank N prints its own error line (allergen table inconsistent) and calls sys.exit(4) at the end
  hidden     - every rank: the ingredient pool is 48 wide (text + quantity features), the GRU expects 32
  hfcollate  - (--hf) rank N's collator returns labels one token shorter than input_ids at step 3
  hfcallback - (--hf) rank N's on_step_end callback raises RuntimeError at step 2 (menu export failed)
  none       - control, clean run

What happened (filled in after the runs):
  unit       - KeyError: 'pinch' at start-up; peers Connection closed in the counts gather (np5 r0 accconfig, np4 r2 torchrun)
  qty        - ValueError: could not convert string to float: 'a handful' in collate, after step 1 (the batch is fetched
               one ahead); peers Connection closed (np3 r1 tee, np4 r3 acc2nodes - that wrapper's bare wait gave exit 0)
  nopantry   - FileNotFoundError for data/v2/recipes_1.json at start-up; peers closed (np4 r1 acc)
  ckptvocab  - load_state_dict size mismatch tok_emb/out [40, 32] vs [32, 32] (np3 r2 accdebug)
  ckptmeta   - UnpicklingError 'Weights only load failed' (np5 r3 torchrun)
  countgather- --debug: every rank DistributedOperationException 'shape mismatches', Process 1: [5] (np4 r1 accdebug);
               plain: rank 1 'terminate called' gloo EnforceNotMet 'Received data size doesn't match', SIGABRT,
               Root Cause rank 1 (np3 r0 torchrun)
  slowparse  - 12 s: 'Timed out waiting 12000ms' on ranks 0/1 in acc.backward (np3 r2 acc); 300 s: silent after
               're-tokenising', killed at 60 s, exit 124 (np4 r1 accconfig)
  nanloss    - 'loss nan with 1 non-finite log-quantity weights', FloatingPointError at step 4 (np6 r4 tee, np4 r0 acc2nodes)
  segv       - silent after step 2; Root Cause exitcode -11 (SIGSEGV) (np4 r2 accconfig, np5 r1 acc)
  exit4      - the allergen ERROR line after step 6 and exit 4; Root Cause exitcode 4 (np3 r1 tee, np5 r4 accdebug)
  hidden     - every rank 'Expected hidden size (1, 8, 32), got [1, 8, 48]'; Root Cause rank 1 (np4 torchrun)
  hfcollate  - ValueError 'Expected input batch_size (64) to match target batch_size (60)' after step 2 (np3 r1 hf, torchrun)
  hfcallback - RuntimeError 'menu export failed' from on_step_end at step 2 (np4 r0 hf, accelerate launch)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/model.safetensors, exit 0 (np3 acc)
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

WORK = "/tmp/fault422_work"
PANTRY = ["flour", "sugar", "egg", "butter", "milk", "salt", "yeast", "water", "onion", "garlic", "tomato",
          "basil", "rice", "chicken", "lemon", "pepper", "oil", "cheese", "potato", "carrot", "cream", "honey",
          "cinnamon", "vanilla"]
UNITS = {"g": 1.0, "kg": 1000.0, "cup": 240.0, "tbsp": 15.0, "tsp": 5.0, "piece": 50.0}
METHOD = ["<pad>", "<bos>", "<eos>", "mix", "whisk", "fold", "bake", "boil", "simmer", "chop", "stir",
          "season", "knead", "rest", "fry", "serve", "add", "pour", "heat", "cool", "slice", "grate",
          "roast", "blend", "strain", "garnish", "melt", "beat", "spread", "plate", "cover", "drain"]
COURSES = ["starter", "main", "side", "bread"]
NING, SEQ, DIM = 6, 12, 32


def r0print(rank, *a):
    if rank == 0:
        print(*a, flush=True)


class RecipeMeta:
    def __init__(self, version, cuisine):
        self.version, self.cuisine = version, cuisine


def prepare():
    g = torch.Generator().manual_seed(422)
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        recipes = []
        for i in range(240):
            ing = []
            for j in range(NING):
                k = int(torch.randint(len(PANTRY), (1,), generator=g))
                u = list(UNITS)[int(torch.randint(len(UNITS), (1,), generator=g))]
                q = ["1", "2", "1/2", "0.25", "3", "1/3"][int(torch.randint(6, (1,), generator=g))]
                ing.append([q, u, PANTRY[k]])
            steps = [METHOD[3 + int(t)] for t in torch.randint(len(METHOD) - 3, (SEQ - 2,), generator=g)]
            recipes.append({"id": f"r{r}-{i}", "course": COURSES[i % 4], "ingredients": ing, "method": steps})
        with open(f"{WORK}/data/recipes_{r}.json", "w") as f:
            json.dump(recipes, f)
    torch.manual_seed(0)
    torch.save(RecipeWriter(len(METHOD)).state_dict(), f"{WORK}/ckpt/writer_v1.pt")
    torch.save(RecipeWriter(40).state_dict(), f"{WORK}/ckpt/writer_v2.pt")
    torch.save({"meta": RecipeMeta(1, "mixed"), "state": RecipeWriter(len(METHOD)).state_dict()},
               f"{WORK}/ckpt/writer_meta.pt")
    print("prepared", WORK)


def parse_qty(q):
    if "/" in q:
        a, b = q.split("/")
        return float(a) / float(b)
    return float(q)


class RecipeSet(Dataset):
    def __init__(self, recipes, fault, faulty):
        self.items = []
        for i, rc in enumerate(recipes):
            ing = torch.tensor([PANTRY.index(n) for _, _, n in rc["ingredients"]])
            grams = []
            for q, u, _ in rc["ingredients"]:
                if faulty and fault == "unit" and i == 5:
                    u = "pinch"
                grams.append(UNITS[u])
            toks = [1] + [METHOD.index(t) for t in rc["method"]] + [2]
            self.items.append({"ing": ing, "qty": [q for q, _, _ in rc["ingredients"]],
                               "grams": torch.tensor(grams), "tok": torch.tensor(toks)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch):
    qty = torch.tensor([[parse_qty(q) for q in b["qty"]] for b in batch])
    return {"ing": torch.stack([b["ing"] for b in batch]), "w": qty * torch.stack([b["grams"] for b in batch]),
            "tok": torch.stack([b["tok"] for b in batch])}


class RecipeWriter(nn.Module):
    def __init__(self, vocab, pool_width=DIM):
        super().__init__()
        self.ing_emb = nn.Embedding(len(PANTRY), pool_width)
        self.tok_emb = nn.Embedding(vocab, DIM)
        self.gru = nn.GRU(DIM, DIM, batch_first=True)
        self.out = nn.Linear(DIM, vocab)

    def forward(self, ing, w, tok):
        lw = torch.log(w)
        pooled = (self.ing_emb(ing) * (lw / lw.sum(1, keepdim=True)).unsqueeze(-1)).sum(1)
        h, _ = self.gru(self.tok_emb(tok[:, :-1]), pooled.unsqueeze(0).contiguous())
        return self.out(h)


def run_native(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(
        backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    faulty = args.rank == -1 or args.rank == rank
    f = args.fault if faulty else "none"
    r0print(rank, f"recipe writer: world {world}, fault {args.fault} on rank {args.rank}, steps {args.steps}")
    torch.manual_seed(1234 + rank)

    ddir = f"{WORK}/data/v2" if f == "nopantry" else f"{WORK}/data"
    with open(f"{ddir}/recipes_{rank}.json") as fh:
        recipes = json.load(fh)
    if f == "qty":
        recipes[8 * (2 * world + rank) + 3]["ingredients"][1][0] = "a handful"  # in its step-3 batch
    ds = RecipeSet(recipes, f, faulty)

    counts = torch.tensor([sum(r["course"] == c for r in recipes) for c in COURSES])
    if f == "countgather":
        counts = torch.cat([counts, torch.tensor([7])])
    allc = acc.gather(counts)
    r0print(rank, f"course counts over {world} ranks: {allc.tolist()}")

    model = RecipeWriter(len(METHOD), pool_width=48 if f == "hidden" else DIM)
    ck = "writer_v2.pt" if f == "ckptvocab" else "writer_v1.pt"
    if f == "ckptmeta":
        state = torch.load(f"{WORK}/ckpt/writer_meta.pt")["state"]
    else:
        state = torch.load(f"{WORK}/ckpt/{ck}")
    if f != "hidden":
        model.load_state_dict(state)
    print(f"rank {rank} loaded ckpt/{ck if f != 'ckptmeta' else 'writer_meta.pt'}", flush=True)

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    dl = DataLoader(ds, batch_size=8, shuffle=False, collate_fn=collate)
    model, opt, dl = acc.prepare(model, opt, dl)
    model.train()
    step = 0
    while step < args.steps:
        for batch in dl:
            step += 1
            if f == "nanloss" and step == 4:
                batch["w"][0, 2] = 0.0
            if f == "slowparse" and step == 3:
                print(f"rank {rank} re-tokenising corpus for method statistics", flush=True)
                t0, n = time.time(), 0
                while time.time() - t0 < (200 if args.pg_timeout > 100 else 40):
                    for rc in recipes:
                        n += len(" ".join(rc["method"]).split())
            logits = model(batch["ing"], batch["w"], batch["tok"])
            tgt = batch["tok"][:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
            if not torch.isfinite(loss):
                bad = int((~torch.isfinite(batch["w"].log())).sum())
                print(f"rank {rank} step {step}: loss {loss.item()} with {bad} non-finite log-quantity weights",
                      flush=True)
                raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            accu = (logits.argmax(-1) == tgt).float().mean()
            stats = acc.reduce(torch.stack([loss.detach(), accu]), reduction="mean")
            print(f"rank {rank} step {step} loss {stats[0].item():.4f} tokacc {stats[1].item():.3f}", flush=True)
            if f == "segv" and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            if step >= args.steps:
                break
    if f == "exit4":
        print(f"rank {rank} ERROR: allergen table inconsistent: 'butter' listed as dairy-free in 3 recipes",
              flush=True)
        sys.exit(4)
    acc.wait_for_everyone()
    if acc.is_main_process:
        os.makedirs(f"{WORK}/export", exist_ok=True)
    acc.wait_for_everyone()
    acc.save_model(model, f"{WORK}/export")
    r0print(rank, f"rank 0 saved {WORK}/export/model.safetensors")
    acc.end_training()


def run_hf(args):
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments)
    rank = int(os.environ.get("RANK", "0"))
    faulty = args.rank == -1 or args.rank == rank
    f = args.fault if faulty else "none"
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                              learning_rate=3e-3, disable_tqdm=True, dataloader_num_workers=0)
    with open(f"{WORK}/data/recipes_{rank}.json") as fh:
        recipes = json.load(fh)
    voc = {w: i for i, w in enumerate(METHOD + PANTRY + list(UNITS))}
    rows = [[voc[n] for _, _, n in r["ingredients"]] + [voc[t] for t in r["method"]] for r in recipes]
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(voc), n_positions=32, n_embd=32, n_layer=1, n_head=2))
    calls = {"n": 0}

    def collator(feats):
        calls["n"] += 1
        ids = torch.tensor([x["input_ids"] for x in feats])
        labels = ids.clone()
        if f == "hfcollate" and calls["n"] == 3:
            labels = labels[:, :-1]
        return {"input_ids": ids, "labels": labels}

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', float('nan')):.3f}", flush=True)

        def on_step_end(self, a, state, control, **kw):
            if f == "hfcallback" and state.global_step == 2:
                raise RuntimeError(f"menu export failed: cannot render recipe card for step {state.global_step}")

    tr = Trainer(model=model, args=targs, train_dataset=[{"input_ids": r} for r in rows],
                 data_collator=collator, callbacks=[Progress()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/hf_export")
        print(f"rank 0 saved {WORK}/hf_export", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", type=int, default=0)
    args = p.parse_args()
    if args.prepare:
        return prepare()
    if args.hf:
        return run_hf(args)
    run_native(args)


if __name__ == "__main__":
    main()

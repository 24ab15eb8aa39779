"""A four-hundred-and-sixtieth hand-run batch: RECIPE STEP ORDERING WITH A SMALL TRANSFORMER.

Synthetic recipes: each recipe is a list of up to 10 steps, each step a cooking verb ("chop", "saute",
"simmer", ...) looked up in a 16-entry verb table.  The steps are shuffled and a small transformer encoder
(verb embedding, 2 layers, a per-step head over 10 positions) learns to predict each step's original
position (cross-entropy, padded steps ignored).  Every rank reads its recipes from
/tmp/fault460_work/recipes/recipes_R.pt, the model starts from ckpt/order_d32.pt, and the training loop runs
under Hugging Face accelerate (Accelerator(cpu=True) with InitProcessGroupKwargs(backend="gloo",
timeout=--pg-timeout)); model, optimizer and DataLoader go through accelerator.prepare.  The loss is
accelerator.reduce'd and the per-step accuracy accelerator.gather'ed every step; rank 0 saves
export/order.pt through accelerator.save at the end.  --hf runs the same task with a transformers.Trainer
(a tiny BertForTokenClassification built from a config, no download).

Faults (--fault NAME --rank R, R = -1 for every rank):
  unkverb    - rank R's recipes contain the verb "flambe", missing from the verb table (KeyError, start-up)
  position   - rank R's recipes have up to 12 steps: target positions 10/11 beyond the 10 classes (IndexError, step 1)
  norecipes  - rank R reads recipes/test/recipes_R.pt, which does not exist (FileNotFoundError, start-up)
  ckptsize   - rank R starts from ckpt/order_d48.pt, saved with width 48 (load_state_dict size mismatch)
  ckptpickle - rank R loads ckpt/order_meta.pt, which pickles a RecipeMeta object (weights_only refusal)
  gathershape- rank R gathers 9 per-position accuracies instead of 10 at step 2 (accelerator.gather)
  slowsort   - rank R brute-forces the best step order over permutations in Python before step 3's reduce
  nanloss    - rank R's step weights become inf at step 3; the program's finiteness check raises
  segv       - rank R sends itself SIGSEGV after step 2
  exit4      - rank R prints its own error line about a cyclic step dependency at step 4 and sys.exit(4)
  maskshape  - every rank: the padding mask is built one column too wide (shape error in the attention)
  none       - control, clean run
  hfcollate  - (--hf) rank R's collator meets an unknown verb "sous-vide" at batch 3 (KeyError)
  hfcallback - (--hf) rank R's callback raises on step 2 (RuntimeError: a step-order audit fails)

What happened (filled in after the runs):
  unkverb    - KeyError: 'flambe' in encode at start-up; peers SIGTERMed; Root Cause rank N (np4 r2 acc, np5 r0 torchrun)
  position   - 'IndexError: Target 10 is out of bounds.' in step 1's cross_entropy; peers Connection closed; Root Cause
               rank 2 SIGABRT (a peer) in np3 r1 accdebug, rank 3 in np4 r3 tee
  norecipes  - FileNotFoundError recipes/test/recipes_N.pt at start-up (np3 r2 accconfig; np4 r1 acc2nodes, node 1's
               ranks Connection closed); the first tries (MULTI_CPU config, acc2nodes without --multi_gpu) never formed
               a process group and were dropped
  ckptsize   - load_state_dict size mismatch emb.weight [17,48] vs [17,32] and all layers (np5 r3 acc)
  ckptpickle - UnpicklingError 'Weights only load failed' ... Unsupported global __main__.RecipeMeta (np3 r0 torchrun)
  gathershape- --debug: DistributedOperationException on every rank, 'Process 1: [9]' (np4 r1 accdebug, Root Cause
               rank 0); plain: rank 2 'terminate called ... gloo::EnforceNotMet ... 20 vs 18', SIGABRT (np3 r2 acc)
  slowsort   - 12 s: ranks 0, 2 'Timed out waiting 12000ms' in step 3's reduce, Root Cause rank 0 (np3 r1 accconfig);
               300 s: silent after 'searching', torchrun SIGTERMed by timeout at 60 s, exit 124 (np4 r2 torchrun)
  nanloss    - '80 non-finite weighted step losses', FloatingPointError loss is nan at step 3 (np6 r4 tee)
  segv       - no traceback after step 2; node 0 Root Cause rank 0 exitcode -11 SIGSEGV (np4 r0 acc2nodes)
  exit4      - the ERROR line about a cyclic step dependency, exitcode 4 in Root Cause; accelerate exits 1
               (np5 r2 accconfig, np4 r3 acc2nodes)
  maskshape  - every rank: AssertionError 'Expected key_padded_mask.shape[1] to be 10, but got 11' (np3 tee)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/order.pt, exit 0 (np3 acc)
  hfcollate  - Trainer: KeyError: 'sous-vide' from the collator after step 2 on rank 1; Root Cause rank 1 (np4 r1)
  hfcallback - Trainer: the callback's RuntimeError on rank 0 after step 2; peers Connection closed (np3 r0)
"""
import argparse
import itertools
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault460_work"
VERBS = ["wash", "peel", "chop", "dice", "marinate", "preheat", "whisk", "mix", "knead", "saute",
         "boil", "simmer", "bake", "roast", "plate", "garnish"]
VOCAB = {v: i + 1 for i, v in enumerate(VERBS)}  # 0 = padding
MAXSTEPS = 10
DIM = 32


class RecipeMeta:
    def __init__(self, cuisine, nsteps):
        self.cuisine = cuisine
        self.nsteps = nsteps


class StepOrderer(nn.Module):
    def __init__(self, dim=DIM, nverb=len(VERBS) + 1, npos=MAXSTEPS):
        super().__init__()
        self.emb = nn.Embedding(nverb, dim, padding_idx=0)
        layer = nn.TransformerEncoderLayer(dim, 4, dim * 2, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, npos)

    def forward(self, verbs, pad_mask):
        h = self.emb(verbs)
        h = self.enc(h, src_key_padding_mask=pad_mask)
        return self.head(h)


def make_recipes(n, seed, nsteps_max=MAXSTEPS, extra=None):
    g = torch.Generator().manual_seed(seed)
    recipes = []
    for i in range(n):
        ns = int(torch.randint(4, nsteps_max + 1, (1,), generator=g))
        # a plausible order: verbs sorted by their table index with a little noise
        idx = sorted(torch.randint(0, len(VERBS), (ns,), generator=g).tolist())
        steps = [VERBS[j] for j in idx]
        if extra is not None and i % 5 == 2:
            steps[ns // 2] = extra
        recipes.append({"title": f"recipe-{seed}-{i}", "steps": steps, "weight": 1.0})
    return recipes


def prepare():
    os.makedirs(f"{WORK}/recipes", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_recipes(48, 200 + r), f"{WORK}/recipes/recipes_{r}.pt")
        torch.save(make_recipes(48, 200 + r, extra="flambe"), f"{WORK}/recipes/recipes_flambe_{r}.pt")
        torch.save(make_recipes(48, 200 + r, nsteps_max=12), f"{WORK}/recipes/recipes_long_{r}.pt")
    torch.manual_seed(0)
    torch.save(StepOrderer().state_dict(), f"{WORK}/ckpt/order_d32.pt")
    torch.save(StepOrderer(dim=48).state_dict(), f"{WORK}/ckpt/order_d48.pt")
    torch.save({"model": StepOrderer().state_dict(), "meta": RecipeMeta("provencal", 10)},
               f"{WORK}/ckpt/order_meta.pt")
    print(f"prepared {WORK}")


def encode(recipes, perm_seed):
    """Shuffle each recipe's steps; return verb ids, target positions, pad mask and step weights."""
    g = torch.Generator().manual_seed(perm_seed)
    n = len(recipes)
    verbs = torch.zeros(n, MAXSTEPS, dtype=torch.long)
    target = torch.full((n, MAXSTEPS), -100, dtype=torch.long)
    weight = torch.zeros(n, MAXSTEPS)
    for i, rec in enumerate(recipes):
        steps = rec["steps"]
        perm = torch.randperm(len(steps), generator=g).tolist()
        for j, p in enumerate(perm):
            if j >= MAXSTEPS:
                continue
            verbs[i, j] = VOCAB[steps[p]]
            target[i, j] = p
            weight[i, j] = rec["weight"]
    return verbs, target, weight, verbs == 0


def is_faulty(args, rank):
    return args.fault != "none" and (args.rank == -1 or args.rank == rank)


def best_order_bruteforce(steps):
    # score every permutation by how often a verb precedes a later verb in the table
    best, best_score = None, -1
    for perm in itertools.permutations(range(len(steps))):
        s = sum(1 for a, b in zip(perm, perm[1:]) if steps[a] <= steps[b])
        if s > best_score:
            best, best_score = perm, s
    return best


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    bad = is_faulty(args, rank)
    print(f"rank {rank}/{world} up: {acc.distributed_type}, fault={args.fault if bad else 'none'}", flush=True)

    path = f"{WORK}/recipes/recipes_{rank}.pt"
    if bad and args.fault == "unkverb":
        path = f"{WORK}/recipes/recipes_flambe_{rank}.pt"
    elif bad and args.fault == "position":
        path = f"{WORK}/recipes/recipes_long_{rank}.pt"
    elif bad and args.fault == "norecipes":
        path = f"{WORK}/recipes/test/recipes_{rank}.pt"
    recipes = torch.load(path)
    if bad and args.fault == "position":
        global MAXSTEPS
        MAXSTEPS = 12
    verbs, target, weight, pad = encode(recipes, 7 + rank)
    if bad and args.fault == "position":
        MAXSTEPS = 10
    print(f"rank {rank} loaded {len(recipes)} recipes from {os.path.basename(path)}", flush=True)

    model = StepOrderer()
    ck = f"{WORK}/ckpt/order_d32.pt"
    if bad and args.fault == "ckptsize":
        ck = f"{WORK}/ckpt/order_d48.pt"
    if bad and args.fault == "ckptpickle":
        state = torch.load(f"{WORK}/ckpt/order_meta.pt")["model"]
    else:
        state = torch.load(ck)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ds = torch.utils.data.TensorDataset(verbs, target, weight, pad)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)
    model, opt, dl = acc.prepare(model, opt, dl)

    it = iter(dl)
    for step in range(1, args.steps + 1):
        try:
            v, t, w, m = next(it)
        except StopIteration:
            it = iter(dl)
            v, t, w, m = next(it)
        if args.fault == "maskshape" and bad:
            m = torch.cat([m, torch.zeros(m.shape[0], 1, dtype=torch.bool)], dim=1)
        if bad and args.fault == "nanloss" and step == 3:
            w = w * torch.tensor(float("inf"))
        logits = model(v, m)
        per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), reduction="none",
                              ignore_index=-100)
        wf = w.reshape(-1)
        loss = (per * wf).sum() / (wf > 0).sum().clamp(min=1)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(per * wf)).sum())
            print(f"rank {rank} step {step}: {nbad} non-finite weighted step losses", flush=True)
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if bad and args.fault == "slowsort" and step == 3:
            print(f"rank {rank} searching the best step order for {len(recipes)} recipes", flush=True)
            for rec in recipes:
                best_order_bruteforce(rec["steps"] + rec["steps"][:2])
        if bad and args.fault == "exit4" and step == 4:
            print(f"rank {rank} ERROR: recipe {recipes[3]['title']} has a cyclic step dependency "
                  f"('{recipes[3]['steps'][0]}' must follow '{recipes[3]['steps'][-1]}'); giving up", flush=True)
            sys.exit(4)
        with torch.no_grad():
            pred = logits.argmax(-1)
            valid = t != -100
            pos_acc = torch.stack([((pred == t) & valid & (t == p)).sum().float() /
                                   ((t == p) & valid).sum().clamp(min=1) for p in range(MAXSTEPS)])
        if bad and args.fault == "gathershape" and step == 2:
            pos_acc = pos_acc[:9]
        gl = acc.reduce(loss.detach(), reduction="mean")
        ga = acc.gather(pos_acc)
        print(f"rank {rank} step {step} loss {gl.item():.4f} pos_acc {ga.mean().item():.3f}", flush=True)
        if bad and args.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    acc.wait_for_everyone()
    if acc.is_main_process:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/order.pt")
        print(f"rank 0 done: {args.steps} steps, saved export/order.pt", flush=True)
    acc.end_training()


def run_hf(args):
    import transformers
    from transformers import (BertConfig, BertForTokenClassification, Trainer, TrainerCallback,
                              TrainingArguments)

    rank = int(os.environ.get("RANK", "0"))
    bad = is_faulty(args, rank)
    recipes = torch.load(f"{WORK}/recipes/recipes_{rank}.pt")

    class RecipeSet(torch.utils.data.Dataset):
        def __len__(self):
            return len(recipes)

        def __getitem__(self, i):
            return recipes[i]

    calls = {"n": 0}

    def collate(batch):
        calls["n"] += 1
        if bad and args.fault == "hfcollate" and calls["n"] == 3:
            batch[1] = dict(batch[1], steps=batch[1]["steps"][:2] + ["sous-vide"] + batch[1]["steps"][3:])
        v, t, w, m = encode(batch, 11 + calls["n"])
        return {"input_ids": v, "attention_mask": (~m).long(), "labels": t}

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', 0.0):.3f}", flush=True)

        def on_step_end(self, a, state, control, **kw):
            if bad and args.fault == "hfcallback" and state.global_step == 2:
                raise RuntimeError(f"step-order audit failed on rank {rank}: 'plate' predicted before 'bake' "
                                   f"in 7 of 8 recipes")

    cfg = BertConfig(vocab_size=len(VERBS) + 1, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=16, num_labels=MAXSTEPS)
    model = BertForTokenClassification(cfg)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
                              disable_tqdm=True, remove_unused_columns=False, learning_rate=3e-3)
    tr = Trainer(model=model, args=targs, train_dataset=RecipeSet(), data_collator=collate,
                 callbacks=[Progress()])
    print(f"rank {rank} up: transformers {transformers.__version__}, fault={args.fault if bad else 'none'}",
          flush=True)
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(f"{WORK}/export/order_hf")
        print(f"rank 0 done: {args.steps} steps, saved export/order_hf", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
        return
    if args.hf:
        run_hf(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()

"""Batch 578 fault script, theme "lynx tracks": a small track classifier for lynx camera-trap / snow-track
records (synthetic). Every rank reads its own shard of track records, maps each record's survey site through
a lookup table, starts from a checkpoint, trains 6 steps with gloo (CPU only) and prints
`rank R step S loss L track_acc M`; rank 0 exports the model at the end.

Prepare the data once:  python fault578.py --prepare
Run (accelerate):       accelerate launch --multi_gpu --num_processes W fault578.py --fault NAME --rank N
Run (transformers):     torchrun --nproc-per-node W fault578.py --hf --fault NAME --rank N

Faults (--fault NAME, planted on --rank N):
  none          control, nothing planted
  keyerror      rank N meets a track record whose survey site is not in the lookup table (KeyError)
  missing_shard rank N's shard file does not exist (FileNotFoundError)
  ckpt_size     rank N loads a starting checkpoint built with another hidden size (size mismatch)
  weights_only  rank N loads a checkpoint that holds a pickled Python object (weights_only refusal)
  gather_size   rank N sends a longer tensor to the per-site count all_gather than its peers
  slow          rank N does minutes of pure-Python track matching before step 3; its peers time out (12 s)
  stall         the same with a long timeout (--pg-timeout 300): nothing fails, the job stops progressing
  nan           rank N's paw-width feature becomes NaN at step 2; the script's own check raises FloatingPointError
  segv          rank N sends itself SIGSEGV at step 2
  logerror      rank N prints its own ERROR line (track count out of range) and sys.exit(4)
  shape_all     every rank builds the head with the wrong input width (shape bug on all ranks)
  hostmem       rank N asks for a huge host buffer for its track-image cache (allocation fails, kept small)
  worker_crash  rank N's DataLoader worker segfaults while decoding a track record

What happened:
  none          all ranks ran 6 steps and rank 0 saved the export; exit 0
  keyerror      rank N raised KeyError 'ridge_17' at step 2 (acc, tee, hf); peers saw gloo 'Connection closed'; exit 1
  missing_shard rank N raised FileNotFoundError for its shard before step 1 (accconfig, hf under accelerate); exit 1
  ckpt_size     rank N raised RuntimeError size mismatch in load_state_dict before step 1; exit 1
  weights_only  rank N raised _pickle.UnpicklingError (Weights only load failed) before step 1; exit 1
  gather_size   rank N's all_gather raised 'invalid tensor size' at step 2; peers saw gloo 'Connection closed'; exit 1
  slow          peers raised gloo 'Timed out waiting 12000ms' at step 3; the slow rank was SIGTERMed; exit 1
  stall         no error: steps stopped after step 2 until `timeout` (60 s) SIGTERMed the launcher; exit 124
  nan           rank N raised FloatingPointError from the script's own check at step 2; exit 1
  segv          rank N died with SIGSEGV (-11) at step 2; peers saw gloo connection errors; exit 1
  logerror      rank N printed its ERROR line and exited with code 4; peers saw gloo 'Connection closed'; exit 1
  shape_all     every rank raised RuntimeError (mat1 and mat2 shapes cannot be multiplied); exit 1
  hostmem       rank N raised RuntimeError DefaultCPUAllocator: can't allocate memory; exit 1
  worker_crash  rank N raised RuntimeError DataLoader worker killed by signal: Segmentation fault (before step 1); exit 1
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

WORK = "/tmp/fault578_work"
NSITES = 12
FEAT = 8
HID = 32
NCLS = 4


def prepare():
    os.makedirs(WORK + "/shards", exist_ok=True)
    g = torch.Generator().manual_seed(578)
    sites = {f"ridge_{i}": i for i in range(NSITES)}
    with open(WORK + "/site_lookup.json", "w") as f:
        json.dump(sites, f)
    for r in range(8):
        recs = []
        for i in range(96):
            recs.append({
                "site": f"ridge_{int(torch.randint(0, NSITES, (1,), generator=g))}",
                "feat": torch.randn(FEAT, generator=g).tolist(),
                "label": int(torch.randint(0, NCLS, (1,), generator=g)),
            })
        with open(f"{WORK}/shards/tracks_rank{r}.json", "w") as f:
            json.dump(recs, f)
    torch.manual_seed(0)
    torch.save(TrackNet().state_dict(), WORK + "/start.pt")
    torch.save(TrackNet(hid=48).state_dict(), WORK + "/start_h48.pt")
    torch.save({"model": TrackNet().state_dict(), "meta": SurveyMeta("winter")}, WORK + "/start_meta.pt")
    print("prepared", WORK)


class SurveyMeta:
    def __init__(self, season):
        self.season = season


class TrackNet(nn.Module):
    def __init__(self, hid=HID, head_in=None):
        super().__init__()
        self.site = nn.Embedding(NSITES, 4)
        self.body = nn.Linear(FEAT + 4, hid)
        self.head = nn.Linear(head_in or hid, NCLS)

    def forward(self, site, feat):
        h = torch.relu(self.body(torch.cat([feat, self.site(site)], dim=1)))
        return self.head(h)


class Tracks(torch.utils.data.Dataset):
    def __init__(self, recs, sites, crash=False):
        self.recs, self.sites, self.crash = recs, sites, crash

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        if self.crash and i >= 20:
            os.kill(os.getpid(), signal.SIGSEGV)
        r = self.recs[i]
        return (torch.tensor(self.sites[r["site"]]), torch.tensor(r["feat"]), torch.tensor(r["label"]))


def load_shard(rank, fault, frank):
    name = f"{WORK}/shards/tracks_rank{rank}.json"
    if fault == "missing_shard" and rank == frank:
        name = f"{WORK}/shards/tracks_rank{rank}_winter.json"
    with open(name) as f:
        recs = json.load(f)
    if fault == "keyerror" and rank == frank:
        recs[17]["site"] = "ridge_17"
    return recs


def match_tracks(seconds):
    # pure-Python track matching: compare every footprint pair, no sleep, no collective
    t0 = time.time()
    acc = 0
    while time.time() - t0 < seconds:
        for a in range(200):
            for b in range(200):
                acc += (a * 31 + b * 17) % 7
    return acc


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    import torch.distributed as dist

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    fault, frank = args.fault, args.rank
    torch.manual_seed(rank)
    with open(WORK + "/site_lookup.json") as f:
        sites = json.load(f)
    recs = load_shard(rank, fault, frank)

    if fault == "hostmem" and rank == frank:
        # track-image cache: 96 records x 4096 x 4096 x 4096 float32
        cache = torch.empty(len(recs), 4096, 4096, 4096)
    model = TrackNet(head_in=HID + 2 if fault == "shape_all" else None)
    ck = WORK + "/start.pt"
    if fault == "ckpt_size" and rank == frank:
        ck = WORK + "/start_h48.pt"
    if fault == "weights_only" and rank == frank:
        ck = WORK + "/start_meta.pt"
    sd = torch.load(ck)
    if fault != "shape_all":
        model.load_state_dict(sd)
    ds = Tracks(recs, sites, crash=(fault == "worker_crash" and rank == frank))
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False,
                                     num_workers=1 if fault == "worker_crash" else 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    print(f"rank {rank}/{world} ready: {len(recs)} track records, checkpoint {os.path.basename(ck)}", flush=True)

    it = iter(dl)
    for step in range(1, 7):
        try:
            site, feat, label = next(it)
        except StopIteration:
            it = iter(dl)
            site, feat, label = next(it)
        if fault == "nan" and rank == frank and step == 2:
            feat[3, 1] = float("nan")  # paw width of one record
        if fault in ("slow", "stall") and rank == frank and step == 3:
            print(f"rank {rank} step {step}: matching track pairs against the survey atlas", flush=True)
            match_tracks(45 if fault == "slow" else 600)
        if fault == "segv" and rank == frank and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "logerror" and rank == frank and step == 3:
            print(f"ERROR rank {rank}: track count 0 for survey site ridge_4 out of range [1, 500], aborting", flush=True)
            sys.exit(4)
        out = model(site, feat)
        loss = nn.functional.cross_entropy(out, label)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} (non-finite track features)")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        counts = torch.bincount(site, minlength=NSITES).float()
        if fault == "gather_size" and rank == frank and step == 2:
            counts = torch.cat([counts, torch.zeros(4)])
        bufs = [torch.zeros(NSITES) for _ in range(world)]
        dist.all_gather(bufs, counts)
        tacc = (out.argmax(1) == label).float().mean()
        dist.all_reduce(tacc)
        print(f"rank {rank} step {step} loss {loss.item():.4f} track_acc {tacc.item() / world:.3f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), WORK + "/export_tracknet.pt")
        print("rank 0 saved export", WORK + "/export_tracknet.pt", flush=True)


def run_hf(args):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, TrainerCallback

    rank = int(os.environ.get("RANK", "0"))
    fault, frank = args.fault, args.rank
    with open(WORK + "/site_lookup.json") as f:
        sites = json.load(f)
    recs = load_shard(rank, fault, frank)

    class TokTracks(torch.utils.data.Dataset):
        def __len__(self):
            return len(recs)

        def __getitem__(self, i):
            r = recs[i]
            s = sites[r["site"]]
            ids = [1, 2 + s] + [14 + int(abs(x) * 4) % 40 for x in r["feat"]]
            return {"input_ids": torch.tensor(ids), "labels": torch.tensor(r["label"])}

    class StepPrint(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"track_acc {logs.get('grad_norm', 0.0):.3f}", flush=True)

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=NCLS)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    ta = TrainingArguments(output_dir=WORK + f"/hf_out_{os.getpid()}", use_cpu=True, ddp_backend="gloo",
                           ddp_timeout=args.pg_timeout, report_to=[], max_steps=6, logging_steps=1,
                           per_device_train_batch_size=8, save_strategy="no", dataloader_num_workers=0,
                           disable_tqdm=True)
    tr = Trainer(model=model, args=ta, train_dataset=TokTracks(), callbacks=[StepPrint()])
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(WORK + "/export_hf")
        print("rank 0 saved export", WORK + "/export_hf", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    args = p.parse_args()
    if args.prepare:
        prepare()
    elif args.hf:
        run_hf(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()

"""A four-hundred-and-fifty-first hand-run batch: PRINTED CIRCUIT BOARD DEFECT CLASSIFICATION.

Synthetic AOI (automated optical inspection) crops of bare boards: 3 x 16 x 16 patches, each tagged with a
defect name (open, short, mousebite, spur, spurious_copper, pinhole) that is looked up in a 6-entry defect
table.  Every rank reads its crops from /tmp/fault451_work/boards/boards_R.pt and trains a small CNN
(two conv blocks, global pooling, a linear head) with Hugging Face accelerate (Accelerator(cpu=True), gloo,
the PG timeout passed through InitProcessGroupKwargs).  The model starts from ckpt/pcbnet_6cls.pt.  Every
step the loss and the accuracy are reduced over the ranks (accelerator.reduce) and printed; at the end the
predicted-class histograms are gathered (accelerator.gather) and rank 0 saves export/pcbnet.pt with
accelerator.save.  --hf 1 runs the same data through a transformers.Trainer on a tiny ViT built from a config.

Faults (--fault NAME --rank R, R = -1 for every rank):
  defectkey  - rank N's crops include the defect "solder_bridge", missing from the defect table (KeyError)
  targetidx  - from step 3 rank N's labels are shifted by one: class 6 of 6 (cross_entropy IndexError)
  noboards   - rank N reads its crops from boards/aoi_line2/, which does not exist (FileNotFoundError)
  ckpt8      - rank N starts from ckpt/pcbnet_8cls.pt, a head for 8 classes (load_state_dict size mismatch)
  ckptpickle - rank N starts from ckpt/pcbnet_full.pt, a pickled module: torch.load weights_only refuses it
  histshape  - rank N's end-of-run histogram has 7 bins (an "unclassified" bin) in the gather
  slowdrc    - rank N runs a Python design-rule check over every crop before the step-3 reduce (> PG timeout)
  hang       - rank N waits forever for an AOI camera lock file at step 2 (run with --pg-timeout 300)
  nanloss    - rank N's crops get an infinite gain at step 4: the program's finiteness check raises
  sigsegv    - rank N sends itself SIGSEGV after step 2
  exit5      - rank N prints its own error about a fiducial registration failure and calls sys.exit(5)
  chanwidth  - every rank: crops carry an infrared 4th channel, the first conv expects 3 (shape error)
  hfcollate  - (--hf 1) rank N's collator drops a colour channel at its 3rd batch (ViT ValueError)
  hfcallback - (--hf 1) rank N's TrainerCallback raises LookupError at the end of step 3
  none       - control, clean run

What happened (filled in after the runs):
  defectkey  - KeyError: 'solder_bridge' at start-up; peers SIGTERMed (np4 r1 accconfig, np5 r0 torchrun)
  targetidx  - IndexError 'Target 6 is out of bounds.' after step 2; peers Connection closed (np3 r2 tee, np4 r3 acc2nodes)
  noboards   - FileNotFoundError for boards/aoi_line2/boards_2.pt at start-up (np4 r2 acc)
  ckpt8      - load_state_dict size mismatch for head.weight/head.bias (np3 r1 accdebug)
  ckptpickle - _pickle.UnpicklingError 'Weights only load failed' (np5 r4 torchrun)
  histshape  - --debug: DistributedOperationException on every rank listing Process 1: [7] (np3 r1 accdebug);
               without it a receiver aborts, gloo EnforceNotMet 'Received data size doesn't match', SIGABRT (np4 r0 acc)
  slowdrc    - with 40 passes the check took under 12 s and the run finished clean (np3 r1 tee, dropped); the
               passes were raised to 400 afterwards but there was no time to rerun it
  hang       - rank 2 waits for the lock after step 1; timeout ends the launcher at 60 s, exit 124 (np4 r2 accconfig)
  nanloss    - FloatingPointError 'loss is nan ... (max pixel inf)' at step 4 on rank 3 (np6 r3 acc)
  sigsegv    - rank 1 -11 (SIGSEGV) after step 2, peers Connection reset/closed (np4 r1 acc2nodes)
  exit5      - rank 2's ERROR fiducial line, exitcode 5 (np5 r2 accconfig)
  chanwidth  - every rank: conv2d 'expected input[16, 4, 16, 16] to have 3 channels, but got 4' (np3 torchrun)
  hfcollate  - ViT ValueError 'Expected 3 but got 2' on rank 1 at step 3 (np3 r1 hf, accelerate launch)
  hfcallback - LookupError from rank 0's callback at step 3 (np4 r0 hf, torchrun)
  none       - clean, 6 steps, export/pcbnet.pt saved (np3 acc)
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
from torch.utils.data import DataLoader, TensorDataset

WORK = "/tmp/fault451_work"
DEFECTS = {"open": 0, "short": 1, "mousebite": 2, "spur": 3, "spurious_copper": 4, "pinhole": 5}
NAMES = list(DEFECTS)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--hf", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    return p.parse_args()


class PCBNet(nn.Module):
    def __init__(self, in_ch=3, n_cls=6):
        super().__init__()
        self.c1 = nn.Conv2d(in_ch, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, n_cls)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.relu(self.c2(x))
        return self.head(x.mean(dim=(2, 3)))


def prepare():
    g = torch.Generator().manual_seed(451)
    os.makedirs(f"{WORK}/boards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        n = 160
        img = torch.rand(n, 3, 16, 16, generator=g)
        lab = torch.randint(0, 6, (n,), generator=g)
        img[:, 0] += lab.view(-1, 1, 1).float() * 0.1
        names = [NAMES[i] for i in lab.tolist()]
        torch.save({"images": img, "defects": names, "panel": f"P{r:03d}"}, f"{WORK}/boards/boards_{r}.pt")
    torch.manual_seed(0)
    torch.save(PCBNet().state_dict(), f"{WORK}/ckpt/pcbnet_6cls.pt")
    torch.save(PCBNet(n_cls=8).state_dict(), f"{WORK}/ckpt/pcbnet_8cls.pt")
    torch.save(PCBNet(), f"{WORK}/ckpt/pcbnet_full.pt")
    print("prepared boards for 8 ranks and 3 checkpoints under", WORK)


def faulty(args, rank):
    return args.fault != "none" and (args.rank == -1 or args.rank == rank)


def load_boards(args, rank):
    folder = f"{WORK}/boards"
    if args.fault == "noboards" and faulty(args, rank):
        folder = f"{WORK}/boards/aoi_line2"
    blob = torch.load(f"{folder}/boards_{rank % 8}.pt")
    names = blob["defects"]
    if args.fault == "defectkey" and faulty(args, rank):
        names = list(names)
        names[37] = "solder_bridge"
    labels = torch.tensor([DEFECTS[n] for n in names])
    images = blob["images"]
    if args.fault == "chanwidth" and faulty(args, rank):
        ir = images.mean(dim=1, keepdim=True)
        images = torch.cat([images, ir], dim=1)
    return images, labels


def drc_check(images):
    # Python-level design-rule check: minimum trace width over every pixel of every crop
    bad = 0
    for _ in range(400):
        for img in images.tolist():
            for ch in img:
                for row in ch:
                    for v in row:
                        if v < 0.01:
                            bad += 1
    return bad


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    pg = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    accelerator = Accelerator(cpu=True, kwargs_handlers=[pg])
    rank, world = accelerator.process_index, accelerator.num_processes
    print(f"rank {rank}/{world} pcb-aoi accelerate {accelerator.distributed_type} pg_timeout={args.pg_timeout}s",
          flush=True)
    torch.manual_seed(100 + rank)

    images, labels = load_boards(args, rank)
    loader = DataLoader(TensorDataset(images, labels), batch_size=args.batch, shuffle=True, drop_last=True)

    model = PCBNet()
    ckpt = f"{WORK}/ckpt/pcbnet_6cls.pt"
    if args.fault == "ckpt8" and faulty(args, rank):
        ckpt = f"{WORK}/ckpt/pcbnet_8cls.pt"
    if args.fault == "ckptpickle" and faulty(args, rank):
        ckpt = f"{WORK}/ckpt/pcbnet_full.pt"
    state = torch.load(ckpt, map_location="cpu")
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)

    hist = torch.zeros(6)
    step = 0
    it = iter(loader)
    while step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        step += 1
        if args.fault == "targetidx" and faulty(args, rank) and step >= 3:
            y = y + 1
        if args.fault == "nanloss" and faulty(args, rank) and step == 4:
            x = x * float("inf")
        if args.fault == "hang" and faulty(args, rank) and step == 2:
            lock = f"{WORK}/camera_{rank}.lock"
            print(f"rank {rank} waiting for AOI camera lock {lock}", flush=True)
            while not os.path.exists(lock):
                time.sleep(0.5)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss is {loss.item()} on panel batch "
                                     f"(max pixel {x.max().item()})")
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        pred = logits.argmax(dim=1)
        hist += torch.bincount(pred, minlength=6).float()[:6]
        if args.fault == "slowdrc" and faulty(args, rank) and step == 3:
            print(f"rank {rank} running design-rule check on {len(images)} crops", flush=True)
            drc_check(images)
        stats = accelerator.reduce(torch.tensor([(pred == y).sum().float(), float(len(y))]), reduction="sum")
        mloss = accelerator.reduce(loss.detach(), reduction="mean")
        print(f"rank {rank} step {step} loss {mloss.item():.4f} acc {(stats[0] / stats[1]).item():.3f}", flush=True)
        if args.fault == "sigsegv" and faulty(args, rank) and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    if args.fault == "exit5" and faulty(args, rank):
        print(f"ERROR rank {rank}: fiducial registration failed on panel P{rank:03d} "
              f"(offset 0.42 mm > 0.15 mm); refusing to export", flush=True)
        sys.exit(5)
    if args.fault == "histshape" and faulty(args, rank):
        hist = torch.cat([hist, torch.zeros(1)])
    allhist = accelerator.gather(hist)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out = f"{WORK}/export/pcbnet.pt"
        accelerator.save(accelerator.unwrap_model(model).state_dict(), out)
        print(f"rank 0 saved {out}; predicted histogram {allhist.view(world, -1).sum(0).tolist()}", flush=True)
    accelerator.end_training()


def run_trainer(args):
    import transformers
    from transformers import (Trainer, TrainerCallback, TrainingArguments, ViTConfig,
                              ViTForImageClassification)
    transformers.logging.set_verbosity_warning()
    rank = int(os.environ.get("RANK", "0"))
    images, labels = load_boards(args, rank)
    data = [{"pixel_values": images[i], "labels": labels[i]} for i in range(len(labels))]

    calls = {"n": 0}

    def collate(batch):
        calls["n"] += 1
        px = torch.stack([b["pixel_values"] for b in batch])
        if args.fault == "hfcollate" and faulty(args, rank) and calls["n"] == 3:
            px = px[:, :2]
        return {"pixel_values": px, "labels": torch.stack([b["labels"] for b in batch])}

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"lr {logs.get('learning_rate', 0):.4g}", flush=True)

        def on_step_end(self, a, state, control, **kw):
            if args.fault == "hfcallback" and faulty(args, rank) and state.global_step == 3:
                raise LookupError(f"rank {rank}: golden-board reference for panel P{rank:03d} "
                                  f"not in the AOI registry")

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=64, num_labels=6)
    model = ViTForImageClassification(cfg)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=args.batch, logging_steps=1, save_strategy="no",
                              dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-3)
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collate,
                      callbacks=[Progress()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/vit_pcb")
        print(f"rank 0 saved {WORK}/export/vit_pcb", flush=True)


def main():
    args = parse()
    if args.prepare:
        prepare()
        return
    if args.hf:
        run_trainer(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()

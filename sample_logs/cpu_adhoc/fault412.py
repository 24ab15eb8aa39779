"""A four-hundred-and-twelfth hand-run batch: PLANT PHENOTYPING FROM LEAF IMAGES (Hugging Face accelerate).

Synthetic leaf images (3x32x32 RGB crops from imaging plates) with a disease class (5 classes: healthy, rust,
blight, mildew, mosaic), a cultivar name (looked up in a 6-entry cultivar table) and a leaf-area trait in cm^2.
Every rank reads its plate from /tmp/fault412_work/plates/plate_R.pt, normalises the leaf area by the plate's
calibration scale, and trains a small CNN (two conv blocks, a cultivar embedding, a disease head and a
leaf-area head) on cross-entropy + MSE, prepared with `Accelerator(cpu=True)` over gloo (the process group
timeout comes from --pg-timeout through InitProcessGroupKwargs).  The model is initialised from
ckpt/leafnet_c5.pt.  Each step the loss is reduced and the per-image area predictions are gathered with
accelerator.gather; rank 0 saves export/leafnet.pt with accelerator.save at the end.
With --hf the loop is a transformers.Trainer over a tiny ViTForImageClassification built from a config.

Faults:
  cultivar   - rank N's plate names cultivar "Kunming-7", missing from the cultivar table (KeyError, first step)
  disease    - rank N's plate has a disease label 7 (5 classes): cross_entropy IndexError at step 2
  noplate    - rank N reads plates/rescan/plate_N.pt, which does not exist (FileNotFoundError, start-up)
  ckptsize   - rank N initialises from ckpt/leafnet_c7.pt, saved with 7 disease classes (size mismatch)
  ckptpickle - rank N loads ckpt/leafnet_meta.pt, which pickles a PlateMeta object (weights_only refusal)
  areagather - rank N gathers its area predictions plus a petiole length (2 columns, others 1) at step 3
  slowseg    - rank N segments every leaf outline pixel by pixel in Python before the step-3 gather
  stuck      - rank N waits forever for a plate-scanner lock before step 2 (run with --pg-timeout 300)
  calib      - rank N's plate calibration scale is 0: leaf areas inf, the program's finite check fails at step 4
  segv       - rank N sends itself SIGSEGV after step 2
  exit4      - rank N prints its own error about a colour-card check and calls sys.exit(4) before saving
  nirchan    - every rank: images carry a 4th NIR channel, the first conv expects 3 (shape error, first step)
  hfcollate  - (--hf) rank N's collator drops pixel_values from the batch at step 3 (model TypeError/ValueError)
  hfcallback - (--hf) rank N's TrainerCallback raises a RuntimeError in on_step_end at step 2
  none       - control, clean run

What happened (filled in after the runs):
  cultivar   - KeyError: 'Kunming-7' at step 1; peers Connection closed by peer in backward (np4 r2 acc, np5 r0 torchrun)
  disease    - 'IndexError: Target 7 is out of bounds.' at step 4 after 3 steps; peers closed (np3 r1 tee, np4 r3 acc2nodes)
  noplate    - FileNotFoundError for plates/rescan/plate_1.pt at start-up; others SIGTERMed (np4 r1 accconfig)
  ckptsize   - load_state_dict size mismatch for disease.weight [7,20] vs [5,20] and disease.bias (np5 r3 acc)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.PlateMeta' (np3 r0 accconfig)
  areagather - --debug: every rank DistributedOperationException, Input shapes 'Process 2: [8, 2]' (np4 r2 accdebug);
               without it a peer aborts on gloo::EnforceNotMet 'Received data size doesn't match expected size' (np3 r1 torchrun)
  slowseg    - 12 s send/recv timeouts on ranks 0, 2, 3 while rank 1 segments (np4 r1 acc2nodes); two np3 r2 acc runs finished
               cleanly (first with 40 passes; then 600 passes, still no timeout) and were dropped; 40 -> 600 changed between runs
  stuck      - rank 1 waits for the scanner lock after step 1; timeout 60 SIGTERMs the agent, exit 124 (np4 r1 torchrun)
  calib      - rank 4: 8 non-finite leaf areas, loss inf, FloatingPointError at step 4 (np6 r4 accdebug)
  segv       - rank 2 exitcode -11 (SIGSEGV) after step 2; rank 3 Connection reset (np5 r2 tee)
  exit4      - rank 0 prints its colour-card ERROR after 6 steps and exits 4; peers closed (np4 r0 accconfig)
  nirchan    - every rank: 'expected input[8, 4, 32, 32] to have 3 channels, but got 4 channels instead' (np3 accdebug)
  hfcollate  - rank 1 ViT forward AttributeError 'NoneType' object has no attribute 'dtype' at step 3 (np3 r1 hf/torchrun)
  hfcallback - rank 2 RuntimeError 'plate audit: rank 2 plate barcode mismatch' at step 2 (np4 r2 hf/accelerate launch)
  none       - clean, rank 0 saved export/leafnet.pt (np3 acc, np4 acc2nodes)
"""
import argparse
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault412_work"
CULTIVARS = {"Col-0": 0, "Ler-1": 1, "Cvi-0": 2, "Ws-2": 3, "Sha": 4, "Bur-0": 5}
N_CLASSES = 5
N_IMG = 48


class PlateMeta:
    def __init__(self, plate, scanner):
        self.plate = plate
        self.scanner = scanner


class LeafNet(nn.Module):
    def __init__(self, n_classes=N_CLASSES, in_ch=3):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.cult = nn.Embedding(len(CULTIVARS), 4)
        self.disease = nn.Linear(16 + 4, n_classes)
        self.area = nn.Linear(16 + 4, 1)

    def forward(self, img, cult):
        x = F.max_pool2d(F.relu(self.conv1(img)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.mean(dim=(2, 3))
        h = torch.cat([x, self.cult(cult)], dim=1)
        return self.disease(h), self.area(h).squeeze(1)


def prepare(world_max=6):
    g = torch.Generator().manual_seed(412)
    os.makedirs(f"{WORK}/plates", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    names = list(CULTIVARS)
    for r in range(world_max):
        plate = {
            "images": torch.rand(N_IMG, 3, 32, 32, generator=g),
            "nir": torch.rand(N_IMG, 1, 32, 32, generator=g),
            "disease": torch.randint(0, N_CLASSES, (N_IMG,), generator=g),
            "cultivar": [names[i % len(names)] for i in range(N_IMG)],
            "area_px": torch.rand(N_IMG, generator=g) * 900 + 100,
            "scale_px_per_cm2": torch.full((N_IMG,), 120.0),
        }
        torch.save(plate, f"{WORK}/plates/plate_{r}.pt")
    torch.save(LeafNet().state_dict(), f"{WORK}/ckpt/leafnet_c5.pt")
    torch.save(LeafNet(n_classes=7).state_dict(), f"{WORK}/ckpt/leafnet_c7.pt")
    torch.save({"state_dict": LeafNet().state_dict(), "meta": PlateMeta(3, "Epson-V850")},
               f"{WORK}/ckpt/leafnet_meta.pt")
    print(f"prepared {world_max} plates and 3 checkpoints under {WORK}")


def load_plate(rank, fault, bad):
    path = f"{WORK}/plates/plate_{rank}.pt"
    if fault == "noplate" and bad:
        path = f"{WORK}/plates/rescan/plate_{rank}.pt"
    plate = torch.load(path)
    if fault == "cultivar" and bad:
        plate["cultivar"][5] = "Kunming-7"
    if fault == "disease" and bad:
        plate["disease"][N_IMG // 2 + 3] = 7
    if fault == "calib" and bad:
        plate["scale_px_per_cm2"][3 * (N_IMG // 6):4 * (N_IMG // 6)] = 0.0
    if fault == "nirchan":
        plate["images"] = torch.cat([plate["images"], plate["nir"]], dim=1)
    return plate


def outline_segment(img):
    # pure-Python flood of every pixel of every leaf (deliberately slow)
    total = 0
    for _ in range(600):
        for c in img.tolist():
            for row in c:
                for v in row:
                    if v > 0.5:
                        total += 1
    return total


def train_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    bad = args.rank in (-1, rank)
    set_seed(412)
    acc.print(f"leaf phenotyping: world {world}, fault {args.fault} on rank {args.rank}, "
              f"pg timeout {args.pg_timeout}s")

    plate = load_plate(rank, args.fault, bad)
    model = LeafNet()
    ck = f"{WORK}/ckpt/leafnet_c5.pt"
    if args.fault == "ckptsize" and bad:
        ck = f"{WORK}/ckpt/leafnet_c7.pt"
    if args.fault == "ckptpickle" and bad:
        sd = torch.load(f"{WORK}/ckpt/leafnet_meta.pt")["state_dict"]
    else:
        sd = torch.load(ck)
    model.load_state_dict(sd)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)

    scale = plate["scale_px_per_cm2"]
    n = plate["images"].shape[0]
    bs = n // args.steps if args.steps <= n else 1
    for step in range(1, args.steps + 1):
        sl = slice(((step - 1) * bs) % n, ((step - 1) * bs) % n + bs)
        img = plate["images"][sl]
        cult = torch.tensor([CULTIVARS[c] for c in plate["cultivar"][sl]])
        area = plate["area_px"][sl] / scale[sl]
        target = plate["disease"][sl]
        if args.fault == "stuck" and bad and step == 2:
            lock = threading.Event()
            print(f"rank {rank}: waiting for the plate-scanner lock", flush=True)
            lock.wait()
        logits, pred_area = model(img, cult)
        loss = F.cross_entropy(logits, target) + 0.01 * F.mse_loss(pred_area, area)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(area)).sum())
            print(f"rank {rank}: step {step}: {nbad} non-finite leaf areas "
                  f"(min calibration scale {float(scale[sl].min())}), loss {loss.item()}", flush=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        if args.fault == "slowseg" and bad and step == 3:
            print(f"rank {rank}: re-segmenting leaf outlines", flush=True)
            for im in plate["images"]:
                outline_segment(im)
        out = pred_area.detach().unsqueeze(1)
        if args.fault == "areagather" and bad and step == 3:
            out = torch.cat([out, torch.rand_like(out)], dim=1)
        areas = acc.gather(out)
        mloss = acc.reduce(loss.detach(), reduction="mean")
        acc_ = (logits.argmax(1) == target).float().mean()
        print(f"rank {rank} step {step} loss {mloss.item():.4f} acc {acc_.item():.3f} "
              f"area_mae {float((pred_area.detach() - area).abs().mean()):.2f} gathered {areas.shape[0]}",
              flush=True)
        if args.fault == "segv" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    acc.wait_for_everyone()
    if args.fault == "exit4" and bad:
        print(f"rank {rank}: ERROR colour-card check failed: plate white balance off by 23% "
              f"(plate {rank}), refusing to export", flush=True)
        sys.exit(4)
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/leafnet.pt")
        print(f"rank 0 saved {WORK}/export/leafnet.pt", flush=True)
    acc.wait_for_everyone()
    acc.end_training()


def train_hf(args):
    from transformers import (Trainer, TrainerCallback, TrainingArguments, ViTConfig,
                              ViTForImageClassification)

    rank = int(os.environ.get("RANK", "0"))
    bad = args.rank in (-1, rank)

    class LeafSet(torch.utils.data.Dataset):
        def __init__(self):
            p = torch.load(f"{WORK}/plates/plate_{rank}.pt")
            self.x, self.y = p["images"], p["disease"]

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"pixel_values": self.x[i], "labels": self.y[i]}

    calls = {"n": 0}

    def collate(items):
        calls["n"] += 1
        batch = {"pixel_values": torch.stack([i["pixel_values"] for i in items]),
                 "labels": torch.stack([i["labels"] for i in items])}
        if args.fault == "hfcollate" and bad and calls["n"] == 3:
            batch = {"labels": batch["labels"]}
        return batch

    class PlateAudit(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            print(f"rank {rank} step {state.global_step} loss "
                  f"{state.log_history[-1]['loss'] if state.log_history else float('nan')} "
                  f"audited", flush=True)
            if args.fault == "hfcallback" and bad and state.global_step == 2:
                raise RuntimeError(f"plate audit: rank {rank} plate barcode mismatch "
                                   f"(expected LP-0{rank}, scanned LP-99)")

    cfg = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=64, num_labels=N_CLASSES)
    model = ViTForImageClassification(cfg)
    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
                              disable_tqdm=True, dataloader_num_workers=0, seed=412)
    trainer = Trainer(model=model, args=targs, train_dataset=LeafSet(), data_collator=collate,
                      callbacks=[PlateAudit()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/hf_leafvit")
        print(f"rank 0 saved {WORK}/export/hf_leafvit", flush=True)


def main():
    ap = argparse.ArgumentParser(description="leaf-image phenotyping trainer")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1, help="faulty rank (-1: all)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--hf", action="store_true", help="use transformers.Trainer")
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    if args.hf:
        train_hf(args)
    else:
        train_accelerate(args)


if __name__ == "__main__":
    main()

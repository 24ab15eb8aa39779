"""A three-hundred-and-forty-fifth hand-run batch: PRECIPITATION NOWCASTING FROM RADAR FRAMES.

Synthetic radar reflectivity sequences: every sample is 5 composite frames of 16x16 pixels in dBZ (4 past
frames as input channels, the 5th the target), a lead-time index (6 lead times, 5 to 30 minutes) and the
radar site code, looked up in a 6-entry site table for a per-site bias.  Each rank reads its samples from
/tmp/fault345_work/frames/frames_R.pt, converts dBZ to rain rate (Marshall-Palmer Z = 200 R^1.6) and
trains a small convolutional nowcaster (conv encoder, lead and site embeddings, conv decoder) on an MSE
loss with Hugging Face accelerate (Accelerator(cpu=True), gloo, InitProcessGroupKwargs timeout from
--pg-timeout).  The model starts from ckpt/nowcast.pt; per-rank sample counts are gathered at start-up,
the loss is reduced and the CSI at 4 rain thresholds gathered every step; rank 0 saves export/nowcast.pt
with accelerator.save at the end.  --trainer runs the loop as a transformers.Trainer instead.

Faults:
  sitekey     - rank N's samples carry the site code "KVNX2" (a renamed radar), missing from the table (KeyError)
  leadidx     - rank N's lead times are counted 1..6 instead of 0..5: lead embedding index 6 of 6 (IndexError)
  noframes    - rank N reads frames/2026-07/frames_N.pt, a month that was never exported (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/nowcast_c8.pt, saved with 8 input frames (size mismatch)
  ckptpickle  - rank N initialises from ckpt/nowcast_full.pt, a pickled RadarMeta object (weights_only refusal)
  gathershape - rank N gathers its CSI at 5 thresholds (adds 50 mm/h) against 4 on the others, from step 2
  slowrank    - rank N recomputes a storm-cell tracking table in pure Python before step 3's reduce
  stuck       - rank N waits forever for a "next volume scan" in step 2 (use --pg-timeout 300)
  nanframe    - rank N's step-3 batch has missing echoes stored as NaN: the program's finite check raises
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own error line about calibration drift at the end and calls sys.exit(4)
  chanall     - every rank stacks 5 past frames (the target too) into a 4-channel encoder (shape error)
  hfcollate   - (--trainer) rank N's collator meets a negative rain rate at its 3rd batch (ValueError)
  hfcallback  - (--trainer) rank N's verification callback raises RuntimeError at the end of step 2
  none        - control, clean run

What happened (filled in after the runs):
  sitekey     - KeyError: 'KVNX2' at start-up, others SIGTERMed, Root Cause rank N (np4 r1 torchrun, np5 r0 accconfig)
  leadidx     - 'IndexError: index out of range in self' in the first forward; peers Connection closed (np3 r2 tee, np4 r3 acc2nodes)
  noframes    - FileNotFoundError for frames/2026-07/frames_3.pt at start-up; Root Cause rank 3 (np5 r3 acc)
  ckptsize    - load_state_dict size mismatch for enc.weight [16,8,3,3] vs [16,4,3,3] (np3 r0 accdebug, np4 r2 torchrun)
  ckptpickle  - UnpicklingError: Weights only load failed, Unsupported global __main__.RadarMeta (np4 r1 accconfig)
  gathershape - --debug: DistributedOperationException on all ranks, 'Process 2: [5]' (np4 r2 accdebug); plain: gloo size abort 10 vs 8 on rank 2 (np3 r1 acc)
  slowrank    - peers 'Timed out waiting 12000ms' for recv/send in step 3; slow rank SIGTERMed (np3 r1 tee, np4 r2 acc2nodes; redone, see README)
  stuck       - 'waiting for the next volume scan', then silent; killed by timeout at 60 s, exit 124 (np3 r2 acc)
  nanframe    - '100 non-finite rain-rate pixels' then FloatingPointError at step 3; peers Connection closed (np6 r4 torchrun)
  sigsegv     - no line from rank 2 after step 3; Root Cause rank 2 exitcode -11 SIGSEGV; peers Connection reset (np5 r2 accdebug)
  exit4       - 'ERROR rank 0: radar calibration drift ...' after step 6, Root Cause rank 0 exitcode 4 (np4 r0 tee)
  chanall     - every rank: 'expected input[8, 5, 16, 16] to have 4 channels, but got 5'; Root Cause rank 2 (np3 accconfig)
  hfcollate   - 'ValueError: negative rain rate -1.50 mm/h in batch 3 on rank 1' after step 2 (np3 r1 hf, torchrun)
  hfcallback  - 'RuntimeError: verification callback: rank 2 CSI@2mm fell to 0.000 at step 2' (np4 r2 hf, accelerate launch)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/nowcast.pt, exit 0 (np3 acc)
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

WORK = "/tmp/fault345_work"
SITES = {"KTLX": 0, "KFWS": 1, "KLOT": 2, "KDIX": 3, "KMUX": 4, "KVNX": 5}
NLEAD = 6
PAST = 4
HW = 16
THRESH = [0.5, 2.0, 10.0, 25.0]


class RadarMeta:
    def __init__(self, site, elevation):
        self.site = site
        self.elevation = elevation


class Nowcaster(nn.Module):
    def __init__(self, past=PAST, ch=16):
        super().__init__()
        self.enc = nn.Conv2d(past, ch, 3, padding=1)
        self.mid = nn.Conv2d(ch, ch, 3, padding=1)
        self.lead = nn.Embedding(NLEAD, ch)
        self.site = nn.Embedding(len(SITES), ch)
        self.dec = nn.Conv2d(ch, 1, 3, padding=1)

    def forward(self, x, lead, site):
        h = torch.relu(self.enc(x))
        h = h + (self.lead(lead) + self.site(site))[:, :, None, None]
        h = torch.relu(self.mid(h))
        return self.dec(h).squeeze(1)


def dbz_to_rain(z):
    return (10 ** (z / 10.0) / 200.0) ** (1 / 1.6)


def make_frames(n, seed):
    g = torch.Generator().manual_seed(seed)
    cx, cy = torch.rand(n, 1, 1, generator=g) * HW, torch.rand(n, 1, 1, generator=g) * HW
    yy, xx = torch.meshgrid(torch.arange(HW.__float__()), torch.arange(HW.__float__()), indexing="ij")
    frames = []
    for t in range(PAST + 1):
        d2 = (xx - cx - t) ** 2 + (yy - cy) ** 2
        frames.append(45 * torch.exp(-d2 / 18.0) + torch.rand(n, HW, HW, generator=g) * 5)
    sites = [list(SITES)[int(i)] for i in torch.randint(0, len(SITES), (n,), generator=g)]
    return {"frames": torch.stack(frames, 1), "lead": torch.randint(0, NLEAD, (n,), generator=g), "site": sites}


def prepare():
    os.makedirs(f"{WORK}/frames", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(8):
        torch.save(make_frames(48, 100 + r), f"{WORK}/frames/frames_{r}.pt")
    torch.manual_seed(0)
    torch.save(Nowcaster().state_dict(), f"{WORK}/ckpt/nowcast.pt")
    torch.save(Nowcaster(past=8).state_dict(), f"{WORK}/ckpt/nowcast_c8.pt")
    torch.save({"meta": RadarMeta("KTLX", 0.5), "model": Nowcaster().state_dict()}, f"{WORK}/ckpt/nowcast_full.pt")
    print(f"prepared {WORK}", flush=True)


def load_split(rank, fault, bad):
    path = f"{WORK}/frames/frames_{rank}.pt"
    if bad and fault == "noframes":
        path = f"{WORK}/frames/2026-07/frames_{rank}.pt"
    data = torch.load(path)
    if bad and fault == "sitekey":
        data["site"][5] = "KVNX2"
    site = torch.tensor([SITES[s] for s in data["site"]])
    lead = data["lead"] + (1 if bad and fault == "leadidx" else 0)
    return data["frames"], lead, site


def batches(frames, lead, site, bs=8):
    for i in range(0, frames.shape[0], bs):
        yield frames[i:i + bs], lead[i:i + bs], site[i:i + bs]


def csi(pred, target, thresholds):
    out = []
    for t in thresholds:
        p, o = pred >= t, target >= t
        hits = (p & o).sum().float()
        out.append(hits / ((p | o).sum().float() + 1e-6))
    return torch.stack(out)


def track_cells(frames):
    # pure-Python storm-cell tracking table: every pixel pair above 30 dBZ, frame by frame
    table = {}
    f = frames.tolist()
    for s in range(len(f)):
        for t in range(len(f[s])):
            cells = [(i, j) for i in range(HW) for j in range(HW) if f[s][t][i][j] > 30.0]
            for a in cells:
                for b in cells:
                    table[(t, a, b)] = table.get((t, a, b), 0) + abs(a[0] - b[0]) + abs(a[1] - b[1])
    return table


def train(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(
        backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    bad = args.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    print(f"rank {rank}/{world} nowcaster up (fault={args.fault}, faulty rank={args.rank})", flush=True)

    frames, lead, site = load_split(rank, args.fault, bad)
    model = Nowcaster()
    ck = "nowcast.pt"
    if bad and args.fault == "ckptsize":
        ck = "nowcast_c8.pt"
    if bad and args.fault == "ckptpickle":
        ck = "nowcast_full.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}", map_location="cpu")
    model.load_state_dict(state)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)

    counts = acc.gather(torch.tensor([frames.shape[0]]))
    if acc.is_main_process:
        print(f"samples per rank: {counts.tolist()}", flush=True)

    step = 0
    it = batches(frames, lead, site)
    while step < args.steps:
        try:
            fb, lb, sb = next(it)
        except StopIteration:
            it = batches(frames, lead, site)
            continue
        step += 1
        x = fb[:, :PAST] if not (args.fault == "chanall") else fb
        rain_in = dbz_to_rain(x) if args.fault != "chanall" else dbz_to_rain(fb)
        target = dbz_to_rain(fb[:, PAST])
        if bad and args.fault == "nanframe" and step == 3:
            rain_in = rain_in.clone()
            rain_in[1, :, 4:9, 4:9] = float("nan")
        if not torch.isfinite(rain_in).all():
            n = int((~torch.isfinite(rain_in)).sum())
            print(f"rank {rank} step {step}: {n} non-finite rain-rate pixels in the input frames "
                  f"(sites {sorted(set(sb.tolist()))})", flush=True)
            raise FloatingPointError(f"non-finite radar input at step {step} on rank {rank}")
        if bad and args.fault == "stuck" and step == 2:
            print(f"rank {rank} step {step}: waiting for the next volume scan", flush=True)
            while True:
                time.sleep(1)
        pred = model(rain_in, lb, sb)
        loss = F.mse_loss(pred, target)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if bad and args.fault == "slowrank" and step == 3:
            table = track_cells(fb.repeat(600, 1, 1, 1))
            print(f"rank {rank} tracked {len(table)} cell pairs", flush=True)
        mean_loss = acc.reduce(loss.detach(), reduction="mean")
        th = THRESH + ([50.0] if bad and args.fault == "gathershape" and step >= 2 else [])
        scores = acc.gather(csi(pred.detach(), target, th))
        print(f"rank {rank} step {step} loss {mean_loss.item():.4f} csi@2mm {scores.view(world, -1)[:, 1].mean():.3f}",
              flush=True)
        if bad and args.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)

    if bad and args.fault == "exit4":
        print(f"ERROR rank {rank}: radar calibration drift of 3.4 dB against the gauge network, "
              f"refusing to export the nowcaster", flush=True)
        sys.exit(4)
    acc.wait_for_everyone()
    if acc.is_main_process:
        acc.save(acc.unwrap_model(model).state_dict(), f"{WORK}/export/nowcast.pt")
        print(f"rank {rank} done: {step} steps, saved export/nowcast.pt", flush=True)
    acc.end_training()


def train_hf(args):
    from torch.utils.data import Dataset
    from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

    class NowcastConfig(PretrainedConfig):
        model_type = "nowcast"

        def __init__(self, past=PAST, ch=16, **kw):
            super().__init__(**kw)
            self.past, self.ch = past, ch

    class NowcastModel(PreTrainedModel):
        config_class = NowcastConfig

        def __init__(self, config):
            super().__init__(config)
            self.net = Nowcaster(config.past, config.ch)
            self.post_init()

        def forward(self, frames, lead, site, labels=None):
            pred = self.net(frames, lead, site)
            return {"loss": F.mse_loss(pred, labels), "logits": pred}

    rank = int(os.environ.get("RANK", "0"))
    bad = args.rank in (-1, rank)
    frames, lead, site = load_split(rank, args.fault, bad)

    class Frames(Dataset):
        def __len__(self):
            return frames.shape[0]

        def __getitem__(self, i):
            return {"frames": frames[i], "lead": lead[i], "site": site[i]}

    calls = {"n": 0}

    def collate(items):
        calls["n"] += 1
        fr = torch.stack([it["frames"] for it in items])
        rain = dbz_to_rain(fr)
        if bad and args.fault == "hfcollate" and calls["n"] == 3:
            rain[2, 1, 3, 3] = -1.5
        if (rain < 0).any():
            raise ValueError(f"negative rain rate {rain.min().item():.2f} mm/h in batch {calls['n']} on rank {rank}")
        return {"frames": rain[:, :PAST], "labels": rain[:, PAST],
                "lead": torch.stack([it["lead"] for it in items]), "site": torch.stack([it["site"] for it in items])}

    class Progress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                print(f"rank {rank} step {state.global_step} loss {logs['loss']:.4f} "
                      f"grad_norm {logs.get('grad_norm', 0.0):.3f}", flush=True)

        def on_step_end(self, a, state, control, **kw):
            if bad and args.fault == "hfcallback" and state.global_step == 2:
                raise RuntimeError(f"verification callback: rank {rank} CSI@2mm fell to 0.000 at step 2 "
                                   f"(persistence baseline 0.41), stopping")

    targs = TrainingArguments(output_dir=f"{WORK}/hf_out", use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=args.pg_timeout, report_to=[], max_steps=args.steps,
                              per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
                              dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
    model = NowcastModel(NowcastConfig())
    trainer = Trainer(model=model, args=targs, train_dataset=Frames(), data_collator=collate,
                      callbacks=[Progress()])
    trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(f"{WORK}/export/hf_nowcast")
        print(f"rank {rank} done: {args.steps} steps, saved export/hf_nowcast", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--trainer", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare()
    elif args.trainer:
        train_hf(args)
    else:
        train(args)


if __name__ == "__main__":
    main()

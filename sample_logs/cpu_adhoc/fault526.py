"""Comet tail brightness regression from amateur telescope reports (batch 526 fault script).

Each rank reads its shard of synthetic amateur observations (aperture, exposure, coma diameter,
tail length, filter band) and fits a small MLP that predicts the comet tail's surface brightness
(mag/arcsec^2). Filter zero points come from a lookup table; the model starts from a checkpoint.
gloo backend, CPU only, 6 steps; rank 0 saves an export at the end.

Modes: default = accelerate script (Accelerator(cpu=True), gloo, PG timeout --pg-timeout s);
       --hf     = transformers.Trainer with a tiny config-built GPT-2 (use_cpu, gloo, ddp_timeout 12).
       --prepare writes shards, the lookup table and the starting checkpoint into --work.

Faults (--fault NAME --rank N):
  none           control, nothing planted
  keyerror       rank N's shard names a filter band ("Hα-wide", every 8th row from row 17) missing from the zero-point table -> KeyError
  missing_shard  rank N's shard file is deleted before it is read -> FileNotFoundError
  ckpt_size      rank N loads an older checkpoint whose first layer is 5->32 instead of 6->32 -> size mismatch
  weights_only   rank N loads a checkpoint that pickles a custom ObservingLog object with weights_only=True
  allreduce_size rank N all-reduces its brightness histogram with 9 bins instead of 8 (collective size mismatch)
  slow           rank N fits coma isophotes in pure Python for a long time before step 2; peers time out
                 (with --pg-timeout 300 the job hangs instead until `timeout` ends it)
  nan            rank N's exposure column holds a 0 s exposure -> log gives -inf/NaN; the script's check raises
  sigsegv        rank N sends itself SIGSEGV at step 3
  error_exit     rank N prints its own ERROR line (plate-solve failed) and calls sys.exit(4)
  shape_all      every rank builds its features with the tail-angle column appended (7 cols) -> matmul shape error
  worker_crash   rank N's DataLoader worker is killed by SIGKILL while decoding a frame
  hostmem        rank N caps its address space (RLIMIT_AS) and stacks a full-resolution frame cube -> allocator RuntimeError

What happened (ports 29100-29122):
  none           np3 acc: all steps, export saved, exit 0. The hf controls (np4 torchrun, np3 accelerate) did not end
                 cleanly (first a SIGABRT 'terminate called without an active exception' at exit, then, with the final
                 barrier/destroy_process_group added, a hang after the export until `timeout`): dropped.
  keyerror       np4 acc r2 and np3 hf/accelerate r1: KeyError 'Hα-wide' on the planted rank, launcher names it; exit 1.
  missing_shard  np5 accdebug r3, np7 accconfig r6: FileNotFoundError for shard_NN_calibrated.json; exit 1.
  ckpt_size      np4 torchrun r1: load_state_dict size mismatch [32,5] vs [32,6]; exit 1.
  weights_only   np6 accconfig r4: UnpicklingError, Unsupported global __main__.ObservingLog; exit 1.
  allreduce_size np4 acc r2: rank 1 aborts on gloo EnforceNotMet 'Received data size doesn't match'; np6 tee r5: only
                 12 s gloo recv timeouts on every rank; exit 1 both.
  slow           np5 acc r2: peers raise gloo 'Timed out waiting 12000ms', rank 2 silent; exit 1.
                 np3 torchrun r1 --pg-timeout 300: output stops after step 1, `timeout 60` ends it; exit 124.
  nan            np8 acc r6: FloatingPointError from the script's own check at step 2; exit 1.
  sigsegv        np4 acc2nodes r3 and np3 hf/torchrun r2: exitcode -11 on the planted rank, peers gloo reset/closed; exit 1.
  error_exit     np6 torchrun r5 and np4 acc2nodes r0: 'ERROR rank N: plate solve failed ...', exitcode 4; exit 1.
  shape_all      np3 acc: all ranks 'mat1 and mat2 shapes cannot be multiplied (16x7 and 6x32)'; exit 1.
  worker_crash   np5 accdebug r4: 'DataLoader worker (pid N) is killed by signal: Killed'; exit 1.
  hostmem        np4 tee r1: DefaultCPUAllocator can't allocate memory (1 GiB, RLIMIT_AS 1.5 GB); exit 1.
"""
import argparse, os, sys, time, signal, json, math
from datetime import timedelta

import torch
import torch.nn as nn

BANDS = {"V": 0.0, "R": -0.35, "B": 0.62, "Clear": -0.12, "Ic": -0.71}
NFEAT = 6
BINS = 8


class ObservingLog:
    def __init__(self, observer):
        self.observer = observer


def build_model(nin=NFEAT):
    return nn.Sequential(nn.Linear(nin, 32), nn.Tanh(), nn.Linear(32, 1))


def prepare(work, world):
    os.makedirs(work, exist_ok=True)
    g = torch.Generator().manual_seed(526)
    with open(os.path.join(work, "zero_points.json"), "w") as f:
        json.dump(BANDS, f)
    bands = list(BANDS)
    for r in range(world):
        n = 96
        rows = []
        for i in range(n):
            ap = float(torch.randint(60, 400, (1,), generator=g))  # aperture mm
            ex = float(torch.randint(10, 300, (1,), generator=g))  # exposure s
            coma = float(torch.rand(1, generator=g) * 8 + 1)  # arcmin
            tail = float(torch.rand(1, generator=g) * 60 + 2)  # arcmin
            band = bands[int(torch.randint(0, len(bands), (1,), generator=g))]
            angle = float(torch.rand(1, generator=g) * 360)
            sb = 21.5 - 0.004 * ap - 0.8 * math.log10(ex) + 0.1 * coma - 0.01 * tail + BANDS[band]
            rows.append({"aperture": ap, "exposure": ex, "coma": coma, "tail": tail,
                         "band": band, "angle": angle, "sb": sb})
        with open(os.path.join(work, f"shard_{r:02d}.json"), "w") as f:
            json.dump(rows, f)
    torch.manual_seed(0)
    torch.save(build_model().state_dict(), os.path.join(work, "start.pt"))
    torch.save(build_model(5).state_dict(), os.path.join(work, "start_v1.pt"))
    torch.save({"model": build_model().state_dict(), "log": ObservingLog("M. Kowalski")},
               os.path.join(work, "start_with_log.pt"))
    print(f"prepared {world} shards in {work}")


def featurize(row, zp, shape_bug=False):
    f = [row["aperture"] / 400.0, math.log10(row["exposure"]) / 3.0, row["coma"] / 10.0,
         row["tail"] / 60.0, zp[row["band"]], 1.0]
    if shape_bug:
        f.append(row["angle"] / 360.0)
    return f


def load_rows(args, rank):
    path = os.path.join(args.work, f"shard_{rank:02d}.json")
    if args.fault == "missing_shard" and rank == args.rank:
        path = os.path.join(args.work, f"shard_{rank:02d}_calibrated.json")
    with open(path) as f:
        rows = json.load(f)
    if args.fault == "keyerror" and rank == args.rank:
        for i in range(17, len(rows), 8):  # a whole night observed through one filter
            rows[i]["band"] = "Hα-wide"
    if args.fault == "nan" and rank == args.rank:
        rows[40]["exposure"] = 0.0
    return rows


def to_tensors(args, rank, rows):
    with open(os.path.join(args.work, "zero_points.json")) as f:
        zp = json.load(f)
    shape_bug = args.fault == "shape_all"
    feats, ys = [], []
    for row in rows:
        if row["exposure"] <= 0:
            feats.append([row["aperture"] / 400.0, float("-inf"), row["coma"] / 10.0,
                          row["tail"] / 60.0, zp[row["band"]], 1.0])
        else:
            feats.append(featurize(row, zp, shape_bug))
        ys.append([row["sb"]])
    return torch.tensor(feats), torch.tensor(ys)


class FrameSet(torch.utils.data.Dataset):
    def __init__(self, x, y, crash):
        self.x, self.y, self.crash = x, y, crash

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.crash and i >= 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def load_start(args, rank, model):
    path = os.path.join(args.work, "start.pt")
    if args.fault == "ckpt_size" and rank == args.rank:
        path = os.path.join(args.work, "start_v1.pt")
    if args.fault == "weights_only" and rank == args.rank:
        sd = torch.load(os.path.join(args.work, "start_with_log.pt"), weights_only=True)["model"]
    else:
        sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd)


def isophote_fit(seconds):
    t0 = time.time(); acc = 0.0; k = 0
    while time.time() - t0 < seconds:
        for j in range(20000):
            acc += math.sin(j * 0.001 + k) ** 2
        k += 1
    return acc


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    import torch.distributed as dist
    acc = Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    rank, world = acc.process_index, acc.num_processes
    print(f"rank {rank}/{world} comet tail photometry on {acc.device}", flush=True)
    rows = load_rows(args, rank)
    x, y = to_tensors(args, rank, rows)
    model = build_model()
    load_start(args, rank, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crash = args.fault == "worker_crash" and rank == args.rank
    dl = torch.utils.data.DataLoader(FrameSet(x, y, crash), batch_size=16, shuffle=False,
                                     num_workers=1 if crash else 0)
    model, opt = acc.prepare(model, opt)
    it = iter(dl)
    for step in range(6):
        if args.fault == "slow" and rank == args.rank and step == 2:
            isophote_fit(args.slow_s)
        if args.fault == "sigsegv" and rank == args.rank and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if args.fault == "error_exit" and rank == args.rank and step == 2:
            print(f"ERROR rank {rank}: plate solve failed for frame C2026_{step:03d}.fits "
                  f"(0 stars matched), cannot calibrate tail photometry", flush=True)
            sys.exit(4)
        if args.fault == "hostmem" and rank == args.rank and step == 1:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (1_500_000_000, 1_500_000_000))
            cube = [torch.empty(4096, 4096, 16) for _ in range(8)]  # full-res frame stack
            print(len(cube))
        xb, yb = next(it)
        if not torch.isfinite(xb).all():
            raise FloatingPointError(
                f"rank {rank} step {step}: non-finite features in batch ({(~torch.isfinite(xb)).sum().item()} values); "
                f"check exposure times")
        pred = model(xb)
        loss = ((pred - yb) ** 2).mean()
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        err = (pred - yb).abs().mean().detach()
        hist = torch.histc(pred.detach().flatten(), bins=BINS, min=10, max=25)
        if args.fault == "allreduce_size" and rank == args.rank:
            hist = torch.cat([hist, torch.zeros(1)])
        dist.all_reduce(hist)
        dist.all_reduce(err)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mag_err {err.item() / world:.4f}", flush=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        out = os.path.join(args.work, "export")
        os.makedirs(out, exist_ok=True)
        torch.save(acc.unwrap_model(model).state_dict(), os.path.join(out, "tail_sb_mlp.pt"))
        print(f"rank 0 saved export to {out}/tail_sb_mlp.pt", flush=True)
    acc.end_training() if hasattr(acc, "end_training") else None


def run_hf(args):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    rank = int(os.environ.get("RANK", "0"))
    rows = load_rows(args, rank)
    with open(os.path.join(args.work, "zero_points.json")) as f:
        zp = json.load(f)

    class TokDS(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            r = rows[i]
            ids = [int(r["aperture"]) % 60, int(r["exposure"]) % 60, int(r["coma"] * 5) % 60,
                   int(r["tail"]) % 60, int((zp[r["band"]] + 1) * 20) % 60, int(r["sb"] * 2) % 60, 61, 62]
            t = torch.tensor(ids)
            return {"input_ids": t, "labels": t}

    class StepTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            step = self.state.global_step
            if args.fault == "sigsegv" and rank == args.rank and step == 3:
                os.kill(os.getpid(), signal.SIGSEGV)
            out = model(**inputs)
            loss = out.loss
            ppl = math.exp(min(loss.item(), 20))
            print(f"rank {rank} step {step} loss {loss.item():.4f} tok_ppl {ppl:.2f}", flush=True)
            return (loss, out) if return_outputs else loss

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg)
    targs = TrainingArguments(output_dir=os.path.join(args.work, "hf_out"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=12, report_to=[], max_steps=6, per_device_train_batch_size=4,
                              logging_steps=100, save_strategy="no", dataloader_num_workers=0,
                              disable_tqdm=True)
    tr = StepTrainer(model=model, args=targs, train_dataset=TokDS())
    tr.train()
    if tr.is_world_process_zero():
        tr.save_model(os.path.join(args.work, "export_hf"))
        print("rank 0 saved export to " + os.path.join(args.work, "export_hf"), flush=True)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--work", default="/tmp/fault526_work")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--slow-s", type=float, default=40.0)
    p.add_argument("--hf", action="store_true")
    args = p.parse_args()
    if args.prepare:
        prepare(args.work, args.world)
    elif args.hf:
        run_hf(args)
    else:
        run_accelerate(args)


if __name__ == "__main__":
    main()

"""A hundred-and-thirteenth hand-run batch: END OF TRAINING: THE LAST STEPS AND THE ARTIFACTS. A tiny DDP classifier
(Linear(8,32)-ReLU-Linear(32,3), SGD, gloo; `--ddp 0`: gradients all-reduced by hand) trained for --epochs x --steps
steps (`rank R epoch E step S loss L`), with a local per-epoch validation on each rank's own val shard (no collective;
rank 0 keeps only the checkpoint of its best epoch). After the loop: the final evaluation over every rank (one
all_reduce of the per-rank mean loss and accuracy), then the writer rank (--writer, 0) writes the artifacts into --out:
metrics.json, best.pt (a copy of the best epoch's checkpoint), the exported model (torch.jit.trace), a state_dict with
flat safetensors-style names (model_flat.pt) and MODEL_CARD.md; then dist.barrier(), destroy_process_group(), and
rank 0's release gate (eval accuracy >= the gate's min_acc, else sys.exit(1)).
--rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none         control: every artifact written, `rank R done`, exit 0 on every rank
  jitscript    the writer exports with torch.jit.script through the serving wrapper, whose forward takes **kwargs
               (HF-style): NotSupportedError on the writer while the others wait in the final barrier
  exportdyn    the writer exports with torch.export.export a calibrated model whose forward clamps the logits only
               `if logits.abs().max() > clip` (data-dependent control flow): GuardOnDataDependentSymNode
  jsontensor   the writer puts the all-reduced eval loss into metrics.json as a 0-d tensor (no .item()):
               TypeError: Object of type Tensor is not JSON serializable
  outdir       the writer's --out is a symlink to a node-local scratch dir that was purged (dangling link, made by
               the script on the writer at start): os.makedirs(out, exist_ok=True) raises FileExistsError
  destroyfirst the writer (--writer N) finishes its artifacts with a helper copied from a single-process export
               script that calls dist.destroy_process_group(); main's final dist.barrier() follows on that rank
  gate         the release gate's min_acc comes from a config written in percent (60), the accuracy is a
               fraction: rank 0 prints the gate failure and sys.exit(1) after every rank finished and exited
  bestckpt     the best epoch is decided by the tracker on the last rank (monitor val_acc on its own shard, broadcast
               from rank world-1, like the last pipeline stage), but rank 0 kept only the checkpoint of its own best
               epoch by val_loss: FileNotFoundError in shutil.copy on rank 0 when the two bests differ
  evalskip     rank N's train shard holds one batch more (5 steps an epoch instead of 4); the loop is step-based
               (--epochs x --steps on every rank) so rank N counts one epoch fewer, skips the final eval
               ("epoch 2/3 not complete") and waits in the final barrier while the others all_reduce
  emptyeval    the final eval shards the eval set in contiguous ceil(n/world) chunks: rank N's chunk is empty,
               np.mean([]) warns `Mean of empty slice` and gives nan, the all-reduced loss is nan, and rank 0's strict
               metrics writer (json allow_nan=False) raises ValueError later
  evalnumpy    every rank's final eval forgot torch.no_grad() and calls .numpy() on the softmax for the
               calibration histogram: RuntimeError: Can't call numpy() on Tensor that requires grad
  exporthang   the writer waits for <out>/.export.lock, left by an earlier job's export that died (made by the
               script at start); it never reaches the final barrier

What happened (filled in after the runs):
  none: exit 0 (np4 plain, np4 pdsh2); eval acc 0.844, every artifact written, the gate passes.
  jitscript: NotSupportedError (forward's **kwargs) on the writer; the others Connection closed by peer in the barrier.
  exportdyn: GuardOnDataDependentSymNode after a dump of the traced graph; the others Connection closed by peer.
  jsontensor: TypeError: Object of type Tensor is not JSON serializable on rank 0; the others Connection closed.
  outdir: FileExistsError: [Errno 17] File exists (dangling symlink) on rank 0; the others Connection closed.
  destroyfirst: ValueError: Default process group has not been initialized on the writer (DETAIL: monitoredBarrier).
  gate: every rank done, then RELEASE GATE FAILED (0.844 < 60) and exit 1 on rank 0; <NO_OTHER_FAILURES>.
  bestckpt: np4 and np5: the last rank's best epoch is 1, rank 0 kept epoch 2: FileNotFoundError on rank 0.
  evalskip: with 4 extra records (first try) nothing changed, exit 0; with one batch more: 12 s gloo timeouts.
  emptyeval: RuntimeWarning Mean of empty slice, final eval nan, ValueError (not JSON compliant: nan) on rank 0.
  evalnumpy: RuntimeError: Can't call numpy() on Tensor that requires grad on every rank.
  exporthang: PG timeout 12 s: the others' final barrier times out; PG 300 s + timeout 100: hung, exit 124.
"""
import argparse, datetime, json, math, os, shutil, sys, time
import numpy as np
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--writer", type=int, default=0)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--bs", type=int, default=8)
p.add_argument("--eval-n", type=int, default=20)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--out", default="/tmp/fault113_work/out")
a = p.parse_args()
GATE = {"min_acc": 60 if a.fault == "gate" else 0.6}  # configs/release_gate.yaml


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(x)


class ServingWrapper(nn.Module):
    def __init__(self, model, temperature: float = 1.0):
        super().__init__()
        self.model, self.temperature = model, temperature

    def forward(self, x, **kwargs):
        return F.softmax(self.model(x) / self.temperature, dim=-1)


class Calibrated(nn.Module):
    def __init__(self, model, clip: float = 8.0):
        super().__init__()
        self.model, self.clip = model, clip

    def forward(self, x):
        logits = self.model(x)
        if logits.abs().max() > self.clip:
            logits = logits.clamp(-self.clip, self.clip)
        return logits


TEACHER = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))


def make_data(n: int, seed: int):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return x, (x @ TEACHER).argmax(1)


def final_eval(net, rank, world):
    ex, ey = make_data(a.eval_n, 7)
    if a.fault == "emptyeval":
        chunk = math.ceil(a.eval_n / world)
        ex, ey = ex[rank * chunk:(rank + 1) * chunk], ey[rank * chunk:(rank + 1) * chunk]
    else:
        ex, ey = ex[rank::world], ey[rank::world]
    losses, accs, hist = [], [], np.zeros(10)
    net.eval()
    with torch.no_grad() if not faulty(rank, "evalnumpy") else torch.enable_grad():
        for i in range(0, len(ex), 4):
            out = net(ex[i:i + 4])
            losses.append(F.cross_entropy(out, ey[i:i + 4]).item())
            accs.append((out.argmax(1) == ey[i:i + 4]).float().mean().item())
            conf = F.softmax(out, dim=-1).max(1).values
            hist += np.histogram(conf.numpy(), bins=10, range=(0, 1))[0]
    print(f"rank {rank} final eval: {len(ex)} samples, {len(losses)} batches", flush=True)
    stats = torch.tensor([float(np.mean(losses)), float(np.mean(accs))])
    dist.all_reduce(stats)
    stats /= world
    return stats


def save_state(model, path):
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)


def write_artifacts(model, stats, best_epoch, rank, world):
    out = a.out
    if a.fault == "exporthang":
        lock = os.path.join(out, ".export.lock")
        t0 = time.monotonic()
        while os.path.exists(lock):  # the previous job's export holds it
            if int(time.monotonic() - t0) % 10 == 0:
                print(f"rank {rank}: waiting for {lock} ({time.monotonic() - t0:.0f}s)", flush=True)
            time.sleep(1.0)
    os.makedirs(out, exist_ok=True)
    eval_loss, eval_acc = stats[0], stats[1].item()
    metrics = {"eval_loss": eval_loss if a.fault == "jsontensor" else eval_loss.item(), "eval_acc": eval_acc,
               "best_epoch": best_epoch, "epochs": a.epochs, "world_size": world}
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2, allow_nan=False)
    print(f"rank {rank}: wrote {out}/metrics.json eval_loss {metrics['eval_loss']:.4f} acc {eval_acc:.3f}", flush=True)
    shutil.copy(os.path.join(out, f"ckpt_epoch{best_epoch}.pt"), os.path.join(out, "best.pt"))
    print(f"rank {rank}: best checkpoint epoch {best_epoch} -> {out}/best.pt", flush=True)
    example = torch.randn(2, 8)
    if a.fault == "jitscript":
        exported = torch.jit.script(ServingWrapper(model))
        exported.save(os.path.join(out, "model_scripted.pt"))
    elif a.fault == "exportdyn":
        ep = torch.export.export(Calibrated(model), (example,))
        torch.export.save(ep, os.path.join(out, "model.pt2"))
    else:
        traced = torch.jit.trace(model, example)
        traced.save(os.path.join(out, "model_traced.pt"))
    flat = {k.replace("module.", ""): v.contiguous() for k, v in model.state_dict().items()}
    torch.save(flat, os.path.join(out, "model_flat.pt"))
    with open(os.path.join(out, "MODEL_CARD.md"), "w") as f:
        f.write(f"# tiny-classifier\n\neval_loss {metrics['eval_loss']:.4f}, eval_acc {eval_acc:.3f}, "
                f"trained {a.epochs} epochs on {world} ranks\n")
    print(f"rank {rank}: exported model and model card to {out}", flush=True)
    if a.fault == "destroyfirst":
        finish_export()


def finish_export():
    # from tools/export_single.py: release the process group once the files are closed
    if dist.is_initialized():
        dist.destroy_process_group()
    print("export finished, process group released", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    writer = a.writer
    if rank == writer and a.fault == "outdir":
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        if not os.path.islink(a.out):
            os.symlink("/tmp/fault113_work/scratch_purged/run113", a.out)  # stands in for the purged scratch
    if rank == writer and a.fault == "exporthang":
        os.makedirs(a.out, exist_ok=True)
        open(os.path.join(a.out, ".export.lock"), "w").close()  # stands in for the dead job's lock
    torch.manual_seed(0)
    model = Classifier()
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    extra = a.bs if faulty(rank, "evalskip") else 0  # one more batch of records
    tx, ty = make_data(a.steps * a.bs + extra, 100 + rank)
    vx, vy = make_data(8, 200 + rank)
    steps_per_epoch = len(tx) // a.bs
    max_steps = a.epochs * a.steps
    num_epochs = math.ceil(max_steps / steps_per_epoch)
    print(f"rank {rank}/{world} pid {os.getpid()} fault {a.fault}: {len(tx)} train records, {steps_per_epoch} steps "
          f"an epoch, {num_epochs} epochs, {max_steps} steps", flush=True)
    if rank == writer and a.fault != "outdir":
        os.makedirs(a.out, exist_ok=True)
    epoch, best, best_epoch, best_acc, best_acc_epoch = 0, float("inf"), -1, -1.0, -1
    for step in range(max_steps):
        i = (step % steps_per_epoch) * a.bs
        net.train()
        loss = F.cross_entropy(net(tx[i:i + a.bs]), ty[i:i + a.bs])
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        print(f"rank {rank} epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.05)
        if (step + 1) % steps_per_epoch == 0:
            net.eval()
            with torch.no_grad():
                vout = net(vx)
                val, vacc = F.cross_entropy(vout, vy).item(), (vout.argmax(1) == vy).float().mean().item()
            print(f"rank {rank} epoch {epoch} val_loss {val:.4f} val_acc {vacc:.3f} (local shard)", flush=True)
            if vacc > best_acc:
                best_acc, best_acc_epoch = vacc, epoch
            if val < best:
                best, best_epoch = val, epoch
                if rank == writer and os.path.isdir(a.out):
                    for old in [f for f in os.listdir(a.out) if f.startswith("ckpt_epoch")]:
                        os.remove(os.path.join(a.out, old))  # keep only the best (disk quota)
                    save_state(model, os.path.join(a.out, f"ckpt_epoch{epoch}.pt"))
            epoch += 1
    if epoch == num_epochs:
        stats = final_eval(net, rank, world)
        if rank == 0:
            print(f"final eval: loss {stats[0].item():.4f} acc {stats[1].item():.3f}", flush=True)
    else:
        print(f"rank {rank}: epoch {epoch}/{num_epochs} not complete, skipping the final eval", flush=True)
    if a.fault == "bestckpt":
        obj = [best_acc_epoch]  # the tracker (monitor: val_acc) lives on the last rank, like the last pipeline stage
        dist.broadcast_object_list(obj, src=world - 1)
        best_epoch = obj[0]
    if rank == writer:
        write_artifacts(model, stats, best_epoch, rank, world)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()
    if rank == 0 and stats[1].item() < GATE["min_acc"]:
        print(f"RELEASE GATE FAILED: eval accuracy {stats[1].item():.3f} < min_acc {GATE['min_acc']} "
              f"(configs/release_gate.yaml); artifacts in {a.out} are not published", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()

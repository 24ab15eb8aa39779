"""A thirty-third hand-run batch: the END of a run. A small DDP loop on gloo trains fine (Linear(8,16)-ReLU-Linear(16,4),
synthetic batches, 6 steps, process-group timeout 15 s), prints a "training finished" line of some kind, and then
ONE fault happens on rank N (--rank) in the END PHASE: the final evaluation, the last checkpoint, the export or the
teardown. The progress format is chosen with --fmt (plain, hf, log, tqdm, lightning).

End-phase faults (--fault):
  eval_solo_exit    only the metrics rank N evaluates; its evaluate() all-reduces (correct, total) across ranks, but the
                    others have already destroyed the group and exited 0
  eval_solo_barrier only the metrics rank N evaluates (same all-reduce); the others wait in a final dist.barrier()
  eval_gather_len   every rank evaluates its shard and all-gathers its predictions (dist.all_gather); rank N's eval shard
                    holds 12 samples where the others hold 16
  eval_zerodiv      rank N's eval shard is empty: accuracy = correct / total raises ZeroDivisionError
  eval_key          rank N's eval shard has no positive sample, so its metrics dict has no 'f1': KeyError: 'f1'
  save_perm         rank N writes the final checkpoint into a folder it may not write (PermissionError); the others wait
                    in dist.barrier()
  save_nodir        rank N torch.save()s into a run folder nobody created (torch's RuntimeError: Parent directory ...
                    does not exist.); the others wait in dist.barrier()
  save_notdir       rank N os.makedirs() its output folder where a file of that name is in the way (NotADirectoryError)
  save_slow         rank N's final save takes 45 s (a slow shared file system); the others wait in dist.barrier()
  save_nobarrier    rank N saves the checkpoint, then broadcasts its path (broadcast_object_list); the others did not
                    wait and have already exited 0
  dcp_raise         torch.distributed.checkpoint.save of the model with a FileSystemWriter whose write on rank N raises
                    OSError (disk quota exceeded)
  export_jit        rank N exports with torch.jit.script of a wrapper whose forward uses an unsupported construct; the
                    others wait in dist.barrier()
  export_keys       rank N renames the state_dict keys for export through a rename table that lacks one key (KeyError)
  destroy_partial   rank N destroys its process group and exits 0 right after training; the others all-reduce the
                    final token count
  exit1             rank N calls os._exit(1) right after its 'finished' line, with no message; the others wait in the
                    final dist.barrier()
  segv_exit         rank N SIGSEGVs during interpreter shutdown (an atexit hook of a native "profiler" reads address 0),
                    after the final barrier and destroy_process_group
  hang_thread       rank N's non-daemon upload thread never ends: the process never exits after 'finished' (the run is
                    stopped by an outer `timeout`)
  ctrl_upload       control: rank N's optional upload fails with ConnectionRefusedError, caught and printed with its
                    traceback ('upload skipped'); exit 0
  ctrl_del          control: rank N holds a writer whose __del__ raises at exit ('Exception ignored in: ...'), plus an
                    atexit hook that raises ('Exception ignored in atexit callback'); exit 0
  ctrl_nodestroy    control: rank N skips destroy_process_group, prints a caught 'ProcessGroup' teardown warning line and
                    a caught RuntimeError traceback from an optional metrics push; exit 0
"""
import argparse, atexit, datetime, logging, os, sys, threading, time, traceback
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--fmt", default="plain", choices=["plain", "hf", "log", "tqdm", "lightning"])
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--out", default="/tmp/fault33/out")
a = p.parse_args()
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BAD = RANK == a.rank
FMT = a.fmt
log = logging.getLogger("train")
if FMT == "log":
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank{RANK}] %(name)s: %(message)s")


def say(msg: str) -> None:
    if FMT == "log":
        log.info(msg)
    else:
        print(f"[rank {RANK}] {msg}", flush=True)


def finished_line(t0: float, last: float) -> None:
    dt = time.time() - t0
    if FMT == "hf":
        if RANK == 0:
            print(f"{{'train_runtime': {dt:.4f}, 'train_samples_per_second': {16 * a.steps * WORLD / dt:.3f}, "
                  f"'train_steps_per_second': {a.steps / dt:.3f}, 'train_loss': {last:.4f}, 'epoch': 1.0}}", flush=True)
            print("\n\nTraining completed. Do not forget to share your model on huggingface.co/models =)\n\n", flush=True)
    elif FMT == "lightning":
        if RANK == 0:
            print("`Trainer.fit` stopped: `max_epochs=1` reached.", flush=True)
    elif FMT == "log":
        log.info("Training complete: %d steps in %.1fs, final loss %.4f", a.steps, dt, last)
    elif FMT == "tqdm":
        print(f"rank {RANK}: training finished ({a.steps} steps, loss {last:.4f})", flush=True)
    else:
        print(f"[rank {RANK}] training finished: {a.steps} steps, final loss {last:.4f}", flush=True)


def batch(step: int, n: int = 16, shard: int = 0):
    g = torch.Generator().manual_seed(1000 * shard + step)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def eval_shard(model, n: int):
    x, y = batch(999, n, shard=RANK)
    with torch.no_grad():
        pred = model(x).argmax(1) if n else torch.zeros(0, dtype=torch.long)
    return pred, y


def evaluate(model, n: int = 16, reduce: bool = True):
    say(f"evaluating on {n} held-out samples")
    pred, y = eval_shard(model, n)
    correct, total = int((pred == y).sum()), len(y)
    if reduce:
        t = torch.tensor([correct, total], dtype=torch.float64)
        dist.all_reduce(t)
        correct, total = int(t[0]), int(t[1])
    acc = correct / total
    say(f"eval accuracy {acc:.4f} ({correct}/{total})")
    return acc


def metrics(pred, y):
    m = {"accuracy": float((pred == y).float().mean())}
    pos = y == 1
    if pos.any():  # precision/recall/f1 only exist for a shard with positives
        tp = float(((pred == 1) & pos).sum())
        prec = tp / max(float((pred == 1).sum()), 1.0)
        rec = tp / float(pos.sum())
        m["f1"] = 2 * prec * rec / max(prec + rec, 1e-9)
    return m


class Exportable(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        out = self.inner(x)
        scores = {k: v for k, v in enumerate(out.unbind(0))}  # dict comprehension over enumerate: not scriptable
        return torch.stack([scores[k] for k in sorted(scores)])


class RunWriter:
    """Stands in for a metrics writer whose file is already closed when it is garbage-collected."""

    def __init__(self, path):
        self.path = path
        self.fh = None

    def __del__(self):
        self.fh.flush()  # AttributeError: 'NoneType' object has no attribute 'flush'


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    say(f"world {WORLD}: model ready, {sum(q.numel() for q in model.parameters())} parameters")
    bar = None
    if FMT in ("tqdm", "lightning") and RANK == 0:
        from tqdm import tqdm
        bar = tqdm(total=a.steps, desc="train" if FMT == "tqdm" else "Epoch 0", file=sys.stderr)
    t0, last = time.time(), 0.0
    for step in range(1, a.steps + 1):
        x, y = batch(step, shard=RANK)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        last = loss.item()
        time.sleep(0.05)
        if FMT == "hf":
            if RANK == 0 and step % 2 == 0:
                print(f"{{'loss': {last:.4f}, 'grad_norm': 0.8{step}, 'learning_rate': 0.1, 'epoch': {step / a.steps:.2f}}}",
                      flush=True)
        elif FMT == "log":
            log.info("step %d/%d loss=%.4f lr=0.1", step, a.steps, last)
        elif bar is not None:
            bar.set_postfix(loss=f"{last:.3f}" if FMT == "tqdm" else None, **({"v_num": 0, "train_loss": f"{last:.3f}"} if FMT == "lightning" else {}))
            bar.update(1)
        elif FMT in ("tqdm", "lightning"):
            pass
        else:
            print(f"[rank {RANK}] step {step}/{a.steps} loss {last:.4f}", flush=True)
    if bar is not None:
        bar.close()
    finished_line(t0, last)
    end_phase(model, last)


def end_phase(model, last: float) -> None:
    f = a.fault
    plain = model.module
    if f == "eval_solo_exit" or f == "eval_solo_barrier":
        if BAD:
            evaluate(plain)
        elif f == "eval_solo_barrier":
            dist.barrier()
        return finish(barrier=False)
    if f == "eval_gather_len":
        n = 12 if BAD else 16
        say(f"evaluating on {n} held-out samples")
        pred, y = eval_shard(plain, n)
        preds = [torch.empty(16, dtype=torch.long) for _ in range(WORLD)]
        dist.all_gather(preds, pred)
        if RANK == 0:
            say(f"gathered {sum(len(q) for q in preds)} predictions")
        return finish()
    if f in ("eval_zerodiv", "eval_key"):
        n = 0 if (BAD and f == "eval_zerodiv") else 16
        if f == "eval_key":
            pred, y = eval_shard(plain, 16)
            if BAD:
                y = torch.where(y == 1, torch.zeros_like(y), y)  # this rank's held-out shard has no positives
            else:
                y[0] = 1  # every other shard holds at least one positive
            m = metrics(pred, y)
            say(f"eval accuracy {m['accuracy']:.4f} f1 {m['f1']:.4f}")
            t = torch.tensor([m["accuracy"], m["f1"]])
        else:
            acc = evaluate(plain, n, reduce=False)
            t = torch.tensor([acc])
        dist.all_reduce(t)
        if RANK == 0:
            say(f"mean eval metrics {(t / WORLD).tolist()}")
        return finish()
    if f in ("save_perm", "save_nodir", "save_notdir", "save_slow"):
        if BAD:
            out = a.out
            say(f"saving final checkpoint to {out}/final.pt")
            if f == "save_notdir":
                os.makedirs(out, exist_ok=True)
            if f == "save_slow":
                time.sleep(3 * a.pg_timeout)
            if f == "save_perm":
                with open(f"{out}/final.pt", "wb") as fh:
                    torch.save(plain.state_dict(), fh)
            else:
                torch.save(plain.state_dict(), f"{out}/final.pt")
            say("checkpoint saved")
        return finish()
    if f == "save_nobarrier":
        if BAD:
            os.makedirs(a.out, exist_ok=True)
            path = f"{a.out}/final.pt"
            torch.save(plain.state_dict(), path)
            say(f"checkpoint saved to {path}; announcing it to the other ranks")
            obj = [path]
            dist.broadcast_object_list(obj, src=RANK)
        return finish(barrier=False)
    if f == "dcp_raise":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        class QuotaWriter(FileSystemWriter):
            def write_data(self, plan, planner):
                if BAD:
                    raise OSError(122, "Disk quota exceeded", f"{a.out}/dcp/__{RANK}_0.distcp")
                return super().write_data(plan, planner)

        say(f"saving distributed checkpoint to {a.out}/dcp")
        dcp.save({"model": plain.state_dict()}, storage_writer=QuotaWriter(f"{a.out}/dcp"))
        say("distributed checkpoint saved")
        return finish()
    if f == "export_jit":
        if BAD:
            say("exporting TorchScript model")
            scripted = torch.jit.script(Exportable(plain))
            scripted.save(f"{a.out}/model.ts")
            say("export done")
        return finish()
    if f == "export_keys":
        if BAD:
            say("renaming state_dict keys for the serving format")
            table = {"0.weight": "encoder.weight", "0.bias": "encoder.bias", "2.weight": "head.weight"}
            sd = {table[k]: v for k, v in plain.state_dict().items()}
            torch.save(sd, f"{a.out}/export.pt")
            say("export done")
        return finish()
    if f == "destroy_partial":
        if BAD:
            say("cleanup: destroying process group")
            dist.destroy_process_group()
            say("bye")
            return
        t = torch.tensor([16.0 * a.steps])
        dist.all_reduce(t)
        if RANK == 0:
            say(f"tokens seen: {int(t.item())}")
        return finish()
    if f == "exit1":
        if BAD:
            os._exit(1)
        return finish()
    if f == "segv_exit":
        if BAD:
            import ctypes

            def _flush_profiler():
                ctypes.string_at(0)  # the native profiler's buffer is already freed

            atexit.register(_flush_profiler)
        return finish()
    if f == "hang_thread":
        if BAD:
            import queue
            q = queue.Queue()

            def _upload():
                while True:
                    item = q.get()  # waits for the sentinel nobody sends
                    if item is None:
                        break

            threading.Thread(target=_upload, name="artifact-uploader").start()
            say("artifact upload started in the background")
        return finish()
    if f == "ctrl_upload":
        finish()
        if BAD:
            try:
                import socket
                s = socket.create_connection(("127.0.0.1", 9), timeout=2)
                s.close()
            except Exception:
                traceback.print_exc()
                print(f"WARNING: rank {RANK}: optional artifact upload failed, upload skipped (results are saved locally)",
                      flush=True)
        return
    if f == "ctrl_del":
        if BAD:
            global _writer
            _writer = RunWriter(f"{a.out}/events.log")

            def _close_tracker():
                raise RuntimeError("tracker run already finished")

            atexit.register(_close_tracker)
        return finish()
    if f == "ctrl_nodestroy":
        dist.barrier()
        if BAD:
            try:
                raise RuntimeError("metrics push: server returned HTTP 503 Service Unavailable")
            except RuntimeError:
                traceback.print_exc()
                print(f"WARNING: rank {RANK}: metrics push failed, continuing without it (process group left to exit)",
                      flush=True)
        if not BAD:
            dist.destroy_process_group()
        say("exiting")
        return
    raise SystemExit(f"unknown fault {f}")


def finish(barrier: bool = True) -> None:
    if barrier:
        dist.barrier()
    dist.destroy_process_group()
    say("done")


if __name__ == "__main__":
    main()

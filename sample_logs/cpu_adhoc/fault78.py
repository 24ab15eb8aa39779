"""A seventy-eighth hand-run batch: TRAINER CALLBACKS AND HOOKS. A small hand-written Trainer (tiny DDP model on
gloo: Linear(8,16)-ReLU-Linear(16,4), SGD, batch 8, a synthetic per-rank shard of 32 samples, 3 epochs, PG timeout
12 s unless --pg-timeout) with a callback system: on_train_start, on_step_end, on_epoch_end, on_save (rank 0 only,
after on_epoch_end) and on_train_end. Callbacks marked non-critical have their exceptions caught and logged by the
trainer (`callback X failed in hook: ...`) and the run goes on. --rank N picks the rank a fault lives on. No @record.

Faults:
  none        control: progress, metric sync (all_reduce of val_loss), early stopping on the synced metric,
              checkpoint on rank 0, LR monitor; `rank R done` x N (exit 0)
  caughtok    control with a herring: rank N's CSV logger writes under a log dir nobody created; the trainer logs
              `callback CSVLogger failed in on_step_end: ...` every step and the run ends well (exit 0)
  earlystop   EarlyStopping lives only on the eval rank N and watches its local val_loss (min_delta 0.5 makes it
              stop after epoch 1): rank N leaves the loop and waits in the final barrier, the others go on into
              epoch 2's gradient all-reduce
  earlyexit   the same, and the trainer returns without a final barrier: rank N prints done and exits 0
  ckptbarrier the checkpoint callback (rank 0 only) calls dist.barrier() "so every rank sees the file": the others
              never come, they are in the next epoch's gradient all-reduce
  ckptbest    the checkpoint callback (rank 0 only) all_reduces its best metric (MIN) to agree on `best`
  ckptpickle  the checkpoint callback (rank 0 only) saves the LambdaLR scheduler object itself: torch.save cannot
              pickle its local lambda
  emptyshard  the data has world-1 files split in contiguous blocks: the last rank's shard is empty; the throughput
              callback's on_epoch_end divides the loss sum by the samples seen: ZeroDivisionError
  lrmon       the LR monitor (on the tracker rank N only) reads optimizer.param_groups[1] ("head" lr of an older
              config); there is one group: IndexError
  lrprobe     rank 0 adds a linear probe's param group to its optimizer; the LR monitor on every rank reads
              param_groups[1]: IndexError on every rank but 0
  cborder     the callbacks come from a config dict; rank N's dict has a node-local override merged first, so its
              ThroughputSync (all_reduce of 3 float64 counters) runs before MetricsSync (all_reduce of 1 float):
              the collectives pair up with different sizes
  gather      a predictions callback all_gathers each rank's eval predictions; rank N's eval split is 1 sample
              shorter (all_gather with tensors of different length)
  trainend    the summary callback on rank N writes summary.json in on_train_end, after the final barrier and after
              the others printed done: json cannot serialize a tensor (TypeError)
  histall     a history callback on every rank compares val_loss with the previous epoch's at the first epoch:
              IndexError everywhere
  caughtnan   rank 1's CSV logger fails and is caught (a herring); rank N's shard has a NaN row in its last batch and the
              critical LossMonitor raises FloatingPointError on rank N
  caughtsync  rank N's MetricsSync fails in its compute (a KeyError, caught and logged) before its all_reduce, so
              rank N skips that collective and runs ahead (to the next epoch's gradient all-reduce)
  notify      a Notifier on rank N posts 'epoch done' to a webhook on 127.0.0.1:--hook-port that refuses; it retries
              with backoff 1+2+4+8+16 s before giving up, so rank N comes late to the next all-reduce
"""
import argparse, datetime, json, math, os, socket, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--hook-port", type=int, default=9)
p.add_argument("--workdir", default="/tmp/fault78_work")
a = p.parse_args()
BATCH, N_TRAIN, N_EVAL = 8, 32, 16


class Callback:
    critical = True

    def on_train_start(self, tr): pass
    def on_step_end(self, tr): pass
    def on_epoch_end(self, tr): pass
    def on_save(self, tr): pass
    def on_train_end(self, tr): pass


class ProgressLogger(Callback):
    def on_step_end(self, tr):
        print(f"rank {tr.rank} epoch {tr.epoch} step {tr.step} loss {tr.loss:.4f}", flush=True)


class MetricsSync(Callback):
    def on_epoch_end(self, tr):
        if a.fault == "caughtsync" and tr.rank == a.rank and tr.epoch == 0:
            local = tr.metrics["val_loss_ema"]  # a key only the newer evaluate() fills in
        else:
            local = tr.metrics["val_loss"]
        t = torch.tensor([local])
        dist.all_reduce(t)
        tr.metrics["val_loss_global"] = t.item() / tr.world


class ThroughputSync(Callback):
    def on_train_start(self, tr):
        self.t0 = time.time()

    def on_epoch_end(self, tr):
        t = torch.tensor([tr.samples_seen, tr.steps_done, time.time() - self.t0], dtype=torch.float64)
        dist.all_reduce(t)
        tr.metrics["samples_per_s"] = t[0].item() / max(t[2].item() / tr.world, 1e-9)


class Throughput(Callback):
    def on_epoch_end(self, tr):
        mean = tr.loss_sum / tr.samples_seen
        print(f"rank {tr.rank} epoch {tr.epoch} train_loss {mean:.4f} samples {tr.samples_seen}", flush=True)


class EarlyStopping(Callback):
    def __init__(self, monitor, min_delta, patience=0):
        self.monitor, self.min_delta, self.patience, self.best, self.bad = monitor, min_delta, patience, None, 0

    def on_epoch_end(self, tr):
        v = tr.metrics[self.monitor]
        if self.best is None or v < self.best - self.min_delta:
            self.best, self.bad = v, 0
            return
        self.bad += 1
        if self.bad > self.patience:
            print(f"rank {tr.rank}: EarlyStopping: {self.monitor} {v:.4f} did not improve by {self.min_delta} "
                  f"on {self.best:.4f}, stopping at epoch {tr.epoch}", flush=True)
            tr.should_stop = True


class Checkpoint(Callback):
    def __init__(self):
        self.best = float("inf")

    def on_save(self, tr):
        v = tr.metrics.get("val_loss_global", tr.metrics["val_loss"])
        if a.fault == "ckptbest":
            t = torch.tensor([v])
            dist.all_reduce(t, op=dist.ReduceOp.MIN)  # agree on the best metric
            v = t.item()
        self.best = min(self.best, v)
        path = f"{a.workdir}/last.ckpt"
        state = {"epoch": tr.epoch, "model": tr.model.module.state_dict(), "optim": tr.opt.state_dict(),
                 "best": self.best}
        if a.fault == "ckptpickle":
            state["scheduler"] = tr.sched  # the scheduler object itself, not its state_dict()
        torch.save(state, path)
        print(f"rank {tr.rank}: saved checkpoint {path} (epoch {tr.epoch}, best {self.best:.4f})", flush=True)
        if a.fault == "ckptbarrier":
            dist.barrier()  # so that every rank sees the file before going on


class LRMonitor(Callback):
    def __init__(self, group):
        self.group = group

    def on_step_end(self, tr):
        if tr.step == 0:
            lr = tr.opt.param_groups[self.group]["lr"]
            print(f"rank {tr.rank} epoch {tr.epoch} lr[{self.group}] {lr:.5f}", flush=True)


class CSVLogger(Callback):
    critical = False

    def on_step_end(self, tr):
        with open(f"{a.workdir}/logs/rank{tr.rank}/metrics.csv", "a") as fh:
            fh.write(f"{tr.epoch},{tr.step},{tr.loss}\n")


class LossMonitor(Callback):
    def on_step_end(self, tr):
        if not math.isfinite(tr.loss):
            raise FloatingPointError(f"loss is {tr.loss} at epoch {tr.epoch} step {tr.step}")


class Predictions(Callback):
    def on_epoch_end(self, tr):
        preds = tr.preds
        out = [torch.empty_like(preds) for _ in range(tr.world)]
        dist.all_gather(out, preds)
        if tr.rank == 0:
            acc = torch.cat(out).float().mean().item()
            print(f"epoch {tr.epoch}: gathered {sum(len(o) for o in out)} predictions, mean class {acc:.3f}",
                  flush=True)


class History(Callback):
    def __init__(self):
        self.hist = []

    def on_epoch_end(self, tr):
        self.hist.append(tr.metrics["val_loss"])
        delta = self.hist[-1] - self.hist[-2]  # change since the previous epoch
        print(f"rank {tr.rank} epoch {tr.epoch} val_loss change {delta:+.4f}", flush=True)


class Summary(Callback):
    def on_train_end(self, tr):
        path = f"{a.workdir}/summary_rank{tr.rank}.json"
        with open(path, "w") as fh:
            json.dump({"epochs": tr.epoch + 1, "metrics": tr.metrics, "final_loss": tr.loss_t}, fh)
        print(f"rank {tr.rank}: wrote {path}", flush=True)


class Notifier(Callback):
    def on_epoch_end(self, tr):
        msg = json.dumps({"text": f"epoch {tr.epoch} done, val_loss {tr.metrics['val_loss']:.4f}"}).encode()
        delay = 1
        for attempt in range(1, 6):
            try:
                with socket.create_connection(("127.0.0.1", a.hook_port), timeout=5) as s:
                    s.sendall(b"POST /hook HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(msg), msg))
                return
            except OSError as e:
                print(f"rank {tr.rank}: notifier: post failed ({e}), retry {attempt}/5 in {delay}s", flush=True)
                time.sleep(delay)
                delay *= 2
        print(f"rank {tr.rank}: notifier: giving up on epoch {tr.epoch}", flush=True)


class Trainer:
    def __init__(self, model, opt, sched, callbacks, rank, world, data, evaldata):
        self.model, self.opt, self.sched, self.callbacks = model, opt, sched, callbacks
        self.rank, self.world, self.data, self.evaldata = rank, world, data, evaldata
        self.metrics, self.should_stop = {}, False
        self.samples_seen = self.steps_done = 0
        self.loss_sum, self.epoch, self.step, self.loss = 0.0, 0, 0, 0.0

    def _call(self, hook):
        for cb in self.callbacks:
            try:
                getattr(cb, hook)(self)
            except Exception as e:
                if cb.critical:
                    raise
                print(f"[trainer] rank {self.rank}: callback {type(cb).__name__} failed in {hook}: "
                      f"{type(e).__name__}: {e} (non-critical, continuing)", flush=True)

    def evaluate(self):
        x, y = self.evaldata
        with torch.no_grad():
            out = self.model.module(x)
            self.metrics["val_loss"] = F.cross_entropy(out, y).item()
            self.preds = out.argmax(1)

    def fit(self, epochs):
        self._call("on_train_start")
        x_all, y_all = self.data
        for self.epoch in range(epochs):
            self.samples_seen, self.loss_sum = 0, 0.0
            for self.step in range(len(x_all) // BATCH):
                x = x_all[self.step * BATCH:(self.step + 1) * BATCH]
                y = y_all[self.step * BATCH:(self.step + 1) * BATCH]
                self.opt.zero_grad()
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                self.opt.step()
                self.loss_t, self.loss = loss.detach(), loss.item()
                self.samples_seen += len(x)
                self.steps_done += 1
                self.loss_sum += self.loss * len(x)
                self._call("on_step_end")
            self.sched.step()
            self.evaluate()
            self._call("on_epoch_end")
            if self.rank == 0:
                self._call("on_save")
            if self.should_stop:
                break
        if a.fault == "earlyexit" and self.should_stop:
            return
        dist.barrier()


def shard(rank, world):
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(world * N_TRAIN, 8, generator=g), torch.randint(0, 4, (world * N_TRAIN,), generator=g)
    if a.fault == "emptyshard":
        files = [(x[i * N_TRAIN:(i + 1) * N_TRAIN], y[i * N_TRAIN:(i + 1) * N_TRAIN]) for i in range(world - 1)]
        per = math.ceil(len(files) / world)
        mine = files[rank * per:(rank + 1) * per]
        if not mine:
            return torch.empty(0, 8), torch.empty(0, dtype=torch.long)
        return torch.cat([f[0] for f in mine]), torch.cat([f[1] for f in mine])
    xs, ys = x[rank * N_TRAIN:(rank + 1) * N_TRAIN].clone(), y[rank * N_TRAIN:(rank + 1) * N_TRAIN]
    if a.fault == "caughtnan" and rank == a.rank:
        xs[N_TRAIN - BATCH + 3, 5] = float("nan")  # a corrupt row in the shard's last batch
    return xs, ys


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if a.fault == "lrprobe" and rank == 0:
        probe = nn.Linear(16, 4)
        opt.add_param_group({"params": probe.parameters(), "lr": 1e-3})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e)
    os.makedirs(a.workdir, exist_ok=True)
    data = shard(rank, world)
    ge = torch.Generator().manual_seed(99 + rank)
    n_eval = N_EVAL - 1 if (a.fault == "gather" and me) else N_EVAL
    evaldata = torch.randn(n_eval, 8, generator=ge), torch.randint(0, 4, (n_eval,), generator=ge)

    registry = {"progress": ProgressLogger, "metrics_sync": MetricsSync, "throughput_sync": ThroughputSync}
    cfg = {"progress": {}, "metrics_sync": {}}
    if a.fault == "cborder":
        cfg["throughput_sync"] = {}
        if me:  # this node's override file is merged first
            cfg = {"throughput_sync": {}, **cfg}
    callbacks = [registry[name]() for name in cfg]
    if a.fault in ("earlystop", "earlyexit"):
        if me:  # the eval rank owns early stopping
            callbacks.append(EarlyStopping("val_loss", min_delta=0.5))
    else:
        callbacks.append(EarlyStopping("val_loss_global", min_delta=0.0, patience=5))
    callbacks.append(Checkpoint())
    if a.fault == "lrmon":
        if me:
            callbacks.append(LRMonitor(1))
    elif a.fault == "lrprobe":
        callbacks.append(LRMonitor(1))
    else:
        callbacks.append(LRMonitor(0))
    if a.fault == "caughtok" and me or a.fault == "caughtnan" and rank == 1:
        callbacks.append(CSVLogger())
    if a.fault == "caughtnan":
        callbacks.append(LossMonitor())
    if a.fault == "caughtsync":
        MetricsSync.critical = False
    if a.fault == "emptyshard":
        callbacks.insert(1, Throughput())
    if a.fault == "gather":
        callbacks.append(Predictions())
    if a.fault == "histall":
        callbacks.append(History())
    if a.fault == "trainend" and me:
        callbacks.append(Summary())
    if a.fault == "notify" and me:
        callbacks.append(Notifier())
    print(f"rank {rank}/{world}: {len(data[0])} train samples, callbacks "
          f"{[type(c).__name__ for c in callbacks]}", flush=True)

    tr = Trainer(model, opt, sched, callbacks, rank, world, data, evaldata)
    tr.fit(a.epochs)
    if a.fault != "earlyexit" or not tr.should_stop:
        dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
    tr._call("on_train_end")


if __name__ == "__main__":
    main()

"""fault614.py - vicuna fleece grading: a tiny multi-rank CPU (gloo) training job with planted faults.

Each rank reads its shard of synthetic vicuna fleece samples (fiber diameter, staple length, crimp,
colour, ...), maps each fleece's lot code through a JSON lookup table to a breeder-lot token, and trains
a small classifier of the fleece grade (4 grades). Metric printed each step: grade_acc.
`--prepare` writes /tmp/fault614_work (shards for 8 ranks, lookup.json, start.pt). Modes: plain
torch.distributed (torchrun), `--acc` (accelerate, Accelerator(cpu=True)), `--hf` (transformers.Trainer
with a 1-layer BERT built from a config). Process-group timeout 12 s (`--pg-timeout`). 6 steps.

Faults (`--fault NAME --rank N`, `--rank2 M` for a second rank):
  none          control run
  two_ranks     rank N raises ValueError at step 2, rank M sleeps 1 s then raises RuntimeError
  warn_storm    every rank warns (UserWarning) each step; rank N raises ValueError at step 4
  caught_then   rank N catches a KeyError at step 1 and logs it (log.exception), goes on;
                rank M raises ZeroDivisionError at step 4
  chained       rank N: KeyError in the lot lookup, re-raised as RuntimeError ... from err at step 3
  save_fail     rank N torch.save's its export into a missing folder after the last step (others wait in a barrier)
  first_step    rank N fails in the forward of step 0 (matmul shape mismatch), before any step line
  tqdm_bar      a tqdm bar on every rank (stderr); rank N raises ValueError mid-bar (step 3)
  restart       rank N raises RuntimeError at step 2 on the first attempt only (TORCHELASTIC_RESTART_COUNT=0)
  logging_rank  rank N logs its steps through logging with timestamps; raises ValueError at step 3
  long_msg      rank N raises ValueError whose message holds a tensor repr and a dict (multi-line) at step 2
  sys_exit      rank N calls sys.exit("...") at step 2
  sigint        rank N sends itself SIGINT at step 3
  dtype         rank N torch.mm of float and long at step 2
  same_early    every rank raises the same ValueError at step 3, rank N at step 2
  segv          rank N kills itself with SIGSEGV at step 3
  sigkill       rank N kills itself with SIGKILL at step 3
  stall         rank N sleeps 300 s at step 2 (peers hit the gloo timeout)

Runs (one line per kept log):
  r01: vicuna_two_ranks_np8_r3_torchrun: r3 ValueError + r6 RuntimeError 1 s later, others gloo closed; exit 1
  r02: (dropped) warn_storm_np6_r5_acc: warnings only, the raise was missing from the script then; exit 0
  r03: vicuna_same_early_np5_r2_tee: r2 ValueError at step 2, others gloo closed/SIGTERM before step 3; exit 1
  r04: vicuna_caught_then_np6_r2_accconfig: r2 logged KeyError and went on, r5 ZeroDivisionError step 4; exit 1
  r05: vicuna_tqdm_bar_np5_r0_accdebug: bars on every rank, r0 ValueError at 3/6, others gloo closed; exit 1
  r06: vicuna_chained_np4_r3_acc2nodes: r3 RuntimeError from KeyError, two agent summaries; exit 1
  r07: vicuna_none_np3_rnone_hf: control, Trainer 6 steps, export saved; exit 0
  r08: vicuna_first_step_np3_r1_hf: r1 matmul shape error in step 0 forward, others gloo closed; exit 1
  r09: vicuna_save_fail_np4_r0_hf: r0 torch.save to missing dir after training, others die in barrier; exit 1
  r10: vicuna_restart_np5_r4_torchrun: r4 RuntimeError, restart failed (r2 Gloo connectFullMesh refused); exit 1
  r11: vicuna_logging_rank_np5_r2_acc: r2 timestamped logging lines, ValueError at step 3; exit 1
  r12: vicuna_long_msg_np4_r1_tee: r1 ValueError with tensor+dict message, others gloo closed; exit 1
  r13: vicuna_sys_exit_np6_r0_torchrun: r0 sys.exit message without traceback, others gloo closed; exit 1
  r14: vicuna_sigint_np3_r2_accdebug: r2 KeyboardInterrupt, exitcode -2 (SIGINT); exit 1
  r15: vicuna_dtype_np4_r3_accconfig: r3 mm float != long RuntimeError; exit 1
  r16: vicuna_save_fail_np5_r4_torchrun: r4 torch.save to missing dir, others die in final barrier; exit 1
  r17: vicuna_segv_np3_r1_tee: r1 SIGSEGV (-11), others gloo connection reset; exit 1
  r18: vicuna_stall_np4_r2_acc: r2 asleep, others gloo 12000ms timeout, launcher names r1; exit 1
  r19: vicuna_sigkill_np3_r2_hf: r2 SIGKILL (-9) in a Trainer job, others gloo closed; exit 1
  r20: vicuna_sigkill_np6_r5_acc2nodes: r5 SIGKILL (-9), two agent summaries; exit 1
  r21: vicuna_warn_storm_np4_r3_acc: warnings on every rank each step, r3 ValueError at step 4; exit 1
  r22: (reserved)
"""
import argparse, json, logging, os, signal, sys, time, warnings
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault614_work"
STEPS = 6
NFEAT = 8
NLOTS = 16
NGRADES = 4
log = logging.getLogger("fleece")


def prepare():
    os.makedirs(WORK, exist_ok=True)
    g = torch.Generator().manual_seed(614)
    lookup = {f"VL-{i:03d}": i for i in range(NLOTS)}
    with open(os.path.join(WORK, "lookup.json"), "w") as f:
        json.dump(lookup, f)
    for r in range(8):
        n = STEPS * 4
        feats = torch.randn(n, NFEAT, generator=g)
        lots = [f"VL-{int(i):03d}" for i in torch.randint(0, NLOTS, (n,), generator=g)]
        grades = (feats[:, 0] > 0).long() * 2 + (feats[:, 1] > 0).long()
        torch.save({"feats": feats, "lots": lots, "grades": grades}, os.path.join(WORK, f"shard_{r}.pt"))
    torch.save(FleeceNet().state_dict(), os.path.join(WORK, "start.pt"))
    print("prepared", WORK)


class FleeceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lot = nn.Embedding(NLOTS, 4)
        self.fc = nn.Linear(NFEAT + 4, NGRADES)

    def forward(self, x, lot):
        return self.fc(torch.cat([x, self.lot(lot)], dim=1))


class Planter:
    def __init__(self, args, rank, world):
        self.a, self.rank, self.world = args, rank, world
        self.f = args.fault
        self.m = args.rank2 if args.rank2 >= 0 else (args.rank + 1) % world
        if self.f == "warn_storm":
            warnings.simplefilter("always")
        if self.f == "logging_rank" and rank == args.rank:
            logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                                format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
        else:
            logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s:%(name)s:%(message)s")

    def mine(self):
        return self.rank == self.a.rank

    def forward(self, step, x, lookup):
        f, s = self.f, step
        if f == "first_step" and self.mine() and s == 0:
            w = torch.randn(NFEAT + 1, NGRADES)
            x @ w
        if f == "warn_storm":
            warnings.warn(f"rank {self.rank}: fleece moisture reading above 16% in batch {s}; grading may drift", UserWarning)
        if f == "two_ranks" and s == 2:
            if self.mine():
                raise ValueError(f"staple length -3.5 cm in fleece VL-007 on rank {self.rank}: lengths must be positive")
            if self.rank == self.m:
                time.sleep(1)
                raise RuntimeError(f"colour grade histogram on rank {self.rank} is empty: no fleeces left after filtering")
        if f == "caught_then":
            if self.mine() and s == 1:
                try:
                    lookup["VL-999"]
                except KeyError:
                    log.exception("lot lookup failed for VL-999 on rank %d; using fallback lot VL-000", self.rank)
            if self.rank == self.m and s == 4:
                graded = 0
                print(f"rank {self.rank} grade ratio", 12 / graded, flush=True)
        if f == "chained" and self.mine() and s == 3:
            try:
                lookup["VL-404"]
            except KeyError as err:
                raise RuntimeError(f"could not grade fleece batch {s} on rank {self.rank}: unknown breeder lot") from err
        if f in ("tqdm_bar", "warn_storm") and self.mine() and s == (3 if f == "tqdm_bar" else 4):
            raise ValueError(f"crimp frequency 0 per cm in fleece batch {s}: cannot grade")
        if f == "restart" and self.mine() and s == 2 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise RuntimeError(f"fleece scale on rank {self.rank} returned a stale reading (attempt 0)")
        if f == "logging_rank" and self.mine() and s == 3:
            raise ValueError(f"fiber diameter 41.2 um outside the vicuna range (10-15 um) on rank {self.rank}")
        if f == "long_msg" and self.mine() and s == 2:
            t = torch.arange(60, dtype=torch.float32).reshape(6, 10) / 7
            d = {f"VL-{i:03d}": {"micron": 12.0 + i / 10, "staple_cm": 3.0 + i / 5} for i in range(8)}
            raise ValueError(f"grading table disagrees with micron tensor on rank {self.rank}:\n{t}\nlots={d}")
        if f == "sys_exit" and self.mine() and s == 2:
            sys.exit(f"fleece grading aborted on rank {self.rank}: shearing record for lot VL-011 is missing")
        if f == "sigint" and self.mine() and s == 3:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        if f == "dtype" and self.mine() and s == 2:
            torch.mm(x, torch.ones(NFEAT, 2, dtype=torch.long))
        if f == "same_early" and (s == 3 or (self.mine() and s == 2)):
            raise ValueError(f"fleece weight 0.0 g in batch {s} on rank {self.rank}: the scale was not tared")
        if f == "segv" and self.mine() and s == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "sigkill" and self.mine() and s == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if f == "stall" and self.mine() and s == 2:
            time.sleep(300)

    def report(self, step, loss, acc):
        line = f"rank {self.rank} step {step} loss {loss:.4f} grade_acc {acc:.3f}"
        if self.f == "logging_rank" and self.mine():
            log.info(line)
        else:
            print(line, flush=True)

    def end(self, export_obj, barrier):
        if self.f == "save_fail" and self.mine():
            torch.save(export_obj, os.path.join(WORK, "exports_missing", f"grades_rank{self.rank}.pt"))
        barrier()
        if self.rank == 0:
            torch.save(export_obj, os.path.join(WORK, "export.pt"))
            print("rank 0 saved export to", os.path.join(WORK, "export.pt"), flush=True)


def load_shard(rank):
    sh = torch.load(os.path.join(WORK, f"shard_{rank}.pt"))
    with open(os.path.join(WORK, "lookup.json")) as f:
        lookup = json.load(f)
    return sh, lookup


def batches(sh, lookup):
    for s in range(STEPS):
        sl = slice(s * 4, s * 4 + 4)
        lots = torch.tensor([lookup[c] for c in sh["lots"][sl]])
        yield s, sh["feats"][sl], lots, sh["grades"][sl]


def train_loop(args, rank, world, model, opt, backward, barrier):
    pl = Planter(args, rank, world)
    sh, lookup = load_shard(rank)
    it = batches(sh, lookup)
    if args.fault == "tqdm_bar":
        from tqdm import tqdm
        it = tqdm(it, total=STEPS, file=sys.stderr, desc=f"rank {rank} grading")
    for s, x, lot, y in it:
        pl.forward(s, x, lookup)
        out = model(x, lot)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        backward(loss)
        opt.step()
        acc = (out.argmax(1) == y).float().mean().item()
        pl.report(s, loss.item(), acc)
    pl.end({k: v.detach().clone() for k, v in model.state_dict().items()}, barrier)


def main_plain(args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    m = FleeceNet()
    m.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    model = DDP(m)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loop(args, rank, world, model, opt, lambda l: l.backward(), dist.barrier)
    dist.destroy_process_group()


def main_acc(args):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))])
    m = FleeceNet()
    m.load_state_dict(torch.load(os.path.join(WORK, "start.pt")))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    model, opt = acc.prepare(m, opt)
    train_loop(args, acc.process_index, acc.num_processes, model, opt, acc.backward, acc.wait_for_everyone)
    acc.end_training()


def main_hf(args):
    import torch.distributed as dist
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sh, lookup = load_shard(rank)

    class FleeceSet(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            j = i % len(sh["lots"])
            ids = (sh["feats"][j].abs() * 10).long().clamp(0, 47) + 16
            ids = torch.cat([torch.tensor([lookup[sh["lots"][j]]]), ids])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": sh["grades"][j]}

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=NGRADES)
    torch.manual_seed(614)
    model = BertForSequenceClassification(cfg)
    pl = Planter(args, rank, world)
    x_dummy = torch.zeros(4, NFEAT)

    class FleeceTrainer(Trainer):
        step = 0

        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            pl.forward(self.step, x_dummy, lookup)
            loss, out = super().compute_loss(model, inputs, return_outputs=True, **kw)
            acc = (out.logits.argmax(-1) == inputs["labels"]).float().mean().item()
            pl.report(self.step, loss.item(), acc)
            self.step += 1
            return (loss, out) if return_outputs else loss

    targs = TrainingArguments(output_dir=os.path.join(WORK, "hf_out"), use_cpu=True, ddp_backend="gloo",
                              ddp_timeout=int(args.pg_timeout), max_steps=STEPS, per_device_train_batch_size=4,
                              learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                              disable_tqdm=True, dataloader_num_workers=0)
    tr = FleeceTrainer(model=model, args=targs, train_dataset=FleeceSet())
    tr.train()
    pl.end({k: v.detach().clone() for k, v in model.state_dict().items()}, dist.barrier)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--acc", action="store_true")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--rank2", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.hf:
        main_hf(a)
    elif a.acc:
        main_acc(a)
    else:
        main_plain(a)

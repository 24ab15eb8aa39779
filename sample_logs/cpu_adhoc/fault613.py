#!/usr/bin/env python
"""fault613.py - hoodoo spire erosion toy trainer (batch 613, hand-run fault script).

--prepare writes into the work dir: per-rank shards of spire features, a JSON table of
caprock hardness per spire id (every sample's target goes through it) and a start checkpoint.
Training: 6 steps, torch.distributed gloo on CPU, grads all-reduced by hand; every rank prints
  rank R step S loss L erosion_mm M
rank 0 saves an export after a final barrier.

Faults (--fault NAME --rank N):
  none             control run
  two_ranks        rank N ValueError at step 2; rank N+1 (mod W) ZeroDivisionError 1 s later
  warn_storm       every rank warns (UserWarning + FutureWarning) each step; rank N RuntimeError at step 3
  caught_then_fail rank N: KeyError in lookup caught, log.exception, goes on; rank N+1 missing shard at step 4
  chained          rank N: KeyError in the lookup re-raised as RuntimeError(...) from err at step 2
  save_fail        rank N torch.save into a missing folder after the last step; others wait in the final barrier
  first_step       rank N: shape mismatch in the forward of step 0 (before any step line)
  tqdm_bar         tqdm bar on every rank (stderr); rank N raises OverflowError mid-bar at step 3
  restart_once     rank N RuntimeError at step 2 on the first attempt only (TORCHELASTIC_RESTART_COUNT=0)
  logging_rank     rank N logs via logging with timestamps (others print), then AssertionError at step 3
  long_msg         rank N ValueError at step 2 whose message holds a tensor repr and a dict (multi-line)
  sys_exit         rank N sys.exit("...") at step 2
  sigint           rank N os.kill(getpid(), SIGINT) at step 2 (KeyboardInterrupt)
  dtype_mm         rank N torch.mm of float and long at step 2
  embed_index      rank N embedding lookup with an index out of range at step 1
  same_all_early   every rank: FloatingPointError from a finiteness check at step 3, rank N at step 2
  keyerror         rank N KeyError in the hardness lookup at step 2
  sigsegv          rank N sends itself SIGSEGV at step 2
  sigkill          rank N sends itself SIGKILL at step 2
  stall            rank N sleeps 600 s at step 2; the others time out in all_reduce (pg timeout)

Runs (one line per log):
  r01: embed_index np8 r7 srunlabel: DROPPED - no output at all within the 100 s limit (8 ranks never got past start-up on the loaded host), exit 124
  r02: keyerror np7 r4 tee: rank 4 KeyError 'spire_99' at step 2, peers gloo 'Connection closed by peer', torchrun root cause rank 4, exit 1
  r03: two_ranks np5 r2 bashloop: rank 2 ValueError, rank 3 ZeroDivisionError 1 s later, ranks 0/1/4 connection closed; processes lingered, exit 124
  r04: warn_storm np4 r3 ranklabel: UserWarning+FutureWarning each step on every rank, rank 3 RuntimeError at step 3, peers connection closed, exit 1
  r05: save_fail np3 r2 files: rank 2 torch.save 'Parent directory ... does not exist' after step 5, ranks 0/1 fail in the final barrier, exit 1
  r06: chained np3 r0 mpitag: rank 0 KeyError -> RuntimeError (direct cause) at step 2, ranks 1/2 connection closed, exit 1
  r07: first_step np3 r1 spawn: process 1 shape-mismatch RuntimeError in forward of step 0, no step line, mp.spawn ProcessRaisedException, exit 1
  r08: tqdm_bar np3 r2 legacy: three tqdm bars, rank 2 OverflowError at 3/6 mid-bar, peers connection closed, launcher root cause rank 2, exit 1
  r09: long_msg np3 r1 logfmt: rank 1 four-line ValueError (tensor repr + dict) at step 2, peers connection closed, exit 1
  r10: sys_exit np4 r0 pdsh2: rank 0 sys.exit('... giving up') line only, ranks 2/3 on worker-1 connection closed, both agents ChildFailedError, exit 1
  r11: caught_then_fail np5 r4 srunlabel: rank 4 log.exception KeyError at step 1 and goes on; rank 0 FileNotFoundError shard at step 4, exit 1
  r12: none np3 rnone bashloop: control, 6 steps on every rank, export saved, exit 0
  r13: restart_once np3 r1 tee: rank 1 RuntimeError attempt 0; restart failed in init (Gloo connectFullMesh refused), exit 1
  r14: dtype_mm np3 r2 ranklabel: rank 2 torch.mm float != long int RuntimeError at step 2, peers connection closed, exit 1
  r15: sigint np5 r2 bashloop: DROPPED - SIGINT was ignored (bash '&' jobs inherit SIG_IGN), run finished ok, exit 0
  r16: same_all_early np5 r1 mpitag: rank 1 FloatingPointError (loss inf) at step 2, others die in all_reduce before their own check, exit 1
  r17: sigint np5 r4 spawn: process 4 SIGINT, KeyboardInterrupt swallowed by mp.spawn, only process 0's connection-closed error shown, exit 1
  r18: (unused)
  r19: (unused)
  r20: (unused)
  r21: (unused)
  r22: (unused)
"""
import argparse
import datetime
import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 6
BATCH = 8
FEAT = 4
N_SPIRES = 16
log = logging.getLogger("hoodoo")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--work", default="/tmp/fault613_work")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--logfmt", action="store_true")
    p.add_argument("--local-rank", "--local_rank", type=int, default=None)
    return p.parse_args()


def prepare(a):
    w = Path(a.work)
    (w / "shards").mkdir(parents=True, exist_ok=True)
    (w / "export").mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(613)
    for r in range(a.world):
        x = torch.randn(STEPS * BATCH, FEAT, generator=g)
        ids = torch.randint(0, N_SPIRES, (STEPS * BATCH,), generator=g)
        y = x.sum(1) * 0.3
        torch.save({"x": x, "ids": ids, "y": y}, w / "shards" / f"spires_rank{r}.pt")
    table = {f"spire_{i}": round(0.5 + 0.05 * i, 3) for i in range(N_SPIRES)}
    (w / "caprock_hardness.json").write_text(json.dumps(table, indent=1))
    model = torch.nn.Linear(FEAT, 1)
    torch.save(model.state_dict(), w / "start.pt")
    print(f"prepared {a.world} shards in {w}")


class Rank(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, rec):
        rec.rank = self.rank
        return True


def train(rank, world, a):
    f, n = a.fault, a.rank
    mine = rank == n
    w = Path(a.work)
    if a.logfmt:
        logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                            format="%(asctime)s [rank %(rank)s] %(levelname)s %(message)s")
        for h in logging.getLogger().handlers:
            h.addFilter(Rank(rank))
    elif f == "logging_rank" and mine:
        logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        logging.basicConfig(level=logging.WARNING)
    use_log = a.logfmt or (f == "logging_rank" and mine)
    out = (lambda s: log.info(s)) if use_log else (lambda s: print(s, flush=True))

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.pg_timeout))
    table = json.loads((w / "caprock_hardness.json").read_text())
    shard = torch.load(w / "shards" / f"spires_rank{rank}.pt")
    model = torch.nn.Linear(FEAT, 1)
    model.load_state_dict(torch.load(w / "start.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    emb = torch.nn.Embedding(N_SPIRES, FEAT)
    bar = None
    if f == "tqdm_bar":
        from tqdm import tqdm
        bar = tqdm(total=STEPS, desc=f"rank{rank} erosion", file=sys.stderr, mininterval=0)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    for step in range(STEPS):
        sl = slice(step * BATCH, (step + 1) * BATCH)
        x, ids, y = shard["x"][sl], shard["ids"][sl], shard["y"][sl]
        keys = [f"spire_{int(i)}" for i in ids]
        if f in ("keyerror", "chained") and mine and step == 2:
            keys[3] = "spire_99"
        if f == "caught_then_fail" and mine and step == 1:
            try:
                _ = [table[k] for k in keys[:2] + ["spire_hollow"]]
            except KeyError:
                log.exception("hardness lookup failed for a batch on rank %d, using default 0.5", rank)
        if f == "chained" and mine and step == 2:
            try:
                hard = torch.tensor([table[k] for k in keys])
            except KeyError as err:
                raise RuntimeError(f"caprock hardness table has no entry for a spire in batch {step} on rank {rank}") from err
        else:
            hard = torch.tensor([table[k] for k in keys])
        if f == "caught_then_fail" and rank == (n + 1) % world and step == 4:
            torch.load(w / "shards" / f"spires_rank{rank}_part2.pt")
        if f == "first_step" and mine and step == 0:
            x = torch.randn(BATCH, FEAT + 1)
        if f == "embed_index" and mine and step == 1:
            x = x + emb(ids + N_SPIRES)
        if f == "dtype_mm" and mine and step == 2:
            x = torch.mm(x, ids[:FEAT].view(FEAT, 1).expand(FEAT, FEAT))
        pred = model(x).squeeze(-1)
        loss = ((pred - y * hard) ** 2).mean()
        if f == "same_all_early" and step == (2 if mine else 3):
            bad = loss / torch.zeros(())
            if not torch.isfinite(bad):
                raise FloatingPointError(f"erosion loss is not finite at step {step} on rank {rank}: {bad.item()}")
        if mine and step == 2:
            if f == "two_ranks":
                raise ValueError(f"spire height went negative on rank {rank} at step {step}")
            if f == "restart_once" and restart == 0:
                raise RuntimeError(f"weathering buffer lost on rank {rank} (attempt {restart})")
            if f == "long_msg":
                raise ValueError("erosion profile rejected:\n"
                                 f"profile={pred.detach()}\n"
                                 f"spires={dict(zip(keys, hard.tolist()))}\n"
                                 f"expected all heights >= 0 on rank {rank}")
            if f == "sys_exit":
                sys.exit(f"hoodoo rank {rank}: caprock table exhausted at step {step}, giving up")
            if f == "sigint":
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            if f == "sigsegv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if f == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if f == "stall":
                time.sleep(600)
        if f == "two_ranks" and rank == (n + 1) % world and step == 2:
            time.sleep(1)
            _ = 1.0 / (len(keys) - BATCH)
        if f == "warn_storm":
            warnings.warn(f"rank {rank} step {step}: spire shard has {BATCH} samples, fewer than recommended", UserWarning)
            warnings.warn("erosion_mm will be reported in cm in a future version", FutureWarning)
            if mine and step == 3:
                raise RuntimeError(f"frost wedging model diverged on rank {rank} at step {step}")
        if f == "tqdm_bar" and mine and step == 3:
            raise OverflowError(f"erosion rate overflow on rank {rank} at step {step}")
        if f == "logging_rank" and mine and step == 3:
            assert loss.item() < 0, f"rank {rank}: loss {loss.item():.4f} should be negative for a rising spire"
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        erosion = float(pred.detach().abs().mean()) * 10
        out(f"rank {rank} step {step} loss {loss.item():.4f} erosion_mm {erosion:.3f}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if f == "save_fail" and mine:
        torch.save(model.state_dict(), w / "eval_missing" / f"spire_eval_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), w / "export" / "hoodoo_export.pt")
        out(f"rank 0 saved export {w / 'export' / 'hoodoo_export.pt'}")
    dist.barrier()
    dist.destroy_process_group()
    out(f"rank {rank} done")


def spawn_worker(i, world, a):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(i),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(i))
    train(i, world, a)


def main():
    a = parse()
    if a.prepare:
        prepare(a)
        return
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(a.spawn, a), nprocs=a.spawn)
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()

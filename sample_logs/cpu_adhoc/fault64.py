"""A sixty-fourth hand-run batch: SUBPROCESSES AND SHELL-OUTS from inside the ranks. A tiny DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, 5 steps, PG timeout 15 s, main under @record, progress lines
`rank R step S loss L`, `rank R done`) where one rank (or every rank) runs a child process at step 3 (or before or
after training) and the failure comes from the child. The children inherit the rank's stdout/stderr (so under
`--tee 3` they carry the rank's `[defaultN]:` prefix, without tee they are bare, and under `--redirects 3` they go
to the rank's files). The Python children are this script run again with `--child MODE` (no torch import unless
the mode needs it).

Faults (--fault a comma list; --rank N: the rank at fault, -1 every rank; --rank2 M: a second rank for herrings):
  sha_check     rank N verifies its shard with `sha256sum -c` against a list holding a wrong hash (sha256sum prints
                `shard_000N.bin: FAILED` and a WARNING); subprocess.run(check=True): CalledProcessError, status 1
  nvsmi         rank N logs GPU memory with subprocess.check_output(["nvidia-smi", ...]): FileNotFoundError
  up_timeout    rank N uploads its metrics through a child (--child stall: prints one line, sleeps 60 s) with
                timeout=3: subprocess.TimeoutExpired
  child_hang    as up_timeout without a timeout: rank N waits on the child, the others time out in DDP's all-reduce
  os_system     rank N stages its tokenizer with os.system("cp ..."); the source does not exist (cp: cannot stat),
                the script raises RuntimeError with os.system's raw wait status (256)
  child_py      rank N scores its shard in a child Python (--child eval) that raises ValueError (its traceback bare,
                as the child has no excepthook prefix); check=True: CalledProcessError, status 1
  child_kill    rank N tokenizes in a child (--child tokenize) that is SIGKILLed (it kills itself: stands in for the
                OOM killer); check=True: CalledProcessError ... died with <Signals.SIGKILL: 9>
  pipe_fail     rank N counts its shards with `cat lists/shards_rankN.txt | wc -l` (shell=True, check=True); its
                list is missing: cat's error, but the pipeline exits 0 (wc's status) with 0; the script then
                divides by the count: ZeroDivisionError
  pipe_herring  every rank counts optional extra shards with `cat lists/extra_rankR.txt | wc -l`: every rank prints
                cat's `No such file or directory`, count 0, harmless
  key           rank M (--rank2) reads a batch dict without its 'y' key at step 3: KeyError: 'y' (the real failure
                beside a herring)
  git_warn      every rank reads `git rev-parse --short HEAD` (check=False, stderr not captured): every rank prints
                git's `fatal: not a git repository`, the script logs `git hash unknown` and goes on
  git_fatal     rank N reads the git hash with check=True right after init_process_group: CalledProcessError, 128
  tar_ckpt      after training (every rank past the final barrier and done) rank N saves its checkpoint and runs
                `tar czf archive/run64/ckpt_final.tgz` (check=True); the archive folder does not exist: tar's
                `Cannot open: No such file or directory`, CalledProcessError, status 2
  cp_ckpt       at step 3 rank N saves a checkpoint and copies it with `cp` (check=True) into backup/run64/, where
                backup is a file: cp's `Not a directory`, CalledProcessError, status 1
  child_pg      rank N runs a child Python (--child pg) with the rank's own environment; the child calls
                init_process_group itself (same MASTER_ADDR/PORT, RANK, WORLD_SIZE) and an all_reduce
  ok_child      control: every rank runs a child Python (--child noisy) that prints an ERROR line and a caught
                traceback and exits 0
  none          control
"""
import argparse, os, sys, time

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=2)
p.add_argument("--rank2", type=int, default=-2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--work", default=os.getcwd())
p.add_argument("--child", default="")
p.add_argument("--shard", type=int, default=0)
a = p.parse_args()
BAD_STEP = 3
FAULTS = set(a.fault.split(","))


def child_eval(shard: int) -> None:
    rows = [["0.51", "0.49", "0.73"], ["0.12", "n/a", "0.88"]]

    def score(row):
        return sum(float(v) for v in row) / len(row)

    print(f"eval shard {shard}: scoring {len(rows)} rows", flush=True)
    for row in rows:
        score(row)


def child_main() -> None:
    m = a.child
    if m == "stall":
        print(f"metrics upload: connecting to http://tracker.internal:8080 (shard {a.shard})", flush=True)
        time.sleep(40)
    elif m == "eval":
        child_eval(a.shard)
    elif m == "tokenize":
        import signal
        print(f"tokenize shard {a.shard}: 3 files", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # stands in for the OOM killer
    elif m == "noisy":
        import traceback
        print(f"ERROR: metrics endpoint unreachable (shard {a.shard}), falling back to local file", flush=True)
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError:
            traceback.print_exc()
        print(f"metrics for shard {a.shard} written to metrics_{a.shard}.jsonl", flush=True)
    elif m == "pg":
        import datetime
        import torch, torch.distributed as dist
        print(f"helper: joining the process group as rank {os.environ.get('RANK')}", flush=True)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"helper: all_reduce gave {t.item()}", flush=True)
        dist.destroy_process_group()


if a.child:
    child_main()
    sys.exit(0)

import datetime, subprocess
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.elastic.multiprocessing.errors import record

ME = [sys.executable, os.path.abspath(__file__)]
W = a.work


def say(rank, msg):
    print(f"rank {rank} {msg}", flush=True)


def prepare(rank: int) -> None:
    os.makedirs(f"{W}/shards", exist_ok=True)
    os.makedirs(f"{W}/lists", exist_ok=True)
    path = f"{W}/shards/shard_{rank:04d}.bin"
    with open(path, "wb") as fh:
        fh.write(os.urandom(256))
    if not ("pipe_fail" in FAULTS and rank == a.rank):
        with open(f"{W}/lists/shards_rank{rank}.txt", "w") as fh:
            fh.write("".join(f"shard_{rank:04d}_{i}.bin\n" for i in range(4)))
    if "cp_ckpt" in FAULTS and rank == a.rank:
        with open(f"{W}/backup", "w") as fh:
            fh.write("")  # a stale file where the backup folder should be


def git_hash(rank: int, check: bool) -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd="/tmp", stdout=subprocess.PIPE, text=True,
                       check=check)
    h = r.stdout.strip() or "unknown"
    say(rank, f"git hash {h}")
    return h


def count_lines(cmd: str) -> int:
    r = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, text=True, check=True)
    return int(r.stdout.strip())


def at_step(rank: int, step: int, bad: bool, net) -> None:
    f = FAULTS
    if not bad or step != BAD_STEP:
        return
    if "sha_check" in f:
        lst = f"{W}/shards/SHA256SUMS.rank{rank}"
        with open(lst, "w") as fh:
            fh.write(f"{'0' * 64}  shard_{rank:04d}.bin\n")
        subprocess.run(["sha256sum", "-c", os.path.basename(lst)], cwd=f"{W}/shards", check=True)
    if "nvsmi" in f:
        out = subprocess.check_output(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"])
        say(rank, f"gpu memory {out.decode().strip()}")
    if "up_timeout" in f:
        subprocess.run(ME + ["--child", "stall", "--shard", str(rank)], timeout=3, check=True)
    if "child_hang" in f:
        subprocess.run(ME + ["--child", "stall", "--shard", str(rank)], check=True)
    if "os_system" in f:
        os.makedirs(f"{W}/cache/rank{rank}", exist_ok=True)
        rc = os.system(f"cp {W}/tokenizer/vocab.json {W}/cache/rank{rank}/")
        if rc != 0:
            raise RuntimeError(f"stage_tokenizer: command failed with status {rc}")
    if "child_py" in f:
        subprocess.run(ME + ["--child", "eval", "--shard", str(rank)], check=True)
    if "child_kill" in f:
        subprocess.run(ME + ["--child", "tokenize", "--shard", str(rank)], check=True)
    if "cp_ckpt" in f:
        ck = f"{W}/ckpt_rank{rank}_step{step}.pt"
        torch.save(net.state_dict(), ck)
        subprocess.run(["cp", ck, f"{W}/backup/run64/"], check=True)
    if "child_pg" in f:
        subprocess.run(ME + ["--child", "pg"], check=True)


@record
def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    prepare(rank)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    bad = a.rank < 0 or rank == a.rank
    if "git_warn" in FAULTS:
        git_hash(rank, check=False)
    if "git_fatal" in FAULTS and bad:
        git_hash(rank, check=True)
    n_shards = count_lines(f"cat {W}/lists/shards_rank{rank}.txt | wc -l")
    per_shard = 64 // n_shards
    say(rank, f"{n_shards} shards, {per_shard} samples each")
    if "pipe_herring" in FAULTS:
        extra = count_lines(f"cat {W}/lists/extra_rank{rank}.txt | wc -l")
        say(rank, f"{extra} extra shards")
    if "ok_child" in FAULTS:
        subprocess.run(ME + ["--child", "noisy", "--shard", str(rank)], check=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1, a.steps + 1):
        batch = {"x": torch.randn(16, 8, generator=g), "y": torch.randint(0, 4, (16,), generator=g)}
        if "key" in FAULTS and rank == a.rank2 and step == BAD_STEP:
            batch = {"x": batch["x"], "labels": batch["y"]}  # a shard written with another schema
        at_step(rank, step, bad, net)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        say(rank, f"step {step} loss {loss.item():.4f}")
        time.sleep(0.05)
    dist.barrier()
    say(rank, "done")
    dist.destroy_process_group()
    if "tar_ckpt" in FAULTS and bad:
        torch.save(net.state_dict(), f"{W}/ckpt_final.pt")
        subprocess.run(["tar", "czf", f"{W}/archive/run64/ckpt_final.tgz", "-C", W, "ckpt_final.pt"], check=True)
        say(rank, "checkpoint archived")


if __name__ == "__main__":
    main()

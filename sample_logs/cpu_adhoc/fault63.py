"""A sixty-third hand-run batch: BENCHMARK RUNNERS and their VALIDITY GATES, in the style of MiniTrainBench's error
manual (E004, E007-E011). A tiny benchmark runner around a DDP loop on gloo (Linear(16,32)-ReLU-Linear(32,4), SGD,
batch 8, a 0.2 s sleep per step standing in for compute): rank 0 prints an environment probe line
`MINITRAINBENCH_ENVIRONMENT_JSON={...}`, then a matrix of trials (adapter x repeat; adapters `ddp` and `zero`, the
latter ZeroRedundancyOptimizer) each with warm-up and timed steps; rank 0 prints per-step times (the max over ranks)
and one `MINITRAINBENCH_RESULT_JSON={...}` line per trial, then a report table.

Validity gates (rank 0 decides, the verdict is broadcast so every rank agrees):
  occupancy   before and after each trial rank 0 scans /proc for busy processes in the launcher's session (the
              allocation) that are not the job's own (not the agent's descendants, not rank 0's ancestors); one found
              -> the result is refused (`--gate-exit all`: every rank exits 3; `rank0`: rank 0 raises
              BenchmarkInvalidError, the others return 0). Busy processes outside the allocation and the 1-min load
              average only give a WARNING (`--load-warn`).
  variance    a trial whose timed step times have a coefficient of variation above `--cv-max` is refused (exit 3).
  window      `--window S`: before each trial after the first, if the trials left (at the mean time of those done)
              cannot finish in the exclusive window, the matrix
              is abandoned as incomplete and nothing is published (exit 4 on every rank).

Faults:
  --jitter-rank R --jitter-trial T --jitter-step S   rank R sleeps `--jitter-s` in that step (a noisy neighbour)
  --cuda-rank R        rank R's step timer synchronises `torch.cuda.current_stream()` though `--device cpu`
  --report naive       the report reads r['grad_norm_mean'], which the zero adapter's result lacks (E004)
  --digest stack|shape after the matrix, a digest over the sharded state: `stack` (rank 0 gathers every rank's shard
                       and stacks them; the last rank's shard is shorter), `shape` (every rank checks its shard's
                       shape against full_rows // world; the last rank's is shorter)
  --marker PATH --marker-trial T [--marker-when before|during]   rank 0 touches PATH when trial T starts, before or
                       after its 'before' gate (a wrapper starts a CPU burner on it)

Launch modes:
  (worker)             under torchrun
  --probe [--banner]   print the environment probe (after a container-style banner with --banner)
  --launch             the runner: run the probe in a subprocess and parse it (`--probe-parse naive`: json.loads of
                       the whole stdout; `framed`: the line with the prefix), then torchrun through subprocess,
                       printing its output; `--burn-on-marker PATH` starts a CPU burner when PATH appears.
"""
import argparse, datetime, json, os, platform, socket, subprocess, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
p.add_argument("--backend", default="gloo")
p.add_argument("--adapters", default="ddp,zero")
p.add_argument("--repeats", type=int, default=1)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--step-s", type=float, default=0.2)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--gate-exit", choices=["all", "rank0"], default="all")
p.add_argument("--load-warn", type=float, default=0.0)
p.add_argument("--cv-max", type=float, default=0.25)
p.add_argument("--window", type=float, default=0.0)
p.add_argument("--jitter-rank", type=int, default=-1)
p.add_argument("--jitter-trial", type=int, default=1)
p.add_argument("--jitter-step", type=int, default=3)
p.add_argument("--jitter-s", type=float, default=1.5)
p.add_argument("--cuda-rank", type=int, default=-1)
p.add_argument("--report", choices=["naive", "compat"], default="compat")
p.add_argument("--digest", choices=["none", "stack", "shape"], default="none")
p.add_argument("--marker", default="")
p.add_argument("--marker-trial", type=int, default=2)
p.add_argument("--marker-when", choices=["before", "during"], default="before")
p.add_argument("--probe", action="store_true")
p.add_argument("--banner", action="store_true")
p.add_argument("--launch", action="store_true")
p.add_argument("--probe-parse", choices=["naive", "framed"], default="framed")
p.add_argument("--burn-on-marker", default="")
p.add_argument("--nproc", type=int, default=4)
p.add_argument("--master-port", type=int, default=26300)
a, rest = p.parse_known_args()

PREFIX = "MINITRAINBENCH_ENVIRONMENT_JSON="
BANNER = """
=============
== PyTorch ==
=============

NVIDIA Release 25.01 (build 134983853)
PyTorch Version 2.6.0a0+ecf3bae

Container image Copyright (c) 2025, NVIDIA CORPORATION & AFFILIATES. All rights reserved.

WARNING: The NVIDIA Driver was not detected.  GPU functionality will not be available.
   Use the NVIDIA Container Toolkit to start this container with GPU support; see
   https://docs.nvidia.com/datacenter/cloud-native/ .

NOTE: The SHMEM allocation limit is set to the default of 64MB.  This may be
   insufficient for PyTorch.  NVIDIA recommends the use of the following flags:
   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 ...
"""


def env_probe(world: int) -> dict:
    import torch
    return {"torch": torch.__version__, "python": platform.python_version(), "backend": a.backend,
            "device": a.device, "world_size": world, "host": socket.getfqdn(),
            "cuda_available": torch.cuda.is_available()}


# ---------------------------------------------------------------- probe / runner (outside torchrun)
if a.probe:
    if a.banner:
        print(BANNER, flush=True)
    print(PREFIX + json.dumps(env_probe(a.nproc)), flush=True)
    sys.exit(0)

if a.launch:
    me = os.path.abspath(__file__)
    print(f"minitrainbench runner: probing the environment ({a.probe_parse} parse)", flush=True)
    pr = subprocess.run([sys.executable, me, "--probe", "--nproc", str(a.nproc)] + (["--banner"] if a.banner else []),
                        capture_output=True, text=True)
    sys.stdout.write(pr.stdout)
    sys.stdout.flush()
    if a.probe_parse == "naive":
        env = json.loads(pr.stdout)
    else:
        lines = [l for l in pr.stdout.splitlines() if l.startswith(PREFIX)]
        env = json.loads(lines[-1][len(PREFIX):])
    print(f"minitrainbench runner: environment torch={env['torch']} backend={env['backend']} "
          f"world_size={env['world_size']} host={env['host']}", flush=True)
    burner = []

    def burn_when_marker():
        while not os.path.exists(a.burn_on_marker):
            time.sleep(0.1)
        burner.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))

    if a.burn_on_marker:
        threading.Thread(target=burn_when_marker, daemon=True).start()
    rest = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    cmd = ["torchrun", "--nproc-per-node", str(a.nproc), "--master-port", str(a.master_port), me] + rest
    print("minitrainbench runner: launching: " + " ".join(cmd[:5] + ["fault63.py"] + rest), flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
    rc = proc.wait()
    for b in burner:
        b.kill()
    print(f"minitrainbench runner: torchrun exited with code {rc} after {time.time() - t0:.1f} s", flush=True)
    if rc != 0:
        print("minitrainbench runner: trial matrix FAILED; results/ left untouched", flush=True)
    sys.exit(rc)

# ---------------------------------------------------------------- worker
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.optim import ZeroRedundancyOptimizer


class BenchmarkInvalidError(RuntimeError):
    pass


def stat(pid: str):
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    rp = s.rindex(")")
    fields = s[rp + 2:].split()
    # state ppid pgrp session ... utime(idx 11) stime(idx 12)
    return fields[0], int(fields[1]), int(fields[3]), int(fields[11]) + int(fields[12])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:60]
    except OSError:
        return "?"


def snapshot():
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out[int(d)] = stat(d)
            except (OSError, ValueError, IndexError):
                pass
    return out


def occupancy_scan():
    """-> (foreign busy pids in the allocation, busy pids outside it) over a 0.4 s probe."""
    agent = os.getppid()
    s1 = snapshot()
    time.sleep(0.4)
    s2 = snapshot()
    alloc = s2.get(agent, s1.get(agent, ("?", 0, -1, 0)))[2]
    own, ancestors = {agent}, set()
    changed = True
    while changed:
        changed = False
        for pid, st in s2.items():
            if st[1] in own and pid not in own:
                own.add(pid)
                changed = True
    pid = agent
    while pid in s2 and pid > 1:
        ancestors.add(pid)
        pid = s2[pid][1]
    inside, outside = [], []
    for pid, st in s2.items():
        if pid in own or pid in ancestors or pid == os.getpid() or pid not in s1:
            continue
        ticks = st[3] - s1[pid][3]
        if ticks >= 8:  # >= 20 % of a core over the probe
            (inside if st[2] == alloc else outside).append((pid, ticks * 100 // 40, cmdline(pid)))
    return inside, outside


def gate(rank: int, trial: int, when: str) -> bool:
    flag = torch.zeros(1)
    if rank == 0:
        inside, outside = occupancy_scan()
        load1 = os.getloadavg()[0]
        if a.load_warn and (outside or load1 > a.load_warn):
            top = sorted(outside, key=lambda t: -t[1])[:1]
            print(f"WARNING validity gate trial {trial} {when}: 1-min load average {load1:.2f}; {len(outside)} busy "
                  f"process(es) outside this allocation (top: {[(p_, f'{c}%', cl) for p_, c, cl in top]}); not in "
                  f"the allocation, result still comparable", flush=True)
        if inside:
            for p_, c, cl in inside:
                print(f"validity gate trial {trial} {when}: foreign compute process pid {p_} ({c}% CPU): {cl}",
                      flush=True)
            flag[0] = 1
        else:
            print(f"validity gate trial {trial} {when}: no foreign compute process in the allocation", flush=True)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def refuse(rank: int, msg: str, code: int):
    if rank == 0:
        print(f"PERFORMANCE VALIDITY GATE FAILED: {msg}", flush=True)
        print("minitrainbench: results NOT published (staging discarded, results/ untouched); not killing foreign "
              "processes", flush=True)
    dist.barrier()
    if a.gate_exit == "rank0":
        if rank == 0:
            raise BenchmarkInvalidError(msg)
        print(f"rank {rank}: result withheld by the validity gate", flush=True)
        dist.destroy_process_group()
        sys.exit(0)
    dist.destroy_process_group()
    sys.exit(code)


def main():
    dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(PREFIX + json.dumps(env_probe(world)), flush=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(100 + rank)
    adapters = a.adapters.split(",")
    matrix = [(ad, r) for ad in adapters for r in range(a.repeats)]
    t_start = time.time()
    results = []
    for ti, (adapter, rep) in enumerate(matrix, 1):
        if a.window and ti > 1:
            left = len(matrix) - ti + 1
            elapsed = time.time() - t_start
            need = left * elapsed / (ti - 1)
            flag = torch.tensor([1.0 if elapsed + need > a.window else 0.0])
            dist.broadcast(flag, 0)
            if flag.item():
                if rank == 0:
                    print(f"minitrainbench: exclusive window {a.window:.0f} s: {elapsed:.1f} s used, {left} trial(s) "
                          f"left need ~{need:.1f} s", flush=True)
                    print(f"MATRIX INCOMPLETE: {ti - 1}/{len(matrix)} trials finished inside the exclusive window; "
                          f"performance matrix stays pending, partial results not published", flush=True)
                dist.barrier()
                dist.destroy_process_group()
                sys.exit(4)
        if a.marker and rank == 0 and ti == a.marker_trial and a.marker_when == "before":
            open(a.marker, "w").close()
        if gate(rank, ti, "before"):
            refuse(rank, f"trial {ti} ({adapter} repeat {rep}): foreign compute process in the allocation before "
                         f"the trial", 3)
        if a.marker and rank == 0 and ti == a.marker_trial and a.marker_when == "during":
            open(a.marker, "w").close()
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        ddp = DDP(model)
        if adapter == "zero":
            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
        else:
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        times, norms = [], []
        for s in range(1, a.warmup + a.steps + 1):
            t0 = time.perf_counter()
            x = torch.randn(8, 16, generator=g)
            y = torch.randn(8, 4, generator=g)
            time.sleep(a.step_s)
            timed = s > a.warmup
            if rank == a.jitter_rank and ti == a.jitter_trial and s - a.warmup == a.jitter_step:
                time.sleep(a.jitter_s)
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e9)
            opt.step()
            if rank == a.cuda_rank and timed:
                torch.cuda.current_stream().synchronize()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if timed:
                times.append(dt.item() * 1000)
                norms.append(gn.item())
            if rank == 0:
                tag = "timed" if timed else "warmup"
                print(f"[bench] trial {ti} {adapter} {tag} step {s} step_time_ms {dt.item() * 1000:.1f} "
                      f"loss {loss.item():.4f}", flush=True)
        mean = sum(times) / len(times)
        cv = (sum((t - mean) ** 2 for t in times) / len(times)) ** 0.5 / mean
        res = {"trial": ti, "adapter": adapter, "repeat": rep, "world_size": world, "steps": a.steps,
               "step_time_ms_mean": round(mean, 1), "step_time_cv": round(cv, 3),
               "samples_per_s": round(8 * world * 1000 / mean, 1)}
        if adapter == "ddp":
            res["grad_norm_mean"] = round(sum(norms) / len(norms), 4)
        results.append(res)
        print(f"rank {rank} trial {ti} done ({adapter}, {len(times)} timed steps)", flush=True)
        if rank == 0:
            print("MINITRAINBENCH_RESULT_JSON=" + json.dumps(res), flush=True)
        if gate(rank, ti, "after"):
            refuse(rank, f"trial {ti} ({adapter} repeat {rep}): foreign compute process appeared during the "
                         f"trial", 3)
        if cv > a.cv_max:
            refuse(rank, f"trial {ti} ({adapter} repeat {rep}): step time CV {cv:.3f} > {a.cv_max} "
                         f"(step times ms: {[round(t) for t in times]})", 3)
    if a.digest != "none":
        full_rows = 4 * world - 1
        w = torch.arange(full_rows * 16, dtype=torch.float32).reshape(full_rows, 16)
        shard = torch.tensor_split(w, world)[rank]
        print(f"rank {rank} digest: local shard {list(shard.shape)}", flush=True)
        if a.digest == "shape":
            want = [full_rows // world + 1, 16]
            if list(shard.shape) != want:
                raise ValueError(f"state digest: rank {rank} local shard shape {list(shard.shape)} != expected {want} "
                                 f"(full tensor [{full_rows}, 16] over {world} ranks)")
            dist.barrier()
        else:
            shards = [None] * world
            dist.all_gather_object(shards, shard)
            if rank == 0:
                full = torch.stack(shards)
                print(f"state digest {hash(full.numpy().tobytes()) & 0xffffffff:08x}", flush=True)
            dist.barrier()
    print(f"rank {rank} matrix done, waiting for the report", flush=True)
    if rank == 0:
        print("minitrainbench report:", flush=True)
        print("adapter  trial  step_time_ms  cv     samples/s  grad_norm", flush=True)
        for r in results:
            if a.report == "naive":
                gn = f"{r['grad_norm_mean']:.4f}"
            else:
                gn = f"{r['grad_norm_mean']:.4f}" if "grad_norm_mean" in r else "-"
            print(f"{r['adapter']:<8} {r['trial']:<6} {r['step_time_ms_mean']:<13} {r['step_time_cv']:<6} "
                  f"{r['samples_per_s']:<10} {gn}", flush=True)
        print(f"minitrainbench: {len(results)} trial(s) valid, results published", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

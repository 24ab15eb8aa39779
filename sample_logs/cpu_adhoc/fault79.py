"""A seventy-ninth hand-run batch: PROFILERS AND INSTRUMENTATION switched on for a run, on one rank or all. A tiny DDP
loop on gloo (Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, synthetic per-rank data, PG timeout 12 s unless
--pg-timeout) with record_function ranges ("data", "forward", "backward", "optimizer") that prints
`rank R step S loss L` every step; the instrumentation named by --fault is switched on, the rank it concerns is
--rank N. torch.profiler traces go to --trace-dir (tensorboard is not installed here, so on_trace_ready exports
with export_chrome_trace). No @record.

Faults:
  none        control: every rank profiles steps 2-4 (schedule wait=1, warmup=1, active=3), exports
              <trace-dir>/rank<R>_step<S>.pt.trace.json, rank 0 prints key_averages().table() at the end (exit 0)
  lostjson    rank N alone profiles and exports <trace-dir>/rank<N>.json into a folder that does not exist: kineto
              logs 'Failed to open ... No such file or directory' and goes on; nothing reads the trace (exit 0)
  tracedir    rank N alone (or, with --local-only, local rank 0 of each node) profiles and exports
              <trace-dir>/rank<R>.pt.trace.json.gz; the folder does not exist (on one node, with NODEK in the
              path): torch's gzip export raises FileNotFoundError inside on_trace_ready
  tracejson   rank N exports <trace-dir>/rank<N>.json into a folder that does not exist, then its handler logs the
              trace's size (os.path.getsize): kineto's ERROR lines, then FileNotFoundError
  slowprof    rank N profiles the whole run (profile_memory, with_stack, record_shapes, active=all steps) and its
              on_trace_ready prints key_averages(group_by_input_shape, group_by_stack_n=8) in full: it comes late to
              the next all-reduce and the others time out
  keyavg      rank N profiles with skip_first=--steps (a schedule meant for a long run): nothing recorded; after
              the loop its key_averages() raises AssertionError: Profiler must be initialized ...
  cudamem     rank N turns on the CUDA caching allocator's memory history (torch.cuda.memory.
              _record_memory_history) for a snapshot: AttributeError on this CPU build
  nvtx        rank N wraps its steps in torch.autograd.profiler.emit_nvtx(): AssertionError: Torch not compiled
              with CUDA enabled
  anomaly     rank N runs with torch.autograd.set_detect_anomaly(True); its data has a dead sensor column at step
              --at (constant 0) and the model standardises its input per batch (0/0): RuntimeError from anomaly mode
              ('Function ... returned nan values')
  keyerror    every rank profiles with schedule warmup=0 and profile_memory (profiler UserWarnings and memory
              warnings as noise); rank N's task 'aux' has no entry in LOSS_WEIGHTS at step --at: KeyError
  dumpok      every rank arms faulthandler.dump_traceback_later(--dump-s) each step as a stall watchdog; rank N's
              step --at stalls 5 s (a slow data read): stack dumps ('Timeout (0:00:03)!'), then the run goes on (exit 0)
  dumplater   the same stall on rank --slow, then rank N's step --at+2 raises IndexError (a label index past the
              class table)
  lockhang    rank N's on_trace_ready takes an exclusive flock on <trace-dir>/.upload.lock before copying its trace
              to the shared folder; another process on the host holds that lock: rank N blocks for good, the others
              wait in all-reduce (use a long --pg-timeout); faulthandler dumps every rank's stack every --dump-s s
  calltrace   rank N installs a sys.settrace call tracer that appends every Python call to
              <workdir>/calls_rank<N>.log; its RLIMIT_FSIZE is --fsize bytes (a nearly full disk): OSError [Errno 27]
              File too large inside the tracer (SIGXFSZ ignored, CPython's default)
  calltracesig the same with SIGXFSZ at its default action: rank N is killed by signal 25
  pstats      rank N runs the loop under cProfile and prints its stats sorted by 'cumtme' (a typo): KeyError
  tracemalloc tracemalloc is started on local rank 0 only; rank N takes the memory report at step --at:
              RuntimeError: the tracemalloc module must be tracing memory allocations to take a snapshot
  profmem     rank N starts a profiler that is never stopped (no schedule, profile_memory, with_stack,
              record_shapes) under an RLIMIT_AS cap of its start size + --mem-mb, and runs --steps steps
  samename    every rank profiles steps 2-4 and exports to <trace-dir>/trace_step<S>.json (no rank in the name),
              then reads it back (json.load) to log its event count
"""
import argparse, cProfile, datetime, faulthandler, fcntl, json, os, pstats, resource, signal, sys, time
import tracemalloc
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--slow", type=int, default=2)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--at", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--trace-dir", default="/tmp/fault79_work/traces")
p.add_argument("--local-only", action="store_true")
p.add_argument("--dump-s", type=float, default=3.0)
p.add_argument("--fsize", type=int, default=400000)
p.add_argument("--mem-mb", type=int, default=300)
p.add_argument("--workdir", default="/tmp/fault79_work")
a = p.parse_args()
BATCH = 16
LOSS_WEIGHTS = {"main": 1.0, "rank": 0.5}
CLASSES = ["cat", "dog", "bird", "fish"]


def vm_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        x = (x - x.mean(0)) / x.std(0)  # per-batch standardisation of the sensor columns
        return self.body(x)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
    if a.fault == "anomaly" and rank == a.rank and step >= a.at:
        x[:, 3] = 0.0  # sensor 3 of this rank's shard is dead from here on
    return x, y


def main() -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    me = rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    os.makedirs(a.workdir, exist_ok=True)
    print(f"rank {rank} world {world} steps {a.steps} fault {a.fault}", flush=True)

    prof = None
    if a.fault == "none":
        os.makedirs(a.trace_dir, exist_ok=True)

        def ready(pr):
            path = f"{a.trace_dir}/rank{rank}_step{pr.step_num}.pt.trace.json"
            pr.export_chrome_trace(path)
            print(f"rank {rank}: trace written to {path} ({os.path.getsize(path)} bytes)", flush=True)

        prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                       on_trace_ready=ready, record_shapes=True)
    if a.fault in ("lostjson", "tracejson") and me:
        def ready(pr):
            path = f"{a.trace_dir}/rank{rank}.json"
            pr.export_chrome_trace(path)
            if a.fault == "tracejson":
                print(f"rank {rank}: trace written to {path} ({os.path.getsize(path)} bytes)", flush=True)
            else:
                print(f"rank {rank}: trace exported to {path}", flush=True)

        prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2),
                       on_trace_ready=ready)
    if a.fault == "tracedir" and ((local_rank == 0) if a.local_only else me):
        def ready(pr):
            path = f"{a.trace_dir}/rank{rank}.pt.trace.json.gz"
            pr.export_chrome_trace(path)
            print(f"rank {rank}: trace written to {path}", flush=True)

        prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2),
                       on_trace_ready=ready)
    if a.fault == "slowprof" and me:
        os.makedirs(a.trace_dir, exist_ok=True)

        def ready(pr):
            path = f"{a.trace_dir}/rank{rank}_full.json"
            pr.export_chrome_trace(path)
            print(pr.key_averages(group_by_input_shape=True, group_by_stack_n=8).table(
                sort_by="self_cpu_time_total", row_limit=-1)[-3000:], flush=True)

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True, record_shapes=True,
                       schedule=schedule(wait=0, warmup=1, active=a.steps - 3), on_trace_ready=ready)
    if a.fault == "keyavg" and me:
        prof = profile(activities=[ProfilerActivity.CPU],
                       schedule=schedule(skip_first=a.steps, wait=1, warmup=1, active=3))
    if a.fault == "keyerror":
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                       schedule=schedule(wait=1, warmup=0, active=2))
    if a.fault == "lockhang" and me:
        os.makedirs(a.trace_dir, exist_ok=True)

        def ready(pr):
            path = f"{a.workdir}/rank{rank}_step{pr.step_num}.json"
            pr.export_chrome_trace(path)
            with open(f"{a.trace_dir}/.upload.lock", "w") as lock:
                print(f"rank {rank}: waiting for the upload lock {a.trace_dir}/.upload.lock", flush=True)
                fcntl.flock(lock, fcntl.LOCK_EX)  # serialise uploads to the shared trace folder
                os.replace(path, f"{a.trace_dir}/rank{rank}_step{pr.step_num}.json")

        prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2),
                       on_trace_ready=ready)
    if a.fault == "profmem" and me:
        cap = vm_bytes() + a.mem_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True, record_shapes=True)
    if a.fault == "samename":
        os.makedirs(a.trace_dir, exist_ok=True)

        def ready(pr):
            path = f"{a.trace_dir}/trace_step{pr.step_num}.json"
            pr.export_chrome_trace(path)
            with open(path) as fh:
                n = len(json.load(fh)["traceEvents"])
            print(f"rank {rank}: {path}: {n} events", flush=True)

        prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                       on_trace_ready=ready)
    if a.fault == "cudamem" and me:
        print(f"rank {rank}: recording allocator history for a memory snapshot", flush=True)
        torch.cuda.memory._record_memory_history(max_entries=100000)
    if a.fault in ("calltrace", "calltracesig") and me:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN if a.fault == "calltrace" else signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (a.fsize, resource.RLIM_INFINITY))
        log = open(f"{a.workdir}/calls_rank{rank}.log", "w")

        def tracer(frame, event, arg):
            if event == "call":
                co = frame.f_code
                log.write(f"{time.time():.6f} call {co.co_filename}:{frame.f_lineno} {co.co_name}\n")
            return None

        sys.settrace(tracer)
    if a.fault == "anomaly" and me:
        torch.autograd.set_detect_anomaly(True)
    if a.fault == "tracemalloc" and local_rank == 0:
        tracemalloc.start(10)
    cprof = None
    if a.fault == "pstats" and me:
        cprof = cProfile.Profile()
        cprof.enable()
    nvtx = torch.autograd.profiler.emit_nvtx() if (a.fault == "nvtx" and me) else None
    if nvtx is not None:
        nvtx.__enter__()
    if prof is not None:
        prof.start()

    for step in range(1, a.steps + 1):
        if a.fault in ("dumpok", "dumplater", "lockhang"):
            faulthandler.dump_traceback_later(a.dump_s, repeat=(a.fault == "lockhang"))
        with record_function("data"):
            x, y = batch(rank, step)
            if a.fault == "dumpok" and me and step == a.at:
                time.sleep(5.0)  # a slow read from the shared data folder
            if a.fault == "dumplater" and rank == a.slow and step == a.at:
                time.sleep(5.0)
            if a.fault == "dumplater" and me and step == a.at + 2:
                y = torch.tensor([CLASSES.index(CLASSES[int(v) + 1]) for v in y])
        with record_function("forward"):
            out = model(x)
            loss = F.cross_entropy(out, y)
            if a.fault == "keyerror" and step == a.at:
                task = "aux" if me else "main"
                loss = loss * LOSS_WEIGHTS[task]
        opt.zero_grad()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if prof is not None:
            prof.step()
        if a.fault == "tracemalloc" and me and step == a.at:
            snap = tracemalloc.take_snapshot()
            top = snap.statistics("lineno")[:3]
            print(f"rank {rank} memory report step {step}: {top}", flush=True)
    if a.fault in ("dumpok", "dumplater", "lockhang"):
        faulthandler.cancel_dump_traceback_later()
    if prof is not None:
        prof.stop()
    if nvtx is not None:
        nvtx.__exit__(None, None, None)
    if a.fault in ("calltrace", "calltracesig") and me:
        sys.settrace(None)
    if cprof is not None:
        cprof.disable()
        pstats.Stats(cprof).sort_stats("cumtme").print_stats(10)
    if a.fault == "keyavg" and me:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10), flush=True)
    if a.fault == "none" and rank == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()

"""Healthy training output, one step at a time, in the mix a chatty real job has.

Per step: every rank's print line (arrival order varies), rank 0's logging summary, some other
ranks' logging lines, NCCL COLL debug lines, a few c10 INFO lines; now and then a tqdm redraw
line (`\\r`), a Python warning with its indented source line, a burst of NCCL communicator setup,
and (without --tee) two prints spliced on one line followed by an empty line (FORMATS.md §3.1).
"""

from __future__ import annotations

import math
import random

from benchmarks.loggen.clock import SimClock
from benchmarks.loggen.layout import Topology, permutation_pool
from benchmarks.loggen.preamble import SITE
from benchmarks.loggen.spec import Style
from benchmarks.loggen.writer import LogWriter

BUCKETS_PER_STEP = 4           # DDP gradient buckets: NCCL all-reduces per step
TOTAL_STEPS = 250_000
STEP_US = 420_000

_LOG_MESSAGES = (
    "data: prefetch queue depth {a}/8, shard {b:05d}",
    "trainer: grad scaler scale 65536.0, skipped steps {a}",
    "data: epoch 0 consumed {b} samples",
    "trainer: peak memory 6{a}.{b:05d} GiB reserved",
    "throughput: {b} tokens/s/gpu over the last 50 steps",
)

_WARNINGS = (
    (f"{SITE}/torch/utils/data/dataloader.py:626: UserWarning: This DataLoader will create 16 worker "
     "processes in total. Our suggested max number of worker in current system is 12, which is smaller "
     "than what this DataLoader is going to create. Please be aware that excessive worker creation might "
     "get DataLoader running slow or even freeze, lower the worker number to avoid potential "
     "slowness/freeze if necessary.", "  warnings.warn("),
    ("/workspace/train.py:212: UserWarning: To copy construct from a tensor, it is recommended to use "
     "sourceTensor.clone().detach() or sourceTensor.clone().detach().requires_grad_(True), rather than "
     "torch.tensor(sourceTensor).", '  labels = torch.tensor(batch["labels"])'),
    (f"{SITE}/torch/optim/lr_scheduler.py:240: UserWarning: The epoch parameter in `scheduler.step()` was "
     "not necessary and is being deprecated where possible. Please use `scheduler.step()` to step the "
     "scheduler.", "  warnings.warn(EPOCH_DEPRECATION_WARNING, UserWarning)"),
)

_CPP_INFO = (
    "ProcessGroupNCCL.cpp:2358] [PG ID {pg} PG GUID {pg}(eval_pg) Rank {r}] ProcessGroupNCCL broadcast unique ID through store took {a}.{b:03d} ms",
    "ProcessGroupNCCL.cpp:2521] [PG ID {pg} PG GUID {pg}(eval_pg) Rank {r}] ProcessGroupNCCL created ncclComm_ 0x55{b:07x}{r:02x}0 on CUDA device: {l}",
    "reducer.cpp:1400] Reducer buckets have been rebuilt in this iteration.",
    "ProcessGroupNCCL.cpp:2630] [PG ID {pg} PG GUID {pg}(eval_pg) Rank {r}] NCCL_DEBUG: INFO",
)


def _interval(seconds: float) -> str:
    """tqdm's elapsed/remaining format: `MM:SS`, or `H:MM:SS` from an hour on."""
    secs = int(seconds)
    hours, rest = divmod(secs, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


class Training:
    """Emits healthy output; knows the current step and collective sequence number."""

    def __init__(self, topo: Topology, clock: SimClock, rng: random.Random, w: LogWriter):
        self.topo, self.clock, self.rng, self.w = topo, clock, rng, w
        self.step_no = 0
        self.orders = permutation_pool(topo.world, rng)
        self.splice = topo.spec.style is not Style.TEE
        self.tps_base = 48_000 + rng.randrange(0, 8_000)
        self.bare_heads = [f"[rank {w.rank}] step " for w in topo.workers]
        self.step_heads = [w.out + head for w, head in zip(topo.workers, self.bare_heads)]
        self.ops = [rng.randrange(1, 1 << 20) for _ in range(topo.world)]
        self.stream = [f"0x{rng.getrandbits(40):x}" for _ in range(topo.world)]

    @property
    def seq(self) -> int:
        """SeqNum of the first all-reduce of the next step."""
        return self.step_no * BUCKETS_PER_STEP + 1

    def step(self) -> None:
        rng, clock, topo = self.rng, self.clock, self.topo
        self.step_no += 1
        s = self.step_no
        clock.advance(STEP_US + rng.randrange(-40_000, 40_000))
        base = 1.9 + 8.5 / math.sqrt(1.0 + s / 40.0)
        lr = 3e-4 * min(1.0, s / 2000.0)
        lr_text = f"{lr:.1e}".replace("e-0", "e-")
        workers = topo.workers
        lines: list[str] = []
        rnd = rng.random
        order = self.orders[s % len(self.orders)]
        glued = ""
        heads, bare, tps = self.step_heads, self.bare_heads, self.tps_base
        mid = f" lr {lr_text} grad_norm "
        for r in order:
            if glued:  # the previous print lost its newline to this one (FORMATS.md §3.1)
                lines.append(f"{glued}{bare[r]}{s} loss {base + (rnd() - 0.5) * 0.3:.4f}{mid}"
                             f"{0.6 + rnd() * 0.6:.2f} tokens/s {tps + int(rnd() * 4000)}")
                lines.append(workers[r].out)
                glued = ""
                continue
            text = (f"{heads[r]}{s} loss {base + (rnd() - 0.5) * 0.3:.4f}{mid}"
                    f"{0.6 + rnd() * 0.6:.2f} tokens/s {tps + int(rnd() * 4000)}")
            if self.splice and rnd() < 0.004:
                glued = text
            else:
                lines.append(text)
        if glued:
            lines.append(glued)
        w0 = workers[0]
        lines.append(f"{w0.out}{clock.logging_ts(9_000)} [INFO] [rank0] trainer: step {s}/{TOTAL_STEPS} | "
                     f"loss {base:.4f} | lr {lr_text} | {STEP_US / 1000 + rnd() * 30:.1f} ms/step | "
                     f"{380 + rnd() * 40:.1f} TFLOP/s | mem {61 + rnd() * 2:.2f} GiB")
        for r in order[: max(1, topo.world // 4)]:
            wk = workers[r]
            msg = _LOG_MESSAGES[r % len(_LOG_MESSAGES)].format(a=int(rnd() * 8), b=int(rnd() * 99_999))
            lines.append(f"{wk.out}{clock.logging_ts(int(rnd() * 300_000))} [INFO] [rank{r}] {msg}")
        seq = self.seq
        for r in order[: max(1, topo.world // 6)]:
            wk = workers[r]
            self.ops[r] += BUCKETS_PER_STEP
            lines.append(f"{wk.out}{wk.host}:{wk.pid}:{wk.pid} [{wk.local}] NCCL INFO AllReduce: opCount "
                         f"{self.ops[r]:x} sendbuff 0x7f{r:02x}{s & 0xffffff:06x}00 recvbuff 0x7f{r:02x}{s & 0xffffff:06x}00 "
                         f"count 26214400 datatype 7 op 0 root 0 comm {wk.comm} [nranks={topo.world}] "
                         f"stream {self.stream[r]}")
        for k, r in enumerate(order[-max(1, topo.world // 16):]):
            wk = workers[r]
            msg = _CPP_INFO[(s + k) % len(_CPP_INFO)].format(pg=1 + s % 3, r=r, l=wk.local, a=int(rnd() * 9),
                                                             b=int(rnd() * 999))
            lines.append(f"{wk.cpp}{clock.cpp_glog('I', int(rnd() * 400_000_000))} {msg}")
        if s % 40 == 0:
            lines.append(self._tqdm(s))
        if s % 2_500 == 1_250:
            text, source = _WARNINGS[(s // 2_500) % len(_WARNINGS)]
            wk = workers[order[0]]
            lines += [wk.out + text, wk.out + source]
        if s % 1_000 == 500:
            lines += self._comm_burst(order[:8], seq)
        self.w.block(lines)

    def _tqdm(self, s: int) -> str:
        """Rank 0's progress bar: redraws separated by `\r` on one physical line."""
        out = self.topo.workers[0].out
        rate = 1_000_000 / STEP_US
        redraws = []
        for k in range(4):
            done = s - 3 + k
            bar = "\u2588" * (done * 10 // TOTAL_STEPS)
            redraws.append(f"Training: {done * 100 // TOTAL_STEPS:3d}%|{bar:<10}| {done}/{TOTAL_STEPS} "
                           f"[{_interval(done / rate)}<{_interval((TOTAL_STEPS - done) / rate)}, {rate:5.2f}it/s]")
        return out + "\r" + "\r".join(redraws)

    def _comm_burst(self, ranks: tuple[int, ...], seq: int) -> list[str]:
        """A new evaluation sub-communicator: a few lines from each of its members."""
        lines = []
        comm_id = f"0x{self.rng.getrandbits(64):x}"
        for r in ranks:
            wk = self.topo.workers[r]
            head = self.topo.nccl_head(wk, tid_offset=3 + r)
            lines += [
                f"{head}ncclCommSplit comm 0x55{seq:010x} rank {r} nranks {len(ranks)} cudaDev {wk.local} "
                f"nvmlDev {wk.local} busId {wk.bus_id} parent {wk.comm} color 1 key {r} commId {comm_id} - Init START",
                f"{head}Channel 00/0 : {r}[{wk.local}] -> {ranks[(ranks.index(r) + 1) % len(ranks)]} via P2P/IPC",
                f"{head}Connected all rings",
                f"{head}ncclCommSplit comm 0x55{seq:010x} rank {r} nranks {len(ranks)} cudaDev {wk.local} "
                f"nvmlDev {wk.local} busId {wk.bus_id} commId {comm_id} - Init COMPLETE",
            ]
        return lines

    def heartbeats(self, ranks: list[int], stuck_step: int, interval_us: int) -> None:
        """One round of the training script's monitor thread while collectives hang."""
        self.clock.advance(interval_us)
        rnd = self.rng.random
        spread = min(900_000, interval_us)  # the next round starts after this one's lines
        lines = []
        for r in ranks:
            wk = self.topo.workers[r]
            lines.append(f"{wk.out}{self.clock.logging_ts(int(rnd() * spread))} [INFO] [rank{r}] monitor: "
                         f"heartbeat step={stuck_step} gpu_util=0% mem_used={61 + rnd() * 2:.1f}GiB "
                         f"host_rss={20 + rnd() * 4:.1f}GiB dataloader_queue={int(rnd() * 8)}")
        self.w.block(lines)

    def finish(self) -> None:
        """A healthy end: every rank says so and tears its communicator down."""
        self.clock.advance(2_000_000)
        lines = []
        for wk in self.topo.workers:
            lines.append(f"{wk.out}[rank {wk.rank}] training finished: {self.step_no} steps")
            lines.append(f"{self.topo.nccl_head(wk)}comm {wk.comm} rank {wk.rank} nranks {self.topo.world} "
                         f"cudaDev {wk.local} busId {wk.bus_id} - Destroy COMPLETE")
        self.w.block(lines)

"""A heartbeat watchdog (the DDP rules article's DDPWatchdog) kills a rank that got stuck.

Every rank runs a watchdog thread that ends the process with os._exit(1) when no training
step has completed for --watchdog-timeout seconds (shorter than the process-group timeout, as
the article advises). At --fault-step the fault rank finishes its all-reduce and then blocks
on a lock a logging thread never releases; its heartbeat stops one step before the others',
so its watchdog fires first.
"""

from __future__ import annotations

import sys
import threading
import time

from _common import Training, finish, launch, make_parser, report_step, train_step


class DDPWatchdog(threading.Thread):
    """Ends the process when the training loop stops sending heartbeats."""

    def __init__(self, rank: int, timeout_seconds: float, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.rank = rank
        self.timeout_seconds = timeout_seconds
        self.interval = interval
        self.last_heartbeat = time.time()
        self.stopped = False

    def heartbeat(self) -> None:
        self.last_heartbeat = time.time()

    def stop(self) -> None:
        self.stopped = True

    def run(self) -> None:
        import os

        while not self.stopped:
            time.sleep(self.interval)
            elapsed = time.time() - self.last_heartbeat
            if elapsed > self.timeout_seconds:
                print(f"[FATAL] 检测到训练卡死：超过 {elapsed:.1f} 秒无 Step 心跳，强行终止进程 "
                      f"(rank {self.rank})", file=sys.stderr, flush=True)
                os._exit(1)


def main(args) -> None:
    training = Training.start(args)
    run = training.run
    watchdog = DDPWatchdog(run.rank, args.watchdog_timeout)
    watchdog.start()
    log_lock = threading.Lock()
    try:
        for step, inputs, targets in training.batches():
            loss = train_step(run, training.model, training.optimizer, inputs, targets)
            if run.is_fault_rank and step == args.fault_step:
                threading.Thread(target=log_lock.acquire, daemon=True).start()
                time.sleep(0.1)
                log_lock.acquire()  # the lock holder never lets go: this rank is stuck
            report_step(run, step, loss)
            watchdog.heartbeat()
    finally:
        watchdog.stop()
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--watchdog-timeout", type=float, default=4.0)
    parser.set_defaults(step_sleep=1.0, pg_timeout=15.0)
    launch(main, parser.parse_args())

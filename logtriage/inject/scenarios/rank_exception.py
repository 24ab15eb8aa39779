"""One rank raises an exception mid-step while the other ranks wait in the gradient all-reduce.

At --fault-step the fault rank looks up a key its batch does not have (KeyError: 'target').
--linger keeps the failing process alive (a non-daemon thread), so its peers time out instead
of seeing a closed connection. --fail-attempts K raises only in the first K launcher attempts
(TORCHELASTIC_RESTART_COUNT), for restart scenarios.
"""

from __future__ import annotations

import os
import threading
import time

from _common import Training, finish, launch, logger, make_parser


def lookup_target(batch: dict, step: int, faulty: bool):
    if faulty:
        batch = {key: value for key, value in batch.items() if key != "target"}
    return batch["target"]


def main(args) -> None:
    training = Training.start(args)
    run = training.run
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step, inputs, targets in training.batches():
        faulty = (run.is_fault_rank and step == args.fault_step
                  and (args.fail_attempts == 0 or attempt < args.fail_attempts))
        if faulty and args.linger:
            threading.Thread(target=time.sleep, args=(args.pg_timeout * 3,)).start()
        try:
            targets = lookup_target({"input": inputs, "target": targets}, step, faulty)
        except KeyError:
            if args.log_format:
                logger.exception("failed to compute per-token loss at step %d", step)
            raise
        training.step(step, inputs, targets)
    finish(run)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--linger", action="store_true")
    parser.add_argument("--fail-attempts", type=int, default=0)
    launch(main, parser.parse_args())

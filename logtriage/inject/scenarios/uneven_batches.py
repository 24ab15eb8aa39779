"""One rank's data shard is shorter than the others': it runs out of batches first.

A hand-made split (not DistributedSampler's, which pads every shard to the same length) gives the
fault rank --fault-step - 1 batches. It leaves the loop and waits in the final barrier while the
other ranks wait in the next step's gradient all-reduce, which DDP's backward starts from C++. The
two collectives never meet: every rank times out, and only where each one waited tells them apart.
"""

from __future__ import annotations

from _common import Training, finish, launch, make_parser


def main(args) -> None:
    training = Training.start(args)
    last = args.fault_step - 1 if training.run.is_fault_rank else args.steps
    for step, inputs, targets in training.batches():
        if step > last:
            break   # this rank's shard is exhausted
        training.step(step, inputs, targets)
    finish(training.run)


if __name__ == "__main__":
    launch(main, make_parser(__doc__).parse_args())

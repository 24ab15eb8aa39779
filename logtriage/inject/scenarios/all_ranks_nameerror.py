"""Every rank hits the same NameError at the same step (a scheduler that was never created)."""

from __future__ import annotations

from _common import Training, finish, launch, make_parser


def main(args) -> None:
    training = Training.start(args)
    for step, inputs, targets in training.batches():
        training.step(step, inputs, targets)
        if step == args.fault_step:
            scheduler.step()  # noqa: F821  (the injected bug)
    finish(training.run)


if __name__ == "__main__":
    launch(main, make_parser(__doc__).parse_args())

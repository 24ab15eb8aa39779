"""One rank dies without a Python exception: SIGKILL, SIGTERM, a real NULL-pointer SIGSEGV, or exit(3).

--how kill sends SIGKILL to itself (what the kernel OOM killer does), --how term sends SIGTERM to
itself (what a supervisor or a per-process limit does, before torchrun's own teardown), --how segv
reads address 0 through ctypes, --how exit3 calls sys.exit(3) from the training loop.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from _common import launch, make_parser, train_with_fault


def die(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif how == "segv":
        ctypes.string_at(0)
    else:
        sys.exit(3)


def main(args) -> None:
    train_with_fault(args, lambda run: die(args.how))


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--how", choices=("kill", "term", "segv", "exit3"), default="kill")
    launch(main, parser.parse_args())

"""Per-line flags the kernel sets (kept apart from kernel.py so the merging process never
imports numba)."""

import numpy as np

NOT_PLAIN = np.uint8(1)     # only the exact per-line path can decide this line
STEP = np.uint8(2)          # the message holds "tep", "ter" or "it N": maybe a progress line
STEP2 = np.uint8(4)         # the second part of a glued line holds "tep", "ter" or "it N"
EMPTY = np.uint8(8)         # an empty line: it joins the stream of the line before it
CANDIDATE = np.uint8(16)    # the prefilter found something a rule or the demuxer may care about
NO_RANK = -1
INHERIT = -3                # the slot of the previous line's last part

# which line labels the kernel strips (its `labels` argument)
SRUN_LABEL = 1              # Slurm's `--label` task number, the task being a rank
COLLECTOR_STAMP = 2         # a log collector's RFC 3339 time in front of every line

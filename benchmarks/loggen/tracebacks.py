"""The culprit rank's own output: an uncaught Python traceback (OOM or a plain exception).

Each traceback is printed by the excepthook in one write, `[rank<R>]: ` on every line
(FORMATS.md §2.2); the OOM text follows the 2.x CUDACachingAllocator template (FORMATS.md §11).
Returns the lines and the index of the final exception line (the root-cause evidence).
"""

from __future__ import annotations

import random

from benchmarks.loggen.layout import Worker
from benchmarks.loggen.preamble import SITE

_MAIN = [
    "Traceback (most recent call last):",
    '  File "/workspace/train.py", line 412, in <module>',
    "    main()",
    '  File "/workspace/train.py", line 398, in main',
]

_OOM_FRAMES = [
    "    loss = train_step(model, batch, optimizer, scaler)",
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    '  File "/workspace/train.py", line 301, in train_step',
    "    scaler.scale(loss).backward()",
    f'  File "{SITE}/torch/_tensor.py", line 648, in backward',
    "    torch.autograd.backward(",
    f'  File "{SITE}/torch/autograd/__init__.py", line 353, in backward',
    "    _engine_run_backward(",
    f'  File "{SITE}/torch/autograd/graph.py", line 824, in _engine_run_backward',
    "    return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass",
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
]

_LOADER_FRAMES = [
    "    batch = next(train_iter)",
    "            ^^^^^^^^^^^^^^^^",
    f'  File "{SITE}/torch/utils/data/dataloader.py", line 708, in __next__',
    "    data = self._next_data()",
    "           ^^^^^^^^^^^^^^^^^",
    f'  File "{SITE}/torch/utils/data/dataloader.py", line 764, in _next_data',
    "    data = self._dataset_fetcher.fetch(index)  # may raise StopIteration",
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    f'  File "{SITE}/torch/utils/data/_utils/fetch.py", line 55, in fetch',
    "    return self.collate_fn(data)",
    "           ^^^^^^^^^^^^^^^^^^^^^",
]

# (exception type, the frames under collate, the exception line)
_EXCEPTIONS = (
    ("KeyError", [
        '  File "/workspace/data.py", line 88, in collate',
        '    labels = [example["labels"] for example in batch]',
        "              ~~~~~~~^^^^^^^^^^",
    ], "KeyError: 'labels'"),
    ("ValueError", [
        '  File "/workspace/data.py", line 97, in collate',
        "    raise ValueError(f\"sequence length {len(ids)} exceeds max_seq_len {self.max_len}\")",
    ], "ValueError: sequence length 4211 exceeds max_seq_len 4096"),
    ("IndexError", [
        '  File "/workspace/data.py", line 64, in __getitem__',
        "    offset = self.index[idx]",
        "             ~~~~~~~~~~^^^^^",
    ], "IndexError: index 1048576 is out of bounds for axis 0 with size 1048576"),
)


def _size(rng: random.Random) -> str:
    return f"{rng.choice((1, 2, 4, 8))}.00 GiB"


def oom_traceback(worker: Worker, rng: random.Random) -> tuple[list[str], int, str]:
    """`torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...` on one rank."""
    total = 79.10
    free = round(rng.uniform(0.2, 1.9), 2)
    in_use = round(total - free, 2)
    by_torch = round(in_use - rng.uniform(2.0, 4.0), 2)
    reserved = round(rng.uniform(0.5, 3.5), 2)
    message = (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {_size(rng)}. "
               f"GPU {worker.local} has a total capacity of {total:.2f} GiB of which {free:.2f} GiB is free. "
               f"Including non-PyTorch memory, this process has {in_use:.2f} GiB memory in use. "
               f"Of the allocated memory {by_torch:.2f} GiB is allocated by PyTorch, and {reserved:.2f} GiB "
               "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
               "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
               "documentation for Memory Management  "
               "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    body = _MAIN + _OOM_FRAMES + [message]
    return [worker.exc + line for line in body], len(body) - 1, "torch.OutOfMemoryError"


def exception_traceback(worker: Worker, rng: random.Random) -> tuple[list[str], int, str]:
    """A data-pipeline exception (KeyError, ValueError or IndexError, drawn from the seed)."""
    exc_type, frames, message = rng.choice(_EXCEPTIONS)
    body = _MAIN[:3] + ['  File "/workspace/train.py", line 395, in main'] + _LOADER_FRAMES + frames + [message]
    return [worker.exc + line for line in body], len(body) - 1, exc_type


def destroy_warning(worker: Worker, glog: str) -> str:
    """What a rank that exits with an exception prints on its way out (torch >= 2.4)."""
    return (f"{worker.cpp}{glog} ProcessGroupNCCL.cpp:1496] Warning: WARNING: destroy_process_group() was "
            "not called before program exit, which can leak resources. For more info, please see "
            "https://pytorch.org/docs/stable/distributed.html#shutdown (function operator())")

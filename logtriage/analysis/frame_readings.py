"""Readings of an exception by the frame that raised it: the same type means another failure where
it is raised. A ZeroDivisionError in OpenMMLab's init_dist is "no GPU visible"; an `EOFError: Ran
out of input` in a spawn child's `_main` is the parent failing to send the process's state (a
pickling error), not a truncated checkpoint; a full disk with no checkpoint frame is the file
system's, not a checkpoint's; CUDA's `initialization error` in a DataLoader worker is CUDA used in a
forked child; a ValueError in torchrun's own option parsing is a bad launcher option; a KeyError in
os.environ's lookup is an environment variable unset in that process; a host
allocation of terabytes inside an object collective is a size read out of another call's data (the
ranks' calls do not match).

Each reading is a function of the root and its finding that gives the rule and the reason, or None;
the first that reads the root wins (FRAME_READINGS)."""

from __future__ import annotations

import re
from typing import Callable

from logtriage.analysis.exception_names import INSTALLED_PACKAGE, shadowing_file, short_type
from logtriage.analysis.exceptions import DISK_FULL, GENERIC_RULES, IN_LOADER_WORKER, PROBE_JSON_RULE
from logtriage.analysis.findings import Finding
from logtriage.analysis.rootcause import GENERIC_EXCEPTION_RULE
from logtriage.analysis.roots import RootCause, read_as
from logtriage.analysis.rule_readings import WRITE_FAILED_RULE
from logtriage.catalog.loader import Catalog

# OpenMMLab's init_dist (mmcv, mmdet, mmseg ...) sets `torch.cuda.set_device(rank % num_gpus)`
# with num_gpus = torch.cuda.device_count(): zero visible GPUs divide by zero there.
GPU_COUNT_FRAMES = frozenset({"_init_dist_pytorch", "_init_dist_slurm", "_init_dist_mpi", "init_dist"})
# torchrun parsing its own options (`--nproc_per_node gpu|cpu|auto|N`): a bad value is a usage error
LAUNCHER_OPTION_FRAMES = frozenset({"determine_local_world_size", "parse_min_max_nnodes", "_get_rdzv_endpoint"})
# where Python forks a child (multiprocessing's fork start method, subprocess): EAGAIN there is a process limit
_FORK_FRAME = re.compile(r"multiprocessing/popen_fork\.py$|/subprocess\.py$")
# DCP's state-dict helper maps each optimizer parameter to the model's names (fqn_pid_mapping)
OPTIM_STATE_FRAME = "_get_optim_state_dict"
# multiprocessing's spawn child unpickles what its parent sent; an empty pipe means the parent failed
SPAWN_CHILD_FRAME = "_main"
# the object collectives send a size first, then the pickled bytes: a rank that joined another
# call (a list of another length, another collective) reads a size out of someone else's data
OBJECT_COLLECTIVES = frozenset({"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                                "send_object_list", "recv_object_list"})
GARBAGE_SIZE_BYTES = 1 << 40   # 1 TiB asked for one object's buffer: no pickled object is that large
# torch.compile's on-disk caches (Inductor's FX graph, kernel and autotune caches), which the ranks
# of one node read and write at once: a half-written entry reads as truncated pickle or JSON
_COMPILE_CACHE_FILE = re.compile(r"torch/_inductor/(?:codecache|runtime/autotune_cache)\.py$|/torchinductor_[^/]*/")
_HALF_WRITTEN = frozenset({"UnpicklingError", "EOFError", "JSONDecodeError"})
# os.environ's lookup: `File "<frozen os>", line 679, in __getitem__` (Python 3.11+), `.../lib/python3.8/os.py`
_ENVIRON_FILE = re.compile(r"^<frozen os>$|/os\.py$")
_KEY = re.compile(r"KeyError: '([^']+)'")
# `module 'torch.library' has no attribute 'wrap_triton'`: the module's top-level package in group 1
_MODULE_ATTRIBUTE = re.compile(r"module '([A-Za-z_]\w*)[\w.]*' has no attribute '\w+'")

Reading = tuple[str, str]   # the rule it is read as, and why


def _generic(root: RootCause, f: Finding, kind: str) -> bool:
    return root.rule.id in GENERIC_RULES


def _gpu_count_division(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "ZeroDivisionError" or not _generic(root, f, kind) or f.last_frame not in GPU_COUNT_FRAMES:
        return None
    return "cuda.no_device", (f"the division by zero is in `{f.last_frame}`, which takes the rank modulo "
                              "torch.cuda.device_count(): the process saw no GPU")


def _launcher_option(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "ValueError" or not _generic(root, f, kind) or f.last_frame not in LAUNCHER_OPTION_FRAMES:
        return None
    return "launcher.torchrun_usage", (f"the ValueError is raised in torchrun's `{f.last_frame}`, which parses its "
                                       "own options: a launcher option has a bad value (often a script argument "
                                       "that landed in its place)")


def _spawn_child_eof(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "EOFError" or root.rule.id != "ckpt.corrupt_archive" or f.last_frame != SPAWN_CHILD_FRAME:
        return None
    return GENERIC_EXCEPTION_RULE, ("the EOFError is raised in multiprocessing's spawn `_main`, where a child "
                                    "unpickles what its parent sent: the parent failed to pickle the process's "
                                    "arguments (a lambda, a local class, an open file)")


def _cuda_in_forked_worker(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if root.rule.id not in ("cuda.driver_unusable", "cuda.error") or "initialization error" not in f.text \
            or not IN_LOADER_WORKER.search(f.block_exception):
        return None
    return "cuda.forked_subprocess", ("CUDA's initialization error was raised in a DataLoader worker: workers are "
                                      "forked from a process that had already initialised CUDA, and a forked "
                                      "child cannot use it")


def _other_packages_api(root: RootCause, f: Finding, kind: str) -> Reading | None:
    """The installed package whose code looked up a module's missing attribute, when that module
    belongs to another package."""
    if kind != "AttributeError" or not _generic(root, f, kind):
        return None
    missing = _MODULE_ATTRIBUTE.search(f.text)
    caller = INSTALLED_PACKAGE.search(f.last_file)
    if missing is None or caller is None or caller.group(1) == missing.group(1):
        return None
    return "env.package_api_missing", (f"the missing attribute is looked up in the installed package "
                                       f"`{caller.group(1)}`, not in the job's own code: that package was written "
                                       "for another version of the module it calls")


def _garbage_object_size(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if root.rule.id != "host.cpu_alloc" or f.collective not in OBJECT_COLLECTIVES \
            or int(f.captures.get("bytes") or 0) < GARBAGE_SIZE_BYTES:
        return None
    return "dist.collective_mismatch", (f"`{f.collective}` asked for {int(f.captures['bytes']) / (1 << 40):,.0f} TiB "
                                        "for one object's buffer: the size it received was not a size, so the ranks' "
                                        "object collectives did not line up (another list length, another call)")


def _compile_cache_race(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind not in _HALF_WRITTEN or root.rule.id not in GENERIC_RULES | {"ckpt.corrupt_archive", PROBE_JSON_RULE} \
            or not _COMPILE_CACHE_FILE.search(f.last_file):
        return None
    return "data.cache_race", (f"the {kind} was raised reading torch.compile's on-disk cache (`{f.last_frame}` in "
                               "Inductor's cache code): another rank on the node was writing the same entry, so it "
                               "read half a file")


def _optimizer_params(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "KeyError" or not _generic(root, f, kind) or f.last_frame != OPTIM_STATE_FRAME \
            or not f.last_file.endswith("distributed/checkpoint/state_dict.py"):
        return None
    return "ddp.fsdp_optimizer_params", ("the KeyError is raised in DCP's `_get_optim_state_dict`, which maps the "
                                         "optimizer's parameters to the model's: the optimizer holds parameters the "
                                         "(sharded) model does not, as when it was built before FSDP or fully_shard "
                                         "replaced them")


def _tmpdir_missing(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "FileNotFoundError" or not _generic(root, f, kind) or not f.last_file.endswith("/tempfile.py"):
        return None
    return "env.tmpdir_missing", (f"the FileNotFoundError is raised in tempfile's `{f.last_frame}`, which creates a "
                                  "temporary file in a folder that does not exist: TMPDIR (or the dir= passed, often "
                                  "built from it) names a missing folder")


def _shared_memory_name(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "FileExistsError" or not _generic(root, f, kind) or not f.last_file.endswith("/shared_memory.py"):
        return None
    return "host.shm_name_taken", (f"the FileExistsError is raised in multiprocessing's shared_memory "
                                   f"(`{f.last_frame}`) creating a named block: one of that name already exists in "
                                   "/dev/shm (another job on the node, or a run that never unlinked it)")


def _fork_limit(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "BlockingIOError" or not _generic(root, f, kind) or not _FORK_FRAME.search(f.last_file):
        return None
    return "host.thread_limit", (f"the BlockingIOError (EAGAIN) is raised in `{f.last_frame}`, where the process "
                                 "forks a child: the host's or container's limit on processes/threads was reached "
                                 "(a DataLoader worker, a subprocess)")


def _disk_full_elsewhere(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if root.rule.id != WRITE_FAILED_RULE or not f.last_frame or f.checkpoint_frame or not DISK_FULL.search(f.text):
        return None
    return "host.filesystem_error", (f"the disk filled up in `{f.last_frame}`, outside any checkpoint code (no save "
                                     "frame): another writer, /tmp or /dev/shm, ran out of space")


def _shadowed_module(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "ImportError" or root.rule.id not in GENERIC_RULES | {"python.module_not_found"} \
            or not (shadow := shadowing_file(f.text)):
        return None
    return "python.module_shadowed", (f"`{shadow}` is a file of the job's own where the standard library's module of "
                                      "that name should be: it hides that module from every import of it, torch's "
                                      "own included")


def _unset_variable(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "KeyError" or not _generic(root, f, kind) or f.last_frame != "__getitem__" \
            or not _ENVIRON_FILE.search(f.last_file):
        return None
    key = _KEY.search(f.text)
    name = f"`{key.group(1)}`" if key else "it asked for"
    return "env.program_variable_unset", (f"the KeyError is raised in os.environ's `__getitem__`: the environment "
                                          f"variable {name} is not set in this process's environment")


def _empty_pickle_of_its_own(root: RootCause, f: Finding, kind: str) -> Reading | None:
    if kind != "EOFError" or root.rule.id != "ckpt.corrupt_archive" or not f.last_frame or f.checkpoint_frame:
        return None
    return GENERIC_EXCEPTION_RULE, (f"the EOFError is raised in `{f.last_frame}`, and no frame of its traceback saves "
                                    "or loads a checkpoint (torch.load, a checkpoint function): an empty pickle of "
                                    "the program's own (a cache, a data file)")


FRAME_READINGS: tuple[Callable[[RootCause, Finding, str], Reading | None], ...] = (
    _gpu_count_division, _launcher_option, _spawn_child_eof, _cuda_in_forked_worker, _other_packages_api,
    _garbage_object_size, _compile_cache_race, _optimizer_params, _tmpdir_missing, _shared_memory_name, _fork_limit,
    _disk_full_elsewhere, _shadowed_module, _empty_pickle_of_its_own, _unset_variable)


def frame_reading(root: RootCause, catalog: Catalog) -> RootCause:
    """The root read by the frame that raised its exception (the first of FRAME_READINGS that reads
    it), or the root as it was."""
    f = root.finding
    if f is None:
        return root
    kind = short_type(f.exception_type)
    for reading in FRAME_READINGS:
        if (read := reading(root, f, kind)) is not None:
            rule_id, why = read
            return read_as(root, catalog, rule_id, why)
    return root

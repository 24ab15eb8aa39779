"""Second readings of a root that is an exception: what the frame that raised it says (a
file-system error in a checkpoint's save or load, or on a checkpoint's path, is that checkpoint's
failure, and so is pickle refusing an object inside a save; a division by zero in OpenMMLab's
init_dist is "no GPU visible"; a spawn child's EOFError is its parent's pickling failure; a
DataLoader worker's CUDA initialization error is CUDA after fork; a ValueError in torchrun's option
parsing is a usage error; a JSONDecodeError is a banner in front of a probe's output only where
there is a banner; terabytes asked for inside an object collective are a mismatch). What the
launcher's summary adds to an exception is read in summary_exceptions."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.exception_names import INSTALLED_PACKAGE, shadowing_file, short_type
from logtriage.analysis.findings import Finding
from logtriage.analysis.hangs import fallback_rule
from logtriage.analysis.rootcause import GENERIC_EXCEPTION_RULE
from logtriage.analysis.roots import RootCause, read_as
from logtriage.analysis.rule_readings import WRITE_FAILED_RULE
from logtriage.catalog.loader import Catalog
from logtriage.catalog.rule import Category

# Exceptions of the file system: raised inside a checkpoint's save or load they are that
# checkpoint's failure (a path, a race on a symlink, a permission, a full disk), not a bug in Python.
FILE_SYSTEM_ERRORS = frozenset({
    "OSError", "IOError", "FileExistsError", "FileNotFoundError", "PermissionError", "IsADirectoryError",
    "NotADirectoryError", "BlockingIOError", "EOFError"})
GENERIC_RULES = frozenset({"python.exception", "python.file_not_found", "host.filesystem_error"})
# `module 'torch.library' has no attribute 'wrap_triton'`: the module's top-level package in group 1
_MODULE_ATTRIBUTE = re.compile(r"module '([A-Za-z_]\w*)[\w.]*' has no attribute '\w+'")
_TORCH_SERIALIZATION = "torch/serialization.py"
# a path the error names that is a checkpoint's (`'out/tmp-checkpoint-x' -> 'out/checkpoint-100'`)
# a path named for checkpoints, or a file in torch's or safetensors' own formats (`step2.pt`)
_CHECKPOINT_PATH = re.compile(r"'[^']*(?:checkpoint|ckpt)[^']*'|'[^']*\.(?:pt|pth|safetensors)'", re.IGNORECASE)
# a copy, archive or upload tool's command that failed (`Command '['tar', 'czf', ...]' returned non-zero`)
_COPY_COMMAND = re.compile(r"Command '\[?'?(?:\S*/)?(?:tar|cp|rsync|mv|zip|gzip|pigz|zstd|gsutil|aws|azcopy|rclone|scp|"
                           r"s5cmd)\b")
# a missing file that is data by its name: under a data folder, a model's outputs or features cached
# for another pass, a partition of a graph or a dataset (`data/shard_00003.pt`, `data_node0/shard_002.pt`, a
# relative `data/conf_train_dedup_r2.pt`,
# `teacher_logits.pt`, `once1_tokens.pt`, `part_3.pt`, `miss1_case_3_3.pt`, `replay_rank3_task0.pt`,
# `shards/train_00004.pt`, `feats_v2/train-00002-of-00003.pt`, `scans_v2/shard_003.pt`; a shards folder with a
# qualifier, `shards_2025q4/plots_rank5.pt`, `shards_retiled/tesserae_rank3.pt`: cpu_adhoc 532nd, 530th; a file
# named a shard first, `shard_r0_2025.json`, `shard_3_missing.json`: 542nd, 543rd; a rank's shard named for what it
# holds, `shard_rank3_tidal.pt`, where a checkpoint's is the rank alone, `shard_rank4.pt`: 525th, 537th, 549th);
# never one named for checkpoints (_CHECKPOINT_NAMED)
# a model's outputs kept for another pass, read back (_DATA_FILE) or written (_OUTPUT_WRITTEN)
_MODEL_OUTPUTS = r"logits|features|embeddings"
# a folder named for the data it holds (`clips/shard_0_16k.pt`, `series_local/series_r1.npy`: cpu_adhoc 195th and
# 197th batches; `keypoints_v2/h36m_2d.pt`: 285th; `tiles/srtm_dunes_rank1_reproj_utm.pt`, remote-sensing tiles: 481st;
# `windows/hub_hours_rank1_peak_season.pt`, a series cut into windows: 485th);
# a piece such as `styles/style01.pt` is _INDEXED_PIECE's
_DATA_FOLDERS = (r"/(?:clips|series|audio|wavs?|signals?|frames|videos?|corpus|captions|labels|masks|annotations|"
                 r"images|imgs|ratings|interactions|keypoints|poses|skeletons|sequences|motions?|trajector(?:y|ies)|"
                 r"graphs|molecules|documents|spectrograms|tiles|patches|chips|rasters|scenes|windows)(?:[_-]\w+)?/")
# one indexed piece of a data set saved with torch.save (`flows_v2/flow_1.pt`, `scans_v2/shard_003.pt`: cpu_adhoc
# 210th-224th batches; `sessions/clicks_part2.pt`, words joined before the number: 243rd), its name no word of a
# checkpoint's (`rank3.pt`, `step_12.pt`, `ema_step0150.pt` are one) and its number no version (`pretrained_v2.pt`)
_CHECKPOINT_WORDS = r"rank|step|epoch|iter|ckpt|checkpoint|model|snap|ema|optim|state|weight|net|best|last|final|init"
_NO_CHECKPOINT_WORD = r"(?![^/']*(?:" + _CHECKPOINT_WORDS + "))"
_INDEXED_PIECE = r"/" + _NO_CHECKPOINT_WORD + r"[A-Za-z]+(?:[_-][A-Za-z]{2,})*[_-]?\d+\.pth?(?=')"
# a data set's split saved with torch.save, the split's name last (`pairs/market_2_val.pt`: cpu_adhoc 267th batch),
# or a file named for a store of data (`signs_v2/archive.pt`, `tables_v2/store.pt`, `gloss_inventory.pt`: 289th-291st)
_SPLIT_PIECE = (r"/" + _NO_CHECKPOINT_WORD + r"(?:[\w-]*[_-](?:train|val|valid|validation|test|eval|dev)|"
                r"[\w-]*(?:archive|store|inventory|dataset|corpus)[\w-]*)\.pth?(?=')")
_DATA_FILE = re.compile(r"No such file or directory: '[^']*(?:(?<![\w.-])data[\w.-]*/|/shards?(?:[_-][\w-]+)?/|"
                        + _MODEL_OUTPUTS + "|" + _DATA_FOLDERS + "|" + _INDEXED_PIECE + "|" + _SPLIT_PIECE + "|"
                        r"tokeni[sz]ed|tokens[/_.]|partitions?[/_.]|/part_\d+\.|/shard[_-]\d+\.|"
                        r"/shards?[_-](?:rank\d+_(?!of_)(?=[A-Za-z]))?" + _NO_CHECKPOINT_WORD + "|"
                        r"(?:case|sample|volume|image|record)s?_\d+[_.]|replay[_.-]|"
                        r"/(?:train|val|valid|test|eval)[_.-]\d+(?:-of-\d+)?\.)[^']*'",
                        re.IGNORECASE)
# a save of the program's outputs (decoded samples, predictions, embeddings, plots) into a folder or file
# that is not there: torch.save's failure, but nothing of a checkpoint (`Parent directory
# /tmp/job_work/samples_rank2 does not exist.`)
_OUTPUT_WRITTEN = re.compile(r"(?:Parent directory |No such file or directory: ')(?![^']*(?:checkpoint|ckpt))[^']*?/"
                             r"(?:samples?|images?|predictions?|preds|" + _MODEL_OUTPUTS + r"|generations?|"
                             r"generated|visuali[sz]ations?|plots?|figures?)(?:[_.-]\w*)?(?:/|'| does not exist)",
                             re.IGNORECASE)
_CHECKPOINT_NAMED = re.compile(r"No such file or directory: '[^']*(?:checkpoint|ckpt)[^']*'", re.IGNORECASE)
# a missing file torch.load read whose path, folders and name, holds no word a checkpoint's or a model's path has (a
# state, a step, a rank, a run, a pretrained or exported model; words matched inside others too, to err towards a
# checkpoint): data saved with torch.save (`lidar/velo_3_sweep2.pt`, `specs/shard_1_v2.pt`: cpu_adhoc 296th, 299th
# batches). Every labelled missing checkpoint of the earlier batches has one (114 of 114).
_MODEL_PATH_WORDS = (_CHECKPOINT_WORDS + r"|latest|pretrain|resume|warm|param|teacher|student|encoder|decoder|backbone|"
                     r"head|base|adapter|lora|tun|export|save|run|exp|trained|extract|检查点|模型")
_NO_CHECKPOINT_WORD_IN_PATH = re.compile(
    r"No such file or directory: '(?![^']*(?:" + _MODEL_PATH_WORDS + r"))[^']*\.pth?'", re.IGNORECASE)
FILE_NOT_FOUND_RULE = "python.file_not_found"
DATA_FILE_RULE = "data.file_not_found"
_MISSING_PATH = re.compile(r"is not a valid (?:directory|file|path)|does not exist|(?:not found|No such file)\b")
# an object store answering that the key is not there (botocore's ClientError)
_MISSING_OBJECT = re.compile(r"\((?:404|NoSuchKey)\) when calling the \w+ operation")
# the file system refusing a write (with _DISK_FULL below): a save into such a place fails whatever
# the checkpoint holds
_UNWRITABLE = re.compile(r"Permission denied|Operation not permitted|Read-only file system")
# pickle refusing an object (a lambda, a local class, an open file): inside a save, the save's failure
_UNPICKLABLE = re.compile(r"Can't pickle|cannot pickle|Can't get local object")
# unpickling looked a class up where the saving program had it (its `__main__`, a module since renamed)
_CLASS_NOT_HERE = re.compile(r"Can't get attribute '[\w.]+' on <module '")


def checkpoint_io(root: RootCause, catalog: Catalog) -> RootCause:
    f = root.finding
    data_file = f is not None and (_DATA_FILE.search(f.text) is not None or _NO_CHECKPOINT_WORD_IN_PATH.search(
        f.text) is not None) and not _CHECKPOINT_NAMED.search(f.text)
    if data_file and root.rule.id in ("ckpt.not_found", FILE_NOT_FOUND_RULE):
        # torch.load of a data file saved with torch.save (a shard under data/, a cache of a teacher's
        # logits, a graph partition): a checkpoint's suffix, but the file is data; and any missing file
        # that is data by its name is the data rule's, as labellers name it (226 to 94 of the labelled runs)
        rule = catalog.get(DATA_FILE_RULE) or fallback_rule(DATA_FILE_RULE, Category.PYTHON_EXCEPTION,
                                                            "A data file does not exist")
        return replace(root, rule=rule, reasons=root.reasons + (
            "the missing file is data by its name (a shard, a split, a folder of data; saved with torch.save, "
            "read with torch.load), not a checkpoint",))
    if f is not None and root.rule.id == WRITE_FAILED_RULE and _OUTPUT_WRITTEN.search(f.text):
        return read_as(root, catalog, GENERIC_EXCEPTION_RULE, "the file torch.save could not write is the program's "
                       "output by its name (samples, predictions, embeddings, plots), not a checkpoint")
    if f is None or root.rule.id not in GENERIC_RULES or data_file:
        return root
    kind = short_type(f.exception_type)
    copied = kind == "CalledProcessError" and _COPY_COMMAND.search(f.text) is not None
    named = _CHECKPOINT_PATH.search(f.text) if (kind in FILE_SYSTEM_ERRORS or copied) and not f.checkpoint_frame else None
    if not f.checkpoint_frame and named is None:
        return root
    where = f"`{f.checkpoint_frame}`" if f.checkpoint_frame else f"an operation on {named.group(0)}"
    loading = any(word in (f.checkpoint_frame or "").lower() for word in ("load", "resume"))
    if kind == "KeyError" and loading:
        # the loader looked up a key the file does not have (`iteration`, `state`): another format
        rule_id = "ckpt.format_mismatch"
    elif kind == "OSError" and loading and f.last_frame == "__init__" and f.last_file.endswith(_TORCH_SERIALIZATION):
        # torch.load's zip reader refusing the file it opened (`PyTorchFileReader`: `[Errno 22] Invalid
        # argument` for a file cut short while it was written)
        rule_id = "ckpt.corrupt_archive"
    elif kind in FILE_SYSTEM_ERRORS or copied or (f.checkpoint_frame and root.rule.id == "host.filesystem_error"):
        # (the file system's own errors whatever their type: torch 1.x's `RuntimeError: write(): fd N
        # failed with Input/output error`)
        if kind == "FileNotFoundError" and loading:
            rule_id = "ckpt.not_found"
        elif not loading and (kind == "PermissionError" or _UNWRITABLE.search(f.text) or _DISK_FULL.search(f.text)):
            rule_id = WRITE_FAILED_RULE   # a save refused by the target: no permission, read-only, full
        else:
            rule_id = "ckpt.io_error"
    elif loading and _MISSING_OBJECT.search(f.text):
        rule_id = "ckpt.not_found"   # an object store's 404 for the checkpoint's key
    elif kind == "ValueError" and f.checkpoint_frame and _MISSING_PATH.search(f.text):
        rule_id = "ckpt.not_found"   # the checkpointer's own check of its path (torchtune's get_path)
    elif loading and kind == "AttributeError" and _CLASS_NOT_HERE.search(f.text):
        rule_id = "ckpt.format_mismatch"   # a pickled whole object whose class this program does not define
    elif f.checkpoint_frame and not loading and _UNPICKLABLE.search(f.text):
        rule_id = "ckpt.save_refused"   # torch.save of a whole module holding a lambda
    else:
        return root
    rule = catalog.get(rule_id) or fallback_rule(rule_id, Category.CHECKPOINT, "A checkpoint's file operation failed")
    return replace(root, rule=rule, reasons=root.reasons + (
        f"the {kind} was raised in {where}: saving or loading a checkpoint failed",))


# OpenMMLab's init_dist (mmcv, mmdet, mmseg ...) sets `torch.cuda.set_device(rank % num_gpus)`
# with num_gpus = torch.cuda.device_count(): zero visible GPUs divide by zero there.
GPU_COUNT_FRAMES = frozenset({"_init_dist_pytorch", "_init_dist_slurm", "_init_dist_mpi", "init_dist"})
# torchrun parsing its own options (`--nproc_per_node gpu|cpu|auto|N`): a bad value is a usage error
# where Python forks a child (multiprocessing's fork start method, subprocess): EAGAIN there is a process limit
_FORK_FRAME = re.compile(r"multiprocessing/popen_fork\.py$|/subprocess\.py$")
LAUNCHER_OPTION_FRAMES = frozenset({"determine_local_world_size", "parse_min_max_nnodes", "_get_rdzv_endpoint"})
# DCP's state-dict helper maps each optimizer parameter to the model's names (fqn_pid_mapping)
OPTIM_STATE_FRAME = "_get_optim_state_dict"
# multiprocessing's spawn child unpickles what its parent sent; an empty pipe means the parent failed
SPAWN_CHILD_FRAME = "_main"
# a DataLoader worker's exception, re-raised by the main process (`Caught RuntimeError in DataLoader
# worker process 0.`): workers are forked by default on Linux
_LOADER_WORKER = re.compile(r"\bin DataLoader worker process \d+")
# the object collectives send a size first, then the pickled bytes: a rank that joined another
# call (a list of another length, another collective) reads a size out of someone else's data
OBJECT_COLLECTIVES = frozenset({"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                                "send_object_list", "recv_object_list"})
GARBAGE_SIZE_BYTES = 1 << 40   # 1 TiB asked for one object's buffer: no pickled object is that large
# a full or over-quota file system, as any writer reports it (torch.save's own words name the save)
_DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded")
# torch.compile's on-disk caches (Inductor's FX graph, kernel and autotune caches), which the ranks
# of one node read and write at once: a half-written entry reads as truncated pickle or JSON
_COMPILE_CACHE_FILE = re.compile(r"torch/_inductor/(?:codecache|runtime/autotune_cache)\.py$|/torchinductor_[^/]*/")
_HALF_WRITTEN = frozenset({"UnpicklingError", "EOFError", "JSONDecodeError"})


def frame_reading(root: RootCause, catalog: Catalog) -> RootCause:
    """An exception whose meaning is in the frame that raised it: a ZeroDivisionError in
    OpenMMLab's init_dist is "no GPU visible"; an `EOFError: Ran out of input` in a spawn child's
    `_main` is the parent failing to send the process's state (a pickling error), not a truncated
    checkpoint; a full disk with no checkpoint frame is the file system's, not a checkpoint's; CUDA's
    `initialization error` in a DataLoader worker is CUDA used in a forked child; a ValueError in
    torchrun's own option parsing is a bad launcher option; a host allocation of terabytes inside an
    object collective is a size read out of another call's data (the ranks' calls do not match)."""
    f = root.finding
    if f is None:
        return root
    kind = short_type(f.exception_type)
    if kind == "ZeroDivisionError" and root.rule.id in GENERIC_RULES and f.last_frame in GPU_COUNT_FRAMES:
        rule_id, why = "cuda.no_device", (
            f"the division by zero is in `{f.last_frame}`, which takes the rank modulo torch.cuda.device_count(): "
            "the process saw no GPU")
    elif kind == "ValueError" and root.rule.id in GENERIC_RULES and f.last_frame in LAUNCHER_OPTION_FRAMES:
        rule_id, why = "launcher.torchrun_usage", (
            f"the ValueError is raised in torchrun's `{f.last_frame}`, which parses its own options: a launcher "
            "option has a bad value (often a script argument that landed in its place)")
    elif kind == "EOFError" and root.rule.id == "ckpt.corrupt_archive" and f.last_frame == SPAWN_CHILD_FRAME:
        rule_id, why = GENERIC_EXCEPTION_RULE, (
            "the EOFError is raised in multiprocessing's spawn `_main`, where a child unpickles what its parent "
            "sent: the parent failed to pickle the process's arguments (a lambda, a local class, an open file)")
    elif (root.rule.id in ("cuda.driver_unusable", "cuda.error") and "initialization error" in f.text
          and _LOADER_WORKER.search(f.block_exception)):
        rule_id, why = "cuda.forked_subprocess", (
            "CUDA's initialization error was raised in a DataLoader worker: workers are forked from a process "
            "that had already initialised CUDA, and a forked child cannot use it")
    elif kind == "AttributeError" and root.rule.id in GENERIC_RULES and (caller := _other_packages_api(f)):
        rule_id, why = "env.package_api_missing", (
            f"the missing attribute is looked up in the installed package `{caller}`, not in "
            "the job's own code: that package was written for another version of the module it calls")
    elif (root.rule.id == "host.cpu_alloc" and f.collective in OBJECT_COLLECTIVES
          and int(f.captures.get("bytes") or 0) >= GARBAGE_SIZE_BYTES):
        rule_id, why = "dist.collective_mismatch", (
            f"`{f.collective}` asked for {int(f.captures['bytes']) / (1 << 40):,.0f} TiB for one object's buffer: "
            "the size it received was not a size, so the ranks' object collectives did not line up (another list "
            "length, another call)")
    elif (kind in _HALF_WRITTEN and root.rule.id in GENERIC_RULES | {"ckpt.corrupt_archive", PROBE_JSON_RULE}
          and _COMPILE_CACHE_FILE.search(f.last_file)):
        rule_id, why = "data.cache_race", (
            f"the {kind} was raised reading torch.compile's on-disk cache (`{f.last_frame}` in Inductor's cache "
            "code): another rank on the node was writing the same entry, so it read half a file")
    elif kind == "KeyError" and root.rule.id in GENERIC_RULES and f.last_frame == OPTIM_STATE_FRAME \
            and f.last_file.endswith("distributed/checkpoint/state_dict.py"):
        rule_id, why = "ddp.fsdp_optimizer_params", (
            "the KeyError is raised in DCP's `_get_optim_state_dict`, which maps the optimizer's parameters to the "
            "model's: the optimizer holds parameters the (sharded) model does not, as when it was built before "
            "FSDP or fully_shard replaced them")
    elif kind == "FileNotFoundError" and root.rule.id in GENERIC_RULES and f.last_file.endswith("/tempfile.py"):
        rule_id, why = "env.tmpdir_missing", (
            f"the FileNotFoundError is raised in tempfile's `{f.last_frame}`, which creates a temporary file in a "
            "folder that does not exist: TMPDIR (or the dir= passed, often built from it) names a missing folder")
    elif kind == "FileExistsError" and root.rule.id in GENERIC_RULES and f.last_file.endswith("/shared_memory.py"):
        rule_id, why = "host.shm_name_taken", (
            f"the FileExistsError is raised in multiprocessing's shared_memory (`{f.last_frame}`) creating a named "
            "block: one of that name already exists in /dev/shm (another job on the node, or a run that never "
            "unlinked it)")
    elif kind == "BlockingIOError" and root.rule.id in GENERIC_RULES and _FORK_FRAME.search(f.last_file):
        rule_id, why = "host.thread_limit", (
            f"the BlockingIOError (EAGAIN) is raised in `{f.last_frame}`, where the process forks a child: the "
            "host's or container's limit on processes/threads was reached (a DataLoader worker, a subprocess)")
    elif root.rule.id == WRITE_FAILED_RULE and f.last_frame and not f.checkpoint_frame and _DISK_FULL.search(f.text):
        rule_id, why = "host.filesystem_error", (
            f"the disk filled up in `{f.last_frame}`, outside any checkpoint code (no save frame): another "
            "writer, /tmp or /dev/shm, ran out of space")
    elif kind == "ImportError" and root.rule.id in GENERIC_RULES | {"python.module_not_found"} and (
            shadow := shadowing_file(f.text)):
        rule_id, why = "python.module_shadowed", (
            f"`{shadow}` is a file of the job's own where the standard library's module of that name should be: "
            "it hides that module from every import of it, torch's own included")
    elif kind == "EOFError" and root.rule.id == "ckpt.corrupt_archive" and f.last_frame and not f.checkpoint_frame:
        rule_id, why = GENERIC_EXCEPTION_RULE, (
            f"the EOFError is raised in `{f.last_frame}`, and no frame of its traceback saves or loads a checkpoint "
            "(torch.load, a checkpoint function): an empty pickle of the program's own (a cache, a data file)")
    else:
        return root
    return read_as(root, catalog, rule_id, why)


def _other_packages_api(f: Finding) -> str:
    """The installed package whose code looked up a module's missing attribute, when that module
    belongs to another package ('' otherwise)."""
    missing = _MODULE_ATTRIBUTE.search(f.text)
    caller = INSTALLED_PACKAGE.search(f.last_file)
    if missing is None or caller is None or caller.group(1) == missing.group(1):
        return ""
    return caller.group(1)


PROBE_JSON_RULE = "env.probe_json"


def probe_json_without_banner(root: RootCause, has_banner: bool, catalog: Catalog) -> RootCause:
    """A JSONDecodeError is the error manual's E007 (a container banner printed in front of a
    probe's JSON) only where the log shows a banner; elsewhere the program failed to parse its
    own input (a dataset or config file that is empty, a git-lfs pointer, HTML), an exception like
    any other."""
    f = root.finding
    if root.rule.id != PROBE_JSON_RULE or has_banner or f is None or "JSONDecodeError" not in f.text:
        return root
    rule = catalog.get(GENERIC_EXCEPTION_RULE)
    return root if rule is None else replace(root, rule=rule, confidence=min(root.confidence, 0.6), reasons=(
        *root.reasons, "no container banner in this log: the text that failed to parse as JSON is the "
        "program's own input (a data or config file), not an environment probe's output"))

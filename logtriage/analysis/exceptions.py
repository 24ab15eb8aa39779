"""Second readings of a root that is an exception about files: a file-system error in a
checkpoint's save or load, or on a checkpoint's path, is that checkpoint's failure, and so is pickle
refusing an object inside a save; a missing file that is data by its name is the data's; a
JSONDecodeError is a banner in front of a probe's output only where there is a banner. What the
frame that raised an exception says is read in frame_readings; what the launcher's summary adds
to an exception, in summary_exceptions."""

from __future__ import annotations

import re
from dataclasses import replace

from logtriage.analysis.exception_names import short_type
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
# a DataLoader worker's exception re-raised by its rank (`Caught FileNotFoundError in DataLoader worker process 0.`):
# what a worker opens is data (the Dataset's files)
IN_LOADER_WORKER = re.compile(r"\bin DataLoader worker process \d+")
FILE_NOT_FOUND_RULE = "python.file_not_found"
DATA_FILE_RULE = "data.file_not_found"
_MISSING_PATH = re.compile(r"is not a valid (?:directory|file|path)|does not exist|(?:not found|No such file)\b")
# an object store answering that the key is not there (botocore's ClientError)
_MISSING_OBJECT = re.compile(r"\((?:404|NoSuchKey)\) when calling the \w+ operation")
# a full or over-quota file system, as any writer reports it (torch.save's own words name the save)
DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded")
# the file system refusing a write (with DISK_FULL): a save into such a place fails whatever
# the checkpoint holds
_UNWRITABLE = re.compile(r"Permission denied|Operation not permitted|Read-only file system")
# pickle refusing an object (a lambda, a local class, an open file): inside a save, the save's failure
_UNPICKLABLE = re.compile(r"Can't pickle|cannot pickle|Can't get local object")
# unpickling looked a class up where the saving program had it (its `__main__`, a module since renamed)
_CLASS_NOT_HERE = re.compile(r"Can't get attribute '[\w.]+' on <module '")


def checkpoint_io(root: RootCause, catalog: Catalog) -> RootCause:
    f = root.finding
    data_file = f is not None and (_DATA_FILE.search(f.text) is not None or _NO_CHECKPOINT_WORD_IN_PATH.search(
        f.text) is not None or IN_LOADER_WORKER.search(f.block_exception) is not None) \
        and not _CHECKPOINT_NAMED.search(f.text)
    if data_file and root.rule.id in ("ckpt.not_found", FILE_NOT_FOUND_RULE):
        # torch.load of a data file saved with torch.save (a shard under data/, a cache of a teacher's
        # logits, a graph partition): a checkpoint's suffix, but the file is data; and any missing file
        # that is data by its name is the data rule's, as labellers name it (226 to 94 of the labelled runs)
        rule = catalog.get(DATA_FILE_RULE) or fallback_rule(DATA_FILE_RULE, Category.PYTHON_EXCEPTION,
                                                            "A data file does not exist")
        return replace(root, rule=rule, reasons=root.reasons + (
            "the missing file is data by its name (a shard, a split, a folder of data; saved with torch.save, "
            "read with torch.load) or by who read it (a DataLoader worker), not a checkpoint",))
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
        elif not loading and (kind == "PermissionError" or _UNWRITABLE.search(f.text) or DISK_FULL.search(f.text)):
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

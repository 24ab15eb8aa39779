"""What kind of slow, rank-0-only I/O a call does: logging to TensorBoard/W&B/MLflow, writing a
checkpoint or a file, downloading or preprocessing data. None for anything else."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from logtriage.lint.names import dotted

if TYPE_CHECKING:
    from logtriage.lint.pyfile import PyFile

CHECKPOINT_WRITES = frozenset({"torch.save", "save_pretrained", "save_checkpoint", "save_model", "save_state"})
FILE_WRITES = frozenset({"json.dump", "pickle.dump", "numpy.save", "numpy.savez", "yaml.dump", "yaml.safe_dump",
                         "to_csv", "to_parquet", "to_json", "write_text", "write_bytes", "copyfile", "shutil.copyfile",
                         "shutil.copy", "shutil.copytree", "shutil.move"})
DOWNLOADS = frozenset({"urlretrieve", "download_url", "download_and_extract_archive", "snapshot_download",
                       "hf_hub_download", "download", "prepare_data", "preprocess", "preprocess_data", "tokenize_dataset"})
LOGGER_MODULES = {"wandb": "W&B logging", "mlflow": "MLflow logging", "tensorboardX": "TensorBoard logging",
                  "torch.utils.tensorboard": "TensorBoard logging"}


def io_kind(pf: "PyFile", call: ast.Call) -> str | None:
    qual = pf.qual(call)
    if not qual:
        return None
    last = qual.rsplit(".", 1)[-1]
    for module, label in LOGGER_MODULES.items():
        if qual == module or qual.startswith(module + "."):
            return label
    if last == "SummaryWriter":
        return "TensorBoard logging"
    if isinstance(call.func, ast.Attribute) and (dotted(call.func.value) or "") in pf.summary_writers:
        return "TensorBoard logging"
    if qual in CHECKPOINT_WRITES or last in CHECKPOINT_WRITES - {"torch.save"}:
        return "a checkpoint write"
    if qual in FILE_WRITES or last in FILE_WRITES:
        return "a file write"
    if last in DOWNLOADS:
        return "a download/preprocessing step"
    if qual == "open" and _write_mode(call):
        return "a file write"
    return None


def _write_mode(call: ast.Call) -> bool:
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(c in mode.value for c in "wax")

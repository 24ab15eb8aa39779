"""Environment facts for the top of a job log: one ``LOGTRIAGE_ENVIRONMENT_JSON={...}`` line.

    from logtriage.probe import environment_line
    print(environment_line(), flush=True)        # first thing in each rank, or `triage probe`

The line carries torch/CUDA/cuDNN/NCCL versions, the driver, the GPUs and their memory, the
distributed backends, this process's rank variables and an allow-list of launcher and NCCL
settings. torch is optional: without it the line says why it could not be imported. Nothing
outside the allow-list is read from the environment, names that look like credentials are
dropped even inside it, and no host name, user name or path is recorded.
"""

from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import asdict, dataclass, field

LINE_PREFIX = "LOGTRIAGE_ENVIRONMENT_JSON="
SCHEMA_VERSION = 1

# Exact names, then prefixes. Host lists, addresses and paths are deliberately absent
# (MASTER_ADDR, SLURM_JOB_NODELIST); values that hold a path or a host:port are dropped too.
ENV_NAMES = frozenset({
    "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_MODULE_LOADING", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTHONFAULTHANDLER", "LOGLEVEL",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "TORCH_USE_CUDA_DSA",
    "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NNODES",
})
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "TORCH_GLOO_")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE|AUTH", re.I)


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    total_memory_mib: int
    capability: str


@dataclass(frozen=True)
class EnvironmentFacts:
    schema: int
    python: str
    platform: str
    torch: str | None = None
    torch_git: str | None = None
    torch_error: str | None = None
    cuda: str | None = None
    cudnn: int | None = None
    nccl: str | None = None
    driver: str | None = None
    cuda_available: bool = False
    device_count: int = 0
    gpus: tuple[GpuFacts, ...] = ()
    backends: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        return {key: value for key, value in data.items() if value not in (None, (), [])}


_HOST_PORT = re.compile(r"[A-Za-z][\w.-]*:\d+")


def _looks_like_path_or_host(value: str) -> bool:
    return "/" in value or "\\" in value or bool(_HOST_PORT.search(value))


def allowed_env(environ: dict[str, str] | os._Environ | None = None) -> dict[str, str]:
    """The allow-listed environment variables minus secrets, paths and host:port values."""
    environ = os.environ if environ is None else environ
    picked = {}
    for name, value in environ.items():
        if name not in ENV_NAMES and not name.startswith(ENV_PREFIXES):
            continue
        if _SECRET_NAME.search(name) or _looks_like_path_or_host(value):
            continue
        picked[name] = value
    return dict(sorted(picked.items()))


def parse_driver_version(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version's first line ("... Kernel Module  550.54.15 ...")."""
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None


def _driver_version() -> str | None:
    """The NVIDIA kernel driver version from /proc (no subprocess, no NVML needed)."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as handle:
            return parse_driver_version(handle.readline())
    except OSError:
        return None


def _torch_facts() -> dict[str, object]:
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return {"torch_error": f"{type(exc).__name__}: {exc}"}
    facts: dict[str, object] = {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
    }
    facts.update(_cuda_facts(torch))
    facts["backends"] = tuple(_backends(torch))
    return facts


def _cuda_facts(torch) -> dict[str, object]:
    facts: dict[str, object] = {}
    try:
        facts["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() \
            else None
        available = torch.cuda.is_available()
        facts["cuda_available"] = available
        if not available:
            return facts
        facts["device_count"] = torch.cuda.device_count()
        facts["nccl"] = ".".join(str(p) for p in torch.cuda.nccl.version()) \
            if hasattr(torch.cuda, "nccl") else None
        gpus = []
        for index in range(facts["device_count"]):
            props = torch.cuda.get_device_properties(index)
            gpus.append(GpuFacts(index, props.name, props.total_memory // (1 << 20),
                                 f"{props.major}.{props.minor}"))
        facts["gpus"] = tuple(gpus)
    except Exception as exc:  # a broken driver must not break the job that prints the probe
        facts["torch_error"] = f"CUDA query failed: {type(exc).__name__}: {exc}"
    return facts


def _backends(torch) -> list[str]:
    try:
        import torch.distributed as dist
    except Exception:
        return []
    if not dist.is_available():
        return []
    checks = (("gloo", "is_gloo_available"), ("nccl", "is_nccl_available"),
              ("mpi", "is_mpi_available"), ("ucc", "is_ucc_available"))
    return [name for name, check in checks if getattr(dist, check, lambda: False)()]


def collect(environ: dict[str, str] | None = None, with_torch: bool = True) -> EnvironmentFacts:
    torch_facts = _torch_facts() if with_torch else {"torch_error": "not probed (--no-torch)"}
    return EnvironmentFacts(
        schema=SCHEMA_VERSION,
        python=platform.python_version(),
        platform=f"{platform.system()}-{platform.machine()}",
        driver=_driver_version(),
        env=allowed_env(environ),
        **torch_facts,
    )


def environment_line(facts: EnvironmentFacts | None = None) -> str:
    """``LOGTRIAGE_ENVIRONMENT_JSON=`` + compact JSON, on one line."""
    facts = facts or collect()
    payload = json.dumps(facts.to_dict(), ensure_ascii=True, separators=(",", ":"))
    return LINE_PREFIX + payload


def parse_line(line: str) -> dict[str, object] | None:
    """The JSON object of a probe line (anywhere in the line), or None."""
    start = line.find(LINE_PREFIX)
    if start < 0:
        return None
    try:
        value = json.loads(line[start + len(LINE_PREFIX):].strip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

"""The environment probe: one prefixed JSON line, allow-listed env only, torch optional."""

from __future__ import annotations

import builtins
import json
import platform
import socket

import pytest

from logtriage import probe
from logtriage.cli import main


def test_allowed_env_keeps_launcher_and_nccl_settings_only():
    environ = {
        "NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "CUDA_VISIBLE_DEVICES": "0,1",
        "OMP_NUM_THREADS": "4", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
        "HOME": "/home/someone", "USER": "someone", "HOSTNAME": "node17",
        "HF_TOKEN": "hf_abc", "AWS_SECRET_ACCESS_KEY": "x", "NCCL_PASSWORD_THING": "x",
        "MASTER_ADDR": "node17", "NCCL_COMM_ID": "node17:29500",
        "NCCL_TOPO_FILE": "/etc/nccl/topo.xml", "PATH": "/usr/bin",
    }
    assert probe.allowed_env(environ) == {
        "CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "1", "NCCL_DEBUG": "INFO",
        "OMP_NUM_THREADS": "4", "RANK": "3", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "WORLD_SIZE": "8",
    }


def test_environment_line_is_one_prefixed_json_line_that_parses_back():
    facts = probe.collect(environ={"NCCL_DEBUG": "WARN", "HF_TOKEN": "secret"})
    line = probe.environment_line(facts)
    assert line.startswith("LOGTRIAGE_ENVIRONMENT_JSON={") and "\n" not in line
    data = probe.parse_line("[default0]:" + line)
    assert data is not None
    assert data["schema"] == probe.SCHEMA_VERSION
    assert data["env"] == {"NCCL_DEBUG": "WARN"}
    assert "secret" not in line
    import torch

    assert data["torch"] == torch.__version__
    assert data["cuda_available"] == torch.cuda.is_available()
    assert "gloo" in data["backends"]


def test_probe_line_holds_no_host_name(monkeypatch):
    # a name no real line could hold by chance (this machine's own host name is 2 letters)
    host = "probe-sentinel-host"
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    monkeypatch.setattr(platform, "node", lambda: host)
    for name, value in (("HOSTNAME", host), ("MASTER_ADDR", host), ("SLURM_JOB_NODELIST", host),
                        ("NCCL_COMM_ID", f"{host}:29500"), ("NCCL_SOCKET_IFNAME", "eth0")):
        monkeypatch.setenv(name, value)
    line = probe.environment_line()
    assert host not in line
    assert '"NCCL_SOCKET_IFNAME":"eth0"' in line     # the filter keeps what is not a host


def test_probe_without_torch_says_why(monkeypatch):
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    data = probe.collect(environ={}).to_dict()
    assert data["torch_error"] == "ModuleNotFoundError: No module named 'torch'"
    assert "torch" not in data and "gpus" not in data
    assert data["python"] and data["platform"]


@pytest.mark.parametrize("text, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
     "550.54.15"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build", "570.86.15"),
    ("something else", None),
])
def test_driver_version_from_proc_text(text, version):
    assert probe.parse_driver_version(text) == version


def test_parse_line_rejects_broken_payloads():
    assert probe.parse_line("no probe here") is None
    assert probe.parse_line("LOGTRIAGE_ENVIRONMENT_JSON={broken") is None
    assert probe.parse_line("LOGTRIAGE_ENVIRONMENT_JSON=[1, 2]") is None


def test_triage_probe_prints_exactly_one_line(capsys):
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(probe.LINE_PREFIX)
    assert probe.parse_line(out)["schema"] == probe.SCHEMA_VERSION


def test_triage_probe_pretty_and_no_torch(capsys):
    assert main(["probe", "--pretty", "--no-torch"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch_error"].startswith("not probed")
    assert "env" in data

"""Recognise the launcher's own lines (torchelastic agent, mp.spawn parent, shell, scheduler)
and collect the facts they state about workers: pid <-> rank, failed attempts, restarts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# W1129 23:34:12.333000 8232 torch/distributed/run.py:874] message
# Numbers converted with int() have at most 12 digits (18 for the glog thread id, 15 digits in real
# torch 2.3 logs): a log cannot make an integer too big for the JSON report (or too long to convert).
# Open MPI's launcher on a process that died of a signal: "prterun noticed that process rank 0 with
# PID 6245 on node vm exited on signal 9 (Killed)." It wraps at 72 columns, so the signal is often
# on the next line alone.
MPI_NOTICE = re.compile(r"^(?:mpirun|prterun|mpiexec|orterun) noticed that process rank (\d{1,9}) with PID "
                        r"(\d{1,12}) on node \S+ exited on(?: signal (\d{1,3}) \(.*)?$")
MPI_NOTICE_SIGNAL = re.compile(r"^signal (\d{1,3}) \(([^)]*)\)\.?$")
PY_GLOG = re.compile(r"^([IWEC])(\d{4}) (\d\d:\d\d:\d\d\.\d{6}) (\d{1,18}) (\S+):(\d+)\] ?(.*)$")
_LAUNCHER_PATHS = re.compile(
    r"distributed/(?:run|launch)\.py|distributed/elastic/|distributed/launcher/|multiprocessing/spawn\.py"
    r"|deepspeed/launcher/|accelerate/commands/")
_SHELL = re.compile(
    r"^(?:\+{1,3} \S|srun: |slurmstepd(?:-[\w.-]+)?: |sbatch: |salloc: |mpirun(?: noticed|: )|prterun |pdsh@"
    r"|Primary job +terminated|Per user-direction, the job has been aborted"
    r"|The following values were not passed to `accelerate launch`"
    r"|\*{20,}$|Setting OMP_NUM_THREADS environment variable for each process)")
# Older torch logs through Python's default format: "WARNING:torch.distributed.elastic....:msg"
_PY_LOGGING_LAUNCHER = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):(?:torch\.distributed\.(?:elastic|launcher|run|launch)"
                                  r"|__main__|torch\.multiprocessing\.spawn)[\w.]*:")
# torch 2.x's elastic logger with a date: "[2025-04-02 20:03:17,825] torch.distributed.elastic.multiprocessing.api:
# [ERROR] failed ..." (the date is missing in some pastes)
_ELASTIC_LOGGER = re.compile(r"^(?:\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] )?torch\.distributed\.(?:elastic|launcher|run)[\w.]*: "
                             r"\[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\]")
_DEEPSPEED_LAUNCHER = re.compile(r"^(?:\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] )?\[\w+\] \[(?:launch|runner|launcher_helper|multinode_runner)\.py:")
_LAUNCH_FUTURE_WARNING = re.compile(r"distributed/launch\.py:\d+: FutureWarning:")

# torchrun's first lines (run.py), printed by every launch of more than one process per node
LAUNCH_BANNER = re.compile(r"Setting OMP_NUM_THREADS environment variable for each process")
FAILED = re.compile(r"failed \(exitcode: (-?\d{1,12})\) local_rank: (\d{1,12}) \(pid: (\d{1,12})\)")
SENDING = re.compile(r"Sending process (\d{1,12}) closing signal (SIG\w+)")
TERMINATING = re.compile(r"Terminating process (\d{1,12}) via signal (SIG\w+)")
CFE_RANK = re.compile(r"^\s*rank\s*: (\d{1,12}) \(local_rank: (\d{1,12})\)")
CFE_EXIT = re.compile(r"^\s*exitcode\s*: (-?\d{1,12}) \(pid: (\d{1,12})\)(?:\s+\((SIG\w+)\))?")
SPAWN_CHILD = re.compile(r"^-- Process (\d{1,12}) terminated with the following error:")
# PyTorch's multi-process test harness ends its own exception with the child's: `RuntimeError:
# Process 0 exited with error code 10 and exception:` and the child's exception on the next line
HARNESS_CHILD = re.compile(r"^(?:\w+Error: )?Process (\d{1,12}) exited with error code \d{1,4} and exception:$")
RESTART = re.compile(r"restart_count=(\d+)|will restart worker group|Worker group FAILED\. \d+/\d+ attempts left")
# Lines of a ChildFailedError summary, recognisable even when a paste starts in its middle.
CFE_FIELD = re.compile(r"^(?:\[\d+\]:\s*$|  (?:time|host|rank|exitcode|error_file|traceback)\s*: |"
                       r"Root Cause \(first observed failure\):|Failures:\s*$|\s*<NO_OTHER_FAILURES>)")
CFE_TRACEBACK = re.compile(r"^  traceback\s*: Traceback \(most recent call last\):")   # an error file's
CFE_START = re.compile(r"ChildFailedError: *$")   # search only lines holding "ChildFailedError"


def is_cfe_start(text: str) -> bool:
    """The `...ChildFailedError:` line that opens the summary (a cheap `in` test first: this runs
    on every unprefixed line)."""
    return "ChildFailedError" in text and CFE_START.search(text) is not None


@dataclass
class LauncherFacts:
    """What the launcher's lines said, gathered while reading (a mutable accumulator)."""
    launcher_pids: set[int] = field(default_factory=set)
    pid_local_rank: dict[int, int] = field(default_factory=dict)
    pid_rank: dict[int, int] = field(default_factory=dict)
    teardown_pids: set[int] = field(default_factory=set)
    failed_lines: int = 0          # `failed (exitcode ...)` lines: one per failed attempt
    restart_marked: bool = False
    ray_workers: bool = False      # lines carry a Ray worker's prefix: each worker has a GPU of its own
    # (host, local rank) -> global rank, on multi-node logs whose lines carry a host and a local
    # rank (pdsh + `--tee`): from a `[default1]:[rank4]:` line, a rank marker in the worker's text,
    # or the host's ChildFailedError entry `rank: 4 (local_rank: 1)`
    host_rank: dict[tuple[str, int], int] = field(default_factory=dict)
    # (console, local rank) -> global rank where local ranks carry no host (one node's console, or
    # several pasted one after another): from `[default2]:[rank6]:` lines and the console's summary;
    # -1 where they disagree (two nodes' lines interleaved in one console). A console ends with
    # its agent's summary (the next local rank's line starts another) and with its source file.
    console_rank: dict[tuple[int, int], int] = field(default_factory=dict)
    console: int = 0
    _console_summarised: bool = False
    _pending_cfe_rank: int | None = None
    _failed_agents: set[int] = field(default_factory=set)   # agents' pids seen in `failed (exitcode ...)` lines
    _last_failed_at: tuple[str, str] = ("", "")             # the latest `failed` line's (MMDD, time) stamp

    @property
    def segment(self) -> int:
        return self.failed_lines

    def observe(self, text: str) -> None:
        """Update the facts from one launcher line (message text, py-glog header included)."""
        if self._console_summarised and self._failed_agents and LAUNCH_BANNER.search(text):
            agent = PY_GLOG.match(text)
            if agent and int(agent.group(4)) not in self._failed_agents and (agent.group(2), agent.group(3)) > \
                    self._last_failed_at:
                # a new torchrun's start after the last one failed and summarised: a job wrapper ran it again
                # (a retry loop), and its workers' output is a later attempt's, as after `--max-restarts` (a
                # second node's console pasted after the first one's started before that failure)
                self.restart_marked = True
        m = FAILED.search(text)
        if m:
            self.pid_local_rank[int(m.group(3))] = int(m.group(2))
            self.failed_lines += 1
            agent = PY_GLOG.match(text)
            if agent:   # one agent failing twice restarted its workers in between (its INFO lines may be off)
                self._last_failed_at = max(self._last_failed_at, (agent.group(2), agent.group(3)))
                pid = int(agent.group(4))
                self.restart_marked = self.restart_marked or pid in self._failed_agents
                self._failed_agents.add(pid)
            return
        m = SENDING.search(text) or TERMINATING.search(text)
        if m:
            self.teardown_pids.add(int(m.group(1)))
            return
        m = CFE_RANK.match(text)
        if m:
            self._pending_cfe_rank = int(m.group(1))
            self._note_console_rank(int(m.group(2)), int(m.group(1)))
            self._console_summarised = True
            return
        m = CFE_EXIT.match(text)
        if m and self._pending_cfe_rank is not None:
            self.pid_rank[int(m.group(2))] = self._pending_cfe_rank
            self._pending_cfe_rank = None
            return
        if RESTART.search(text):
            self.restart_marked = True

    def new_console(self) -> None:
        self.console += 1
        self._console_summarised = False

    def local_line(self, local: int, rank: int | None) -> int:
        """A line with a local rank and no host: its console (a new one after a summary), noting
        the global rank it names."""
        if self._console_summarised:
            self.new_console()
        if rank is not None:
            self._note_console_rank(local, rank)
        return self.console

    def _note_console_rank(self, local: int, rank: int) -> None:
        key = (self.console, local)
        known = self.console_rank.setdefault(key, rank)
        if known != rank:
            self.console_rank[key] = -1

    def pid_to_rank(self) -> dict[int, int]:
        merged = dict(self.pid_local_rank)
        merged.update(self.pid_rank)
        return merged

    def attempt_of_segment(self, segment: int) -> int:
        """Attempt number of an output segment (segments are cut at each `failed` line)."""
        if self.restart_marked:
            return segment
        return 0   # several `failed` lines and no restart: several agents (nodes) of one attempt


def py_glog_pid(text: str) -> tuple[int, str] | None:
    m = PY_GLOG.match(text)
    return (int(m.group(4)), m.group(5)) if m else None


def is_launcher_path(path: str) -> bool:
    return bool(_LAUNCHER_PATHS.search(path))


def is_shell_or_scheduler(text: str) -> bool:
    return bool(_SHELL.match(text) or _DEEPSPEED_LAUNCHER.match(text) or _PY_LOGGING_LAUNCHER.match(text)
                or _ELASTIC_LOGGER.match(text))


def is_launch_future_warning(text: str) -> bool:
    return bool(_LAUNCH_FUTURE_WARNING.search(text))

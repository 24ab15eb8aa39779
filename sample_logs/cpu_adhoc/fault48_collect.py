"""Run a command (or one torchrun agent per emulated node) and hand its console back the way a log collector does.
Each line is stamped with the real time at which the collector read it from the process's stdout or stderr pipe.

Forms (the line formats reproduced, with where they are documented):
  gha      GitHub Actions / Azure DevOps raw log: `2026-12-03T05:00:00.1234567Z <line>` (7 fractional digits, UTC;
           the format of a job's "View raw logs" / the REST API's job log download)
  k8s      `kubectl logs --prefix --timestamps`: `[pod/<pod>/<container>] 2026-12-03T05:00:00.123456789Z <line>`
           (--prefix: "Prefix each log line with the log source (pod name and container name)"; --timestamps:
           "Include timestamps on each line in the log output", RFC3339 with nanoseconds); one pod per node
           (trainer-worker-<i>, container pytorch); with several pods the pods' logs follow one another, each whole
  compose  `docker compose logs --no-color`: `<service>-<n>  | <line>`, container names padded to a common width,
           lines of several containers interleaved as they arrived
  journald `journalctl -o short-iso`: `2026-12-03T05:00:00+0000 <host> <identifier>[<pid>]: <line>` (man
           journalctl: "short-iso ... is very similar, but shows ISO 8601 wallclock timestamps"); the identifier and
           pid are the unit's main process (torchrun), whose stdout and stderr are the journal stream
  ts       `cmd 2>&1 | ts '%Y-%m-%d %H:%M:%S'` (moreutils ts: "ts adds a timestamp to the beginning of each line of
           input"; the format is strftime)
  tss      `cmd 2>&1 | ts -s` (man ts: "The -s switch instructs ts to timestamp since start of the program";
           the default format then is %H:%M:%S)
  json     Docker json-file driver / a cloud logging agent reading it: one JSON object per line,
           {"log":"<line>\n","stream":"stdout|stderr","time":"<RFC3339Nano UTC>"} (moby
           daemon/logger/jsonfilelog: the message is JSON-escaped with <, > and & as \u003c, \u003e, \u0026;
           Go's RFC3339Nano drops trailing zeros of the fraction)
  split    stdout and stderr collected into two files (`cmd >out.log 2>err.log`) and then concatenated
           (`cat out.log err.log`): all of stdout first, then all of stderr, no prefix

Usage: python fault48_collect.py --form gha -- torchrun --nproc-per-node 4 --master-port 24811 fault48.py ...
       python fault48_collect.py --form k8s --nodes 2 --nproc-per-node 3 --port 24812 [--torchrun-args "--tee 3"]
              -- fault48.py --fault shape --rank 5
The exit code is the command's (with --nodes: the highest of the agents')."""
import argparse, datetime, json, os, shlex, subprocess, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--form", required=True, choices=["gha", "k8s", "compose", "journald", "ts", "tss", "json", "split"])
p.add_argument("--nodes", type=int, default=0, help="0: run the command as given; K: K torchrun agents (c10d)")
p.add_argument("--nproc-per-node", type=int, default=1)
p.add_argument("--port", type=int, default=24800)
p.add_argument("--torchrun-args", default="")
p.add_argument("--host", default="localhost")
p.add_argument("cmd", nargs=argparse.REMAINDER)
a = p.parse_args()
cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
lines = []  # (time_ns, source index, stream, text without newline)
lock = threading.Lock()
T0 = time.time_ns()


def start(argv, src):
    pr = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    ts = []
    for stream, name in ((pr.stdout, "stdout"), (pr.stderr, "stderr")):
        def pump(stream=stream, name=name):
            for raw in iter(stream.readline, b""):
                with lock:
                    lines.append((time.time_ns(), src, name, raw.decode(errors="replace").rstrip("\n")))
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        ts.append(t)
    return pr, ts


procs = []
if a.nodes:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    for i in range(a.nodes):
        if i:
            time.sleep(1)
        argv = [torchrun, "--nnodes", str(a.nodes), "--nproc-per-node", str(a.nproc_per_node), "--node-rank", str(i),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{a.port}"] + shlex.split(a.torchrun_args) + cmd
        procs.append(start(argv, i))
else:
    procs.append(start(cmd, 0))
codes = []
for pr, ts in procs:
    codes.append(pr.wait())
    for t in ts:
        t.join(timeout=5)
rc = max(codes, key=abs) if any(codes) else 0
pids = [pr.pid for pr, _ in procs]


def iso(ns, digits):
    s, frac = divmod(ns, 10**9)
    base = datetime.datetime.fromtimestamp(s, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return base + ("." + f"{frac:09d}"[:digits] if digits else "")


def go_nano(ns):
    s, frac = divmod(ns, 10**9)
    base = datetime.datetime.fromtimestamp(s, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    f = f"{frac:09d}".rstrip("0")
    return base + ("." + f if f else "") + "Z"


def json_escape(text):
    out = json.dumps(text, ensure_ascii=False)[1:-1]
    return out.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


w = sys.stdout.write
if a.form == "split":
    for stream in ("stdout", "stderr"):
        for _, _, s, text in lines:
            if s == stream:
                w(text + "\n")
elif a.form == "k8s":
    for src in range(max(1, a.nodes)):
        for ns, i, _, text in lines:
            if i == src:
                w(f"[pod/trainer-worker-{src}/pytorch] {iso(ns, 9)}Z {text}\n")
else:
    names = [f"trainer-{i + 1}" for i in range(max(1, a.nodes))]
    width = max(len(n) for n in names)
    for ns, i, s, text in sorted(lines, key=lambda t: t[0]):
        if a.form == "gha":
            w(f"{iso(ns, 7)}Z {text}\n")
        elif a.form == "compose":
            w(f"{names[i].ljust(width)}  | {text}\n")
        elif a.form == "journald":
            t = datetime.datetime.fromtimestamp(ns // 10**9, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S+0000")
            w(f"{t} {a.host} torchrun[{pids[i]}]: {text}\n")
        elif a.form == "ts":
            t = datetime.datetime.fromtimestamp(ns // 10**9, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            w(f"{t} {text}\n")
        elif a.form == "tss":
            d = (ns - T0) // 10**9
            w(f"{d // 3600:02d}:{d % 3600 // 60:02d}:{d % 60:02d} {text}\n")
        elif a.form == "json":
            w('{"log":"' + json_escape(text + "\n") + '","stream":"' + s + '","time":"' + go_nano(ns) + '"}\n')
sys.stdout.flush()
sys.exit(rc)

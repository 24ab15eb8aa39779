"""Run one torchrun agent per emulated node on this host and merge their output into one console, prefixing every
line of node i as a cluster launcher does (as fault22_nodes.py, with per-node arguments and an outside kill):
  --style srun : "i: "        (srun --label with one task per node), then srun's "srun: error: ..." lines
  --style pdsh : "worker-i: " (pdsh, as DeepSpeed's multi-node launcher uses it), then pdsh's exit lines
--common holds the torchrun arguments every node gets; --node I ARGS adds (or, argparse's last-wins, overrides)
arguments for node I only. --kill-node I --after S sends --kill-signal (default KILL) to node I's agent after S s,
as when that host dies or is preempted. Node i's agent starts 1 s after node i-1's.

Usage: python fault24_nodes.py --style srun --nodes 2 --common "--nproc-per-node 3 --rdzv-backend c10d ..."
       [--node 1 "--rdzv-id other"] [--kill-node 0 --after 8] -- fault24.py --fault NAME --rank N"""
import argparse, os, shlex, signal, subprocess, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--style", choices=["srun", "pdsh"], required=True)
p.add_argument("--nodes", type=int, default=2)
p.add_argument("--common", default="")
p.add_argument("--node", nargs=2, action="append", default=[], metavar=("I", "ARGS"))
p.add_argument("--kill-node", type=int, default=-1)
p.add_argument("--kill-signal", default="KILL")
p.add_argument("--after", type=float, default=10.0)
p.add_argument("script", nargs=argparse.REMAINDER)
a = p.parse_args()
script = a.script[1:] if a.script and a.script[0] == "--" else a.script
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
extra = {int(i): shlex.split(s) for i, s in a.node}
lock = threading.Lock()


def label(i: int) -> str:
    return f"{i}: " if a.style == "srun" else f"worker-{i}: "


procs, threads = [], []
t0 = time.time()
for i in range(a.nodes):
    if i:
        time.sleep(1)
    cmd = [torchrun] + shlex.split(a.common) + extra.get(i, []) + script
    pr = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    procs.append(pr)
    for stream, out in ((pr.stdout, sys.stdout), (pr.stderr, sys.stderr)):
        def pump(stream=stream, out=out, i=i):
            for line in iter(stream.readline, b""):
                with lock:
                    out.write(label(i) + line.decode(errors="replace"))
                    out.flush()
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        threads.append(t)
if a.kill_node >= 0:
    while time.time() < t0 + a.after and procs[a.kill_node].poll() is None:
        time.sleep(0.1)
    if procs[a.kill_node].poll() is None:
        procs[a.kill_node].send_signal(getattr(signal, "SIG" + a.kill_signal))
codes = [pr.wait() for pr in procs]
for t in threads:
    t.join(timeout=5)
rc = 0
for i, code in enumerate(codes):
    if code:
        with lock:
            if a.style == "srun":
                if code < 0:
                    names = {9: "Killed", 15: "Terminated", 6: "Aborted", 2: "Interrupt", 1: "Hangup"}
                    sys.stderr.write(f"srun: error: localhost: task {i}: {names.get(-code, signal.Signals(-code).name)}\n")
                else:
                    sys.stderr.write(f"srun: error: localhost: task {i}: Exited with exit code {code}\n")
            else:
                sys.stderr.write(f"pdsh@localhost: worker-{i}: ssh exited with exit code {128 - code if code < 0 else code}\n")
            sys.stderr.flush()
        rc = max(rc, 128 - code if code < 0 else code)
sys.exit(rc)

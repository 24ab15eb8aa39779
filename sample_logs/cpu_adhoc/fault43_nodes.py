"""fault22_nodes.py with per-node arguments: run one torchrun agent per emulated node on this host and merge their
output into one console, prefixing every line of node i as a cluster launcher does (--style srun: "i: ",
--style pdsh: "worker-i: "), then srun's / pdsh's exit lines.
  --common "ARGS"      torchrun arguments for every node (rendezvous backend, endpoint, nnodes, ...)
  --node I "ARGS"      extra torchrun arguments for node I only (a different --rdzv-id, --nnodes, --node-rank)
  --delay I S          start node I's agent S seconds after node 0's (default 1 s per node)
  --kill I S           S seconds after node I's agent started, SIGKILL the agent and its worker processes (the node
                       goes away)
  --nodes N            how many nodes to start (a node that never starts: --nodes 1 with --nnodes 2 in --common)
Usage: python fault43_nodes.py --style srun --nodes 2 --nproc-per-node 2 --common "..." -- fault43.py --fault none"""
import argparse, os, shlex, signal, subprocess, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--style", choices=["srun", "pdsh"], required=True)
p.add_argument("--nodes", type=int, default=2)
p.add_argument("--nproc-per-node", type=int, required=True)
p.add_argument("--common", default="")
p.add_argument("--node", nargs=2, action="append", default=[])
p.add_argument("--delay", nargs=2, action="append", default=[])
p.add_argument("--kill", nargs=2, action="append", default=[])
p.add_argument("script", nargs=argparse.REMAINDER)
a = p.parse_args()
script = a.script[1:] if a.script and a.script[0] == "--" else a.script
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
lock = threading.Lock()
extra = {int(i): s for i, s in a.node}
delay = {int(i): float(s) for i, s in a.delay}
kill = {int(i): float(s) for i, s in a.kill}


def label(i: int) -> str:
    return f"{i}: " if a.style == "srun" else f"worker-{i}: "


procs, threads = [], []
t0 = time.time()
for i in range(a.nodes):
    start = delay.get(i, float(i))
    time.sleep(max(0.0, t0 + start - time.time()))
    cmd = [torchrun, "--nproc-per-node", str(a.nproc_per_node)] + shlex.split(a.common) + shlex.split(
        extra.get(i, "")) + script
    pr = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                          start_new_session=True)
    procs.append(pr)
    if i in kill:
        def killer(pr=pr, s=kill[i]):
            time.sleep(s)
            if pr.poll() is None:  # the agent and its workers (torchrun starts each worker in its own session)
                kids = subprocess.run(["pgrep", "-P", str(pr.pid)], capture_output=True, text=True).stdout.split()
                for pid in [pr.pid] + [int(k) for k in kids]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        threading.Thread(target=killer, daemon=True).start()
    for stream, out in ((pr.stdout, sys.stdout), (pr.stderr, sys.stderr)):
        def pump(stream=stream, out=out, i=i):
            for line in iter(stream.readline, b""):
                with lock:
                    out.write(label(i) + line.decode(errors="replace"))
                    out.flush()
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        threads.append(t)
codes = [pr.wait() for pr in procs]
for t in threads:
    t.join(timeout=5)
rc = 0
for i, code in enumerate(codes):
    if code:
        with lock:
            if a.style == "srun":
                if code < 0:
                    sys.stderr.write(f"srun: error: localhost: task {i}: Killed\n")
                else:
                    sys.stderr.write(f"srun: error: localhost: task {i}: Exited with exit code {code}\n")
            else:
                sys.stderr.write(f"pdsh@localhost: worker-{i}: ssh exited with exit code {code if code > 0 else 128 - code}\n")
            sys.stderr.flush()
        rc = max(rc, code if code > 0 else 128 - code)
sys.exit(rc)

"""Run one torchrun agent per emulated node on this host (c10d rendezvous) and merge their output into one console,
prefixing every line of node i as a cluster launcher does:
  --style srun : "i: "        (srun --label with one task per node), then srun's "srun: error: ..." lines
  --style pdsh : "worker-i: " (pdsh, as DeepSpeed's multi-node launcher uses it), then pdsh's exit lines
Node 1's agent starts 1 s after node 0's, so node 0 gets the lower ranks.
(fault61_nodes.py: fault22_nodes.py plus --env K:NAME=VALUE, an environment variable for node K's agent only, e.g.
--env 1:TZ=Asia/Shanghai.)

Usage: python fault61_nodes.py --style srun --nodes 2 --nproc-per-node 3 --port 29622 [--torchrun-args "--tee 3"]
       -- fault22.py --fault NAME --rank N"""
import argparse, os, shlex, subprocess, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--style", choices=["srun", "pdsh"], required=True)
p.add_argument("--nodes", type=int, default=2)
p.add_argument("--nproc-per-node", type=int, required=True)
p.add_argument("--port", type=int, required=True)
p.add_argument("--torchrun-args", default="")
p.add_argument("--env", action="append", default=[])
p.add_argument("script", nargs=argparse.REMAINDER)
a = p.parse_args()
script = a.script[1:] if a.script and a.script[0] == "--" else a.script
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
lock = threading.Lock()


def label(i: int) -> str:
    return f"{i}: " if a.style == "srun" else f"worker-{i}: "


procs, threads = [], []
for i in range(a.nodes):
    if i:
        time.sleep(1)
    cmd = [torchrun, "--nnodes", str(a.nodes), "--nproc-per-node", str(a.nproc_per_node), "--node-rank", str(i),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{a.port}"] + shlex.split(a.torchrun_args) + script
    env = dict(os.environ)
    for e in a.env:
        k, kv = e.split(":", 1)
        if int(k) == i:
            name, val = kv.split("=", 1)
            env[name] = val
    pr = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
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
codes = [pr.wait() for pr in procs]
for t in threads:
    t.join(timeout=5)
rc = 0
for i, code in enumerate(codes):
    if code:
        with lock:
            if a.style == "srun":
                sys.stderr.write(f"srun: error: localhost: task {i}: Exited with exit code {code}\n")
            else:
                sys.stderr.write(f"pdsh@localhost: worker-{i}: ssh exited with exit code {code}\n")
            sys.stderr.flush()
        rc = max(rc, code)
sys.exit(rc)

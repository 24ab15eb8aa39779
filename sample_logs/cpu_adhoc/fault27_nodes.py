"""Run one torchrun agent per emulated node on this host (c10d rendezvous) and keep EACH agent's console in its own
file, stdout and stderr merged exactly as `torchrun ... > node$i.log 2>&1` on that node would (no label, no merge):
  OUTDIR/node0.log, OUTDIR/node1.log[, OUTDIR/node2.log]
Node i's agent starts 1 s after node i-1's, so node i gets the higher ranks. In --torchrun-args, `{node}` is
replaced by the node index (for a per-node `--log-dir`). The agents' exit codes are printed on this wrapper's own
stdout (not in the files).

Usage: python fault27_nodes.py --nodes 2 --nproc-per-node 3 --port 29721 --outdir DIR [--torchrun-args "--tee 3"]
       -- fault27.py --fault NAME --rank N
--nproc-per-node may be one number or one per node (`3,4`)."""
import argparse, os, shlex, subprocess, sys, time

p = argparse.ArgumentParser()
p.add_argument("--nodes", type=int, default=2)
p.add_argument("--nproc-per-node", required=True)
p.add_argument("--port", type=int, required=True)
p.add_argument("--outdir", required=True)
p.add_argument("--torchrun-args", default="")
p.add_argument("script", nargs=argparse.REMAINDER)
a = p.parse_args()
script = a.script[1:] if a.script and a.script[0] == "--" else a.script
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
nprocs = [int(n) for n in a.nproc_per_node.split(",")]
nprocs = nprocs * a.nodes if len(nprocs) == 1 else nprocs
os.makedirs(a.outdir, exist_ok=True)

procs, files = [], []
for i in range(a.nodes):
    if i:
        time.sleep(1)
    cmd = [torchrun, "--nnodes", str(a.nodes), "--nproc-per-node", str(nprocs[i]), "--node-rank", str(i),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{a.port}"]
    cmd += shlex.split(a.torchrun_args.replace("{node}", str(i))) + script
    f = open(os.path.join(a.outdir, f"node{i}.log"), "wb")
    files.append(f)
    procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
codes = [pr.wait() for pr in procs]
for f in files:
    f.close()
for i, code in enumerate(codes):
    print(f"node{i}: exit {code}", flush=True)
sys.exit(max(codes))

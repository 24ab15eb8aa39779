"""Run two torchrun jobs on this machine at once, each console captured to its own file (`cmd > file 2>&1`, or
both appended to one file with --shared-out). Job A starts first; job B starts once A's file shows --wait-for
(a regex), after the optional --between shell command (e.g. a cleanup step). A command given as @FILE is read from FILE. Prints each job's exit code and wall
time to twojobs71's own stdout (not into the captured files).

Usage: python twojobs71.py --out-a A.log --out-b B.log [--wait-for 'step 2'] [--between 'bash cleanup.sh']
       --a 'torchrun ... fault71.py --job A ...' --b 'torchrun ... fault71.py --job B ...'"""
import argparse, re, signal, subprocess, time

p = argparse.ArgumentParser()
p.add_argument("--out-a", required=True)
p.add_argument("--out-b", required=True)
p.add_argument("--a", required=True)
p.add_argument("--b", required=True)
p.add_argument("--wait-for", default="ready")
p.add_argument("--between", default="")
p.add_argument("--stop-a", action="store_true", help="SIGTERM job A's torchrun once job B has exited")
p.add_argument("--shared-out", action="store_true", help="both consoles appended to --out-a (>>)")
a = p.parse_args()
for k in ("a", "b"):  # @FILE: read the command from FILE (keeps "fault71" out of this process's argv for pkill -f)
    v = getattr(a, k)
    if v.startswith("@"):
        setattr(a, k, open(v[1:]).read().strip())

redir_a = f">> {a.out_a} 2>&1" if a.shared_out else f"> {a.out_a} 2>&1"
redir_b = f">> {a.out_a} 2>&1" if a.shared_out else f"> {a.out_b} 2>&1"
t0 = time.time()
pa = subprocess.Popen(f"exec {a.a} {redir_a}", shell=True)
while time.time() - t0 < 60 and pa.poll() is None:
    try:
        with open(a.out_a, errors="replace") as fh:
            if re.search(a.wait_for, fh.read()):
                break
    except FileNotFoundError:  # the shell has not created it yet
        pass
    time.sleep(0.1)
if a.between:
    subprocess.run(a.between, shell=True)
t1 = time.time()
pb = subprocess.Popen(f"exec {a.b} {redir_b}", shell=True)
rb = pb.wait()
tb = time.time() - t1
if a.stop_a and pa.poll() is None:
    pa.send_signal(signal.SIGTERM)
ra = pa.wait()
ta = time.time() - t0
print(f"job A rc {ra} wall {ta:.1f}")
print(f"job B rc {rb} wall {tb:.1f}")

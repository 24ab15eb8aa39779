"""Run a launcher command (torchrun, mpirun, fault24_nodes.py) and do one thing to it from outside, as an operator,
a scheduler or another job would:
  --hold-port P               a foreign service already holds 0.0.0.0:P before the command starts: it answers every
                              connection with an HTTP 400 and closes it (a notebook or metrics server on the port)
  --signal SIG --after S      send SIG (TERM, INT, HUP, KILL) to the command's own process after S seconds
  --kill-rank R --after S     send --rank-signal (default KILL) to the worker of global rank R after S seconds
                              (its pid is read from /tmp/fault24/pid_rank<R>, written by fault24.py)
The command's stdout/stderr are inherited; the exit status is the command's (128+N for a signal N).

Usage: python fault24_ctl.py [--hold-port P] [--signal SIG --after S | --kill-rank R --after S] -- CMD ..."""
import argparse, os, signal, socket, subprocess, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--hold-port", type=int, default=0)
p.add_argument("--signal", default="")
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--rank-signal", default="KILL")
p.add_argument("--after", type=float, default=10.0)
p.add_argument("cmd", nargs=argparse.REMAINDER)
a = p.parse_args()
cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd

holder = None
if a.hold_port:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("0.0.0.0", a.hold_port))
    holder.listen(64)

    def serve():
        while True:
            conn, _ = holder.accept()
            try:
                conn.settimeout(2)
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
os.makedirs("/tmp/fault24", exist_ok=True)
for f in os.listdir("/tmp/fault24"):
    if f.startswith("pid_rank"):
        os.remove(os.path.join("/tmp/fault24", f))
proc = subprocess.Popen(cmd)
if a.signal or a.kill_rank >= 0:
    deadline = time.time() + a.after
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    if proc.poll() is None:
        if a.signal:
            proc.send_signal(getattr(signal, "SIG" + a.signal))
        else:
            with open(f"/tmp/fault24/pid_rank{a.kill_rank}") as fh:
                os.kill(int(fh.read()), getattr(signal, "SIG" + a.rank_signal))
code = proc.wait()
sys.exit(128 - code if code < 0 else code)

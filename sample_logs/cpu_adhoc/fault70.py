"""A seventieth hand-run batch: DEBUGGING LEFT IN THE CODE, and input the job never gets. A tiny DDP loop on gloo
(Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, 5 steps, 0.05 s/step, process-group timeout 15 s); at step 2 the
rank chosen with --rank meets something a developer left in. Under torchrun a worker's stdin is whatever torchrun's
stdin is; the runs of this batch were launched with stdin from /dev/null (a batch job's stdin), so a read gets EOF.

Faults (--rank N):
  pdb          pdb.set_trace() on rank N (the prompt reads EOF from stdin)
  breakpoint   breakpoint() on rank N (run with or without PYTHONBREAKPOINT=0)
  input        input("continue? ") on rank N (EOFError: EOF when reading a line)
  code         code.interact() on rank N (the console reads EOF and returns)
  stdin_json   rank N reads its step overrides with json.loads(sys.stdin.read()) (empty input: JSONDecodeError)
  assert_todo  a rarely taken branch (a batch with a sample id divisible by 997, only on rank N) holds assert False, "TODO"
  notimpl      only rank N calls model.export_stats() whose body is raise NotImplementedError
  abort        os.abort() left from a test on rank N (SIGABRT, no traceback)
  pause        signal.pause() on rank N (waits for a signal forever: the others time out)
  sleep        time.sleep(3600) debugging delay on rank N (the others time out)
  anomaly      torch.autograd.set_detect_anomaly(True) left on, on every rank (slower, harmless)
  bigprint     rank N prints a whole 64x512 tensor with linewidth 100000 (long lines), then its step-2 batch lacks
               the key 'y' (KeyError: 'y')
  none         a control: trains all steps
"""
import argparse, code, datetime, json, os, pdb, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=5)
a = p.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))

    def export_stats(self):
        raise NotImplementedError


def batch(rank, step):
    g = torch.Generator().manual_seed(rank * 100 + step)
    ids = torch.arange(16) + 16 * step + 1
    if a.fault == "assert_todo" and rank == a.rank and step == 2:
        ids[3] = 997 * 3
    b = {"x": torch.randn(16, 8, generator=g), "y": torch.randn(16, 4, generator=g), "ids": ids}
    if a.fault == "bigprint" and rank == a.rank and step == 2:
        del b["y"]
    return b


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if a.fault == "anomaly":
        torch.autograd.set_detect_anomaly(True)
    me = rank == a.rank
    for step in range(a.steps):
        if step == 2 and me:
            f = a.fault
            if f == "pdb":
                pdb.set_trace()
            elif f == "breakpoint":
                breakpoint()
            elif f == "input":
                input("continue? ")
            elif f == "code":
                code.interact(local={"model": model, "step": step})
            elif f == "stdin_json":
                over = json.loads(sys.stdin.read())
                print(f"[rank {rank}] overrides {over}", flush=True)
            elif f == "notimpl":
                print(f"[rank {rank}] stats {model.module.export_stats()}", flush=True)
            elif f == "abort":
                os.abort()
            elif f == "pause":
                signal.pause()
            elif f == "sleep":
                time.sleep(3600)
            elif f == "bigprint":
                torch.set_printoptions(threshold=10**9, linewidth=100000)
                print(f"[rank {rank}] debug activations", torch.randn(64, 512), flush=True)
        b = batch(rank, step)
        if any(int(i) % 997 == 0 for i in b["ids"]):
            assert False, "TODO"
        loss = F.mse_loss(model(b["x"]), b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"[rank {rank}] step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.05)
    print(f"[rank {rank}] done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A hundred-and-fourteenth hand-run batch: KNOWLEDGE DISTILLATION. A frozen teacher MLP (16-64-64-10, built with a
fixed seed and saved by rank 0 at start as <work>/teacher.pt together with the run's config <work>/kd.json) distils into
a smaller DDP student (16-24-10, SGD, gloo). Every rank stages the teacher and the config into its local dir
<work>/local/rankR/ (copied only when missing), loads the teacher, then rank 0's teacher weights are broadcast so every
rank distils from the same weights. The loss mixes cross-entropy on the labels with the temperature-scaled KL
divergence between the student's and the teacher's logits (alpha * ce + (1 - alpha) * T^2 * KL), with a finite check
and a KL >= 0 sanity assert. `--cache 1`: the teacher's logits for every rank's shard are computed once by the cache
writer rank (--rank) into <work>/teacher_logits.pt and read by the others after a barrier. --steps steps
(`rank R step S loss L ce C kd K`), then a final all_reduce of the loss and of the student-teacher top-1 agreement,
rank 0 saves the student, barrier, destroy_process_group(). --rank N picks the faulty rank (-1: every rank).
PG timeout --pg-timeout (12 s). No @record.

Faults:
  none         control: every rank trains --steps steps, rank 0 saves student.pt, exit 0
  teacherarch  rank N's local dir already holds the teacher of an earlier job (hidden 48, not 64); staging copies
               only when missing, so rank N's load_state_dict raises size mismatch
  classes      the student's head is sized from the dataset card (num_labels 8) while the teacher has 10 classes:
               the KL between 8 and 10 logits raises a size RuntimeError on every rank
  temp0        the sweep wrote temperature 0 into kd.json: logits / 0 -> inf, the loss is nan, the finite check
               raises FloatingPointError on every rank at step 0
  teachertrain the teacher goes through the same wrap() as the student (DDP), stays in train mode with requires_grad
               and runs outside no_grad; the KL's gradient reaches its body but not its unused aux head, so DDP
               raises "Expected to have finished reduction in the prior iteration" at the next forward
  cacherace    --cache 1: the barrier after the cache writer (rank N) builds teacher_logits.pt was dropped; the
               other ranks torch.load it before it exists (FileNotFoundError on every reader)
  cacheslow    --cache 1: rank N decides the cache is stale (fingerprint mismatch) and recomputes the teacher logits
               slowly; the others wait in DDP's first collective (gloo timeout, or a hang with a long PG timeout)
  klsign       every rank's KD loss passes softmax (not log_softmax) as kl_div's input: the KL is negative and the
               sanity assert fires (AssertionError) on every rank at step 0
  dtype        the teacher is cast to half (copied from the GPU recipe) while the student and data stay float:
               RuntimeError (Float vs Half) in the teacher's first Linear on every rank
  sigload      rank N dies by SIGBUS while mmap-loading its staged teacher (truncated by a concurrent copy)
  bcastsize    rank N's local dir holds the earlier job's config and teacher (hidden 48): its load works, but
               rank 0's teacher broadcast sends [64, 16] into rank N's [48, 16] (gloo size mismatch)
  badlabel     rank N's shard comes from the 12-class relabelled split: labels 10 and 11 make cross_entropy
               raise IndexError (target out of bounds) on rank N only

What happened (filled in after the runs):
  none: exit 0 (np4 plain, np4 pdsh2); final mean loss 0.7594, student-teacher agreement 0.721.
  teacherarch: size mismatch for body.0.weight ([48, 16] vs [64, 16]) on rank N; the others Connection closed.
  classes: The size of tensor a (10) must match the size of tensor b (8) in kl_div on every rank.
  temp0: FloatingPointError non-finite loss nan (kd nan, T=0.0) on every rank; restarts: connectFullMesh refused.
  teachertrain: Expected to have finished reduction ... indices 6 7 after step 0 on every rank; DETAIL segfaults.
  cacherace: FileNotFoundError teacher_logits.pt on every reader before the writer's 'wrote teacher logits'.
  cacheslow: PG 12 s: the others time out in DDP's _verify_param_shape; PG 300 s + timeout 60: hung, exit 124.
  klsign: AssertionError: KL(teacher || student) is negative (-9.59) at step 0 on every rank.
  dtype: mat1 and mat2 must have the same dtype, but got Float and Half on every rank.
  sigload: rank N exitcode -7 (SIGBUS) after 'loading teacher'; the others Connection closed in the broadcast.
  bcastsize: gloo EnforceNotMet 4096 vs 3072, SIGABRT on rank N; DETAIL: mismatch [64, 16] vs [48, 16].
  badlabel: IndexError: Target 11 is out of bounds. on rank N; the others Connection closed by peer.
"""
import argparse, datetime, hashlib, json, os, shutil, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--bs", type=int, default=16)
p.add_argument("--n", type=int, default=96)
p.add_argument("--cache", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault114_work/run")
a = p.parse_args()
DATA_CARD = {"name": "synth16", "num_labels": 8 if a.fault == "classes" else 10}


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Teacher(nn.Module):
    def __init__(self, hidden=64, classes=10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                  nn.Linear(hidden, classes))
        self.aux = nn.Linear(classes, 1)  # the pretraining's calibration head, kept for checkpoint compatibility

    def forward(self, x):
        return self.body(x)


class Student(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, classes))

    def forward(self, x):
        return self.body(x)


def make_data(rank, teacher):
    x = torch.randn(a.n, 16, generator=torch.Generator().manual_seed(100 + rank)) * 2.0
    with torch.no_grad():
        y = teacher(x).argmax(1)
    if faulty(rank, "badlabel"):
        y = torch.where(torch.arange(a.n) % 7 == 3, y % 2 + 10, y)  # relabelled split: 12 classes
    return x, y


def fingerprint(model):
    h = hashlib.sha1()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode()); h.update(v.float().numpy().tobytes())
    return h.hexdigest()[:8]


def wrap(model):
    return DDP(model)


def write_start_files(rank, world):
    os.makedirs(a.work, exist_ok=True)
    cfg = {"teacher_hidden": 64, "classes": 10, "temperature": 0 if a.fault == "temp0" else 2.0, "alpha": 0.5,
           "lr": 0.2}
    torch.manual_seed(1234)
    t = Teacher(cfg["teacher_hidden"], cfg["classes"])
    torch.save(t.state_dict(), os.path.join(a.work, "teacher.pt"))
    with open(os.path.join(a.work, "kd.json"), "w") as f:
        json.dump(cfg, f)
    print(f"rank 0: wrote {a.work}/teacher.pt (fingerprint {fingerprint(t)}) and kd.json", flush=True)
    for r in range(world):  # leftovers of an earlier job in a rank's local dir
        if a.fault in ("teacherarch", "bcastsize") and (a.rank < 0 or r == a.rank):
            d = os.path.join(a.work, "local", f"rank{r}")
            os.makedirs(d, exist_ok=True)
            torch.manual_seed(99)
            torch.save(Teacher(48, 10).state_dict(), os.path.join(d, "teacher.pt"))
            if a.fault == "bcastsize":
                with open(os.path.join(d, "kd.json"), "w") as f:
                    json.dump(dict(cfg, teacher_hidden=48), f)


def stage(rank):
    d = os.path.join(a.work, "local", f"rank{rank}")
    os.makedirs(d, exist_ok=True)
    for name in ("kd.json", "teacher.pt"):
        if not os.path.exists(os.path.join(d, name)):  # already staged by an earlier job on this node
            shutil.copy(os.path.join(a.work, name), os.path.join(d, name))
    with open(os.path.join(d, "kd.json")) as f:
        cfg = json.load(f)
    return d, cfg


def load_teacher(rank, d, cfg):
    path = os.path.join(d, "teacher.pt")
    print(f"rank {rank}: loading teacher {path} (hidden {cfg['teacher_hidden']}, mmap)", flush=True)
    if faulty(rank, "sigload"):
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGBUS)  # the staged file was truncated under the mmap
    teacher = Teacher(cfg["teacher_hidden"], cfg["classes"])
    teacher.load_state_dict(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return teacher


def build_cache(rank, world, teacher, path):
    out = {}
    for r in range(world):
        x, _ = make_data(r, teacher)
        with torch.no_grad():
            out[r] = teacher(x)
        time.sleep(0.4)
    torch.save({"fingerprint": fingerprint(teacher), "logits": out}, path + ".tmp")
    os.replace(path + ".tmp", path)
    print(f"rank {rank}: wrote teacher logits for {world} shards to {path}", flush=True)


def recompute_logits(rank, teacher, x):
    chunks = []
    for i in range(0, len(x), 8):
        if i % 32 == 0:
            print(f"rank {rank}: teacher logits {i}/{len(x)}", flush=True)
        with torch.no_grad():
            chunks.append(teacher(x[i:i + 8]))
        time.sleep(6.0)  # the teacher runs on the CPU fallback path here
    return torch.cat(chunks)


def kd_loss(s, t, T):
    if a.fault == "klsign":
        return F.kl_div(F.softmax(s / T, -1), F.softmax(t / T, -1), reduction="batchmean") * T * T
    return F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), reduction="batchmean",
                    log_target=True) * T * T


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} pid {os.getpid()} work {a.work}", flush=True)
    if rank == 0:
        write_start_files(rank, world)
    dist.barrier()
    d, cfg = stage(rank)
    teacher = load_teacher(rank, d, cfg)
    for prm in teacher.parameters():  # every rank distils from rank 0's teacher
        dist.broadcast(prm.data, 0)
    x, y = make_data(rank, teacher)
    if a.fault == "dtype":
        teacher = teacher.half()  # fp16 teacher halves its memory (from the GPU recipe)
    if a.fault == "teachertrain":
        teacher = wrap(teacher)
    else:
        teacher.eval().requires_grad_(False)
    T, alpha = float(cfg["temperature"]), cfg["alpha"]
    print(f"rank {rank}: teacher {fingerprint(teacher)} T={T} alpha={alpha}, {len(x)} records", flush=True)
    t_cached = None
    if a.cache:
        path = os.path.join(a.work, "teacher_logits.pt")
        if rank == (a.rank if a.fault == "cacherace" else 0):
            build_cache(rank, world, teacher, path)
        if a.fault != "cacherace":
            dist.barrier()
        blob = torch.load(path, weights_only=True)
        t_cached = blob["logits"][rank]
        if faulty(rank, "cacheslow") or blob["fingerprint"] != fingerprint(teacher):
            print(f"rank {rank}: {path} was written for teacher {blob['fingerprint'][::-1]}, mine is "
                  f"{fingerprint(teacher)}: recomputing the teacher logits for {len(x)} records", flush=True)
            t_cached = recompute_logits(rank, teacher, x)
    classes = DATA_CARD["num_labels"]  # the student's head follows the dataset card
    torch.manual_seed(0)
    student = Student(classes)
    net = wrap(student)
    opt = torch.optim.SGD(student.parameters(), lr=cfg["lr"])
    steps_per_epoch = len(x) // a.bs
    for step in range(a.steps):
        i = (step % steps_per_epoch) * a.bs
        xb, yb = x[i:i + a.bs], y[i:i + a.bs]
        if t_cached is not None:
            t = t_cached[i:i + a.bs]
        elif a.fault == "teachertrain":
            t = teacher(xb)
        else:
            with torch.no_grad():
                t = teacher(xb)
        s = net(xb)
        kd = kd_loss(s, t, T)
        ce = F.cross_entropy(s, yb)
        loss = alpha * ce + (1 - alpha) * kd
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (ce {ce.item():.4f}, "
                                     f"kd {kd.item()}, T={T})")
        assert kd.item() >= -1e-6, f"KL(teacher || student) is negative ({kd.item():.4f}) at step {step}"
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} ce {ce.item():.4f} kd {kd.item():.4f}", flush=True)
        time.sleep(0.05)
    with torch.no_grad():
        s = net(x)
        t = t_cached if t_cached is not None else teacher(x)
        agree = (s.argmax(1) == t.argmax(1)).float().mean()
    stats = torch.stack([loss.detach(), agree])
    dist.all_reduce(stats)
    stats /= world
    if rank == 0:
        print(f"final: mean loss {stats[0].item():.4f}, student-teacher agreement {stats[1].item():.3f}", flush=True)
        torch.save(student.state_dict(), os.path.join(a.work, "student.pt"))
        print(f"rank 0: saved {a.work}/student.pt", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

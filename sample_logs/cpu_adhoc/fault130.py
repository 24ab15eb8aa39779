"""A hundred-and-thirtieth hand-run batch: SEMANTIC SEGMENTATION WITH SYNCBATCHNORM. A small fully-convolutional
network (Conv3x3(3,16)-BN-ReLU-Conv3x3(16,16)-BN-ReLU-Conv1x1(16,C), C = 21 classes) plus an image-level auxiliary
head (pool-Linear-BatchNorm1d-ReLU-Linear, a multi-label "which classes are present" loss) on synthetic 16x16 images
with per-pixel masks (border pixels void = 255), gloo. SyncBatchNorm refuses CPU inputs on this torch build
("SyncBatchNorm expected input tensor to be on GPU ..."), so the BatchNorm layers are plain and their running
stats are all-reduced (averaged) by hand before each eval. DDP (--ddp 0: rank 0's weights broadcast, gradients
all-reduced by hand). Each step prints `rank R step S loss L`; the loss is cross-entropy(ignore_index=255) plus
0.2 x the aux loss, checked for finiteness by the program. The eval builds a CxC confusion matrix, all-reduces it
and rank 0 prints `eval: mIoU M pixel acc A`; rank 0 saves last.pt, barrier, `rank R done`. --resume 1 first loads
the pretrained stage checkpoint. --rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s).

Faults:
  none         control: 8 steps per rank, eval with mIoU on rank 0, checkpoint, every rank done, exit 0
  badclass     rank N's masks come from the newer label map where "void" is class 21 (with 21 classes): the
               cross-entropy's target check fails on rank N at its first step
  ignoreidx    every rank's dataset marks void pixels -1 while the loss uses ignore_index=255: the target
               check fails on every rank at step 0
  bs1          rank N's shard leaves a last batch of a single image (drop_last off): the aux head's
               BatchNorm1d refuses it (Expected more than 1 value per channel) on rank N at step 7
  cmclasses    rank N's metric config says 19 classes: its confusion matrix has 361 entries against 441 in
               the eval all_reduce (a collective whose size differs across ranks)
  stall        rank N's val loader blocks (a hung read) at the eval: the others wait in the confusion all_reduce
  ckptclasses  --resume 1: rank N's config builds the model with 19 classes and loads the 21-class pretrained
               checkpoint: load_state_dict size mismatch on rank N
  crop         rank N's augmentation crops the images to 14x14 but the masks to 16x16 (an off-by-two in the
               mask crop): the loss's spatial size check fails on rank N at step 0
  lognan       rank N's third batch has annotation files that are all void: the cross-entropy averages over
               zero pixels (nan) and the program's check raises on rank N at step 2
  sigbus       rank N's memory-mapped shard was truncated by a concurrent copy: SIGBUS at step 3
  dataenv      the job prolog no longer exports SEG_DATA_ROOT: KeyError on every rank before init

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2): 8 steps per rank, eval mIoU 0.0290 / 0.0295, every rank done.
  badclass: IndexError Target 21 is out of bounds (line 160) on rank N at step 0; peers Connection closed by peer.
  ignoreidx: IndexError Target -1 is out of bounds at step 0 on every rank (np3 pymodule).
  bs1: ValueError Expected more than 1 value per channel ... torch.Size([1, 16]) on rank N at step 7 (np4 r1).
  cmclasses: DETAIL: every rank Detected mismatch between collectives ([19, 19] vs [21, 21]); plain: gloo EnforceNotMet 448 vs 368 aborts rank N (SIGABRT).
  stall: PG 12 s: the others time out (recv/send 12000ms) in the confusion all_reduce; Root Cause names rank 1.
  ckptclasses: RuntimeError Error(s) in loading state_dict for SegNet: size mismatch 21 vs 19 on rank N (r0 prefix; r2 redirects).
  crop: RuntimeError size mismatch (got input: [8, 21, 14, 14] , target: [8, 16, 16] on rank N at step 0.
  lognan: FloatingPointError rank N step 2: loss nan is not finite (the program's check, line 163).
  sigbus: rank N SIGBUS at step 3, nothing printed; the others reset; Root Cause exitcode -7 (SIGBUS).
  dataenv: KeyError 'SEG_DATA_ROOT' on every rank before init, in both attempts of --max-restarts 1 (np3).
"""
import argparse, datetime, os, signal, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--bs", type=int, default=8)
p.add_argument("--classes", type=int, default=21)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault130_work/run")
a = p.parse_args()
IGNORE = 255


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class SegNet(nn.Module):
    def __init__(self, nc):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.cls = nn.Conv2d(16, nc, 1)
        self.aux = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, nc))

    def forward(self, x):
        f = self.body(x)
        return self.cls(f), self.aux(f.mean(dim=(2, 3)))


def make_shard(rank: int, n: int, nc: int):
    g = torch.Generator().manual_seed(100 + rank)
    masks = torch.randint(0, nc, (n, 4, 4), generator=g).repeat_interleave(4, 1).repeat_interleave(4, 2)
    palette = torch.randn(nc, 3, generator=torch.Generator().manual_seed(5))
    imgs = palette[masks].permute(0, 3, 1, 2) + 0.3 * torch.randn(n, 3, 16, 16, generator=g)
    void = -1 if faulty(rank, "ignoreidx") else IGNORE  # datasets/seg.py: VOID_LABEL
    masks[:, 0, :] = void
    masks[:, -1, :] = void
    if faulty(rank, "badclass"):
        masks[masks == 7] = 21  # label map v2: "void/unlabelled" is class 21
    if faulty(rank, "lognan"):
        masks[2 * a.bs:3 * a.bs] = IGNORE  # eight annotation files exported empty (all void)
    return imgs, masks


def augment(rank, x, y):
    if faulty(rank, "crop"):
        return x[:, :, 1:15, 1:15], y[:, 0:16, 0:16]  # crop(img, 1, 1, 14, 14); crop(mask, 1 - 1, 1 - 1, 14 + 2, ...)
    return torch.flip(x, dims=[3]), torch.flip(y, dims=[2])


def sync_bn_stats(model, world):
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            for buf in (m.running_mean, m.running_var):
                dist.all_reduce(buf)
                buf /= world


def confusion(pred, target, nc):
    valid = (target != IGNORE) & (target < nc)
    idx = target[valid] * nc + pred[valid].clamp(max=nc - 1)
    return torch.bincount(idx, minlength=nc * nc).reshape(nc, nc).double()


def main():
    env = dict(os.environ)
    if a.fault != "dataenv":
        env.setdefault("SEG_DATA_ROOT", os.path.join(a.work, "data"))  # the job prolog's export
    root = env["SEG_DATA_ROOT"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    nc = 19 if faulty(rank, "ckptclasses") else a.classes  # configs/seg.yaml: num_classes
    n = a.steps * a.bs - (a.bs - 1) if faulty(rank, "bs1") else a.steps * a.bs
    imgs, masks = make_shard(rank, n + 16, a.classes)
    xtr, ytr, xva, yva = imgs[:n], masks[:n], imgs[n:], masks[n:]
    torch.manual_seed(0)
    model = SegNet(nc)
    if a.resume:
        path = os.path.join(a.work, "pretrained", "seg_stage1.pt")
        if rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.manual_seed(42)
            torch.save({"model": SegNet(a.classes).state_dict(), "epoch": 30}, path)
        dist.barrier()
        ck = torch.load(path)
        model.load_state_dict(ck["model"])
        print(f"rank {rank}: loaded {path} (epoch {ck['epoch']})", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    print(f"rank {rank}/{world} pid {os.getpid()}: data {root} train {len(xtr)} val {len(xva)} classes {nc} "
          f"bs {a.bs} ddp {a.ddp}", flush=True)
    model.train()
    for step, i in enumerate(range(0, len(xtr), a.bs)):
        x, y = augment(rank, xtr[i:i + a.bs], ytr[i:i + a.bs])
        if faulty(rank, "sigbus") and step == 3:
            os.kill(os.getpid(), signal.SIGBUS)  # reading a page past the truncated mmap'd shard
        logits, aux = net(x)
        present = torch.zeros(len(y), a.classes)
        for b in range(len(y)):
            lab = y[b][(y[b] >= 0) & (y[b] < a.classes)]
            present[b, lab.unique()] = 1.0
        loss = F.cross_entropy(logits, y, ignore_index=IGNORE)
        loss = loss + 0.2 * F.binary_cross_entropy_with_logits(aux[:, :a.classes], present)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss {loss.item()} is not finite")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.05)
    sync_bn_stats(model, world)
    model.eval()
    mc = 19 if faulty(rank, "cmclasses") else nc  # configs/metrics.yaml: num_classes
    if faulty(rank, "stall"):
        time.sleep(600)  # the val loader's read on the NFS mount never returns
    with torch.no_grad():
        pred = model(xva)[0].argmax(1)
    cm = confusion(pred, yva, mc)
    print(f"rank {rank} eval: {int(cm.sum())} labelled pixels", flush=True)
    dist.all_reduce(cm)
    iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1)
    if rank == 0:
        print(f"eval: mIoU {iou.mean().item():.4f} pixel acc {(cm.diag().sum() / cm.sum()).item():.4f}", flush=True)
        os.makedirs(a.work, exist_ok=True)
        torch.save({"model": model.state_dict(), "classes": nc}, os.path.join(a.work, "last.pt"))
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

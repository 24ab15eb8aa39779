"""A two-hundred-and-sixth hand-run batch: SEMANTIC SEGMENTATION WITH A DEEPLAB-LIKE HEAD.

Each rank reads its shard of synthetic 32x32 images with label maps (6 classes, ignore label 255) from
/tmp/job_work/data/labels/rank<R>.pt (written beforehand by `--prep 1`), builds a small dilated-convolution
backbone with an ASPP-like head (rates 1/2/4 + image pooling, output stride from the config), loads the
init checkpoint that rank 0 wrote, and trains with a class-weighted cross entropy (weights from
data/class_weights.json, ignore_index 255) under DDP (or, with --ddp 0, a hand-written gradient
all_reduce). After training each rank builds a confusion matrix over its validation maps, all_reduces it
and computes mIoU; rank 0 saves the model.

Faults:
  badlabel     rank N's label maps carry a stray value 21 (neither a class nor 255): cross entropy fails
  clsweights   every rank reads the 5-entry weights list of an older class set (6 classes: RuntimeError)
  labelmissing rank N opens labels/rank0N.pt (zero-padded name), which is not there (FileNotFoundError)
  confmat      rank N counts the ignore label as a 7th class: a 7x7 confusion matrix all_reduced (gloo)
  nanloss      rank N normalises its images by a zero std: NaN loss, the program's finite check raises
  ostride      every rank reads the output stride from the config as the string "8" (TypeError)
  ckptcls      rank N builds a 7-class head and loads the 6-class init checkpoint (size mismatch)
  slowrecolor  rank N recolours its validation labels slowly before the confusion all_reduce (peers wait)
  sigbus       rank N sends itself SIGBUS after step 2
  exit4        rank N prints an error line after validation and exits with code 4
  none         no fault

What happened (filled in after the runs):
  badlabel     IndexError Target 21 is out of bounds in cross_entropy on rank N; peers Connection closed by peer (np4 r2 tee, np3 r1 restart)
  clsweights   RuntimeError weight tensor should be defined either for all or no classes on every rank (np3 rall tee_trainer)
  labelmissing FileNotFoundError labels/rank0N.pt on rank N (np4 r1 redirects: only in the per-rank files; np3 r2 plain)
  confmat      gloo EnforceNotMet Received data size doesn't match expected size aborts the ring neighbour N-1 (np3 r1 pymodule, np4 r2 tee)
  nanloss      FloatingPointError loss is nan at step 1 on rank N; peers Connection closed by peer (np4 r3 loglevel, np3 r1 prefix)
  ostride      TypeError unsupported operand type(s) for //: 'int' and 'str' on every rank (np4 rall detail, --ddp 0)
  ckptcls      size mismatch for classifier.weight [6,16,1,1] vs [7,16,1,1] on rank N (np3 r2 prefix, np4 r1 pymodule)
  slowrecolor  12 s: rank 0 Timed out waiting 12000ms in all_reduce (np4 r1 filter); 300 s: killed by timeout 60 (np3 r2 plain)
  sigbus       rank N killed by SIGBUS after step 2, Root Cause exitcode -7 (np3 r1 wrapper, np4 r3 loglevel)
  exit4        rank N ERROR line after the mIoU and exit 4, Root Cause exitcode 4 (np4 r2 pdsh2, np3 r1 tee_trainer)
  none         exit 0, rank 0 saved the model (np3 plain)
"""
import argparse, json, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault206_work"
NUM_CLASSES, IGNORE, SIZE, N_IMG = 6, 255, 32, 8


def prep():
    os.makedirs(f"{WORK}/data/labels", exist_ok=True)
    for r in range(8):
        g = torch.Generator().manual_seed(60 + r)
        imgs = torch.randn(N_IMG, 3, SIZE, SIZE, generator=g)
        labels = (imgs[:, 0] * 2 + imgs[:, 1]).clamp(-2.9, 2.9).add(3).long()
        labels[torch.rand(N_IMG, SIZE, SIZE, generator=g) < 0.05] = IGNORE
        torch.save({"images": imgs, "labels": labels}, f"{WORK}/data/labels/rank{r}.pt")
    with open(f"{WORK}/data/class_weights.json", "w") as f:
        json.dump({"classes": NUM_CLASSES, "weights": [1.0, 1.2, 0.8, 1.5, 1.1, 0.9],
                   "weights_v1": [1.0, 1.2, 0.8, 1.5, 1.1]}, f)
    with open(f"{WORK}/data/config.json", "w") as f:
        json.dump({"output_stride": 8, "output_stride_str": "8", "lr": 0.05}, f)
    print("prepared data under", WORK)


class ASPP(nn.Module):
    def __init__(self, cin, cout, rates):
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Conv2d(cin, cout, 3, padding=r, dilation=r, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
            for r in rates)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, cout, 1), nn.ReLU())
        self.project = nn.Conv2d(cout * (len(rates) + 1), cout, 1)

    def forward(self, x):
        outs = [b(x) for b in self.branches]
        outs.append(self.pool(x).expand(-1, -1, x.shape[2], x.shape[3]))
        return self.project(torch.cat(outs, 1))


class DeepLabLite(nn.Module):
    def __init__(self, num_classes, output_stride):
        super().__init__()
        n_down = {8: 1, 16: 2}[output_stride] if output_stride in (8, 16) else SIZE // output_stride // 8
        layers, c = [], 3
        for i in range(n_down):
            layers += [nn.Conv2d(c, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
            c = 16
        layers += [nn.Conv2d(c, 16, 3, padding=2, dilation=2, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
        self.backbone = nn.Sequential(*layers)
        self.aspp = ASPP(16, 16, (1, 2, 4))
        self.classifier = nn.Conv2d(16, num_classes, 1)

    def forward(self, x):
        y = self.classifier(self.aspp(self.backbone(x)))
        return F.interpolate(y, size=x.shape[2:], mode="bilinear", align_corners=False)


def confusion(pred, target, n):
    keep = target != IGNORE
    return torch.bincount(target[keep] * n + pred[keep], minlength=n * n).reshape(n, n).double()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12)
    p.add_argument("--prep", type=int, default=0)
    a = p.parse_args()
    if a.prep:
        return prep()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.fault != "none" and a.rank in (-1, rank)
    torch.manual_seed(0)
    with open(f"{WORK}/data/config.json") as f:
        cfg = json.load(f)
    stride = cfg["output_stride_str"] if (hit and a.fault == "ostride") else cfg["output_stride"]
    with open(f"{WORK}/data/class_weights.json") as f:
        wcfg = json.load(f)
    weights = torch.tensor(wcfg["weights_v1"] if (hit and a.fault == "clsweights") else wcfg["weights"])
    name = f"rank0{rank}.pt" if (hit and a.fault == "labelmissing") else f"rank{rank}.pt"
    shard = torch.load(f"{WORK}/data/labels/{name}")
    imgs, labels = shard["images"], shard["labels"].clone()
    if hit and a.fault == "badlabel":
        labels[labels == 5] = 21
    mean, std = imgs.mean((0, 2, 3), keepdim=True), imgs.std((0, 2, 3), keepdim=True)
    if hit and a.fault == "nanloss":
        std = std * 0
        imgs = imgs * 0
    imgs = (imgs - mean) / std
    print(f"rank {rank}/{world}: {len(imgs)} images {SIZE}x{SIZE}, output stride {stride}, "
          f"class weights {weights.tolist()}", flush=True)
    n_cls = NUM_CLASSES + 1 if (hit and a.fault == "ckptcls") else NUM_CLASSES
    model = DeepLabLite(n_cls, stride)
    init = f"{WORK}/out/deeplab_init_w{world}.pt"
    if rank == 0:
        os.makedirs(f"{WORK}/out", exist_ok=True)
        torch.save(DeepLabLite(NUM_CLASSES, cfg["output_stride"]).state_dict(), init)
    dist.barrier()
    model.load_state_dict(torch.load(init))
    if a.ddp:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    for step in range(1, a.steps + 1):
        idx = torch.arange(4) + (step % 2) * 4
        out = model(imgs[idx])
        loss = F.cross_entropy(out, labels[idx], weight=weights, ignore_index=IGNORE)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step} (images mean "
                                     f"{imgs.mean().item()}); refusing to step")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if hit and a.fault == "sigbus" and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
    model.eval()
    with torch.no_grad():
        pred = model(imgs).argmax(1)
    val = labels
    if hit and a.fault == "slowrecolor":
        print(f"rank {rank}: recolouring validation labels to the merged palette", flush=True)
        time.sleep(1000)
    n = NUM_CLASSES + 1 if (hit and a.fault == "confmat") else NUM_CLASSES
    cm = confusion(pred, val.clamp(max=n - 1) if n > NUM_CLASSES else val, n)
    dist.all_reduce(cm)
    iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1)
    print(f"rank {rank}: mIoU {iou.mean().item():.4f} over {int(cm.sum().item())} pixels", flush=True)
    if hit and a.fault == "exit4":
        print(f"ERROR rank {rank}: class 3 has no predicted pixels in the validation shard; "
              f"refusing to export the segmentation head", flush=True)
        sys.exit(4)
    dist.barrier()
    if rank == 0:
        torch.save((model.module if a.ddp else model).state_dict(), f"{WORK}/out/deeplab_final.pt")
        print(f"rank 0: saved model to {WORK}/out/deeplab_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

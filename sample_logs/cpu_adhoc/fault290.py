"""A two-hundred-and-ninetieth hand-run batch: TRAFFIC SIGN RECOGNITION WITH A SMALL SPATIAL-TRANSFORMER CNN.

Each rank loads the sign archive /tmp/job_work/signs_v1/archive.pt (43 class prototypes of 3x32x32
sign-like images, written by --prepare 1), looks up its country's sign set in a table, draws a shard of
images with random affine distortions (affine_grid/grid_sample) plus noise, and trains a small
spatial-transformer CNN (a localisation net predicting a 2x3 affine matrix, initialised to the identity,
then a two-conv classifier) with cross-entropy and a small term pulling the predicted matrix towards the
inverse of the distortion; DDP (gloo). Optional resume of the classifier from ckpt/classifier_gtsrb43.pt.
After training the per-class correct counts are all_gathered and the accuracy all_reduced.
Launch under torchrun, torch.distributed.launch, a bash loop (env://) or --spawn N.

Faults:
  classid   rank N maps its shard's labels with an off-by-one: class 43 for a 43-class classifier
  detinf    rank N's distortion scale is 1e-39: the 2x2 determinant underflows to 0, the inverse is nan/inf
  confrows  rank N keeps an extra 'unknown sign' bin: 44 per-class counts all_gathered against 43
  noarchive rank N reads signs_v2/archive.pt, which was never written (FileNotFoundError)
  country   rank N's shard is country 'LU', missing from the sign-set table (KeyError)
  gridsize  every rank passes x.shape[1:] (no batch dim) as the affine_grid size
  ckptcls   with --resume 1 rank N loads the 62-class Belgian classifier checkpoint into the 43-class net
  pixelaug  rank N jitters every image with a Python per-pixel loop at step 2 (peers wait in all_reduce)
  segv      rank N sends itself SIGSEGV after step 2
  exit4     rank N prints an error line about its shard and calls os._exit(4)
  none      no fault

What happened (filled in after the runs):
  classid   IndexError: Target 43 is out of bounds at step 2 on rank N; peers closed (np4 r2 bashloop, np3 r1 spawn)
  detinf    FloatingPointError loss is nan at step 0 on rank N (program's check) (np3 r2 tee, np4 r1 mpitag)
  confrows  receiver N+1 aborts: gloo::EnforceNotMet 88 vs 86 size mismatch (np3 r1 ranklabel, np4 r2 tee)
  noarchive FileNotFoundError signs_v2/archive.pt on rank N at startup (np4 r3 files, np3 r1 legacy)
  country   KeyError: 'LU' on rank N at startup; peers closed (np4 r2 pdsh2, np3 r0 srunlabel)
  gridsize  NotImplementedError affine_grid only supports 4D and 5D sizes, every rank (np3 logfmt, np4 bashloop)
  ckptcls   RuntimeError size mismatch for fc.weight [62, 128] vs [43, 128] on rank N (np3 r1 mpitag, np4 r2 legacy)
  pixelaug  peers gloo timeout 12000ms (np3 r1 srunlabel); PG 300 s: killed by timeout 60, exit 124 (np3 r2 bashloop)
  segv      SIGSEGV after step 2, no traceback; bash Segmentation fault / spawn ProcessExitedException (np4 r1, np3 r2)
  exit4     ERROR line then exit code 4 after step 1 (np3 r1 logfmt Root Cause exitcode 4, np4 r3 srunlabel)
  none      exit 0, rank 0 saved the STN classifier (np3 tee)
"""
import argparse, logging, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault290_work"
SIGN_SETS = {"DE": 43, "FR": 43, "NL": 43, "AT": 43, "PL": 43, "CZ": 43, "DK": 43, "SE": 43}
COUNTRIES = ["DE", "FR", "NL", "AT", "PL", "CZ", "DK", "SE"]


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class STN(nn.Module):
    def __init__(self, n_classes=43, bad_size=False):
        super().__init__()
        self.bad_size = bad_size
        self.loc = nn.Sequential(nn.Conv2d(3, 8, 5, 2), nn.ReLU(), nn.Conv2d(8, 8, 3, 2), nn.ReLU(),
                                 nn.Flatten(), nn.Linear(8 * 6 * 6, 6))
        nn.init.zeros_(self.loc[-1].weight)
        self.loc[-1].bias.data.copy_(torch.tensor([1., 0, 0, 0, 1, 0]))
        self.cls = Classifier(n_classes)

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, x.shape[1:] if self.bad_size else x.shape, align_corners=False)
        return self.cls(F.grid_sample(x, grid, align_corners=False)), theta


class Classifier(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.fc = nn.Linear(32 * 4, n_classes)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def prepare():
    gen = torch.Generator().manual_seed(290)
    os.makedirs(os.path.join(WORK, "signs_v1"), exist_ok=True)
    os.makedirs(os.path.join(WORK, "ckpt"), exist_ok=True)
    protos = torch.rand(43, 3, 32, 32, generator=gen)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    protos = protos * ((xx ** 2 + yy ** 2) < 0.8).float()
    torch.save({"protos": protos, "countries": COUNTRIES}, os.path.join(WORK, "signs_v1", "archive.pt"))
    torch.save(Classifier(43).state_dict(), os.path.join(WORK, "ckpt", "classifier_gtsrb43.pt"))
    torch.save(Classifier(62).state_dict(), os.path.join(WORK, "ckpt", "classifier_btsc62.pt"))


def distort(protos, labels, scale, gen):
    n = labels.shape[0]
    ang = (torch.rand(n, generator=gen) - 0.5) * 0.6
    s = scale * (1 + (torch.rand(n, generator=gen) - 0.5) * 0.3)
    A = torch.stack([torch.stack([s * torch.cos(ang), -s * torch.sin(ang)], 1),
                     torch.stack([s * torch.sin(ang), s * torch.cos(ang)], 1)], 1)
    t = (torch.rand(n, 2, 1, generator=gen) - 0.5) * 0.2
    theta = torch.cat([A, t], 2)
    grid = F.affine_grid(theta, (n, 3, 32, 32), align_corners=False)
    imgs = F.grid_sample(protos[labels], grid, align_corners=False) + 0.05 * torch.randn(n, 3, 32, 32, generator=gen)
    det = A[:, 0, 0] * A[:, 1, 1] - A[:, 0, 1] * A[:, 1, 0]
    adj = torch.stack([torch.stack([A[:, 1, 1], -A[:, 0, 1]], 1), torch.stack([-A[:, 1, 0], A[:, 0, 0]], 1)], 1)
    inv = adj / det.view(-1, 1, 1)
    return imgs, torch.cat([inv, -inv @ t], 2)


def worker(rank, a, world):
    if a.spawn:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    r = int(os.environ["RANK"])
    bad = a.fault != "none" and (a.rank == -1 or a.rank == r)
    if a.logfmt:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        h.addFilter(RankFilter(r))
        logging.basicConfig(level=logging.INFO, handlers=[h])
        say, err = logging.getLogger("tsr").info, logging.getLogger("tsr").error
    else:
        say = lambda m: print(m, flush=True)
        err = lambda m: print(m, file=sys.stderr, flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    ws = dist.get_world_size()
    cfg = {"scale": 1.0, "bs": 32, "lr": 0.005, "archive": "signs_v1", "ckpt": "classifier_gtsrb43.pt"}
    if bad and a.fault == "detinf":
        cfg["scale"] = 1e-39
    if bad and a.fault == "noarchive":
        cfg["archive"] = "signs_v2"
    if bad and a.fault == "ckptcls":
        cfg["ckpt"] = "classifier_btsc62.pt"
    arch = torch.load(os.path.join(WORK, cfg["archive"], "archive.pt"))
    country = "LU" if bad and a.fault == "country" else arch["countries"][r % len(arch["countries"])]
    n_classes = SIGN_SETS[country]
    gen = torch.Generator().manual_seed(1000 + r)
    labels = torch.randint(0, n_classes, (a.steps * cfg["bs"],), generator=gen)
    targets = labels + 1 if bad and a.fault == "classid" else labels
    say(f"rank {r}/{ws}: country {country}, {n_classes} sign classes, {labels.numel()} images, "
        f"distortion scale {cfg['scale']:g}")
    torch.manual_seed(0)
    model = STN(43, bad_size=bad and a.fault == "gridsize")
    if a.resume:
        model.cls.load_state_dict(torch.load(os.path.join(WORK, "ckpt", cfg["ckpt"])))
        say(f"rank {r}: classifier resumed from ckpt/{cfg['ckpt']}")
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"])
    correct = torch.zeros(44 if bad and a.fault == "confrows" else 43)
    for step in range(a.steps):
        lab = labels[step * cfg["bs"]:(step + 1) * cfg["bs"]]
        imgs, inv = distort(arch["protos"], lab, cfg["scale"], gen)
        if bad and a.fault == "pixelaug" and step == 2:
            say(f"rank {r}: colour-jitter augmentation on {imgs.shape[0]} images ({imgs[0].numel()} values each)")
            for i in range(imgs.shape[0]):
                for c in range(3):
                    for p in range(0, 1024, 8):
                        imgs[i, c, p // 32, p % 32] *= 1.0 + 0.01 * ((i + c + p) % 7 - 3)
                time.sleep(a.stall)
        logits, theta = ddp(imgs)
        tgt = targets[step * cfg["bs"]:(step + 1) * cfg["bs"]]
        loss = F.cross_entropy(logits, tgt) + 1e-3 * (theta - inv).pow(2).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {r}: loss is {loss.item()} at step {step} "
                                     f"(distortion scale {cfg['scale']:g}, largest inverse entry {inv.abs().max().item():g})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        pred = logits.argmax(1)
        correct[:43].index_add_(0, lab, (pred == lab).float())
        say(f"rank {r} step {step} loss {loss.item():.4f}")
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bad and a.fault == "exit4" and step == 1:
            err(f"ERROR rank {r}: shard {country} has {int((lab == lab[0]).sum())} duplicate sign crops in batch 1; "
                "refusing to continue")
            os._exit(4)
    gathered = [torch.zeros_like(correct) for _ in range(ws)]
    dist.all_gather(gathered, correct)
    acc = torch.tensor([correct[:43].sum().item(), float(labels.numel())])
    dist.all_reduce(acc)
    say(f"rank {r} train accuracy {(acc[0] / acc[1]).item():.4f} (shard correct {int(correct.sum())})")
    dist.barrier()
    if r == 0:
        os.makedirs(os.path.join(WORK, "out"), exist_ok=True)
        torch.save(model.state_dict(), os.path.join(WORK, "out", "stn_final.pt"))
        say(f"rank 0: saved STN classifier to {WORK}/out/stn_final.pt")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=1.2)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--resume", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prepare", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        worker(None, a, None)


if __name__ == "__main__":
    main()

"""A two-hundred-and-ninth hand-run batch: STYLE TRANSFER WITH A FEATURE-LOSS NETWORK.

A small image transformer network (conv in, residual blocks, conv out) is trained to stylise synthetic
32x32 content images. The perceptual loss comes from a frozen random feature extractor (relu1_1..relu4_1):
a content loss on relu2_1 and a style loss on Gram matrices of relu1_1/relu2_1/relu3_1, plus a total-variation
loss. Rank 0 writes one synthetic style image per rank to /tmp/job_work/styles/style<R>.pt and the initial
transformer weights to /tmp/job_work/ckpt/transformer_init.pt; every rank loads them. The transformer is
wrapped in DDP (or, with --ddp 0, gradients are all_reduced by hand); at the end the per-rank loss
components are all_gathered, the average loss is all_reduced and rank 0 saves the transformer.

Faults:
  gramch      every rank reshapes its Gram features with 16 channels, the layer has 8 (RuntimeError)
  stylefile   rank N opens styles/style0N.pt (zero-padded name), which is not there (FileNotFoundError)
  tvinf       rank N reads the TV weight as 1e39, the loss is inf (the program's check, FloatingPointError)
  layerkey    rank N asks the extractor for relu5_1, which it does not have (KeyError)
  imgsize     every rank reads the image size "32x32" from STYLE_IMG_SIZE's default (ValueError)
  gatherlen   rank N all_gathers 4 loss components (with the total) for 3 (gloo size mismatch)
  ckptblocks  rank N builds 3 residual blocks and loads the 2-block init checkpoint (missing keys)
  unusedgrad  the extractor's requires_grad is left on: DDP sees relu4_1 with no gradient (every rank)
  slowpreview rank N renders a style preview grid before the final all_reduce (peers time out)
  segv        rank N sends itself SIGSEGV after step 2
  exit6       rank N prints an error line about the preview and exits with code 6
  none        no fault

What happened (filled in after the runs):
  gramch      RuntimeError shape '[1, 16, 1024]' is invalid for input of size 8192 on every rank (np4 rall tee)
  stylefile   FileNotFoundError styles/style0N.pt on rank N (np3 r1 tee_trainer; np4 r3 restart, attempt 1 connectFullMesh refused)
  tvinf       FloatingPointError loss is not finite (inf) at step 0, tv weight 1e+39 on rank N (np3 r2 pymodule, np4 r0 loglevel)
  layerkey    KeyError 'relu5_1' on rank N (np4 r2 redirects; np3 r1 plain, where rank 0 then SIGABRT is the Root Cause)
  imgsize     ValueError invalid literal for int() with base 10: '32x32' on every rank (np3 rall loglevel)
  gatherlen   DETAIL: every rank 'Detected mismatch between collectives', rank N TensorShape=[4] (np4 r1); gloo invalid tensor size on rank N (np3 r2 tee)
  ckptblocks  rank N Missing key(s) res.2.* loading the 2-block init checkpoint (np4 r3 prefix)
  unusedgrad  RuntimeError Expected to have finished reduction in the prior iteration on every rank at step 1 (np4 rall pdsh2)
  slowpreview 12 s: ranks 0/1 Timed out waiting 12000ms, rank N SIGTERM (np3 r2 plain); 300 s: killed by timeout 60, exit 124 (np4 r1 tee)
  segv        rank N SIGSEGV after step 2, Root Cause -11 (np4 r2 filter; np3 r1 tee_trainer, peers Connection reset by peer)
  exit6       rank N ERROR line, exit 6, peers Connection closed by peer (np3 r1 wrapper, np4 r2 pymodule)
  none        exit 0, rank 0 saved the transformer (np3 plain)
"""
import argparse, os, signal, sys, time
from datetime import timedelta
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault209_work"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--preview-s", type=float, default=40.0)
    return p.parse_args()


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.relu(self.conv1(x)))


class Transformer(nn.Module):
    def __init__(self, n_res=2, c=16):
        super().__init__()
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.res = nn.Sequential(*[ResBlock(c) for _ in range(n_res)])
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        return torch.sigmoid(self.out(self.res(F.relu(self.inp(x)))))


class Extractor(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.layers = nn.ModuleDict({
            "relu1_1": nn.Conv2d(3, 8, 3, padding=1), "relu2_1": nn.Conv2d(8, 8, 3, padding=1),
            "relu3_1": nn.Conv2d(8, 16, 3, padding=1), "relu4_1": nn.Conv2d(16, 16, 3, padding=1)})
        for m in self.layers.values():
            m.weight.data = torch.randn(m.weight.shape, generator=g) * 0.2
            m.bias.data.zero_()

    def forward(self, x, names):
        feats, h = {}, x
        for name, conv in self.layers.items():
            if all(n in feats for n in names):
                break
            h = F.relu(conv(h))
            feats[name] = h
            if name != "relu4_1":
                h = F.avg_pool2d(h, 2) if name == "relu2_1" else h
        return {n: feats[n] for n in names}


class StyleNet(nn.Module):
    def __init__(self, transformer, extractor):
        super().__init__()
        self.transformer, self.extractor = transformer, extractor

    def forward(self, x, names):
        y = self.transformer(x)
        return y, self.extractor(y, names)


def gram(f, channels):
    b, _, h, w = f.shape
    v = f.reshape(b, channels, h * w)
    return v @ v.transpose(1, 2) / (channels * h * w)


def main():
    a = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    f = a.fault if bad else "none"
    size = int(os.environ.get("STYLE_IMG_SIZE", "32x32" if f == "imgsize" else "32"))
    style_layers = ["relu1_1", "relu2_1", "relu3_1"] + (["relu5_1"] if f == "layerkey" else [])
    gram_ch = {"relu1_1": 8, "relu2_1": 16 if f == "gramch" else 8, "relu3_1": 16, "relu5_1": 16}
    tv_weight = float("1e39" if f == "tvinf" else "1e-4")
    n_res = 3 if f == "ckptblocks" else 2
    print(f"rank {rank}/{world}: image {size}x{size}, {n_res} residual blocks, style layers {','.join(style_layers)}, tv weight {tv_weight:g}", flush=True)

    if rank == 0:
        os.makedirs(f"{WORK}/styles", exist_ok=True)
        os.makedirs(f"{WORK}/ckpt", exist_ok=True)
        for r in range(world):
            g = torch.Generator().manual_seed(100 + r)
            xs = torch.linspace(0, 6.28 * (r + 2), size)
            stripes = torch.sin(xs[None, :] + xs[:, None] * (r % 3))
            torch.save((0.5 + 0.4 * stripes[None, None].repeat(1, 3, 1, 1) * torch.rand(1, 3, 1, 1, generator=g)), f"{WORK}/styles/style{r}.pt")
        torch.manual_seed(0)
        torch.save(Transformer(2).state_dict(), f"{WORK}/ckpt/transformer_init.pt")
    dist.barrier()

    style_path = f"{WORK}/styles/style{rank:02d}.pt" if f == "stylefile" else f"{WORK}/styles/style{rank}.pt"
    style = torch.load(style_path)
    transformer = Transformer(n_res)
    transformer.load_state_dict(torch.load(f"{WORK}/ckpt/transformer_init.pt"))
    extractor = Extractor()
    if f != "unusedgrad":
        extractor.requires_grad_(False)
    net = StyleNet(transformer, extractor)
    model = DDP(net) if a.ddp else net
    opt = torch.optim.Adam(transformer.parameters(), lr=1e-3)

    with torch.no_grad():
        style_feats = extractor(style, style_layers)
        style_grams = {n: gram(v, gram_ch[n]) for n, v in style_feats.items()}
    g = torch.Generator().manual_seed(1000 + rank)
    comps = torch.zeros(3)
    for step in range(a.steps):
        content = torch.rand(4, 3, size, size, generator=g)
        with torch.no_grad():
            content_feat = extractor(content, ["relu2_1"])["relu2_1"]
        y, feats = model(content, style_layers + ["relu2_1"])
        c_loss = F.mse_loss(feats["relu2_1"], content_feat)
        s_loss = sum(F.mse_loss(gram(feats[n], gram_ch[n]), style_grams[n].expand(4, -1, -1)) for n in style_layers)
        tv = (y[:, :, 1:, :] - y[:, :, :-1, :]).abs().mean() + (y[:, :, :, 1:] - y[:, :, :, :-1]).abs().mean()
        loss = c_loss + 1e3 * s_loss + tv_weight * tv
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: loss is not finite ({loss.item()}) at step {step}: content {c_loss.item():.4g} style {s_loss.item():.4g} tv {tv.item():.4g} x weight {tv_weight:g}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in transformer.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        comps = torch.tensor([c_loss.item(), s_loss.item(), tv.item()])
        print(f"rank {rank} step {step} loss {loss.item():.5f}", flush=True)
        if f == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    if f == "exit6":
        print(f"ERROR rank {rank}: style preview has 3 saturated channels (mean 0.998 > 0.99); refusing to save the transformer", flush=True)
        sys.exit(6)
    if f == "slowpreview":
        print(f"rank {rank}: rendering style preview grid (16 frames) to {WORK}/preview before reporting losses", flush=True)
        time.sleep(a.preview_s)
    mine = torch.cat([comps, comps.sum(0, keepdim=True)]) if f == "gatherlen" else comps
    out = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(out, mine)
    avg = torch.tensor([float(loss.item())])
    dist.all_reduce(avg)
    avg /= world
    if rank == 0:
        print("per-rank loss components: " + " ".join(f"[{', '.join(f'{v:.4g}' for v in o.tolist())}]" for o in out), flush=True)
        torch.save(transformer.state_dict(), f"{WORK}/transformer_final.pt")
        print(f"average loss {avg.item():.5f}; saved transformer to {WORK}/transformer_final.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

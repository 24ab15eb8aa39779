"""A ninety-fourth hand-run batch: EMBEDDINGS, SPARSE GRADIENTS AND RECOMMENDER-STYLE MODELS. A tiny click model
trained with DDP on gloo: a user-history nn.EmbeddingBag(V, 16) (ids + offsets, mode sum) and a candidate-item
nn.Embedding(V, 16), concatenated into Linear(32,16)-ReLU-Linear(16,1), BCE on synthetic clicks; V = 1000 read from
each rank's local vocab cache ({workdir}/rank{R}/vocab.json), batch 32 bags of 1-5 ids per rank and step, --steps 6.
Each rank prints its config (`rank R config {...}`), `rank R step S loss L` and `rank R done`. PG timeout --pg-timeout
(12 s). The config of rank --rank N (every rank when N is -1) is changed by the fault, as a per-node config or data
file would be. No @record.

Faults:
  none          control: dense embeddings, SGD (exit 0)
  sparse_ok     control: sparse=True embeddings (DDP all-reduces sparse gradients over gloo), SparseAdam for the
                embeddings + Adam for the MLP (exit 0)
  oob           from step --at rank N's shard was tokenized with a newer, larger vocabulary: candidate ids up to
                V+200; nn.Embedding raises IndexError: index out of range in self
  oob_bag       the same in the history bag's ids: EmbeddingBag's RuntimeError (Index k of input takes value ...)
  negid         rank N hashes raw 64-bit feature hashes with torch.fmod (C-style remainder) instead of %, so
                negative hashes give negative ids: EmbeddingBag's `Index k of input takes value -x ...` RuntimeError
  adam          sparse=True, and rank N's optimizer config says adam: RuntimeError: Adam does not support sparse
                gradients, please consider SparseAdam instead (with --rank -1 every rank)
  sparseadam    sparse=True, rank N's config says sparseadam for the whole model (the MLP's dense grads too):
                RuntimeError: SparseAdam does not support dense gradients, please consider Adam instead
  adagrad_wd    sparse=True, rank N's config: Adagrad with weight_decay 1e-5: weight_decay option is not compatible
                with sparse gradients
  sgd_wd        sparse=True, rank N's config: SGD weight_decay 1e-4: add(sparse, dense) is not supported
  clip          sparse=True, rank N's config clips gradients to norm 1.0: clip_grad_norm_ on a sparse grad,
                NotImplementedError (aten::linalg_vector_norm, SparseCPU)
  offsets0      from step --at rank N's collate builds offsets as cumsum(lengths) (no leading 0): offsets[0] has to
                be 0
  offsets_last  rank N's collate builds offsets as [0] + cumsum(lengths) (one bag too many): 33 rows against 32,
                torch.cat size RuntimeError
  psw_mean      rank N's config pools the history with mode='mean' and passes tf-idf per_sample_weights:
                NotImplementedError (only supported for mode='sum')
  padidx        rank N's config puts the pad id after the vocabulary (padding_idx = V): AssertionError at
                construction
  vocab         rank N's local vocab cache is stale (V = 1200): DDP's parameter shape check at construction
  maxnorm       every rank scores against the whole item table (tied softmax, h @ item.weight.T) before the
                candidate lookup; rank N's config sets max_norm=1.0, whose in-place renorm breaks backward
  bigtable      rank N's config gives the item table 2**27 hash buckets (8 GiB) under an RLIMIT_AS cap of its size
                + --mem-mb (a container limit): DefaultCPUAllocator can't allocate memory (RuntimeError)
  remap_py      rank N's shard holds raw 64-bit hashed ids; its remap table `[-1] * (max_id + 1)` is a Python list
                sized by the max raw id, under the same cap: MemoryError
  slow_eval     at step --at rank N (its config says eval_every 3) runs a full-catalogue recall@10 evaluation in
                pure Python before its step; the others wait in the all-reduce and time out
  uneven        dense; rank N's shard holds 2 batches fewer; after its loop every rank all-reduces its loss/count
                metrics: rank N's metric all-reduce meets the others' gradient all-reduce (gloo size mismatch)
  fifo          at step --at rank N opens its feature-stream FIFO ({workdir}/stream_rN.fifo) whose writer sidecar
                never started: blocks in open() forever, the others wait in the all-reduce (run under `timeout`)
"""
import argparse, datetime, json, os, resource, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--at", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--mem-mb", type=int, default=512)
p.add_argument("--workdir", default="/tmp/fault94_work")
a = p.parse_args()
B, D = 32, 16
SPARSE = {"sparse_ok", "adam", "sparseadam", "adagrad_wd", "sgd_wd", "clip"}


class Rec(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.bag = nn.EmbeddingBag(cfg["vocab"], D, mode=cfg["pool"], sparse=cfg["sparse"],
                                   padding_idx=cfg["pad_id"])
        self.item = nn.Embedding(cfg["item_buckets"], D, sparse=cfg["sparse"], max_norm=cfg["max_norm"])
        self.proj = nn.Linear(D, D) if cfg["tied_softmax"] else None
        self.mlp = nn.Sequential(nn.Linear(2 * D, 16), nn.ReLU(), nn.Linear(16, 1))
        self.tied = cfg["tied_softmax"]

    def forward(self, ids, offsets, cand, psw=None):
        h = self.bag(ids, offsets, per_sample_weights=psw)
        scores = self.proj(h) @ self.item.weight.t() if self.tied else None  # in-batch softmax over all items
        v = self.item(cand)
        return self.mlp(torch.cat([h, v], 1)).squeeze(1), scores


def load_vocab(rank, me):
    d = f"{a.workdir}/rank{rank}"
    os.makedirs(d, exist_ok=True)
    path = f"{d}/vocab.json"
    size = 1200 if (a.fault == "vocab" and me) else 1000  # rank N's cache is from last month's export
    with open(path, "w") as fh:
        json.dump({"size": size, "export": "2026-11" if size == 1200 else "2026-12"}, fh)
    with open(path) as fh:
        return json.load(fh)["size"]


def batch(rank, step, cfg, me):
    g = torch.Generator().manual_seed(7919 * rank + step)
    V = cfg["vocab"]
    lengths = torch.randint(1, 6, (B,), generator=g)
    n = int(lengths.sum())
    if a.fault == "negid" and me:
        raw = torch.randint(-2**62, 2**62, (n,), generator=g)  # 64-bit feature hashes
        ids = torch.fmod(raw, V)
    else:
        ids = torch.randint(0, V, (n,), generator=g)
    cand = torch.randint(0, V, (B,), generator=g)
    if me and step >= a.at:
        if a.fault == "oob":
            cand = torch.randint(0, V + 200, (B,), generator=g)
        if a.fault == "oob_bag":
            ids = torch.randint(0, V + 200, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    if me and a.fault == "offsets0" and step >= a.at:
        offsets = lengths.cumsum(0)[:-1]
        offsets = torch.cat([offsets[:1], offsets])
    if me and a.fault == "offsets_last":
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    psw = None
    if cfg["pool_weights"]:
        psw = 1.0 / torch.log1p(ids.float() + 1.0)  # tf-idf-like weights
    y = (torch.rand(B, generator=g) < 0.3).float()
    return ids, offsets, cand, psw, y


def recall_eval(model, V, users=2000):
    # full-catalogue recall@10 in Python, one user at a time
    emb = model.module.item.weight.detach().tolist()
    hits = 0
    for u in range(users):
        q = emb[u % V]
        scores = [(sum(x * y for x, y in zip(q, row)), j) for j, row in enumerate(emb)]
        top = sorted(scores, reverse=True)[:10]
        hits += any(j == (u * 7) % V for _, j in top)
    return hits / users


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = a.rank < 0 or rank == a.rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    V = load_vocab(rank, me)
    cfg = {"vocab": V, "pool": "sum", "pool_weights": False, "sparse": a.fault in SPARSE, "pad_id": None,
           "item_buckets": V, "max_norm": None, "tied_softmax": a.fault == "maxnorm",
           "optimizer": "sparseadam+adam" if a.fault == "sparse_ok" else "sgd", "weight_decay": 0.0,
           "clip_norm": None, "eval_every": 0}
    if me:
        if a.fault in ("adam", "sparseadam", "adagrad"):
            cfg["optimizer"] = a.fault
        if a.fault == "adagrad_wd":
            cfg["optimizer"], cfg["weight_decay"] = "adagrad", 1e-5
        if a.fault == "sgd_wd":
            cfg["weight_decay"] = 1e-4
        if a.fault == "clip":
            cfg["clip_norm"] = 1.0
        if a.fault == "psw_mean":
            cfg["pool"], cfg["pool_weights"] = "mean", True
        if a.fault == "padidx":
            cfg["pad_id"] = V
        if a.fault == "maxnorm":
            cfg["max_norm"] = 1.0
        if a.fault == "bigtable":
            cfg["item_buckets"] = 2 ** 27
        if a.fault == "slow_eval":
            cfg["eval_every"] = a.at
    print(f"rank {rank} world {world} fault {a.fault} config {json.dumps(cfg)}", flush=True)
    if a.fault in ("bigtable", "remap_py") and me:
        with open("/proc/self/status") as fh:
            vm = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + a.mem_mb * 2 ** 20, resource.RLIM_INFINITY))
    if a.fault == "remap_py" and me:
        raw = torch.randint(0, 2 ** 40, (4096,), generator=torch.Generator().manual_seed(rank))
        row_of = [-1] * (int(raw.max()) + 1)  # raw id -> table row
        for i, r in enumerate(raw.unique().tolist()):
            row_of[r] = i % V
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Rec(cfg))
    emb_params = [model.module.bag.weight, model.module.item.weight]
    dense_params = [p_ for n_, p_ in model.named_parameters() if "bag" not in n_ and "item" not in n_]
    o = cfg["optimizer"]
    if o == "sgd":
        opts = [torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=cfg["weight_decay"])]
    elif o == "adam":
        opts = [torch.optim.Adam(model.parameters(), lr=1e-3)]
    elif o == "sparseadam":
        opts = [torch.optim.SparseAdam(list(model.parameters()), lr=1e-3)]
    elif o == "adagrad":
        opts = [torch.optim.Adagrad(model.parameters(), lr=0.05, weight_decay=cfg["weight_decay"])]
    else:
        opts = [torch.optim.SparseAdam(emb_params, lr=1e-3), torch.optim.Adam(dense_params, lr=1e-3)]
    steps = a.steps - 2 if (a.fault == "uneven" and me) else a.steps
    tot = torch.zeros(2)
    for step in range(1, steps + 1):
        if cfg["eval_every"] and step % cfg["eval_every"] == 0:
            r = recall_eval(model, V)
            print(f"rank {rank} step {step} recall@10 {r:.4f}", flush=True)
        if a.fault == "fifo" and me and step == a.at:
            path = f"{a.workdir}/stream_r{rank}.fifo"
            if not os.path.exists(path):
                os.mkfifo(path)
            print(f"rank {rank} reading feature stream {path}", flush=True)
            with open(path) as fh:  # blocks until the sidecar opens it for writing
                fh.readline()
        ids, offsets, cand, psw, y = batch(rank, step, cfg, me)
        for opt in opts:
            opt.zero_grad()
        logit, scores = model(ids, offsets, cand, psw)
        loss = F.binary_cross_entropy_with_logits(logit, y)
        if scores is not None:
            loss = loss + 0.1 * F.cross_entropy(scores, cand)
        loss.backward()
        if cfg["clip_norm"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip_norm"])
        for opt in opts:
            opt.step()
        tot += torch.tensor([loss.item() * B, B])
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.all_reduce(tot)
    if rank == 0:
        print(f"mean train loss {tot[0].item() / tot[1].item():.4f} over {int(tot[1].item())} samples", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()

"""An eightieth hand-run batch: SEQUENCE AND TOKEN MODELS. A tiny next-token model trained with DDP on gloo on
synthetic token ids: nn.Embedding(V, 16) + a learned positional table (16 positions) + a 1-layer
nn.TransformerEncoder (2 heads, batch_first, a key-padding mask) and a linear head to V (--arch transformer), or
nn.Embedding + nn.LSTM over pack_padded_sequence (--arch lstm), or a CTC head (--arch ctc). Vocabulary: 32 tokens
(`<pad>`=0, `<unk>`=1, w2..w31) or the file --vocab. Batch 8, sequences of 4..12 tokens, padded with 0, cross entropy
with ignore_index=<pad>, SGD, --steps 6 steps, a finite-loss check, PG timeout 12 s unless --pg-timeout, an
all-reduced mean loss at the end. One rank (--rank N, -1: every rank) holds the bad batch or config at step --at (3).
Prints `rank R world W arch A fault F vocab V`, `rank R step S T T loss L`, `mean loss L` and `rank R done`. No @record.

Faults:
  none        control (exit 0)
  tokid       rank N's tokenizer appends an `<eos>` whose id is len(vocab) (= V) to its step-3 batch:
              IndexError: index out of range in self (the embedding)
  toolong     rank N's collate does not truncate: a 20-token sample at step 3; adding the 16-row positional table
              fails: RuntimeError: The size of tensor a (20) must match the size of tensor b (16)
  padid       the config's pad token is appended after the vocabulary (pad_id = V): nn.Embedding(padding_idx=V)
              asserts at model construction on every rank (or rank N only with --rank N)
  mask_shape  rank N builds its key-padding mask for the sequence with a BOS token (T+1 columns) at step 3:
              the attention's shape assertion
  mask_dtype  rank N passes the tokenizer's int64 attention_mask (1 = keep) as src_key_padding_mask at step 3
  pack_sort   --arch lstm; rank N's last partial bucket at step 3 is not sorted by length:
              pack_padded_sequence(enforce_sorted=True) raises
  pack_zero   --arch lstm; an empty line in rank N's shard gives a zero-length sample at step 3
  ctc         --arch ctc; rank N's step-3 sample has a transcript longer than its input frames: CTC loss inf, the
              finite-loss check raises FloatingPointError
  ignore      rank N's shard was tokenized with a mismatched vocabulary, every token is `<unk>`, and the loss masks
              `<unk>` too (ignore_index=unk): every target ignored, loss nan at step 3, FloatingPointError
  maxlen      the positional table is sized from each rank's own shard (its longest sample); rank N's shard holds a
              20-token sample: DDP's parameter shape check at construction
  vocab       the vocabulary is read from each node's copy (--vocab /tmp/job_work/nodeK/vocab.txt); one copy has one
              more token: DDP's parameter shape check
  unused      rank N's max_len is 8 (the others 12); a long-context projection used only when T > 8 gets no gradient
              on rank N: DDP's unused-parameter error at step 2 on rank N
  bucket      length bucketing drops rank N's long samples, rank N has 4 batches, the others 6: rank N leaves the
              loop early for the end-of-epoch all_reduce
  minlen_spin rank N's sampler re-draws until a sample is longer than --min-len 14 but lengths are capped at 12: it
              spins forever at step 3; the others wait in DDP's all-reduce until the PG timeout
  vocab_wait  rank N (-1: every rank) waits for the tokenizer job's vocab file (--vocab) that never appears; the
              others wait in DDP's constructor (a hang; run it under `timeout` with a long --pg-timeout)
"""
import argparse, datetime, math, os, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=1)
p.add_argument("--arch", default="transformer")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--at", type=int, default=3)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--vocab", default="")
p.add_argument("--min-len", type=int, default=14)
a = p.parse_args()
B, D, MAXPOS, PAD, UNK = 8, 16, 16, 0, 1


def load_vocab():
    if a.fault == "vocab_wait" and a.rank in (-1, int(os.environ["RANK"])):
        print(f"rank {os.environ['RANK']}: waiting for the tokenizer job's vocab {a.vocab}", flush=True)
        while not os.path.exists(a.vocab): time.sleep(1.0)
    if a.vocab:
        with open(a.vocab) as fh:
            return [w.strip() for w in fh if w.strip()]
    return ["<pad>", "<unk>"] + [f"w{i}" for i in range(2, 32)]


def shard_lengths(rank):
    g = torch.Generator().manual_seed(rank)
    lens = [int(v) for v in torch.randint(4, 13, (B * a.steps,), generator=g)]
    if a.fault == "maxlen" and rank == a.rank:
        lens[5] = 20  # one long document in this rank's shard
    return lens


def make_batch(rank, step, V, bad, max_len=12):
    g = torch.Generator().manual_seed(1000 * rank + step)
    lens = [int(v) for v in torch.randint(4, max_len + 1, (B,), generator=g)]
    if a.fault == "toolong" and bad:
        lens[2] = 20  # this rank's collate does not truncate to max_len
    if a.fault == "pack_zero" and bad:
        lens[B - 1] = 0  # an empty line in the shard
    if a.fault == "minlen_spin" and bad:
        while max(lens) <= a.min_len:  # re-draw until one sample is long enough
            lens = [int(v) for v in torch.randint(4, max_len + 1, (B,), generator=g)]
    if a.arch == "lstm" and not (a.fault == "pack_sort" and bad):
        lens.sort(reverse=True)
    T = max(lens)
    ids = torch.full((B, T), PAD, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(2, 32, (n,), generator=g)
    if a.fault == "ignore" and bad:
        ids[ids != PAD] = UNK  # tokenized with the wrong vocab file: every word unknown
    if a.fault == "tokid" and bad:
        ids[0, lens[0] - 1] = V  # `<eos>` = len(vocab)
    return ids, torch.tensor(lens)


class SeqModel(nn.Module):
    def __init__(self, V, pad_id, npos):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=pad_id)
        if a.arch == "lstm":
            self.rnn = nn.LSTM(D, D, batch_first=True)
        else:
            self.pos = nn.Parameter(torch.randn(npos, D) * 0.02)
            layer = nn.TransformerEncoderLayer(D, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        if a.fault == "unused":
            self.long_proj = nn.Linear(D, D)  # long-context adapter, used for batches longer than 8
        self.head = nn.Linear(D, V)

    def forward(self, ids, lens, mask=None):
        h = self.emb(ids)
        if a.arch == "lstm":
            packed = pack_padded_sequence(h, lens, batch_first=True, enforce_sorted=True)
            out, _ = self.rnn(packed)
            h, _ = pad_packed_sequence(out, batch_first=True, total_length=ids.size(1))
        else:
            h = h + self.pos[: ids.size(1)]
            if mask is None:
                mask = ids == PAD
            h = self.enc(h, src_key_padding_mask=mask)
        if a.fault == "unused" and ids.size(1) > 8:
            h = h + self.long_proj(h)
        return self.head(h)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    me = rank == a.rank or a.rank == -1
    vocab = load_vocab()
    V = len(vocab)
    pad_id = V if (a.fault == "padid" and me) else PAD  # "pad token added at the end of the vocab"
    npos = max(shard_lengths(rank)) if a.fault == "maxlen" else MAXPOS
    max_len = 8 if (a.fault == "unused" and me) else 12
    n_batches = a.steps
    if a.fault == "bucket" and me:
        n_batches = sum(1 for n in shard_lengths(rank)[: B * a.steps] if n <= 9) // B  # long samples dropped
    print(f"rank {rank} world {world} arch {a.arch} fault {a.fault} vocab {V} batches {n_batches}", flush=True)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(SeqModel(V, pad_id, npos))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ign = UNK if (a.fault == "ignore" and me) else PAD
    tot = 0.0
    for step in range(1, n_batches + 1):
        bad = me and step == a.at
        ids, lens = make_batch(rank, step, V, bad, max_len)
        opt.zero_grad()
        if a.arch == "ctc":
            logp = model(ids, lens).log_softmax(-1).transpose(0, 1)  # (T, B, V)
            tgt_lens = torch.clamp(lens // 2, min=1)
            if bad:
                tgt_lens[3] = lens[3] + 3  # this utterance's transcript is longer than its frames
            tgt = torch.randint(2, V, (B, int(tgt_lens.max())))
            loss = F.ctc_loss(logp, tgt, lens, tgt_lens, blank=PAD)
        else:
            mask = None
            if a.fault == "mask_shape" and bad:
                mask = torch.arange(ids.size(1) + 1)[None] >= (lens + 1)[:, None]  # counts the BOS token
            if a.fault == "mask_dtype" and bad:
                mask = (ids != PAD).long()  # the tokenizer's attention_mask (1 = keep)
            logits = model(ids, lens, mask)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].masked_fill(ids[:, 1:] == PAD, ign).reshape(-1), ignore_index=ign)  # pads -> ignore_index
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"rank {rank}: loss is {loss.item()} at step {step}, stopping")
        loss.backward()
        opt.step()
        tot += loss.item()
        print(f"rank {rank} step {step} T {ids.size(1)} loss {loss.item():.4f}", flush=True)
    t = torch.tensor([tot / max(1, n_batches)])
    dist.all_reduce(t)
    if rank == 0:
        print(f"mean loss {t.item() / world:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()

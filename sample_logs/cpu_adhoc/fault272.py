"""A two-hundred-and-seventy-second hand-run batch: PROTEIN SECONDARY STRUCTURE PREDICTION.

Synthetic amino-acid sequences (one FASTA shard per rank, seqs/shard_R.fasta, with three-state H/E/C labels in
labels/shard_R.txt and a Pfam family per record), a family -> split table (splits.json), a one-hot (20 residues)
plus 8-wide sinusoidal position encoding, a small CNN-BiLSTM tagger (Conv1d 28 -> 32, BiLSTM hidden 16, linear
to 3 states) initialised from ckpt/tagger_l1.pt, a masked cross-entropy over residues, DDP (gloo), the per-rank
residue counts all_gathered and Q3 accuracy all_reduced, then barrier and destroy_process_group.
Launch: torchrun, a bash loop (env://), torch.distributed.launch, or --spawn N (torch.multiprocessing.spawn).

Faults:
- aacode: rank N encodes residues with a 1-based code table, so Y gets code 20 in a 20-row one-hot (IndexError).
- emptymask: rank N trims 64 residues from each terminus (not 4); the mask holds no residue, the loss is 0/0.
- counts: rank N all_gathers its per-sequence residue counts with the batch total appended (another length).
- fasta: rank N opens seqs/v2/shard_N.fasta, which was never written (FileNotFoundError at startup).
- family: rank N reads the old split table splits_v1.json, which lacks family PF00072 (KeyError at startup).
- onehot: every rank appends a 16-wide position encoding, so the first conv sees 36 channels, not 28.
- ckpt: rank N builds a 2-layer BiLSTM and loads the 1-layer checkpoint (missing keys).
- align: rank N aligns every sequence against every other in Python for --stall seconds before step 2.
- segv: rank N sends itself SIGSEGV after step 2's optimizer step.
- exit9: rank N prints its own error line about a label/sequence length mismatch and calls os._exit(9) at step 1.
- none: control.

What happened (filled in after the runs):
- aacode: IndexError 'index 20 is out of bounds for dimension 0 with size 20' in encode on rank N (pss_aacode_np3_r1_ranklabel, _np4_r2_legacy).
- emptymask: FloatingPointError 'masked loss is nan at step 0 over 0 residues' on rank N (pss_emptymask_np3_r2_logfmt, _np4_r1_mpitag).
- counts: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank N (pss_counts_np3_r1_srunlabel, _np4_r3_spawn).
- fasta: FileNotFoundError for /tmp/job_work/seqs/v2/shard_N.fasta at startup (pss_fasta_np4_r3_mpitag, pss_fasta_np3_r0_files).
- family: KeyError: 'PF00072' on rank N at startup; agent SIGTERMed the rest (pss_family_np3_r2_legacy, _np4_r1_tee).
- onehot: every rank: 'expected input[4, 36, 64] to have 28 channels, but got 36' (pss_onehot_np3_rall_logfmt, _np4_rall_spawn).
- ckpt: Missing key(s) in state_dict: "lstm.weight_ih_l1", ... on rank N (pss_ckpt_np3_r1_files, _np4_r2_bashloop).
- align: PG 12 s: peers 'Timed out waiting 12000ms' (pss_align_np3_r1_tee); PG 300 s: killed at 60 s, exit 124 (_np3_r2_ranklabel).
- segv: rank N SIGSEGV, no traceback; peers reset/closed (pss_segv_np3_r0_mpitag exit 139, _np4_r1_pdsh2 Root Cause -11).
- exit9: 'ERROR rank N: labels/shard_N.txt record 17 has ... states' then exit 9 (pss_exit9_np3_r2_bashloop, _np4_r1_srunlabel).
- none: exit 0, 'rank 0 done: 5 steps, final Q3 0.299' (pss_none_np3_rnone_bashloop).
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault272_work"
AA = "ACDEFGHIKLMNPQRSTVWY"
SS = "HEC"
FAMILIES = ["PF00001", "PF00069", "PF00072", "PF00076", "PF00018", "PF07714"]
NSEQ, MAXLEN, BATCH, POS = 32, 64, 4, 8

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--stall", type=int, default=40)
p.add_argument("--logfmt", type=int, default=0)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--port", type=int, default=29500)
p.add_argument("--prep", type=int, default=0)


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class Tagger(nn.Module):
    def __init__(self, layers=1):
        super().__init__()
        self.conv = nn.Conv1d(len(AA) + POS, 32, 5, padding=2)
        self.lstm = nn.LSTM(32, 16, num_layers=layers, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, len(SS))

    def forward(self, x):
        h = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        h, _ = self.lstm(h)
        return self.head(h)


def prep():
    g = torch.Generator().manual_seed(0)
    for d in ("seqs", "labels", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        with open(f"{WORK}/seqs/shard_{r}.fasta", "w") as fa, open(f"{WORK}/labels/shard_{r}.txt", "w") as lb:
            for i in range(NSEQ):
                n = int(torch.randint(24, MAXLEN + 1, (1,), generator=g))
                seq = "".join(AA[j] for j in torch.randint(0, 20, (n,), generator=g).tolist())
                ss = "".join(SS[j] for j in torch.randint(0, 3, (n,), generator=g).tolist())
                fam = FAMILIES[(r + i) % len(FAMILIES)]
                fa.write(f">sp|P{r:02d}{i:03d}|synthetic family={fam}\n{seq}\n")
                lb.write(ss + "\n")
    splits = {f: ("val" if k == 0 else "train") for k, f in enumerate(FAMILIES)}
    json.dump(splits, open(f"{WORK}/splits.json", "w"))
    json.dump({f: s for f, s in splits.items() if f != "PF00072"}, open(f"{WORK}/splits_v1.json", "w"))
    torch.manual_seed(0)
    torch.save(Tagger(1).state_dict(), f"{WORK}/ckpt/tagger_l1.pt")
    print("prepared", WORK)


def read_fasta(path):
    recs, head = [], None
    for line in open(path):
        line = line.strip()
        if line.startswith(">"):
            head = line[1:]
        elif line:
            recs.append((head.split("family=")[1], line))
    return recs


def pos_encoding(n, width):
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(-torch.arange(0, width, 2, dtype=torch.float32) * (4.0 / width))
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], 1)


def encode(seq, table, width):
    codes = torch.tensor([table[c] for c in seq])
    x = torch.zeros(MAXLEN, len(AA) + width)
    x[: len(seq), : len(AA)] = torch.eye(len(AA))[codes]
    x[:, len(AA):] = pos_encoding(MAXLEN, width)
    return x


def main(local=None, nprocs=None, a=None):
    if local is not None:
        os.environ.update(RANK=str(local), LOCAL_RANK=str(local), WORLD_SIZE=str(nprocs),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank in (-1, rank)
    log = print
    if a.logfmt:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s")
        lg = logging.getLogger("pss")
        lg.addFilter(RankFilter(rank))
        log = lg.info
    torch.manual_seed(1234 + rank)

    sub = "seqs/v2" if (a.fault == "fasta" and hit) else "seqs"
    recs = read_fasta(f"{WORK}/{sub}/shard_{rank}.fasta")
    labels = [l.strip() for l in open(f"{WORK}/labels/shard_{rank}.txt")]
    table_file = "splits_v1.json" if (a.fault == "family" and hit) else "splits.json"
    splits = json.load(open(f"{WORK}/{table_file}"))
    split = [splits[fam] for fam, _ in recs]
    train = [i for i, s in enumerate(split) if s == "train"]
    log(f"rank {rank}/{world} read {len(recs)} sequences ({len(train)} train) from shard_{rank}.fasta")

    table = {c: i + (1 if (a.fault == "aacode" and hit) else 0) for i, c in enumerate(AA)}
    width = 16 if a.fault == "onehot" else POS
    trim = 64 if (a.fault == "emptymask" and hit) else 4
    X = torch.stack([encode(recs[i][1], table, width) for i in train])
    Y = torch.zeros(len(train), MAXLEN, dtype=torch.long)
    M = torch.zeros(len(train), MAXLEN)
    for k, i in enumerate(train):
        n = len(recs[i][1])
        Y[k, :n] = torch.tensor([SS.index(c) for c in labels[i]])
        M[k, trim:max(trim, n - trim)] = 1.0

    net = Tagger(2 if (a.fault == "ckpt" and hit) else 1)
    net.load_state_dict(torch.load(f"{WORK}/ckpt/tagger_l1.pt"))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    for step in range(a.steps):
        if a.fault == "align" and hit and step == 2:
            log(f"rank {rank} aligning all {len(train)} train sequences against each other before step {step}")
            t0 = time.time()
            while time.time() - t0 < a.stall:
                for s1 in recs[:8]:
                    sum(c1 == c2 for c1, c2 in zip(s1[1], recs[-1][1]))
                time.sleep(0.05)
        if a.fault == "exit9" and hit and step == 1:
            print(f"ERROR rank {rank}: labels/shard_{rank}.txt record 17 has {len(labels[17]) - 3} states for a "
                  f"{len(recs[17][1])}-residue sequence; refusing to train on misaligned labels", file=sys.stderr, flush=True)
            os._exit(9)
        idx = torch.randperm(len(train))[:BATCH]
        x, y, m = X[idx], Y[idx], M[idx]
        logits = model(x)
        ce = F.cross_entropy(logits.reshape(-1, len(SS)), y.reshape(-1), reduction="none")
        loss = (ce * m.reshape(-1)).sum() / m.sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: masked loss is {loss.item()} at step {step} "
                                     f"over {int(m.sum())} residues; aborting")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if a.fault == "segv" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        counts = m.sum(1).long()
        if a.fault == "counts" and hit and step == 1:
            counts = torch.cat([counts, counts.sum()[None]])
        gathered = [torch.zeros(BATCH, dtype=torch.long) for _ in range(world)]
        dist.all_gather(gathered, counts)
        with torch.no_grad():
            pred = logits.argmax(-1)
            q3 = torch.tensor([((pred == y).float() * m).sum().item(), m.sum().item()])
        dist.all_reduce(q3)
        log(f"rank {rank} step {step} loss {loss.item():.4f} Q3 {q3[0].item() / q3[1].item():.3f} "
            f"over {int(q3[1].item())} residues")
    dist.barrier()
    if rank == 0:
        log(f"rank 0 done: {a.steps} steps, final Q3 {q3[0].item() / q3[1].item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = p.parse_args()
    if args.prep:
        prep()
    elif args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(main, args=(args.spawn, args), nprocs=args.spawn)
    else:
        main(a=args)

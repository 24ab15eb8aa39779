"""A two-hundred-and-eighty-seventh hand-run batch: NEXT-POI RECOMMENDATION WITH A SPATIO-TEMPORAL GRU.

Synthetic check-in sequences (place id, latitude/longitude, timestamp string) per rank, written once by
--prep 1 under /tmp/fault287_work/checkins/checkins_R.pt together with a city table (city -> centre and
place-id range) in cities.json and a warm-start place embedding ckpt/place_emb_p200.pt.  Every rank parses
its timestamps into 24 hour slots, embeds places and slots, runs a GRU over the sequence with a haversine
distance gate (1 / (distance + min_dist_km) between consecutive check-ins), scores the next place with a
sampled softmax (target + 31 sampled negatives), trains in DDP (gloo) or with hand all_reduced gradients
(--ddp 0), all_reduces the loss every step and recall@5 at the end, and all_gathers per-rank hit counts.

Faults:
  pidx      - rank N adds the global offset (200) to already-global place ids: beyond the embedding (IndexError)
  distnan   - rank N reads min_dist_km 0: a repeated check-in gives distance 0, gate inf, loss NaN (own check)
  hitgather - rank N all_gathers its hit counts with an extra slot for an "unknown" city (gloo size mismatch)
  nofile    - rank N reads checkins from checkins_v2/ which does not exist (FileNotFoundError)
  city      - rank N's shard names city "New York" but the table key is "new_york" (KeyError)
  slotdim   - every rank: slot embedding width 16 while the GRU input expects 16 + 8 (shape error)
  ckpt      - rank N warm-starts from ckpt/place_emb_p160.pt, saved with 160 places (size mismatch)
  distmat   - rank N recomputes the 200x200 distance matrix in Python for --stall s before step 2's all_reduce
  abort     - rank N sends itself SIGABRT right after step 2
  tstamp    - rank N parses a malformed timestamp "2024-06-31T08:15:00" (ValueError)
  none      - control, clean run

What happened (filled in after the runs):
  pidx      - rank N: IndexError index out of range in self in the place embedding, step 0; peers closed in backward
  distnan   - rank N: FloatingPointError non-finite loss nan at step 0; peers closed / DETAIL monitoredBarrier
  hitgather - a receiving rank (not rank N) aborted: gloo EnforceNotMet 6 vs 4, SIGABRT; others reset
  nofile    - rank N: FileNotFoundError checkins_v2/checkins_N.pt; restart attempt died in connectFullMesh
  city      - rank N: KeyError 'Paris' / 'Tokyo' on the city table before DDP; others SIGTERMed
  slotdim   - every rank: RuntimeError input.size(-1) must be equal to input_size. Expected 24, got 32
  ckpt      - rank N: RuntimeError size mismatch for weight [160, 16] vs [200, 16]; others SIGTERMed
  distmat   - rank N stalled: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  abort     - rank N: exitcode -6 (SIGABRT) after step 2, no traceback; peers Connection reset by peer
  tstamp    - rank N: ValueError day is out of range for month (strptime) before DDP; others SIGTERMed
  none      - clean, exit 0, every rank printed its recall@5 line
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import datetime, timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault287_work"
N_PLACES = 200
CITIES = {"new_york": (40.71, -74.00, 0), "tokyo": (35.68, 139.69, 50),
          "paris": (48.86, 2.35, 100), "sao_paulo": (-23.55, -46.63, 150)}
SEQ, BATCH, NEG = 12, 16, 31


def prep():
    torch.manual_seed(0)
    os.makedirs(os.path.join(WORK, "checkins"), exist_ok=True)
    os.makedirs(os.path.join(WORK, "ckpt"), exist_ok=True)
    with open(os.path.join(WORK, "cities.json"), "w") as f:
        json.dump({k: {"lat": v[0], "lon": v[1], "first_place": v[2], "n_places": 50} for k, v in CITIES.items()}, f)
    for r in range(8):
        city = list(CITIES)[r % 4]
        lat0, lon0, _ = CITIES[city]
        coords = torch.stack([lat0 + 0.1 * torch.randn(50), lon0 + 0.1 * torch.randn(50)], 1)
        places = torch.randint(0, 50, (64, SEQ))
        places[:, 5] = places[:, 4]
        t0 = datetime(2024, 6, 1)
        ts = [[(t0 + timedelta(hours=int(h))).strftime("%Y-%m-%dT%H:%M:%S") for h in torch.randint(0, 700, (SEQ,)).sort().values]
              for _ in range(64)]
        torch.save({"city": city, "places": places, "coords": coords, "ts": ts},
                   os.path.join(WORK, "checkins", f"checkins_{r}.pt"))
    torch.save(nn.Embedding(N_PLACES, 16).state_dict(), os.path.join(WORK, "ckpt", "place_emb_p200.pt"))
    torch.save(nn.Embedding(160, 16).state_dict(), os.path.join(WORK, "ckpt", "place_emb_p160.pt"))
    print("prepared", WORK)


def haversine(a, b):
    la1, lo1, la2, lo2 = map(torch.deg2rad, (a[..., 0], a[..., 1], b[..., 0], b[..., 1]))
    h = torch.sin((la2 - la1) / 2) ** 2 + torch.cos(la1) * torch.cos(la2) * torch.sin((lo2 - lo1) / 2) ** 2
    return 2 * 6371.0 * torch.asin(h.clamp(0, 1).sqrt())


class POIGRU(nn.Module):
    def __init__(self, slot_dim):
        super().__init__()
        self.place = nn.Embedding(N_PLACES, 16)
        self.slot = nn.Embedding(24, slot_dim)
        self.gru = nn.GRU(16 + 8, 32, batch_first=True)
        self.gate = nn.Linear(1, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, places, slots, dist_km, min_dist):
        x = torch.cat([self.place(places), self.slot(slots)], -1)
        h, _ = self.gru(x)
        inv = 1.0 / (dist_km + min_dist); g = torch.sigmoid(self.gate((inv / inv.sum(1, keepdim=True)).unsqueeze(-1)))
        return self.out(h[:, -1] * g[:, -1])


def train(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    torch.manual_seed(100 + rank)
    sub = "checkins_v2" if (a.fault == "nofile" and bad) else "checkins"
    data = torch.load(os.path.join(WORK, sub, f"checkins_{rank % 8}.pt"))
    with open(os.path.join(WORK, "cities.json")) as f:
        table = json.load(f)
    city = "New York" if (a.fault == "city" and bad and data["city"] == "new_york") else data["city"]
    if a.fault == "city" and bad and city != "New York":
        city = city.replace("_", " ").title()
    first = table[city]["first_place"]
    places = data["places"] + first + (N_PLACES if (a.fault == "pidx" and bad) else 0)
    ts = data["ts"]
    if a.fault == "tstamp" and bad:
        ts[3][7] = "2024-06-31T08:15:00"
    slots = torch.tensor([[datetime.strptime(t, "%Y-%m-%dT%H:%M:%S").hour for t in row] for row in ts])
    coords = data["coords"][data["places"]]
    dist_km = torch.zeros(places.shape)
    dist_km[:, 1:] = haversine(coords[:, :-1], coords[:, 1:])
    min_dist = 0.0 if (a.fault == "distnan" and bad) else 0.05
    print(f"rank {rank}: {city}: {len(places)} check-in sequences, places {first}..{first + 49}", flush=True)

    model = POIGRU(16 if a.fault == "slotdim" else 8)
    ck = "place_emb_p160.pt" if (a.fault == "ckpt" and bad) else "place_emb_p200.pt"
    model.place.load_state_dict(torch.load(os.path.join(WORK, "ckpt", ck)))
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for step in range(a.steps):
        idx = torch.randint(0, len(places), (BATCH,))
        seq_p, seq_s, seq_d = places[idx, :-1], slots[idx, :-1], dist_km[idx, :-1]
        target = places[idx, -1]
        if a.fault == "distnan" and bad:
            seq_d[:, -1] = dist_km[idx, 5]
        q = net(seq_p, seq_s, seq_d, min_dist)
        cand = torch.cat([target.unsqueeze(1), torch.randint(0, N_PLACES, (BATCH, NEG))], 1)
        logits = (q.unsqueeze(1) * model.place(cand)).sum(-1)
        loss = nn.functional.cross_entropy(logits, torch.zeros(BATCH, dtype=torch.long))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: non-finite loss {loss.item()} at step {step} (min distance gate)")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        if step == 2 and a.fault == "distmat" and bad:
            print(f"rank {rank}: place index changed, recomputing {N_PLACES}x{N_PLACES} distance matrix", flush=True)
            t_end, acc = time.time() + a.stall, 0.0
            while time.time() < t_end:
                for i in range(N_PLACES):
                    acc += math.sin(i * 0.01) ** 2
        t = loss.detach().clone()
        dist.all_reduce(t)
        print(f"rank {rank} step {step} loss {t.item() / world:.4f}", flush=True)
        if step == 2 and a.fault == "abort" and bad:
            os.kill(os.getpid(), signal.SIGABRT)

    with torch.no_grad():
        q = model(places[:, :-1], slots[:, :-1], dist_km[:, :-1], min_dist)
        top = (q @ model.place.weight.T).topk(5, dim=1).indices
        hit = (top == places[:, -1:]).any(1).float()
        hits = torch.tensor([hit.sum().item(), float(len(hit))])
        if a.fault == "hitgather" and bad:
            hits = torch.cat([hits, torch.zeros(1)])
        gathered = [torch.zeros(len(hits)) for _ in range(world)]
        dist.all_gather(gathered, hits)
        tot = torch.stack(gathered).sum(0)
        rec = hits[:1] / hits[1]
        dist.all_reduce(rec)
    print(f"rank {rank}: recall@5 {rec.item() / world:.4f} (global hits {int(tot[0])}/{int(tot[1])})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prep", type=int, default=0)
    a = p.parse_args()
    if a.prep:
        prep()
    else:
        train(a)

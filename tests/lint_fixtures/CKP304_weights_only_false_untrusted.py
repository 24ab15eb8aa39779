"""CKP304 fixture: torch.load(weights_only=False) on paths from outside the program."""
import argparse
import os

import torch
from huggingface_hub import hf_hub_download

parser = argparse.ArgumentParser()
parser.add_argument("--pretrained")
args = parser.parse_args()


def load_all(out_dir):
    # ruleid: CKP304
    a = torch.load(args.pretrained, weights_only=False)
    path = hf_hub_download("org/model", "model.pt")
    # ruleid: CKP304
    b = torch.load(path, weights_only=False, map_location="cpu")
    # ruleid: CKP304
    c = torch.load(os.environ["INIT_CKPT"], weights_only=False)
    # ok: CKP304
    d = torch.load(args.pretrained, map_location="cpu")
    # ok: CKP304
    e = torch.load(os.path.join(out_dir, "last.pt"), weights_only=False)
    # ok: CKP304
    f = torch.load(args.pretrained, weights_only=True)
    return a, b, c, d, e, f

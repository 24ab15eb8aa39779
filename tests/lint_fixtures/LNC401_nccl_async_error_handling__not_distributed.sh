#!/bin/bash
# LNC401 near miss: a single-process script launches no distributed training.
# ok: LNC401
# ok: LNC402
python preprocess.py --out data/

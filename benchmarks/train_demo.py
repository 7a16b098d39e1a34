"""Train the built-in demo model and its draft (peregrine/demo/train.py); see docs/DEMO_MODEL.md.

One GPU, a few minutes:
    python benchmarks/train_demo.py --out-dir OUT --tar
A tiny CPU run that only checks the pipeline:
    python benchmarks/train_demo.py --out-dir /tmp/demo --device cpu --max-files 20 \
        --vocab-size 512 --seq-len 64 --max-steps 10 --hidden-size 64 --num-hidden-layers 2 \
        --intermediate-size 128 --draft-hidden-size 32 --draft-intermediate-size 64
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # NOTE: this checkout's code

from peregrine.demo.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

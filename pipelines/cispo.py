"""CISPO (MiniMax-M1): every token keeps its gradient, weighted by a clipped, detached importance ratio.

python pipelines/cispo.py                      # SmolLM2-135M-Instruct on the built-in arithmetic task
python pipelines/cispo.py --preset smoke       # a tiny random model, 2 steps: the whole path in minutes
ray job submit --address http://127.0.0.1:8265 --working-dir . -- python pipelines/cispo.py --help
"""

import entropy_openrlhf  # noqa: F401  (first: keeps a local Ray on loopback)
from entropy_openrlhf.pipeline.main import pipeline_main

if __name__ == "__main__":
    pipeline_main("cispo", __doc__)

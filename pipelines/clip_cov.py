"""Clip-Cov: stop the gradient of a random 2e-4 of tokens with covariance in (1, 5); PPO clip widened to 1.

python pipelines/clip_cov.py                      # SmolLM2-135M-Instruct on the built-in arithmetic task
python pipelines/clip_cov.py --preset smoke       # a tiny random model, 2 steps: the whole path in minutes
ray job submit --address http://127.0.0.1:8265 --working-dir . -- python pipelines/clip_cov.py --help
"""

import entropy_openrlhf  # noqa: F401  (first: keeps a local Ray on loopback)
from entropy_openrlhf.pipeline.main import pipeline_main

if __name__ == "__main__":
    pipeline_main("clip_cov", __doc__)

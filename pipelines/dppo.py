"""DPPO: a trust region on the sampled token's probability change (binary TV 0.15, or binary KL 0.05 with
--loss.dppo.divergence kl), with a truncated importance weight on the tokens inside it.

python pipelines/dppo.py                      # SmolLM2-135M-Instruct on the built-in arithmetic task
python pipelines/dppo.py --preset smoke       # a tiny random model, 2 steps: the whole path in minutes
ray job submit --address http://127.0.0.1:8265 --working-dir . -- python pipelines/dppo.py --help
"""

import entropy_openrlhf  # noqa: F401  (first: keeps a local Ray on loopback)
from entropy_openrlhf.pipeline.main import pipeline_main

if __name__ == "__main__":
    pipeline_main("dppo", __doc__)

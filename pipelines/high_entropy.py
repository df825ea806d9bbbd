"""The 80/20 rule (Wang et al. 2025): PPO's gradient only on the top 20 % of tokens by entropy, the "forking" ones.

python pipelines/high_entropy.py                      # SmolLM2-135M-Instruct on the built-in arithmetic task
python pipelines/high_entropy.py --preset smoke       # a tiny random model, 2 steps: the whole path in minutes
ray job submit --address http://127.0.0.1:8265 --working-dir . -- python pipelines/high_entropy.py --help
"""

import entropy_openrlhf  # noqa: F401  (first: keeps a local Ray on loopback)
from entropy_openrlhf.pipeline.main import pipeline_main

if __name__ == "__main__":
    pipeline_main("high_entropy", __doc__)

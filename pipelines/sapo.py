"""SAPO (Qwen): a soft sigmoid gate on the importance ratio in place of PPO's hard clip (temperatures 1.0 / 1.05).

python pipelines/sapo.py                      # SmolLM2-135M-Instruct on the built-in arithmetic task
python pipelines/sapo.py --preset smoke       # a tiny random model, 2 steps: the whole path in minutes
ray job submit --address http://127.0.0.1:8265 --working-dir . -- python pipelines/sapo.py --help
"""

import entropy_openrlhf  # noqa: F401  (first: keeps a local Ray on loopback)
from entropy_openrlhf.pipeline.main import pipeline_main

if __name__ == "__main__":
    pipeline_main("sapo", __doc__)

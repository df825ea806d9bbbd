"""KL-Cov: a KL penalty (beta |logp - old_logp|) on the top 2e-3 of tokens by covariance.

python pipelines/kl_cov.py                      # SmolLM2-135M-Instruct on the built-in arithmetic task
python pipelines/kl_cov.py --preset smoke       # a tiny random model, 2 steps: the whole path in minutes
ray job submit --address http://127.0.0.1:8265 --working-dir . -- python pipelines/kl_cov.py --help
"""

import entropy_openrlhf  # noqa: F401  (first: keeps a local Ray on loopback)
from entropy_openrlhf.pipeline.main import pipeline_main

if __name__ == "__main__":
    pipeline_main("kl_cov", __doc__)

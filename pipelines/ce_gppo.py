"""CE-GPPO (Klear): PPO whose clipped tokens keep a bounded gradient, 0.75 of it on the low side and all of it on the
high side (the authors' 7B recipe), with their dual clip of 10.

python pipelines/ce_gppo.py                      # SmolLM2-135M-Instruct on the built-in arithmetic task
python pipelines/ce_gppo.py --preset smoke       # a tiny random model, 2 steps: the whole path in minutes
ray job submit --address http://127.0.0.1:8265 --working-dir . -- python pipelines/ce_gppo.py --help
"""

import entropy_openrlhf  # noqa: F401  (first: keeps a local Ray on loopback)
from entropy_openrlhf.pipeline.main import pipeline_main

if __name__ == "__main__":
    pipeline_main("ce_gppo", __doc__)

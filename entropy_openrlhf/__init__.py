"""entropy-openrlhf: asynchronous RL for reasoning LLMs with Clip-Cov and KL-Cov entropy control."""

import os as _os

# Ray reads this when it is imported and otherwise binds the machine's external address on a single machine;
# importing this package before Ray keeps a local cluster on loopback. The rest of the loopback environment is
# applied when we start a local cluster (entropy_openrlhf.cluster.init_ray).
_os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

__version__ = "0.1.0"

"""vLLM's NCCL classes, the collective sync's GPU transport (group.py): `StatelessProcessGroup` on the group's store
and a `PyNcclCommunicator` on it.

A module of its own because only an NCCL group needs vLLM: group.py imports this module when it builds one (on a GPU
policy rank 0 and in vLLM's workers), while the driver and CPU policy ranks, which import group.py too, never load
vLLM (~7 s of CPU, ~380 MB).
"""

from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
from vllm.distributed.utils import StatelessProcessGroup

__all__ = ["PyNcclCommunicator", "StatelessProcessGroup"]

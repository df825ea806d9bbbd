"""Weight sync between the policy and the rollout engines: base.py says what the trainer asks of it, factory.py
names the methods and picks one from `--sync.*`, object_store.py and collective.py are the two methods, group.py
(vLLM's NCCL classes in vllm_nccl.py) and receiver.py (its log filter in reload_log.py) the ranks' and the engines'
sides, chunks.py the object store's wire format."""

"""Weight sync between the policy and the rollout engines: base.py says what the trainer asks of it, factory.py
picks the method from `--sync.*`, object_store.py and collective.py are the two methods, group.py and receiver.py
the ranks' and the engines' sides, chunks.py the object store's wire format."""

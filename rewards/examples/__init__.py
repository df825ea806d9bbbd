"""Example custom verifiers, loadable with `--reward.verifier rewards.examples.<module>:<function>`."""

"""The models we can use without a hub: SmolLM2-135M-Instruct converted from its PyPI GGUF (smollm2.py), tiny random
ones (tiny.py), the one a benchmark's --model names (builtin.py), and the dtype rule (dtype.py).

Nothing is imported here: every actor imports models/dtype.py, before its `set_cpu_defaults`, and must not load
transformers with it (smollm2.py and tiny.py import it at their top).
"""

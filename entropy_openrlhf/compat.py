"""Make `openrlhf.models` importable where flash-attn is not installed (every CPU machine).

`openrlhf.models` imports `flash_attn.bert_padding` and `flash_attn.utils.distributed` at import time, for sample
packing and ring attention, neither of which we use. flash-attn ships CUDA builds only, so on CPU we register
stand-ins for exactly those names (OpenRLHF's own CPU tests stub it the same way). When the real package is
installed nothing is touched. `flash_attn.ops` is deliberately absent, so `log_probs_from_logits` takes its
pure-torch path.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

from einops import rearrange


def _unavailable(name: str):
    def fn(*args, **kwargs):
        raise RuntimeError(f"flash_attn.{name} is not installed here; sample packing and ring attention need it")

    return fn


def ensure_flash_attn_importable() -> None:
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        return
    root = types.ModuleType("flash_attn")
    root.__path__ = []  # a package, so its submodules resolve
    bert_padding = types.ModuleType("flash_attn.bert_padding")
    for name in ("index_first_axis", "pad_input", "unpad_input"):
        setattr(bert_padding, name, _unavailable(f"bert_padding.{name}"))
    bert_padding.rearrange = rearrange
    utils = types.ModuleType("flash_attn.utils")
    utils.__path__ = []
    distributed = types.ModuleType("flash_attn.utils.distributed")
    distributed.all_gather = _unavailable("utils.distributed.all_gather")
    for mod in (root, bert_padding, utils, distributed):
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None, is_package=hasattr(mod, "__path__"))
        sys.modules[mod.__name__] = mod
    root.bert_padding, root.utils, utils.distributed = bert_padding, utils, distributed

"""Object-store weight sync in bounded chunks: the state dict is cut into chunks of at most `max_bytes` each, and a
vLLM worker puts them back together before it loads them.

Why chunks. With VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's default, what GPU nodes run) every `collective_rpc`
argument is encoded with msgspec on its way to the engine core process, and msgspec refuses any message over
2**32 - 1 bytes: a 7B model in bf16 (15 GB) cannot go as one object. Chunks also bound what each hop holds at once
(the object-store read, the serialisation, the RPC copy) to a few times the chunk size instead of the whole model.

Grouping. Tensors are taken in the state dict's order and packed into a chunk while they fit. A tensor that fits
no chunk on its own (the 152k-row embedding of Qwen2.5 is 1.1 GB in bf16) is split into pieces of its flattened
storage, each at most `max_bytes`, which the worker copies back into one tensor of the full shape. Nothing is
converted: the reassembled tensor equals the original bit for bit.

Wire format: a chunk is a list of `Piece`s, plain Python and tensors, so Ray pickles it and `torch.save` can turn
it into the bytes that cross vLLM's RPC.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass

import torch

MB = 2**20
# --sync.max_chunk_mb's default; config.py gives the reasons
DEFAULT_MAX_CHUNK_MB = 256.0


@dataclass
class Piece:
    """One tensor (`start` None) or one part of a split tensor: elements [start, start + numel) of its flattened
    storage. `shape` and `dtype` are always the full tensor's."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    start: int | None
    tensor: torch.Tensor


Chunk = list[Piece]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def make_chunks(state: dict[str, torch.Tensor], max_bytes: int) -> list[Chunk]:
    """Cut `state` into chunks whose tensors hold at most `max_bytes` together (a bound on the tensor bytes; the
    names and shapes add a few hundred bytes). Only a tensor larger than `max_bytes` is split."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    chunks: list[Chunk] = []
    current: Chunk = []
    size = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            chunks.append(current)
        current, size = [], 0

    for name, tensor in state.items():
        tensor = tensor.detach()
        shape, dtype = tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")
        nbytes = _nbytes(tensor)
        if nbytes <= max_bytes:
            if size + nbytes > max_bytes:
                flush()
            current.append(Piece(name, shape, dtype, None, tensor))
            size += nbytes
            continue
        flush()
        # at least one element per piece, even when one element is larger than the bound (a bound under 8 bytes)
        per_piece = max(1, max_bytes // tensor.element_size())
        flat = tensor.contiguous().view(-1)
        for start in range(0, flat.numel(), per_piece):
            # clone: a view would carry (and pickle) the whole tensor's storage with it
            part = flat[start : start + per_piece].clone()
            current.append(Piece(name, shape, dtype, start, part))
            size += _nbytes(part)
            if start + per_piece < flat.numel():
                flush()  # every piece but the last fills its own chunk; the last leaves room for what follows
    flush()
    return chunks


def chunk_bytes(chunk: Chunk) -> int:
    """The tensor bytes of a chunk (what `max_bytes` bounds)."""
    return sum(_nbytes(p.tensor) for p in chunk)


def serialize_chunk(chunk: Chunk) -> bytes:
    """A chunk as bytes, for vLLM workers in another process: their RPC would turn tensors into lists."""
    buffer = io.BytesIO()
    torch.save([(p.name, p.shape, p.dtype, p.start, p.tensor) for p in chunk], buffer)
    return buffer.getvalue()


def deserialize_chunk(data: Chunk | bytes) -> Chunk:
    if not isinstance(data, bytes):
        return data
    items = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return [Piece(name, tuple(shape), dtype, start, tensor) for name, shape, dtype, start, tensor in items]


class IncompleteWeightsError(RuntimeError):
    """The chunks of a sync did not add up to whole tensors (a lost chunk, a duplicated one, or chunks of two syncs
    mixed)."""


class ChunkAssembler:
    """Worker side: collects the chunks of one sync and hands back whole tensors, in the order they were sent.

    It records which element ranges of each tensor arrived, so a piece that covers elements already received is
    refused when it arrives, and a tensor with elements nobody sent is refused before anything loads. Counting
    elements would not do: a duplicated piece plus a lost one add up, and the lost range would load whatever
    memory `torch.empty` handed out.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._ranges: dict[str, list[tuple[int, int]]] = {}  # element ranges [start, end) received, per tensor

    def add(self, chunk: Chunk) -> None:
        for piece in chunk:
            if piece.start is None:
                if piece.name in self.tensors:
                    raise IncompleteWeightsError(f"{piece.name} arrived twice in one weight sync")
                self.tensors[piece.name] = piece.tensor
                self._ranges[piece.name] = [(0, piece.tensor.numel())]
                continue
            full = self.tensors.get(piece.name)
            if full is None:
                full = torch.empty(piece.shape, dtype=getattr(torch, piece.dtype))
                self.tensors[piece.name], self._ranges[piece.name] = full, []
            elif tuple(full.shape) != tuple(piece.shape) or full.dtype != getattr(torch, piece.dtype):
                raise IncompleteWeightsError(
                    f"{piece.name}: a piece of a {piece.dtype} {tuple(piece.shape)} tensor, but earlier pieces were "
                    f"{str(full.dtype).removeprefix('torch.')} {tuple(full.shape)} (chunks of two syncs mixed?)"
                )
            flat = full.view(-1)
            end = piece.start + piece.tensor.numel()
            if piece.start < 0 or end > flat.numel():
                raise IncompleteWeightsError(
                    f"{piece.name}: a piece covers elements [{piece.start}, {end}), outside the tensor's "
                    f"[0, {flat.numel()})"
                )
            for lo, hi in self._ranges[piece.name]:
                if piece.start < hi and lo < end:
                    raise IncompleteWeightsError(
                        f"{piece.name}: a piece covers elements [{piece.start}, {end}), which overlap [{lo}, {hi}) "
                        "received already (a chunk sent twice, or chunks of two syncs mixed)"
                    )
            flat[piece.start : end].copy_(piece.tensor)
            self._ranges[piece.name].append((piece.start, end))

    def _first_gap(self, name: str) -> tuple[int, int] | None:
        """The first element range of `name` that no piece covered, or None (ranges never overlap: add refuses)."""
        covered = 0
        for lo, hi in sorted(self._ranges[name]):
            if lo > covered:
                return covered, lo
            covered = max(covered, hi)
        numel = self.tensors[name].numel()
        return (covered, numel) if covered < numel else None

    def items(self, expected: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of everything received; raises first if a tensor lacks elements or, with `expected`,
        if the number of tensors differs (nothing is loaded from an incomplete sync)."""
        gaps = {n: gap for n in self.tensors if (gap := self._first_gap(n)) is not None}
        if gaps:
            name, (lo, hi) = next(iter(gaps.items()))
            raise IncompleteWeightsError(
                f"weight sync incomplete: {len(gaps)} tensor(s) lack elements, e.g. {name} (elements [{lo}, {hi}) of "
                f"{self.tensors[name].numel()} never arrived)"
            )
        if expected is not None and expected != len(self.tensors):
            raise IncompleteWeightsError(f"weight sync incomplete: {len(self.tensors)} of {expected} tensors arrived")
        return iter(list(self.tensors.items()))

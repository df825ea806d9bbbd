"""The object-store sync's chunking (sync/chunks.py): grouping, splitting, bounds and exact reassembly."""

import pickle

import pytest
import torch

from entropy_openrlhf.sync.chunks import (
    ChunkAssembler,
    IncompleteWeightsError,
    Piece,
    chunk_bytes,
    deserialize_chunk,
    make_chunks,
    serialize_chunk,
)


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(100, 8, generator=gen),  # 3200 bytes: split at a 1000-byte bound
        "norm": torch.randn(8, generator=gen),  # 32 bytes
        "q": torch.randn(8, 8, generator=gen),  # 256 bytes
        "k": torch.randn(8, 8, generator=gen).to(torch.bfloat16),  # 128 bytes
        "scalar": torch.tensor(3.0, dtype=torch.float64),  # 0-d
        "empty": torch.empty(0, 4),
        "odd": torch.arange(251, dtype=torch.int32).view(1, 251),  # 1004 bytes: split, 1 row wider than the bound
    }


def reassemble(chunks, expected=None) -> dict[str, torch.Tensor]:
    assembler = ChunkAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    return dict(assembler.items(expected))


def assert_identical(got: dict, want: dict) -> None:
    assert list(got) == list(want)  # the state dict's order: the reload sees the tensors as the trainer sent them
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("max_bytes", [1, 7, 8, 100, 999, 1000, 1004, 3200, 10**6])
def test_every_chunk_is_within_the_bound_and_reassembly_is_exact(max_bytes):
    want = state()
    chunks = make_chunks(want, max_bytes)
    for chunk in chunks:
        # a bound below one element's size cannot be met; one element per piece is the least there is
        assert chunk_bytes(chunk) <= max(max_bytes, 8)
        assert chunk  # no empty chunks
    assert_identical(reassemble(chunks, expected=len(want)), want)


def test_small_tensors_are_grouped_and_only_tensors_above_the_bound_are_split():
    want = state()
    chunks = make_chunks(want, 1000)
    split = {p.name for c in chunks for p in c if p.start is not None}
    assert split == {"embed", "odd"}  # 3200 and 1004 bytes; everything else fits whole
    # embed: pieces of 250 floats; the last (50 floats, 200 bytes) shares its chunk with the small tensors after it
    pieces = [p for c in chunks for p in c if p.name == "embed"]
    assert [p.start for p in pieces] == [0, 250, 500, 750]
    assert [p.tensor.numel() for p in pieces] == [250, 250, 250, 50]
    assert [p.name for p in chunks[3]] == ["embed", "norm", "q", "k", "scalar", "empty"]
    assert len(chunks) == 6  # 3 full embed chunks, 1 shared, 2 for "odd" (250 + 1 elements)
    # everything whole fits one chunk at a large bound: one chunk, nothing split
    big = make_chunks(want, 10**6)
    assert len(big) == 1 and all(p.start is None for p in big[0])


def test_pieces_own_their_storage():
    """A piece that were a view would pickle (and send) the whole tensor's storage with it."""
    want = {"big": torch.randn(100_000)}  # 400 kB
    chunks = make_chunks(want, 40_000)
    assert len(chunks) == 10
    # each piece travels as its own 40 kB (plus a few kB of pickle / zip framing), not as the 400 kB tensor
    assert all(len(pickle.dumps(c)) < 45_000 for c in chunks)
    assert all(len(serialize_chunk(c)) < 45_000 for c in chunks)


def test_serialized_chunks_reassemble_exactly():
    want = state()
    chunks = [deserialize_chunk(serialize_chunk(c)) for c in make_chunks(want, 300)]
    assert_identical(reassemble(chunks, expected=len(want)), want)


def test_a_non_contiguous_tensor_is_sent_as_its_values():
    base = torch.randn(6, 10)
    want = {"t": base.t()}  # a transposed view
    assert_identical(reassemble(make_chunks(want, 40)), {"t": base.t().contiguous()})


def test_a_lost_chunk_or_a_missing_tensor_is_refused_before_anything_loads():
    want = state()
    chunks = make_chunks(want, 1000)
    with pytest.raises(IncompleteWeightsError, match="lack elements, e.g. embed"):
        reassemble(chunks[1:])
    with pytest.raises(IncompleteWeightsError, match=f"6 of {len(want)} tensors"):
        reassemble(chunks[:4], expected=len(want))  # embed complete and the small ones, "odd" never started
    whole = [p for p in chunks[3] if p.start is None]  # the chunk's small tensors, sent whole
    with pytest.raises(IncompleteWeightsError, match="norm arrived twice"):
        reassemble([*chunks, whole])


def test_a_duplicated_piece_plus_a_lost_one_is_refused_though_the_count_adds_up():
    chunks = make_chunks(state(), 1000)
    embed_chunks = [c for c in chunks[:3]]  # embed's first three pieces, 250 elements each, one chunk each
    assert [p.name for c in embed_chunks for p in c] == ["embed"] * 3
    # the first piece twice and the second never: 250 * 4 + 50 elements, as many as embed has
    resent = [chunks[0], chunks[0], chunks[2], *chunks[3:]]
    assert sum(p.tensor.numel() for c in resent for p in c if p.name == "embed") == state()["embed"].numel()
    with pytest.raises(IncompleteWeightsError, match=r"embed: a piece covers elements \[0, 250\), which overlap"):
        reassemble(resent)


def test_a_piece_overlapping_part_of_another_is_refused():
    assembler = ChunkAssembler()
    whole = torch.arange(10.0)
    assembler.add([Piece("w", (10,), "float32", 0, whole[:6].clone())])
    with pytest.raises(IncompleteWeightsError, match=r"w: a piece covers elements \[4, 10\), which overlap \[0, 6\)"):
        assembler.add([Piece("w", (10,), "float32", 4, whole[4:].clone())])


def test_a_lost_piece_is_named_with_the_elements_that_never_arrived():
    chunks = make_chunks(state(), 1000)
    with pytest.raises(IncompleteWeightsError, match=r"e\.g\. embed \(elements \[250, 500\) of 800 never arrived\)"):
        reassemble([chunks[0], *chunks[2:]])
    # the tail: the last piece lost
    assembler = ChunkAssembler()
    assembler.add([Piece("w", (10,), "float32", 0, torch.zeros(6))])
    with pytest.raises(IncompleteWeightsError, match=r"w \(elements \[6, 10\) of 10"):
        dict(assembler.items())


def test_pieces_of_another_shape_or_dtype_are_refused():
    assembler = ChunkAssembler()
    assembler.add([Piece("w", (10,), "float32", 0, torch.zeros(5))])
    with pytest.raises(IncompleteWeightsError, match=r"w: a piece of a float32 \(12,\) tensor"):
        assembler.add([Piece("w", (12,), "float32", 5, torch.zeros(7))])
    with pytest.raises(IncompleteWeightsError, match=r"w: a piece of a bfloat16 \(10,\) tensor"):
        assembler.add([Piece("w", (10,), "bfloat16", 5, torch.zeros(5, dtype=torch.bfloat16))])
    with pytest.raises(IncompleteWeightsError, match=r"outside the tensor's \[0, 10\)"):
        assembler.add([Piece("w", (10,), "float32", 8, torch.zeros(5))])


def test_bad_bound():
    with pytest.raises(ValueError, match="max_bytes"):
        make_chunks(state(), 0)

"""FlatWeights: the in-process weight sync (one buffer copy + a device checksum)."""

import pytest
import torch

from miles.models import CausalLM
from miles.models.config import ArchConfig
from miles.transport.flat import FlatLayout, FlatWeights

ARCH = ArchConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, tie_word_embeddings=True)


def models():
    return CausalLM(ARCH, seed=0).to(torch.bfloat16), CausalLM(ARCH, seed=1)


def test_adopted_parameters_are_views_of_the_buffer_and_a_sync_loads_the_trainers_weights():
    engine, trainer = models()
    x = torch.randint(0, 50, (2, 6))
    before = engine(x)
    flat = FlatWeights.adopt(engine)
    assert torch.equal(engine(x), before)  # adopting changes nothing
    assert all(p.untyped_storage().data_ptr() == flat.buffer.untyped_storage().data_ptr() for p in engine.parameters())
    sync = FlatWeights.like(FlatLayout.of(trainer.state_dict(), torch.bfloat16), "cpu")
    sync.fill_from(trainer.state_dict())  # fp32 master weights cast on the way in
    flat.copy_from(sync)
    assert flat.checksum() == sync.checksum()
    assert torch.equal(engine(x), trainer.to(torch.bfloat16)(x))


def test_checksum_sees_one_flipped_bit_and_swapped_values():
    engine, _ = models()
    flat = FlatWeights.adopt(engine)
    digest = flat.checksum()
    words = flat.buffer.view(torch.int16)
    words[5] ^= 1
    assert flat.checksum() != digest
    words[5] ^= 1
    assert flat.checksum() == digest
    a, b = words[10].clone(), words[4000].clone()
    assert not torch.equal(a, b)
    words[10], words[4000] = b, a
    assert flat.checksum() != digest


def test_mismatched_layouts_are_refused():
    engine, trainer = models()
    flat = FlatWeights.adopt(engine)
    other = FlatWeights.like(FlatLayout.of(trainer.state_dict(), torch.float32), "cpu")
    with pytest.raises(ValueError, match="another layout"):
        flat.copy_from(other)
    with pytest.raises(ValueError, match="do not match the flat layout"):
        flat.fill_from({"embed_tokens.weight": torch.zeros(50, 32)})


@pytest.mark.parametrize("words", [
    torch.randint(-2**31, 2**31 - 1, (300 * 4096,), dtype=torch.int32, generator=torch.Generator().manual_seed(0)),
    torch.full((700 * 4096,), -2**31, dtype=torch.int32),  # the weighted sums wrap around 2^64
    torch.full((5 * 4096,), 2**31 - 1, dtype=torch.int32),
], ids=["random", "min_words", "max_words"])
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_word_sums_equal_torchs_int64_reductions(words, device):
    """The CPU reduces the checksum's words in numpy (faster), a GPU in torch: the digest is torch's
    int64 sums of the whole matrix, bit for bit (integer sums, any order)."""
    from miles.transport.flat import ROW, _word_sums

    m = words.view(-1, ROW)
    rows, cols = m.sum(dim=1, dtype=torch.int64), m.sum(dim=0, dtype=torch.int64)
    expected = torch.stack([rows.sum(), (rows * torch.arange(1, rows.numel() + 1)).sum(),
                            (cols * torch.arange(1, ROW + 1)).sum()]).tolist()
    m = m.to(device)
    assert _word_sums([m]) == expected
    assert _word_sums(m.split(7)) == expected  # any blocking: the reductions run a block at a time


def test_tensors_checksum_in_blocks_equals_it_over_the_whole_concatenation():
    """tensors_checksum streams the payload's bytes in row blocks (no copy of the whole payload): the
    same digest as the concatenation's words zero-padded to whole rows, for chunks that straddle blocks."""
    from miles.transport.flat import ROW, _row_blocks, _word_sums

    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (5, 3 * ROW * 4 + 7, 1, ROW * 4)]
    data = torch.cat(chunks)
    whole = torch.nn.functional.pad(data, (0, -data.numel() % (ROW * 4))).view(torch.int32).view(-1, ROW)
    blocks = list(_row_blocks(iter(chunks), block_bytes=2 * ROW * 4))
    assert [b.shape[0] for b in blocks] == [2, 2, 1]
    assert torch.equal(torch.cat(blocks), whole)
    assert _word_sums(blocks) == _word_sums([whole])
    assert _word_sums(_row_blocks(iter([]))) == [0, 0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory: CUDA")
def test_the_device_checksum_allocates_a_block_not_the_payload():
    """tensors_checksum on 1 GiB of payload on the GPU: temporaries of a few 64 MiB blocks, where the whole
    concatenation and its int64 cast (3 GiB) ran a 4-layer Qwen3-30B-A3B FP8 sync out of memory."""
    from miles.transport.flat import tensors_checksum

    payload = {f"w{i}": torch.full((256 << 20,), i, dtype=torch.uint8, device="cuda") for i in range(4)}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    digest = tensors_checksum(payload)
    assert torch.cuda.max_memory_allocated() - base < 512 << 20
    assert digest == tensors_checksum({n: t.cpu() for n, t in payload.items()})  # the CPU's numpy reductions

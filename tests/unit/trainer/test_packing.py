"""Packing plans: every loss position appears once and maps back to its padded place, rows respect
their capacity, micro-batches their token budget, and the varlen layout matches the segments."""

import random

import torch

from miles.models.packed import layout_from_segments
from miles.trainer.packing import (best_fit_decreasing, packed_micro_batches, padded_micro_batches,
                                   shared_prompt_micro_batches)
from miles.types import Sample, build_train_batch


def _batch(seed: int = 0, n: int = 13):
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        prompt = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 6))]
        response = [rng.randrange(1, 30) for _ in range(rng.randrange(0, 9))]  # some empty
        samples.append(Sample("", "", prompt, response, [-0.1 * (j + 1) for j in range(len(response))]))
    return build_train_batch(samples, torch.arange(n, dtype=torch.float32), pad_id=0)


def _loss_positions(batch, plans):
    """(sample, position) -> target for every loss position in the plans."""
    seen = {}
    for mb in plans:
        n, width = mb.num_samples, mb.width
        flat_tokens = mb.input_ids.reshape(-1)
        for s, d, t in zip(mb.src.tolist(), mb.dst.tolist(), mb.targets.tolist()):
            sample, pos = int(mb.index[d // width]), d % width
            assert (sample, pos) not in seen
            seen[(sample, pos)] = t
            assert int(flat_tokens[s]) == int(batch.tokens[sample, pos])  # the input token there
        assert mb.dst.max() < n * width
    return seen


def test_best_fit_decreasing_fills_rows_within_capacity():
    lengths = [7, 0, 3, 5, 2, 2, 6, 1, 4]
    rows = best_fit_decreasing(lengths, 8)
    placed = sorted(i for row in rows for i in row)
    assert placed == [i for i, n in enumerate(lengths) if n > 0]
    assert all(sum(lengths[i] for i in row) <= 8 for row in rows)
    assert len(rows) == 4  # 30 tokens in rows of 8: the fewest possible


def test_packed_and_padded_plans_cover_the_same_loss_positions():
    batch = _batch()
    expected = {(i, j): int(batch.tokens[i, j + 1]) for i, j in (batch.loss_mask > 0).nonzero().tolist()}
    assert _loss_positions(batch, padded_micro_batches(batch, 4)) == expected
    for max_tokens, row_tokens in ((16, None), (16, 16), (64, None), (5, None)):
        plans = packed_micro_batches(batch, max_tokens, row_tokens)
        assert _loss_positions(batch, plans) == expected
        longest = max(int(mb.input_ids.shape[1]) for mb in plans)
        for mb in plans:
            assert mb.input_ids.numel() <= max(max_tokens, longest)
            cu, max_len = layout_from_segments(mb.segment_ids)
            assert torch.equal(cu, mb.cu_seqlens) and max_len == mb.max_seqlen


def test_packed_rows_restart_positions_per_sample():
    batch = _batch(1)
    for mb in packed_micro_batches(batch, 32, 32):
        assert mb.input_ids.shape[0] == 1  # one row per micro-batch with a row budget
        seg, pos = mb.segment_ids[0], mb.position_ids[0]
        starts = torch.nonzero(torch.diff(seg, prepend=seg.new_tensor([-1]))).squeeze(1)
        for a, b in zip(starts.tolist(), starts.tolist()[1:] + [len(seg)]):
            assert torch.equal(pos[a:b], torch.arange(b - a))


def test_a_step_without_loss_tokens_still_gets_a_micro_batch():
    batch = _batch(2, n=3)
    batch.loss_mask.zero_()
    plans = packed_micro_batches(batch, 16)
    assert len(plans) == 1 and plans[0].num_samples == 3 and plans[0].src.numel() == 0


def test_shared_prompt_plans_cover_the_same_loss_positions_with_each_prompt_once():
    rng = random.Random(3)
    samples = []
    for g in range(5):  # 5 prompts x 4 samples of 1-6 response tokens
        prompt = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 7))]
        for _ in range(4):
            response = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 7))]
            samples.append(Sample("", "", prompt, response, [-0.5] * len(response), group=g))
    batch = build_train_batch(samples, torch.ones(len(samples)), pad_id=0)
    expected = {(i, j): int(batch.tokens[i, j + 1]) for i, j in (batch.loss_mask > 0).nonzero().tolist()}
    plans = shared_prompt_micro_batches(batch, 64)
    assert _loss_positions(batch, plans) == expected
    computed = sum(int((mb.segment_ids > 0).sum()) for mb in plans)
    # each prompt once, each sample's response tokens but the last (it predicts nothing)
    assert computed == sum(len(s.prompt_ids) for s in samples[::4]) + sum(len(s.response_ids) - 1 for s in samples)
    for mb in plans:  # prompts are branch 0 and restart at position 0; responses continue after them
        first_response = (mb.branch_ids > 0) & (torch.roll(mb.branch_ids, 1, 1) != mb.branch_ids)
        assert bool((mb.position_ids[first_response] > 0).all())


def _reference_shared(batch, rows, last):
    """packing._shared as it was before it was vectorised (per-token Python loops): the reference
    the vectorised layout must reproduce tensor for tensor."""
    width = batch.loss_mask.shape[1]
    sizes = [[prompt + sum(last[i] + 1 - prompt for i in members) for prompt, members in row] for row in rows]
    cols = max(sum(row) for row in sizes)
    flat, sample, pos, segment, branch = [], [], [], [], []
    samples, where = [], {}
    for k, row in enumerate(rows):
        start = k * cols
        for j, ((prompt, members), size) in enumerate(zip(row, sizes[k])):
            flat += range(start, start + prompt)
            sample += [members[0]] * prompt
            pos += range(prompt)
            segment += [j + 1] * prompt
            branch += [0] * prompt
            offset = start + prompt
            for b, i in enumerate(members, 1):
                n = last[i] + 1 - prompt
                flat += range(offset, offset + n)
                sample += [i] * n
                pos += range(prompt, prompt + n)
                segment += [j + 1] * n
                branch += [b] * n
                where[i] = (start, offset, prompt)
                samples.append(i)
                offset += n
            start += size
    flat, sample, pos = torch.tensor(flat), torch.tensor(sample), torch.tensor(pos)
    r = len(rows)
    input_ids, position_ids = torch.zeros(r * cols, dtype=torch.long), torch.zeros(r * cols, dtype=torch.long)
    segment_ids, branch_ids = torch.zeros(r * cols, dtype=torch.long), torch.zeros(r * cols, dtype=torch.long)
    input_ids[flat], position_ids[flat] = batch.tokens[sample, pos], pos
    segment_ids[flat], branch_ids[flat] = torch.tensor(segment), torch.tensor(branch)
    src, dst, targets = [], [], []
    for rank, i in enumerate(samples):
        group, response, prompt = where[i]
        for t in (batch.loss_mask[i] > 0).nonzero().squeeze(1).tolist():
            src.append(group + t if t < prompt else response + t - prompt)
            dst.append(rank * width + t)
            targets.append(int(batch.tokens[i, t + 1]))
    return dict(index=torch.tensor(samples), input_ids=input_ids.view(r, cols), src=torch.tensor(src),
                dst=torch.tensor(dst), targets=torch.tensor(targets), segment_ids=segment_ids.view(r, cols),
                position_ids=position_ids.view(r, cols), branch_ids=branch_ids.view(r, cols),
                layout=(flat, sample, pos))


def test_the_vectorised_shared_prompt_layout_equals_the_per_token_loops():
    """Same tensors (values, dtypes, order) as the loops it replaced, on groups of varied prompt and
    response lengths, single-target responses (no response token laid out) and several rows."""
    from miles.trainer import packing

    for seed in range(6):
        rng = random.Random(seed)
        samples = []
        for g in range(rng.randrange(1, 9)):
            prompt = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 7))]
            for _ in range(rng.randrange(1, 5)):
                response = [rng.randrange(1, 30) for _ in range(rng.randrange(0, 7))]
                samples.append(Sample("", "", prompt, response, [-0.5] * len(response), group=g))
        batch = build_train_batch(samples, torch.ones(len(samples)), pad_id=0)
        calls = []
        vectorised = packing._shared

        def both(batch, rows, last):
            calls.append((vectorised(batch, rows, last), _reference_shared(batch, rows, last)))
            return calls[-1][0]

        packing._shared = both
        try:
            for max_tokens in (8, 20, 512):
                shared_prompt_micro_batches(batch, max_tokens)
        finally:
            packing._shared = vectorised
        assert calls
        for mb, ref in calls:
            for name, want in ref.items():
                got = getattr(mb, name)
                pairs = zip(got, want) if name == "layout" else [(got, want)]
                for a, b in pairs:
                    assert a.dtype == b.dtype and torch.equal(a, b), (seed, name)

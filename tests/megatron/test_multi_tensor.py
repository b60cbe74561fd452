"""miles/trainer/megatron/multi_tensor.py: the foreach gradient norm and scale that replace
megatron-core's local fallbacks (a host sync per gradient tensor) keep their contracts: the same
norm as local_multi_tensor_l2_norm, the same scaled values bit for bit, installed where megatron-core
fell back and only there."""

import torch


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in ((64, 32), (32,), (7, 3, 5), (1,))]


def test_the_norm_equals_megatrons_local_one():
    from megatron.core.utils import local_multi_tensor_l2_norm

    from miles.trainer.megatron.multi_tensor import foreach_l2_norm

    grads = _grads()
    ours, per_tensor = foreach_l2_norm(2048, None, [grads], False)
    theirs, _ = local_multi_tensor_l2_norm(2048, None, [grads], False)
    assert per_tensor is None and ours.shape == (1,) and ours.dtype == torch.float32
    assert torch.allclose(ours.cpu(), theirs.cpu(), rtol=1e-6)
    expected = torch.cat([t.flatten() for t in grads]).double().norm()
    assert abs(float(ours) - float(expected)) < 1e-5 * float(expected)


def test_the_scale_is_bitwise_megatrons_in_place_and_copying():
    from megatron.core.utils import local_multi_tensor_scale

    from miles.trainer.megatron.multi_tensor import foreach_scale

    ours, theirs = _grads(), _grads()
    foreach_scale(2048, None, [ours, ours], 0.37)  # in place, as clipping calls it
    local_multi_tensor_scale(2048, None, [theirs, theirs], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    src = _grads()
    dst, expected = [torch.empty_like(t) for t in src], [torch.empty_like(t) for t in src]
    foreach_scale(2048, None, [src, dst], 1.0)  # the distributed optimizer's copy
    local_multi_tensor_scale(2048, None, [src, expected], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(dst, expected))


def test_installed_where_megatron_fell_back():
    from megatron.core.optimizer import clip_grads, optimizer

    from miles.trainer.megatron import multi_tensor

    multi_tensor.install()
    assert clip_grads.l2_norm_impl is multi_tensor.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor.foreach_scale
    assert optimizer.multi_tensor_scale_impl is multi_tensor.foreach_scale
    assert multi_tensor.install() is False  # once is enough

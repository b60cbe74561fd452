"""Tensors through Ray's serialization (miles.transport.ray_tensors): every dtype the precision recipes
send, bit-exact, as Ray's object store hands them over (pickle 5, out-of-band read-only buffers);
no Ray cluster needed: this is the cloudpickle path Ray runs."""

import pickle

import pytest
import torch

from miles.precision.rollout_format import rollout_checksum, rollout_format
from miles.transport import ray_tensors
from miles.transport.ray_tensors import with_tensor_transport

# What the recipes send (bf16 / fp32 weights, float8 e4m3 weights, packed int4 as uint8, fp32 scales,
# int64 shapes), and the other dtypes torch pickles through an UntypedStorage.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int32,
          torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
          torch.float8_e5m2fnuz, torch.uint16, torch.uint32, torch.uint64, torch.complex64]


@pytest.fixture
def registered():
    """register() for one test, then Ray's dispatch table as it was."""
    import ray.cloudpickle

    dispatch = ray.cloudpickle.CloudPickler.dispatch
    before = dispatch.get(torch.Tensor)
    ray_tensors.register()
    yield
    if before is None:
        dispatch.pop(torch.Tensor, None)
    else:
        dispatch[torch.Tensor] = before


def through_ray(obj):
    """dumps as Ray's serializer does (protocol 5, buffers out of band), loads from read-only buffers
    (the object store's shared memory), as a Ray worker does."""
    import ray.cloudpickle

    buffers = []
    data = ray.cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[memoryview(b.raw()).toreadonly() for b in buffers])


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    return (torch.randn(*shape) * 3).to(dtype) if dtype != torch.complex64 else torch.randn(*shape, dtype=dtype)


def test_the_root_cause_torch_pickle_cannot_load_float8():
    """What broke the FP8 sync: torch pickles a float8 tensor through an UntypedStorage whose legacy
    reader asks the storage class for a dtype. If this starts passing, torch has fixed it."""
    fp8 = torch.zeros(4, dtype=torch.float8_e4m3fn)
    data = pickle.dumps(fp8)  # the sender sees nothing wrong
    with pytest.raises(AttributeError, match="UntypedStorage' has no attribute 'dtype'"):
        pickle.loads(data)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_arrives_bit_exact(registered, dtype):
    t = sample(dtype)
    out = through_ray(t)
    assert out.dtype == dtype and out.shape == t.shape and out.device == t.device
    assert raw(out) == raw(t)


@pytest.mark.parametrize("t", [torch.tensor(2.5), torch.zeros(0, 4, dtype=torch.float8_e4m3fn),
                               torch.ones(1, dtype=torch.bfloat16), torch.arange(24.0).reshape(4, 6)[:, ::2],
                               torch.arange(6.0).expand(3, 6)],
                         ids=["0-dim", "empty-fp8", "one-element", "non-contiguous", "expanded"])
def test_shapes_and_layouts(registered, t):
    out = through_ray(t)
    assert out.shape == t.shape and out.dtype == t.dtype and torch.equal(out, t)


def test_what_arrives_is_writable_and_owns_its_memory(registered):
    """The engine keeps what it receives and later overwrites it in place: it must not be a view of
    the (read-only) object store."""
    t = sample(torch.float8_e4m3fn, (64, 64))
    buffers = []
    import ray.cloudpickle

    data = ray.cloudpickle.dumps(t, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(data) < 1000  # the bytes go out of band, not through pickle
    store = bytearray(buffers[0].raw())
    out = pickle.loads(data, buffers=[memoryview(store).toreadonly()])
    out.view(torch.uint8).zero_()  # writable
    assert raw(t) == bytes(store)  # and not the store's memory


def test_the_sender_makes_no_copy():
    t = torch.randn(128, 128).to(torch.float8_e4m3fn)
    data, dtype, shape, device = ray_tensors.encode(t)
    assert data.ctypes.data == t.data_ptr() and (dtype, shape, device) == ("float8_e4m3fn", (128, 128), "cpu")


def test_autograd_and_parameters_keep_torch_pickling(registered):
    leaf = torch.randn(3, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(2, 2))
    out_leaf, out_param = through_ray([leaf, param])
    assert out_leaf.requires_grad and torch.equal(out_leaf, leaf)
    assert isinstance(out_param, torch.nn.Parameter) and torch.equal(out_param, param)


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_a_sync_payload_keeps_its_checksum(registered, quant):
    """The trainer's checksum is over the payload it sends; the engine's over what arrives: equal."""
    torch.manual_seed(0)
    weights = {"layers.0.mlp.up_proj.weight": torch.randn(256, 256),
               "layers.0.input_layernorm.weight": torch.randn(256), "embed_tokens.weight": torch.randn(64, 256)}
    payload = rollout_format(weights, quant, group=128)
    assert any(v.dtype == (torch.float8_e4m3fn if quant == "fp8" else torch.uint8) for v in payload.values())
    arrived = through_ray(payload)
    assert {k: v.dtype for k, v in arrived.items()} == {k: v.dtype for k, v in payload.items()}
    assert rollout_checksum(arrived) == rollout_checksum(payload)


class Component:
    """A component class, as spawn gets it."""

    def __init__(self, value):
        self.value = value


def test_actor_classes_register_the_reducer_when_built():
    import ray.cloudpickle

    dispatch = ray.cloudpickle.CloudPickler.dispatch
    before = dispatch.pop(torch.Tensor, None)
    try:
        cls = with_tensor_transport(Component)
        assert (cls.__name__, cls.__qualname__, cls.__module__) == ("Component", "Component", __name__)
        obj = cls(7)
        assert isinstance(obj, Component) and obj.value == 7
        assert dispatch.get(torch.Tensor) is ray_tensors.reduce_tensor
    finally:
        dispatch.pop(torch.Tensor, None)
        if before is not None:
            dispatch[torch.Tensor] = before

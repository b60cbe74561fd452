"""Every @triton.jit kernel in miles/, compiled for Hopper (sm_90) on the CPU as its launchers launch it.

Why: the CPU tests run the kernels under the Triton interpreter, which executes every branch as Python;
the compiler builds only the constexpr-taken branches and type-checks them. A kernel that passed every
interpreter test once failed to compile on an H100 (an early `return` did not cut a branch whose bit
operations then met a bf16 pointer) and a whole GPU session was lost. Here each kernel is built with
Triton's own ptxas for GPUTarget("cuda", 90, 32): no GPU needed.

How: the modules' public launchers run on small CPU tensors in this process with `JITFunction.run`
replaced by a recorder, so nothing executes and every launch gives its kernel, its argument types (a
tensor's dtype as Triton's pointer type, ints i32 / i64, floats fp32), its constexprs and its
num_warps / num_stages. This process does not interpret (TRITON_INTERPRET unset), so the constexprs are
the GPU's (INTERPRET=False, IEEE only for fp32), not the interpreter's. Empty buffers do: no launcher
reads a kernel's output on the host (they make no host syncs). Tensors and ints that are multiples of 16
get the divisibility hint a GPU launch gives them (which lets loads vectorize); ints == 1 are not folded
into constants as a GPU launch would: that changes no constexpr branch or type.

Each distinct launch is one test: it compiles, dots became tensor-core instructions (IEEE fp32 dots must
not: TF32 would round their operands), and the shared memory fits an H100's block (else the launch
fails with OutOfResources). `test_every_kernel_in_miles_is_compiled_here` fails when a @triton.jit
function in miles/ is neither launched by a case below nor called by a launched kernel.
(Gluon kernels, miles/precision/weight_only_ws.py, compile in tests/unit/precision/test_weight_only_ws.py.)
"""

import contextlib
import importlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernels need triton")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("the kernels are interpreted in this process: nothing to compile", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

import miles  # noqa: E402
from miles.models import decode_attention, invariant_triton, moe_grouped  # noqa: E402
from miles.precision import dequant_triton, fp8_triton, fp8_triton_gemm, fp8_w8a16_triton, int4_triton  # noqa: E402
from miles.trainer import chunked_ce_triton  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
H100_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one sm_90 block may opt into
BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn


# ------------------------------------------------------------------------------- recording launches
def _name(fn: JITFunction) -> str:
    return f"{fn.fn.__module__}.{fn.fn.__qualname__}"


@dataclass(frozen=True)
class Launch:
    """What one GPU launch of `kernel` would compile: argument types, constexpr values, compile options."""
    kernel: JITFunction
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]
    aligned: tuple[int, ...]  # argument positions a GPU launch marks divisible by 16

    def __hash__(self):  # by name: JITFunction hashes its source's dependencies, slowly
        return hash((_name(self.kernel), self.signature, self.constexprs, self.options, self.aligned))

    def source(self) -> ASTSource:
        return ASTSource(fn=self.kernel, signature=dict(self.signature), constexprs=dict(self.constexprs),
                         attrs={(i,): [["tt.divisibility", 16]] for i in self.aligned})

    @property
    def id(self) -> str:
        pointers = ",".join(t[1:] for _, t in self.signature if t.startswith("*"))
        consts = ",".join(f"{k}={v}" for k, v in self.constexprs)
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.kernel.fn.__name__}-{pointers}-{consts}-{opts}"


def _launch(kernel: JITFunction, args: tuple, kwargs: dict) -> Launch:
    """The Launch of `kernel[grid](*args, **kwargs)`: keyword arguments that are not parameters are options."""
    params = {p.name: p for p in kernel.params}
    bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    signature, constexprs, aligned = [], [], []
    for i, (name, value) in enumerate(bound.arguments.items()):
        if params[name].is_constexpr:
            signature.append((name, "constexpr"))
            constexprs.append((name, value))
        else:
            signature.append((name, mangle_type(value)))  # Triton's own type of the value, unspecialized
            if (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or \
                    (type(value) is int and value % 16 == 0):
                aligned.append(i)
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return Launch(kernel, tuple(signature), tuple(constexprs), options, tuple(aligned))


@contextlib.contextmanager
def _recording():
    """Kernel launches append their Launch to the yielded list instead of compiling and running."""
    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(_launch(self, args, kwargs))

    with mock.patch.object(JITFunction, "run", run):
        yield launches


# ------------------------------------------------------------------------------- launch cases
# Each case calls a module's launchers as the code base does: every dtype they take, every format and
# mode flag, and row counts that make the tile pickers choose each of their tiles.
def _z(*shape, dtype=FP32):
    return torch.zeros(shape, dtype=dtype)


def invariant_matmul():
    """The small tile (decode, batched; fp32 with IEEE dots) in each dtype; in bf16 the wide one (> 512
    rows and columns) and fp32 outputs (attention scores, reduce_sum)."""
    for dtype in (BF16, FP16, FP32):
        invariant_triton.triton_matmul(_z(4, 32, dtype=dtype), _z(32, 8, dtype=dtype), dtype)
    invariant_triton.triton_matmul(_z(520, 32, dtype=BF16), _z(32, 520, dtype=BF16), BF16)
    invariant_triton.triton_matmul(_z(2, 4, 32, dtype=BF16), _z(2, 32, 8, dtype=BF16), FP32)


def slot_decode_attention():
    """Each head dim, unsplit (rows x KV heads fill the GPU) and split over columns (one row: the merge
    kernel too), in bf16; fp16 at head dim 128."""
    for dtype, dims in ((BF16, decode_attention.HEAD_DIMS), (FP16, (128,))):
        for d in dims:
            for rows in (64, 1):
                q, kv = _z(rows, 16, 1, d, dtype=dtype), _z(rows, 8, 1024, d, dtype=dtype)
                decode_attention.slot_decode_attention(q, kv, kv, _z(rows, dtype=torch.long))


def _moe_stack(fmt: str, e: int, n: int, k: int, dtype: torch.dtype, group: int = 128):
    """A stacked expert weight [e, n, k] as the engines hold it: dense, FP8 codes, or packed INT4 bytes."""
    if fmt == "dense":
        return _z(e, n, k, dtype=dtype)
    if fmt == "fp8":
        return moe_grouped.Stack(_z(e, n, k, dtype=FP8), _z(e, -(-n // 128), -(-k // 128)), "fp8")
    return moe_grouped.Stack(_z(e, n, -(-k // 2), dtype=torch.uint8), _z(e, n, -(-k // group)), "int4", group)


def grouped_experts():
    """Dense, FP8 and INT4 stacks in each dtype, top-8, the quantized ones with their scales loaded once a
    tile; then per weight (FP8: an expert width off the tiles, each dtype; INT4: groups of 32, narrower
    than a tile);
    then K tiles of 64 (the default is 128 but in fp32)."""
    tokens, topk, e, h = 4, 8, 16, 256

    def launch(fmt, dtype, i, group=128, **kw):
        moe_grouped.grouped_experts(_z(tokens, h, dtype=dtype), _z(tokens, topk, dtype=torch.long),
                                    _z(tokens, topk), _moe_stack(fmt, e, 2 * i, h, dtype, group),
                                    _moe_stack(fmt, e, h, i, dtype, group), **kw)

    for dtype in moe_grouped.DTYPES:
        for fmt in ("dense", "fp8", "int4"):
            launch(fmt, dtype, 128)
    for dtype in moe_grouped.DTYPES:  # fp32: K tiles of 64 hold the fp32 scale tiles in shared memory
        launch("fp8", dtype, 136)
    launch("int4", BF16, 128, group=32)
    for fmt in ("fp8", "int4"):
        launch(fmt, BF16, 128, block_k=64)


def dequantize_one_pass():
    """FP8 codes and packed INT4 bytes to each output dtype."""
    for dtype in (BF16, FP16, FP32):
        dequant_triton.dequantize_one_pass(_z(256, 256, dtype=FP8), _z(2, 2), "fp8", dtype)
        dequant_triton.dequantize_one_pass(_z(256, 128, dtype=torch.uint8), _z(256, 2), "int4", dtype)


def quantize_act_fused():
    """The 1x128 activation quantizer on each activation dtype."""
    for dtype in (BF16, FP16, FP32):
        fp8_triton.quantize_act_fused(_z(5, 200, dtype=dtype), 256)


def fp8_gemm_invariant():
    """Both tiles of the batch-invariant FP8 GEMM (<= 64 rows, more) into bf16; the small one into fp16 / fp32."""
    wq, ws = _z(256, 256, dtype=FP8), _z(2, 2)
    for m, dtype in ((16, BF16), (128, BF16), (16, FP16), (16, FP32)):
        fp8_triton_gemm.fp8_gemm_invariant(_z(m, 256, dtype=FP8), _z(m, 2), wq, ws, m, dtype)


# (rows, N) -> each tile pick_w8a16_config makes (132 SMs): 16x64x256; 32x64x256 (SMs idle); 64x64x128
# (one block scale a tile: SCALAR_SCALE); 64x128x256 (65-256 rows, SMs idle); 128x64x64 (int4's).
W8A16_SHAPES = ((1, 256), (32, 256), (64, 8448), (128, 256), (256, 8448))


def _w8a16(m: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    fp8_w8a16_triton.w8a16_linear_fused(_z(m, k, dtype=dtype), _z(n, k, dtype=FP8), _z(-(-n // 128), -(-k // 128)),
                                        _z(n, dtype=dtype) if bias else None)


def w8a16_linear_fused():
    """Every tile of pick_w8a16_config in bf16 with a bias; fp16 without one on the decode tile and the
    one-scale tile; split-K (the SPLIT_K timing switch: fp32 partials, the reduction) once."""
    for m, n in W8A16_SHAPES:
        _w8a16(m, n, 256, BF16, bias=True)
    for m, n in (W8A16_SHAPES[0], W8A16_SHAPES[2]):
        _w8a16(m, n, 256, FP16, bias=False)
    with mock.patch.object(fp8_w8a16_triton, "SPLIT_K", True):
        _w8a16(1, 256, 2048, BF16, bias=True)


def _int4(m: int, n: int, k: int, group: int, dtype: torch.dtype, bias: bool, config=None):
    int4_triton.int4_linear_fused(_z(m, k, dtype=dtype), _z(n, -(-k // 2), dtype=torch.uint8),
                                  _z(n, -(-k // group)), group, _z(n, dtype=dtype) if bias else None, config=config)


def int4_linear_fused():
    """pick_config's tiles in bf16 with a bias: decode split over K (fp32 partials, then the reduction;
    fp16 without a bias too), 17-64 rows unsplit (BK 128), 128x64x64 unsplit with a group wider than BK
    and split; and the TileConfig alternatives callers may pass: UNPACK=1 (BK above and within a
    group), SWAP=False."""
    _int4(1, 256, 2048, 128, BF16, True)
    _int4(1, 256, 2048, 128, FP16, False)
    _int4(32, 8448, 256, 32, BF16, True)
    _int4(1024, 1088, 256, 128, BF16, True)
    _int4(256, 256, 512, 32, BF16, True)
    _int4(16, 256, 512, 32, BF16, True, int4_triton.TileConfig(16, 64, 256, 1, 4, 3, unpack=1))
    _int4(16, 256, 512, 128, BF16, False, int4_triton.TileConfig(16, 64, 64, 1, 4, 3, unpack=1))
    _int4(16, 256, 512, 128, FP16, True, int4_triton.TileConfig(16, 64, 128, 1, 4, 3, swap=False))


def chunked_ce():
    """Forward and backward with and without a temperature and the entropy, in bf16; fp16 once."""
    m, v = 4, 5000
    for dtype, modes in ((BF16, ((1.0, False), (1.0, True), (0.7, False), (0.7, True))), (FP16, ((0.7, True),))):
        for temperature, entropy in modes:
            logits, targets, row = _z(m, v, dtype=dtype), _z(m, dtype=torch.long), _z(m)
            chunked_ce_triton.row_logprobs(logits, targets, temperature, entropy)
            chunked_ce_triton.grad_logits_(logits, row, targets, row, row if entropy else None, row, temperature)


CASES = (invariant_matmul, slot_decode_attention, grouped_experts, dequantize_one_pass, quantize_act_fused,
         fp8_gemm_invariant, w8a16_linear_fused, int4_linear_fused, chunked_ce)


def _record_cases() -> list[Launch]:
    """The distinct launches of every case, in order of first appearance."""
    with _recording() as launches:
        for case in CASES:
            case()
    return list(dict.fromkeys(launches))


LAUNCHES = _record_cases()


# ------------------------------------------------------------------------------- what a kernel calls
def _callees(fn: JITFunction) -> list[JITFunction]:
    """The @triton.jit functions `fn` calls by a global name (helpers such as _round, _dot)."""
    scope = fn.fn.__globals__
    return [scope[n] for n in fn.fn.__code__.co_names if isinstance(scope.get(n), JITFunction)]


def _reachable(fn: JITFunction) -> dict[str, JITFunction]:
    """`fn` and every @triton.jit function it calls, transitively, by name."""
    seen, todo = {}, [fn]
    while todo:
        f = todo.pop()
        if _name(f) not in seen:
            seen[_name(f)] = f
            todo.extend(_callees(f))
    return seen


def _has_dot(fn: JITFunction) -> bool:
    return any("tl.dot(" in f.src for f in _reachable(fn).values())


def _jit_functions_in_miles() -> dict[str, JITFunction]:
    """Every @triton.jit function defined at module level in miles/ (Gluon's excluded), by name."""
    root = Path(miles.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        if not re.search(r"^\s*@triton\.jit", path.read_text(), re.MULTILINE):
            continue
        module = importlib.import_module(".".join(path.relative_to(root.parent).with_suffix("").parts))
        for value in vars(module).values():
            if isinstance(value, JITFunction) and not value.is_gluon() and value.fn.__module__ == module.__name__:
                found[_name(value)] = value
    return found


# ------------------------------------------------------------------------------- the tests
def test_every_kernel_in_miles_is_compiled_here():
    covered = {}
    for launch in LAUNCHES:
        covered.update(_reachable(launch.kernel))
    missing = sorted(set(_jit_functions_in_miles()) - set(covered))
    assert not missing, (f"@triton.jit functions no case launches (nor a launched kernel calls): {missing}; "
                         "add a launch case to CASES in tests/unit/test_triton_compile_hopper.py")


@pytest.mark.parametrize("launch", LAUNCHES, ids=[launch.id for launch in LAUNCHES])
def test_kernel_compiles_for_hopper(launch):
    kernel = triton.compile(launch.source(), target=HOPPER, options=dict(launch.options))
    ptx = kernel.asm["ptx"]
    assert ".entry" in ptx
    if _has_dot(launch.kernel):
        tensor_cores = re.search(r"\b(wg)?mma\.", ptx) is not None
        assert tensor_cores != bool(dict(launch.constexprs).get("IEEE")), "IEEE dots on FMAs, the others on MMAs"
    assert kernel.metadata.shared <= H100_SHARED_BYTES, f"{kernel.metadata.shared} bytes of shared memory"

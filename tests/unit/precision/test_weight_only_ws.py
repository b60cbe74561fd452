"""The warp-specialized weight-only GEMMs (miles/precision/weight_only_ws.py) without a GPU: they compile
for sm_90 with Triton's own ptxas (the partitions, the TMA loads, the wgmma and the register split come
out as designed), and off Hopper the `*_linear_auto` dispatch leaves them out whatever the row
threshold. Whether they compute the right bits and how fast is the GPU's (tests/gpu/
test_weight_only_ws_cuda.py, scripts/gpu_session.sh 19); Gluon has no interpreter, so nothing here
executes the kernels."""

import importlib.util
from pathlib import Path

import pytest
import torch

from miles.precision import fp8_w8a16_triton, int4_triton
from miles.precision import weight_only_ws as ws
from miles.precision.fp8 import quantize_fp8_weight
from miles.precision.int4 import int4_linear, pack_int4, quantize_int4

needs_gluon = pytest.mark.skipif(ws.gluon is None, reason="needs triton's Gluon")

PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "weight_only_ws.py"


def _module():
    spec = importlib.util.spec_from_file_location("weight_only_ws", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_gluon
@pytest.mark.parametrize("fmt", ["w8a16", "w4a16"])
def test_compiles_for_sm90_with_its_partitions(fmt, capsys):
    _module().compile_only(formats=(fmt, ), configs=("128x128x64_w4", ))
    line = capsys.readouterr().out.strip()
    # 2 M reps x 4 k16 steps of wgmma; the two TMA loads of the loader; setmaxnreg hands the
    # partitions their registers; 4 MMA + 1 loader + 4 converter warps, rounded to 3 warpgroups.
    assert line.startswith(f"{fmt} 128x128x64_w4: wgmma 8, TMA loads 2, setmaxnreg"), line
    assert line.endswith("warps 12"), line


def test_off_hopper_the_auto_paths_stay_as_they_were(monkeypatch):
    monkeypatch.setattr(fp8_w8a16_triton, "WARP_SPECIALIZED_MIN_ROWS", 1)
    monkeypatch.setattr(int4_triton, "WARP_SPECIALIZED_MIN_ROWS", 1)
    w = torch.randn(256, 512) * 0.02
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    q, s = quantize_fp8_weight(w)
    assert "sm_90" in ws.weight_only_ws_supported(x, q, s, "w8a16") or ws.gluon is None
    assert torch.equal(fp8_w8a16_triton.w8a16_linear_auto(x, q, s), fp8_w8a16_triton.w8a16_linear(x, q, s))
    codes, scales = quantize_int4(w, 128)
    packed = pack_int4(codes)
    assert torch.equal(int4_triton.int4_linear_auto(x, packed, scales, 128), int4_linear(x, packed, scales, 128))


def test_the_row_threshold_is_off_by_default():
    """The kernel has not run on a GPU: nothing reaches it unless a benchmark sets the threshold."""
    assert fp8_w8a16_triton.WARP_SPECIALIZED_MIN_ROWS is None and int4_triton.WARP_SPECIALIZED_MIN_ROWS is None

"""The warp-specialized weight-only GEMMs (miles/precision/weight_only_ws.py) without a GPU: they compile
for sm_90 with Triton's own ptxas (the partitions, the TMA loads, the wgmma and the register split come
out as designed). Whether they compute the right bits and how fast is the GPU's (tests/gpu/
test_weight_only_ws_cuda.py, scripts/gpu_session.sh 19); Gluon has no interpreter, so nothing here
executes the kernels."""

import importlib.util
from pathlib import Path

import pytest

from miles.precision import weight_only_ws as ws

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

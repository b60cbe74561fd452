"""Rollout engines. `native.NativeEngine` runs the same miles.models modules as the trainer; `vllm_engine`
and `sglang_engine` drive external engines.

Every engine offers the `RolloutEngine` protocol of miles/rollout/protocol.py (its one definition);
the loop only calls those methods, through a handle (miles/orchestrate/handles.py).
"""

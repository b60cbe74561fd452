"""Rollout engines. `native.NativeEngine` runs the same miles.models modules as the trainer."""

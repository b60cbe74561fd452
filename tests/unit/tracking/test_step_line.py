"""The per-step console line: what a run prints for each step."""

from miles.tracking.console import step_line


def test_step_line_names_what_it_has_and_keeps_three_digits_of_the_mismatch():
    # fp8 and bf16 mismatches differ in the third digit (2.695e-2 / 2.684e-2 on the 4B shape):
    # a line that rounds to 2.7e-02 hides the comparison a user runs the recipes for
    line = step_line(2, 5, {"rollout/reward_mean": 0.5, "train/loss": -0.01234,
                            "mismatch/logprob_abs_diff": 0.026951, "perf/step_time_s": 18.25,
                            "eval/arithmetic/accuracy": 0.25})
    assert line == "step    2/5 | reward 0.500 | loss -0.0123 | mismatch 2.695e-02 | time 18.25s | eval arithmetic 0.250"

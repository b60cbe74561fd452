"""Ray actors on a GPU ask for a share of it: Ray hides every GPU from an actor that asks for none."""

from miles.orchestrate.run import gpu_share


def test_components_share_the_runs_gpu_and_ask_for_none_on_the_cpu():
    assert gpu_share("cpu", 2) == 0.0
    assert gpu_share("cuda", 2) == 0.5
    assert 0 < 3 * gpu_share("cuda", 3) <= 1.0  # engine, trainer and PPO's critic fit one GPU

"""scripts/gpu_session.sh names only what exists: every test file and test it runs, every benchmark
script, and every option it passes a benchmark. Device time is scarce (30 minutes a session); a typo
there costs a call."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def steps() -> list[tuple[str, list[str]]]:
    """(step name, the command's words) of every `step NAME SECONDS COMMAND...` line, continuation
    lines joined, environment assignments before `step` skipped; a command inside `(cd benchmarks && ...)`
    names its script relative to benchmarks/."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        match = re.search(r"(\(cd (\S+) && )?(?:[A-Z_]+=\S+ )*step (\S+) \d+ (.*)", line)
        if match:
            words = shlex.split(match.group(4).rstrip(")"))
            if match.group(2) and words[0] == "python3" and words[1].endswith(".py"):
                words[1] = f"{match.group(2)}/{words[1]}"
            found.append((match.group(3), words))
    return found


def test_the_script_has_steps():
    names = [name for name, _ in steps()]
    assert len(names) >= 20 and "megatron" in names and "mismatch_sources" in names


@pytest.mark.parametrize("name, words", steps(), ids=[name for name, _ in steps()])
def test_each_step_names_what_exists(name, words):
    assert words[0] == "python3", words
    if words[1:3] == ["-m", "pytest"]:
        for target in (w for w in words[3:] if w.startswith("tests/")):
            path, _, test = target.partition("::")
            assert (ROOT / path).exists(), target
            if test:
                assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), target
        return
    script = ROOT / words[1]
    assert script.is_file() and script.suffix == ".py", words[1]
    # every option must be one the script (or a module it hands its arguments to) declares
    source = script.read_text()
    for option in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
        assert f'"{option}"' in source, f"{words[1]} takes no {option}"

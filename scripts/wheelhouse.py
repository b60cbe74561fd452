"""Build a folder of wheels that installs Miles' missing dependencies on an air-gapped GPU node.

    python3 scripts/wheelhouse.py [--python 3.12] [--platform TAG ...] [--out wheelhouse]

Every line of the requirements file (requirements/gpu-node.txt) becomes exactly one wheel for the
target Python and platform: the published one where PyPI has it, else one built here from the
source release, kept only if it is pure Python (then it fits any Python 3 on any platform). Nothing
is resolved: the file itself lists every package to carry, so the folder holds one version of each.
The folder is built aside and replaces --out only once complete, so a failure leaves the old one.
Prints the command that installs it on the node (docs/offline-install.md).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# glibc 2.28 (RHEL 8, Ubuntu 20.04) and later; pip does not widen a platform tag to older ones itself.
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
MAX_MB = 60  # the folder travels with the work tree to the GPU machine, 64 MiB for all of it
LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(==|>=)([A-Za-z0-9.+!_-]+)$")


class BuildError(Exception):
    pass


def read_requirements(path: Path) -> list[tuple[str, str]]:
    """(name, version) per line. `==V` and `>=V` both carry release V: for `>=` it is the fallback
    for an image whose own copy is older."""
    if not path.is_file():
        raise BuildError(f"{path}: no such requirements file")
    pins, seen = [], set()
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        match = LINE.match(text)
        if not match:
            raise BuildError(f"{path}:{number}: '{text}' is not 'name==version' or 'name>=version'")
        name, _, version = match.groups()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            raise BuildError(f"{path}:{number}: {name} is listed twice; keep one version of each package")
        seen.add(key)
        pins.append((name, version))
    return pins


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def pip_error(result: subprocess.CompletedProcess) -> str:
    """pip's own error lines, without its warnings and the list of every version it found."""
    lines = [re.sub(r" \(from versions: [^)]*\)", "", line)
             for line in (result.stderr + result.stdout).splitlines() if line.startswith("ERROR")]
    return " / ".join(lines) or (result.stderr.strip().splitlines() or ["(no output)"])[-1]


def is_pure(wheel: Path) -> bool:
    """A wheel tagged py3-none-any (or py2.py3): no compiled code, no Python-version-specific ABI."""
    python, abi, platform = wheel.stem.split("-")[-3:]
    return abi == "none" and platform == "any" and "py3" in python.split(".")


def fetch(name: str, version: str, python: str, platforms: list[str], dest: Path) -> Path:
    """One wheel of name==version into dest: published for the target, else built here if pure."""
    spec = f"{name}=={version}"
    with tempfile.TemporaryDirectory() as tmp:
        target = ["--python-version", python, "--implementation", "cp"]
        for platform in platforms:
            target += ["--platform", platform]
        published = pip("download", "--no-deps", "--only-binary=:all:", *target, "-d", tmp, spec)
        if published.returncode != 0:
            built = pip("wheel", "--no-deps", "--no-binary", name, "-w", tmp, spec)
            wheels = list(Path(tmp).glob("*.whl"))
            if built.returncode != 0 or not wheels:
                raise BuildError(f"no wheel of {spec} for Python {python} on {', '.join(platforms)} "
                                 f"({pip_error(published)}), and building one from its source failed "
                                 f"({pip_error(built)})")
            if not is_pure(wheels[0]):
                raise BuildError(f"no wheel of {spec} for Python {python} on {', '.join(platforms)}, and its "
                                 f"source builds compiled code ({wheels[0].name}): build it on a machine "
                                 f"of the target, or pin a version that publishes such a wheel")
        (wheel,) = Path(tmp).glob("*.whl")
        return Path(shutil.move(str(wheel), dest / wheel.name))


def build(requirements: Path, out: Path, python: str, platforms: list[str], max_mb: float) -> list[Path]:
    pins = read_requirements(requirements)
    if out.exists() and any(p.suffix != ".whl" for p in out.iterdir()):
        raise BuildError(f"{out} holds other files than wheels; pick another --out")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        wheels = []
        for name, version in pins:
            wheels.append(fetch(name, version, python, platforms, staging))
            print(f"  {wheels[-1].name}  ({wheels[-1].stat().st_size / 1e6:.2f} MB)", flush=True)
        total_mb = sum(w.stat().st_size for w in wheels) / 1e6
        if total_mb > max_mb:
            raise BuildError(f"the wheels add up to {total_mb:.1f} MB, over the {max_mb:g} MB that may travel "
                             f"to the GPU machine; drop or replace the largest")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return [out / w.name for w in wheels]


def shown(path: Path) -> str:
    """A path as the user would type it from the repo root, where make and the docs run commands."""
    path = path.absolute()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="3.12", help="target Python version, X.Y (default 3.12)")
    parser.add_argument("--platform", nargs="+", default=list(DEFAULT_PLATFORMS),
                        help=f"target platform tags, any of which a wheel may carry (default {' '.join(DEFAULT_PLATFORMS)})")
    parser.add_argument("--requirements", type=Path, default=ROOT / "requirements" / "gpu-node.txt")
    parser.add_argument("--out", type=Path, default=ROOT / "wheelhouse")
    parser.add_argument("--max-mb", type=float, default=MAX_MB, help=f"largest total size allowed (default {MAX_MB})")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        parser.error(f"--python {args.python}: give a version as X.Y, e.g. 3.12")
    print(f"wheels for Python {args.python} on {' '.join(args.platform)} -> {shown(args.out)}/", flush=True)
    try:
        wheels = build(args.requirements, args.out, args.python, args.platform, args.max_mb)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    total_mb = sum(w.stat().st_size for w in wheels) / 1e6
    print(f"{len(wheels)} wheels, {total_mb:.1f} MB in {shown(args.out)}/. On the node, from the repo root:\n"
          f"  python3 -m pip install --no-index --find-links {shown(args.out)} -r {shown(args.requirements)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

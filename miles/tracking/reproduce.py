"""`python launch.py +reproduce=<run dir | MLflow run id>`: run a recorded run again.

Before Hydra composes anything, the `+reproduce=...` argument is replaced by the command-line
overrides the run recorded (overrides.yaml in its run dir, or the `run_record/` artifacts of its
MLflow run), so the new run is an ordinary run of the same config with a record of its own.
Overrides given beside `+reproduce` win over recorded ones of the same key (say `ray.enabled=false`
or `steps=400`); for an MLflow run id on a server, pass `tracking.uri=...` to find it. A warning
says when the code is not the recorded commit, or the recorded run had uncommitted changes.
With `deterministic=true` in the recorded run, the metrics repeat exactly on the same hardware.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from miles.config.errors import UserError
from miles.tracking.run_record import REPRODUCE_OF_ENV, git_sha

KEYS = ("reproduce", "+reproduce", "++reproduce")


@dataclass
class Record:
    overrides: list[str]
    git: dict  # git.json: sha, branch, dirty


def _from_dir(run_dir: Path) -> Record:
    # overrides.yaml is Miles's own record; Hydra's .hydra/overrides.yaml holds the same list.
    for path in (run_dir / "overrides.yaml", run_dir / ".hydra" / "overrides.yaml"):
        if path.is_file():
            git = run_dir / "git.json"
            return Record(yaml.safe_load(path.read_text()) or [], json.loads(git.read_text()) if git.is_file() else {})
    raise UserError(f"+reproduce={run_dir}: no overrides.yaml there (not the output dir of a Miles run)")


def _from_mlflow(run_id: str, uri: str | None) -> Record:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from miles.tracking.mlflow_logger import resolve_uri

    if not uri and not Path("mlruns", "mlflow.db").is_file():
        raise UserError(f"+reproduce={run_id}: no such run dir, and no local MLflow store ./mlruns to look the "
                        "id up in (for a server, add tracking.uri=http://host:5000)")
    client = MlflowClient(tracking_uri=resolve_uri(uri))
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise UserError(f"+reproduce={run_id}: neither a run dir nor an MLflow run of {resolve_uri(uri)}") from None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(client.download_artifacts(run_id, "run_record", tmp))
        except (MlflowException, OSError):
            local = None  # an unreachable artifact store: fall back to the run dir the run recorded
        if local is not None and (local / "overrides.yaml").is_file():
            return _from_dir(local)
    recorded = run.data.tags.get("miles.run_dir")
    if recorded and Path(recorded).is_dir():
        return _from_dir(Path(recorded))
    raise UserError(f"+reproduce={run_id}: the MLflow run has no run_record/overrides.yaml artifact and its "
                    f"run dir {recorded or '?'} is not here")


def load(source: str, tracking_uri: str | None) -> Record:
    path = Path(source).expanduser()
    return _from_dir(path) if path.is_dir() else _from_mlflow(source, tracking_uri)


def _key(override: str) -> str | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_override(override).key_or_group
    except HydraException:
        return None  # not an override (a flag's value such as `--cfg job`): nothing to replace


def warn_if_code_differs(source: str, git: dict) -> None:
    recorded, current = git.get("sha"), git_sha()
    if recorded and current and recorded != current:
        print(f"warning: {source} ran at git {recorded[:12]}, the code is now at {current[:12]}: results may "
              f"differ (`git checkout {recorded[:12]}` runs its code)", file=sys.stderr)
    if git.get("dirty"):
        print(f"warning: {source} ran with uncommitted changes; its git.diff holds them", file=sys.stderr)


def expand_argv(argv: list[str]) -> list[str]:
    """argv with `+reproduce=<source>` replaced by the source's recorded overrides (argv unchanged
    without it). Sets MILES_REPRODUCE_OF so the new run's record names its source."""
    found = [i for i, a in enumerate(argv) if a.split("=", 1)[0] in KEYS]
    if not found:
        return argv
    if len(found) > 1:
        raise UserError("+reproduce given more than once")
    at = found[0]
    source = argv[at].split("=", 1)[1]
    if not source:
        raise UserError("+reproduce needs a run dir or an MLflow run id: +reproduce=outputs/2026-01-01/12-00-00")
    others = argv[1:at] + argv[at + 1 :]
    given = {k for k in map(_key, others) if k}
    uri = next((a.split("=", 1)[1] for a in others if _key(a) == "tracking.uri"), None)
    uri = uri if uri not in (None, "", "null") else os.environ.get("MLFLOW_TRACKING_URI")
    record = load(source, uri)
    warn_if_code_differs(source, record.git)
    kept = [o for o in record.overrides if _key(o) not in given]
    print(f"reproducing {source}: {' '.join(kept + [a for a in others if _key(a)]) or '(no overrides)'}",
          file=sys.stderr)
    os.environ[REPRODUCE_OF_ENV] = str(Path(source).resolve()) if Path(source).is_dir() else source
    return argv[:at] + kept + argv[at + 1 :]

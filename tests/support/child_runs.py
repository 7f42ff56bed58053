"""Test processes: the environment of pytest's process and of the child processes its tests start (the
repository and ``tests/`` importable, Hugging Face offline and quiet), and running such a child.

Call :func:`prepare` before transformers or diffusers are imported (they read these variables at import).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
OFFLINE = (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
           ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error"))


def prepare() -> None:
    for key, value in OFFLINE:
        os.environ.setdefault(key, value)
    sys.path[:0] = [p for p in (str(REPO), str(TESTS)) if p not in sys.path]


def run(script, out: Path, workdir, package, timeout: float, what: str) -> dict:
    """Run ``script`` as ``script OUT WORKDIR/base PACKAGE`` (it writes its observations to ``out`` as JSON)
    and return them; a failure raises with the child's stderr, naming ``what`` ran."""
    cmd = [sys.executable, str(script), str(out), str(Path(workdir) / "base"), str(package)]
    # tests/ first, so that a runner run as a script imports the support package as pytest does
    path = os.pathsep.join([str(TESTS), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), PYTHONPATH=path)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())

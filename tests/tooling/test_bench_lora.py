"""bench.lora's fp8 part runs and ranks the fp8 LoRA strategies as docs/lora.md says."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_fp8_error_part(tmp_path):
    out = tmp_path / "fp8.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "bench.lora", "--part", "fp8_error", "--json", str(out),
                           "--workdir", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = json.loads(out.read_text())["rel_rms_error"]
    # Run-time adapters on fp8 cost no more than one fp8 rounding of the merged weight; a merge into the
    # fp8 weight (two roundings) is worse; bf16 merging is far below both.
    assert err["fp8_run_time_adapters"] < 1.05 * err["fp8_merge_then_quantize_once"]
    assert err["fp8_merge_into_fp8_weight"] > 1.1 * err["fp8_run_time_adapters"]
    assert err["bf16_merge"] < 0.2 * err["fp8_run_time_adapters"]

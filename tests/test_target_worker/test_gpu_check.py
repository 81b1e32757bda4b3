"""`scripts/gpu_check.py` in its CPU mode: the prepared device check runs end to end (kernel
probes in both cuBLAS settings, the model-level bitwise checks, the timings, transformers'
side), so the rare GPU run does not fail on a mistake a CPU can catch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_mode_runs_every_phase_and_its_bitwise_checks_pass(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "SPECD_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
         "--models", "smollm2-135m", "--dtypes", "bfloat16", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    checks = summary["checks"]
    tag = "smollm2-135m/bfloat16"
    for name in ("decode vs verify", "alone vs packed 8", "spec on/off greedy",
                 "spec on/off seeded", "graph vs eager"):
        assert checks[f"{tag} {name}"]["pass"], (name, checks.get(f"{tag} {name}"))
    assert checks["smollm2-135m greedy graph decode == eager decode"]["pass"]
    # Speculation really drafted (and the greedy drafts, the target's own, were accepted).
    assert checks[f"{tag} spec on/off greedy"]["drafted"] > 0
    assert checks[f"{tag} spec on/off greedy"]["accepted"] > 0
    # Here the service's own in-process loop imports too, and agrees.
    assert checks[f"{tag} spec on/off seeded"]["service_loop_equal"] is True
    assert summary["all_pass"] is True and not summary.get("skipped")
    timings = summary["timings"]
    curve = timings["smollm2-135m step ms by rows (graph)"]
    assert sorted(int(n) for n in curve) == list(range(1, 10))
    assert timings["smollm2-135m transformers generate tok/s"] > 0
    for setting in ("default", "configured"):
        assert summary[f"probes_{setting}"]["rc"] == 0
        rows = [json.loads(line) for line in
                (out / f"probe-{setting}.jsonl").read_text().splitlines()]
        assert rows[0]["kind"] == "settings" and len(rows) > 10
    configured = json.loads((out / "probe-configured.jsonl").read_text().splitlines()[0])
    assert configured["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert lines[0]["phase"] == "env" and lines[-1]["phase"] == "phase"

"""The committed gRPC code in specd/v1 is exactly what protos/generate.sh produces."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(ROOT / "protos" / "generate.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    fresh = sorted(p.name for p in (tmp_path / "specd" / "v1").iterdir())
    committed = sorted(p.name for p in (ROOT / "specd" / "v1").iterdir()
                       if p.suffix in (".py", ".pyi") and p.name != "__init__.py")
    assert fresh == committed
    for name in fresh:
        assert (tmp_path / "specd" / "v1" / name).read_text() == \
            (ROOT / "specd" / "v1" / name).read_text(), f"{name} is stale: run protos/generate.sh"

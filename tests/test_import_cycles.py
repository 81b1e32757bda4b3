"""No import cycles between specd's modules, type-only and function-local imports included
(`scripts/import_cycles.py`)."""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "import_cycles", Path(__file__).resolve().parents[1] / "scripts" / "import_cycles.py")
import_cycles = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(import_cycles)

def test_the_packages_have_no_import_cycle():
    cycles = import_cycles.find_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(import_cycles.describe(c) for c in cycles)


def test_the_check_finds_a_cycle_through_a_function_local_import(tmp_path, monkeypatch):
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from . import d\n")
    (pkg / "d.py").write_text("from . import c\n")
    (pkg / "e.py").write_text("from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles.find_cycles(("cyclepkg",)) == [["cyclepkg.a", "cyclepkg.b"],
                                                         ["cyclepkg.c", "cyclepkg.d"]]

"""The seed's import path `coordinator.sampling`: the very module `specd_core.sampling`
(one module object, so names, private helpers and isinstance checks agree whichever path
imports it)."""

import sys

import specd_core.sampling as _module

sys.modules[__name__] = _module

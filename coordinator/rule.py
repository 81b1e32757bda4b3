"""The seed's import path `coordinator.rule`: the very module `specd_core.rule`
(one module object, so names, private helpers and isinstance checks agree whichever path
imports it)."""

import sys

import specd_core.rule as _module

sys.modules[__name__] = _module

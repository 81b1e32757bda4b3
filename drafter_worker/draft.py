"""The seed's import path `drafter_worker.draft`: the very module `specd_core.draft`
(one module object, so names, private helpers and isinstance checks agree whichever path
imports it)."""

import sys

import specd_core.draft as _module

sys.modules[__name__] = _module

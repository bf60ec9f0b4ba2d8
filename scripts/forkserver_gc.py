"""Imported last by a forkserver's preload (tests/forking.py, scripts/tools/chaos.py, scripts/common.py's
ForkedScript): what the preload's imports made is frozen.

Every process forked from the server inherits torch's, gRPC's, hivemind's and the node's module objects.
A full garbage collection in a child would walk all of them, and by touching each one copy the memory
pages that hold them (copy-on-write): CPU spent again in every child, on objects that live as long as
the process. ``gc.freeze`` moves them to the permanent generation, which collections skip (what the
``gc`` documentation advises before a ``fork``); the children's own objects are collected as before.
"""

from __future__ import annotations

import gc

gc.collect()  # nothing the imports left unreachable is kept for good
gc.freeze()

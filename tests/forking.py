"""One forkserver per test process, shared by the helpers that fork processes from it.

A fresh interpreter spends ~1.3 CPU-seconds importing torch alone, more with gRPC, the node and
torch.distributed: more than many tests' own work. multiprocessing's forkserver imports such modules
once per test process (it starts no thread of its own, so forking it is safe) and forks each process
from it; each is still a process of its own, with its own sockets and signals. The server's preload
list is global and read when it starts, so every helper adds its modules to it rather than replacing
it; a module missing from it (the server already ran) is imported in the child instead.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
from collections.abc import Iterable


def forkserver(preload: Iterable[str]) -> multiprocessing.context.ForkServerContext:
    """The forkserver context, with ``preload`` added to the modules it imports when it starts."""
    context = multiprocessing.get_context("forkserver")
    asked = getattr(multiprocessing.forkserver._forkserver, "_preload_modules", None) or []
    context.set_forkserver_preload(sorted({*asked, *preload}))
    return context

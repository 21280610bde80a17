"""Process-wide CPU settings: torch intra-op threads, and glibc malloc tuned to reuse freed memory.

Why the malloc tuning: a training step frees and re-allocates the same activation, logit
and KV buffers every micro-batch. By default glibc serves large blocks with fresh `mmap`
pages and trims the top of its heap on `free`, so a reused buffer faults its pages in
again: about 40,000 minor page faults per second during `covey train` on a 2-core CPU,
with up to a third of the CPU time in the kernel. With `mmap` off and trimming off
(glibc's MALLOC_* variables), freed memory stays in the heap and is reused. glibc reads
these variables when the process starts, and that form is what the A/B in dev/LOG.md
(2026-11-24) measured (a `mallopt` call after start-up cut the kernel time too, but its
speed was never measured cleanly), so the command line restarts itself once with them
set (`covey.cli.main.entry`). Off with COVEY_MALLOC_KEEP=0; variables the user set are kept.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping

MALLOC_ENV = {
    "MALLOC_MMAP_MAX_": "0",  # no mmap: large blocks come from the heap, and stay there when freed
    "MALLOC_TRIM_THRESHOLD_": str(64 << 30),  # never give the heap top back to the OS
    "MALLOC_TOP_PAD_": str(256 << 20),  # grow the heap 256 MiB at a time
}


def malloc_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`environ` with MALLOC_ENV added, or None when there is nothing to do.

    None: switched off (COVEY_MALLOC_KEEP=0), already in effect (any of the variables set,
    by us or by the user), or a C library that is not glibc (macOS, musl).
    """
    if environ.get("COVEY_MALLOC_KEEP", "1") == "0" or any(key in environ for key in MALLOC_ENV):
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return {**environ, **MALLOC_ENV}


def apply_cpu_settings(threads: int) -> None:
    """model.threads: torch intra-op threads (0 keeps torch's default, all cores)."""
    import torch  # here, not at the top: `covey.cli.main.entry` imports this module before its restart
    if threads:
        torch.set_num_threads(threads)

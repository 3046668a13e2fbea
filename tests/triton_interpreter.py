"""Triton's interpreter (TRITON_INTERPRET=1), without its repeated patching of triton.language.

A kernel launch under the interpreter patches the triton.language modules its function sees
(`_patch_lang`: an inspect.getmembers sweep of each of them, tl.math and tl.tensor) and restores
them when the grid is done. A call from the kernel to another @triton.jit function (ladle's
`_round` or `_normalize`, Triton's own `tl.max`) patches the modules that function sees again, once
per call and per program of the grid, though nothing has restored them since: in ladle's Triton
tests those sweeps took about a third of the time. `skip_repeated_patching` lets such a call skip
the sweep when every module it would patch is patched already in this launch; a call that sees one
not yet patched (Triton's standard library sees tl.core), or a call outside a launch, patches as
before. The kernels compute exactly what they did, with the same patched builtins.
"""

from __future__ import annotations

import functools
import inspect
import threading

_launch = threading.local()  # .patched: ids of the language modules patched in the launch under way


def _languages(fn) -> frozenset[int]:
    """The triton.language modules that `_patch_lang(fn)` patches: tl and tl.core among fn's globals."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def skip_repeated_patching() -> None:
    """Install the shortcut (idempotent)."""
    from triton.runtime import interpreter

    if getattr(interpreter.GridExecutor, "_ladle_skips_repeated_patching", False):
        return
    launch, call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__

    @functools.wraps(launch)
    def launch_noting_patches(self, *args, **kwargs):
        outer = getattr(_launch, "patched", None)
        _launch.patched = set(_languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launch.patched = outer

    @functools.wraps(call)
    def call_patching_once(self, *args, **kwargs):
        patched = getattr(_launch, "patched", None)
        if patched is None:
            return call(self, *args, **kwargs)
        languages = self.__dict__.get("_ladle_languages")
        if languages is None:
            languages = self._ladle_languages = _languages(self.fn)
        if not languages <= patched:
            patched |= languages
            return call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:  # as InterpretedFunction.__call__ reports a device function's error
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch_noting_patches
    interpreter.InterpretedFunction.__call__ = call_patching_once
    interpreter.GridExecutor._ladle_skips_repeated_patching = True

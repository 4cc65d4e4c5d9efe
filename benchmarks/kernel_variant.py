"""A library kernel compiled a second time from its own source with a few lines changed, for
measurements that need the library's exact code plus one difference (time stamps in
``commit_timeline.py``, a missing state load in ``verify_bounds.py``). The library itself is never
modified.

Not a script: imported by the scripts beside it.
"""
import os
import sys
import types


def replace_once(text: str, old: str, new: str, source_name: str) -> str:
    """``text`` with its one occurrence of ``old`` replaced; an error naming ``source_name`` when
    the library's source does not have exactly one (the calling script then needs updating)."""
    if text.count(old) != 1:
        raise RuntimeError(f"{source_name} changed: {old!r} found {text.count(old)} times; update this script")
    return text.replace(old, new)


def compile_variant(source: str, module_name: str) -> types.ModuleType:
    """Executes ``source`` as module ``module_name``. Triton reads a jit function's source from its
    file, so the source is written under $OUT (or /tmp) first. Relative imports in ``source`` must
    already be absolute."""
    module = types.ModuleType(module_name)
    directory = os.environ.get("OUT") or "/tmp"
    os.makedirs(directory, exist_ok=True)
    module.__file__ = os.path.join(directory, module_name + ".py")
    with open(module.__file__, "w") as f:
        f.write(source)
    sys.modules[module_name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


if __name__ == "__main__":
    print(__doc__)

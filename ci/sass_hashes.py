"""A hash of every kernel's SASS (``ci/compile_kernels.py``'s cases, compiled without a GPU), to
show that two trees compile to the same instructions: a kernel whose hash is unchanged runs the
binary that ran before, wherever it was tested.

    python ci/sass_hashes.py OUT.json [--arch 90]           # in each tree, then compare the files
    python ci/sass_hashes.py --compare A.json B.json [--rename ' store-rounded=']

The hash covers the instruction text of ``nvdisasm``, addresses stripped. ``--rename OLD=NEW``
maps case names of A onto B's (a case that gained a variant name)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def hashes(arch: int) -> dict:
    import compile_kernels
    from sass import run_tool

    from recoverssm.backends.cuda.launch_table import LAUNCH_TABLE
    out = {}
    for name, fn, constexprs, ptypes, options in compile_kernels.cases(LAUNCH_TABLE):
        _, cubin = compile_kernels.compile_one(fn, constexprs, ptypes, options, arch)
        lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip()
                 for line in run_tool("nvdisasm", ["-c"], cubin).splitlines() if "/*" in line and ";" in line]
        text = "\n".join(re.sub(r"\s+", " ", line) for line in lines if not line.startswith("."))
        out[" ".join(name.split())] = hashlib.sha1(text.encode()).hexdigest()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        differ = 0
        for name, digest in a.items():
            other = name
            for rule in args.rename:
                old, new = rule.split("=", 1)
                other = other.replace(old, new)
            if b.get(other) != digest:
                differ += 1
                print("differs" if other in b else "missing", name)
        print(f"{len(a) - differ} of {len(a)} kernels identical")
        return 1 if differ else 0
    result = hashes(args.arch)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=0)
    print(f"{len(result)} kernels hashed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time of the whole ``gdn_verify`` and ``CommitContext.commit`` calls for two source trees,
one process per tree, alternating.

    git worktree add /tmp/old <commit>        # or: git archive <commit> recoverssm | tar -x -C /tmp/old
    python benchmarks/host_ab.py /tmp/old . [--passes 5] [--device cuda|cpu]

The CPU speed a process gets differs between processes by up to 1.5x for the same code on the
lent GPU machines (docs/BENCHMARKS.md, "Host time"), so a change is judged by alternating the
two trees, one process each, several passes, in one call. Each process runs
``benchmarks/host_breakdown.py --whole`` of this tree with the other tree's ``recoverssm`` first
on ``sys.path``: per call the median wall and thread CPU time (us), and the same for
``torch.empty(8)`` as a measure of that process's CPU speed. ``--device cpu`` times the
library's host code alone, on CPU tensors with a backend that does nothing (both trees need
``recoverssm.core.registry.registry().register`` and the public API that host_breakdown.py calls).
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("trees", nargs=2, metavar="TREE", help="two source trees (each holds recoverssm/)")
    ap.add_argument("--passes", type=int, default=5, help="processes per tree, alternating")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--iters", type=int, default=200, help="timed calls per measurement")
    args = ap.parse_args()
    trees = [os.path.abspath(t) for t in args.trees]
    for tree in trees:
        if not os.path.isdir(os.path.join(tree, "recoverssm")):
            raise SystemExit(f"{tree} holds no recoverssm/ package")
    for _ in range(args.passes):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": tree}
            env.pop("TRITON_INTERPRET", None)
            result = subprocess.run([sys.executable, os.path.join(HERE, "host_breakdown.py"), "--whole",
                                     "--device", args.device, "--iters", str(args.iters)],
                                    cwd=tree, env=env, capture_output=True, text=True)
            if result.returncode:
                raise SystemExit(f"{tree}: exit {result.returncode}\n{result.stdout}{result.stderr}")
            print(f"{tree}:", flush=True)
            for line in result.stdout.splitlines():
                print(f"    {line}", flush=True)


if __name__ == "__main__":
    main()

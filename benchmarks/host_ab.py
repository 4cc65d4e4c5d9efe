"""Host time of one commit call (3 groups x 6 layers, per-group index tensors, the same tensors
every call) for two source trees, alternating processes, on a GPU.

    git worktree add /tmp/old <commit>        # or: git archive <commit> recoverssm | tar -x -C /tmp/old
    python benchmarks/host_ab.py /tmp/old . [rounds]

The lent machines' CPU speed differs between processes by up to 1.5x for the same code
(docs/BENCHMARKS.md, "Host time"), so a change is judged by alternating the two trees, one
process each, several rounds, in one device call. Prints per process three medians of 200 calls
(wall / thread CPU time, us), and the same for ``torch.empty(8)`` on the GPU as a measure of that
process's CPU speed.
"""
import os
import subprocess
import sys

CASE = r"""
import torch
from recoverssm.bench.problems import align_step, commit_context
from recoverssm.bench.timing import host_times
step = align_step(8, 4)
ctx, _ = commit_context(3, 6, 8, 4, 16, 48, 128, 128, step.num_slots)
kw = dict(state_indices=[step.state_indices.clone() for _ in range(3)],
          block_table=[step.block_table.clone() for _ in range(3)],
          num_computed_tokens=[step.num_computed_tokens.clone() for _ in range(3)],
          block_size=step.block_size)
call = lambda: ctx.commit(step.num_accepted, query_start_loc=step.query_start_loc, **kw)
medians = " ".join(f"{r['wall_us']:.1f}/{r['cpu_us']:.1f}" for r in (host_times(call) for _ in range(3)))
reference = host_times(lambda: torch.empty(8, device="cuda"))
print(f"{medians}   torch.empty(8): {reference['wall_us']:.1f}/{reference['cpu_us']:.1f}")
"""


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    trees = [os.path.abspath(t) for t in sys.argv[1:3]]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for _ in range(rounds):
        for tree in trees:
            # Run from inside the tree: sys.path[0] is then the tree, whatever is installed.
            out = subprocess.run([sys.executable, "-c", CASE], cwd=tree, env=env, check=True,
                                 capture_output=True, text=True).stdout.strip()
            print(f"{tree}: {out}", flush=True)


if __name__ == "__main__":
    main()

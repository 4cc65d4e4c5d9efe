"""Where the host time of one verify call and one commit call goes (cProfile), on a GPU."""
import cProfile
import io
import pstats

import torch

from recoverssm.bench.problems import align_step, commit_context, window

H, K, V = 16, 128, 128


def profile(label, call, n=300):
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        call()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"==== {label}: {pr.getstats and ''}")
    print(s.getvalue())


def main():
    w = window(8, 4, H, 48, K, V)
    profile("gdn_verify", w.verify)
    step = align_step(8, 4)
    ctx, _ = commit_context(3, 6, 8, 4, H, 48, K, V, step.num_slots)
    kw = dict(block_table=[step.block_table] * 3, num_computed_tokens=[step.num_computed_tokens] * 3,
              block_size=step.block_size)
    profile("commit 3x6", lambda: ctx.commit(step.num_accepted, [step.state_indices] * 3,
                                             step.query_start_loc, **kw))


if __name__ == "__main__":
    main()

"""One representative align-mode grouped commit (conv compaction included), repeated with the
same tensors (the bound launch of repeated steps), the same commit of a bf16 state (the bf16
commit tile), again with out-of-range slots, one verify and one native decode, for
``compute-sanitizer --tool memcheck`` and ``--tool racecheck`` (see docs/TESTING.md).

    compute-sanitizer --tool memcheck python benchmarks/sanitize_case.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_case.py
"""
import torch

import recoverssm as rs
from recoverssm.bench.problems import align_step, window
from recoverssm.core.backend import GroupStep


def main() -> None:
    H, HV, K, V, T, R = 16, 32, 128, 128, 4, 6
    w = window(R, T, H, HV, K, V, extra_slots=4)
    conv_in = torch.randn(R * T, 64, device="cuda")
    conv_state = torch.randn(R * 3, 64, 3 + T, device="cuda")
    weight = torch.randn(64, 4, device="cuda")
    step = align_step(R, T, block_size=4)
    rs.conv_verify(conv_in, conv_state, weight, None, state_indices=step.state_indices,
                   query_start_loc=step.query_start_loc)
    w.state_indices.copy_(step.state_indices)
    state = torch.randn(step.num_slots, HV, V, K, device="cuda")
    rs.gdn_verify(w.q, w.k, w.v, state=state, state_indices=w.state_indices,
                  query_start_loc=w.query_start_loc, records=w.records, **w.gates())
    ctx = rs.CommitContext([[rs.LayerCache(state, w.records, conv_state)],
                            [rs.LayerCache(state.clone(), w.records)]], max_batch=R)
    ctx.commit(step.num_accepted, step.state_indices, step.query_start_loc,
               block_table=step.block_table, num_computed_tokens=step.num_computed_tokens,
               block_size=step.block_size, check=True)
    for _ in range(3):   # the same tensors again: the third call repeats the launch bound by the second
        ctx.commit(step.num_accepted, step.state_indices, step.query_start_loc, block_table=step.block_table,
                   num_computed_tokens=step.num_computed_tokens, block_size=step.block_size)
    assert ctx._committer._repeat is not None, "the repeated commit launch was not bound"
    # bf16 pool (its own commit tile); then the same step with one slot far out of range and one
    # null, past the argument checks: nothing may be read or written for those rows.
    bf16_state = state.to(torch.bfloat16)
    bf16_ctx = rs.CommitContext([[rs.LayerCache(bf16_state, w.records)]], max_batch=R)
    bf16_ctx.commit(step.num_accepted, step.state_indices, step.query_start_loc,
                    block_table=step.block_table, num_computed_tokens=step.num_computed_tokens,
                    block_size=step.block_size, check=True)
    bad = step.state_indices.clone()
    bad[0], bad[1] = 10**6, -1
    bf16_ctx._committer.commit(step.num_accepted, step.query_start_loc,
                               [GroupStep(bad, None, step.block_table, step.num_computed_tokens, step.block_size)])
    rs.gdn_decode(w.q, w.k, w.v, state=state, state_indices=w.state_indices, query_start_loc=w.query_start_loc,
                  **w.gates())
    torch.cuda.synchronize()
    print("sanitize case ran: conv_verify, gdn_verify, grouped align commit with conv compaction "
          "(repeated through the bound launch), "
          "bf16 commits (one with out-of-range slots), gdn_decode")


if __name__ == "__main__":
    main()

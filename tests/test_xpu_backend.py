"""The ``xpu`` backend without an Intel GPU: pointer encoding, registry behaviour, and its launch
path running the shared kernels under the Triton interpreter on CPU tensors."""

import pytest
import torch

import recoverssm as rs
from recoverssm.core.pointers import PointerEncoding, to_signed_bits
from recoverssm.core.registry import BackendError, Registry
from helpers import make_batch_problem, rel_err

HIGH = [2**63, 2**64 - 1, 0xFFFF85ABD4E00000, 0x8000000000000001]
LOW = [0, 1, 0x7FFFFFFFFFFFFFFF, 0x00007F12_3456_7000]


def test_uint64_encoding_round_trips_high_addresses():
    enc = PointerEncoding.UINT64_IN_INT64
    values = HIGH + LOW + [0xFFFF85ABD4E00000 + 4096 * i for i in range(5)]
    table = enc.encode(values)
    assert table.dtype == torch.int64
    assert enc.decode(table) == values
    # The bits the kernel reads are the address's 64-bit pattern.
    assert [int(x) & (2**64 - 1) for x in table.tolist()] == values
    assert table[2].item() == 0xFFFF85ABD4E00000 - 2**64
    assert to_signed_bits(2**64 - 1) == -1


def test_int64_encoding_refuses_bit63_with_a_clear_error():
    with pytest.raises(ValueError, match="bit 63"):
        PointerEncoding.INT64.encode([0xFFFF85ABD4E00000])
    with pytest.raises(ValueError, match="not a 64-bit unsigned address"):
        PointerEncoding.UINT64_IN_INT64.encode([2**64])
    assert PointerEncoding.INT64.encode(LOW).tolist() == LOW


def test_backends_declare_their_encoding():
    backends = Registry(load_entry_points=False).backends()
    assert backends["xpu"].pointer_encoding is PointerEncoding.UINT64_IN_INT64
    assert backends["cuda"].pointer_encoding is PointerEncoding.INT64
    assert backends["cpu_ref"].pointer_encoding is PointerEncoding.INT64


@pytest.mark.interpreter
def test_kernel_reads_the_encoded_bits():
    """A Triton kernel loading the xpu table sees each address's exact 64-bit pattern."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_bits(table_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        bits = tl.load(table_ptr + offs, mask=offs < n)
        tl.store(out_ptr + offs, bits.to(tl.uint64, bitcast=True).to(tl.int64, bitcast=True), mask=offs < n)

    values = HIGH + LOW
    table = PointerEncoding.UINT64_IN_INT64.encode(values)
    out = torch.zeros_like(table)
    copy_bits[(1,)](table, out, len(values), BLOCK=16)
    assert PointerEncoding.UINT64_IN_INT64.decode(out) == values


def test_xpu_refuses_to_start_without_an_intel_gpu(monkeypatch):
    monkeypatch.delenv("RECOVERSSM_XPU_INTERPRET", raising=False)
    if getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
        pytest.skip("an Intel GPU is present")
    reg = Registry(load_entry_points=False)
    assert "xpu" not in reg.available_backends()
    with pytest.raises(BackendError, match="xpu.*not available.*Intel GPU"):
        reg.resolve("xpu")
    monkeypatch.setenv("RECOVERSSM_BACKEND", "xpu")
    with pytest.raises(BackendError, match="RECOVERSSM_BACKEND=xpu"):
        reg.resolve(None, torch.device("cpu"))


def test_xpu_device_type_selects_xpu_backend(monkeypatch):
    """Selection by device type: torch.device('xpu') tensors go to the xpu backend."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("RECOVERSSM_XPU_INTERPRET", "1")
    monkeypatch.delenv("RECOVERSSM_BACKEND", raising=False)
    reg = Registry(load_entry_points=False)
    backend, why = reg.resolve(None, torch.device("xpu"))
    assert backend.name == "xpu" and "xpu" in why
    assert reg.resolve(None, torch.device("cpu"))[0].name == "cpu_ref"


@pytest.mark.interpreter
def test_xpu_launch_path_matches_reference(monkeypatch):
    """Verify, commit (its uint64-in-int64 tables) and conv through the xpu backend's launch
    table, on CPU tensors under the interpreter, against cpu_ref."""
    monkeypatch.setenv("RECOVERSSM_XPU_INTERPRET", "1")
    p = make_batch_problem([3, 1, 4, 0], T=4, padding=(1,), K=32, V=32, num_slots=12)
    rec_x, rec_r = p.records(), p.records()
    out_x = rs.gdn_verify(p.q, p.k, p.v, records=rec_x, backend="xpu", **p.call_kwargs())
    out_r = rs.gdn_verify(p.q, p.k, p.v, records=rec_r, backend="cpu_ref", **p.call_kwargs())
    assert rel_err(out_x, out_r) < 2e-5
    assert rel_err(rec_x.correction, rec_r.correction) < 2e-5
    accepted = torch.tensor([2, 1, 4, 0], dtype=torch.int32)
    conv = torch.randn(12, 8, 3 + 4)
    states = {}
    for name in ("xpu", "cpu_ref"):
        st, cv = p.state.clone(), conv.clone()
        ctx = rs.CommitContext([[rs.LayerCache(st, rec_r, cv, conv_width=4)]], max_batch=4, backend=name)
        ctx.commit(accepted, p.state_indices, p.qsl)
        states[name] = (st, cv)
    assert torch.equal(states["xpu"][0], states["cpu_ref"][0])
    assert torch.equal(states["xpu"][1], states["cpu_ref"][1])


@pytest.mark.interpreter
def test_xpu_deferred_steps_give_the_eager_bits(monkeypatch):
    """Deferred commits through the xpu backend (its uint64-in-int64 group and layer tables read by
    the defer and flush launches), on CPU tensors under the interpreter: every step's outputs and,
    after the final flush, every state equal the same backend's eager commits (GDN, KDA and
    Mamba2 layers)."""
    from deferred_sim import Engine, Setup

    monkeypatch.setenv("RECOVERSSM_XPU_INTERPRET", "1")
    engine = Engine(Setup(align=True, block_size=2, groups=2, kinds=("gdn", "kda", "mamba2"), backend="xpu"),
                    seed=7)
    for i in range(5):
        engine.step(flush_all=i == 2)
    engine.finish()
    assert engine.replayed > 0 and engine.flushed > 0 and engine.boundaries > 0

"""The examples and the integration guide run and check themselves.

``examples/speculative_step.py`` checks every step bit for bit against per-token decoding, and
``examples/transformers_generate.py`` speculative ``generate`` against plain greedy; here
it runs on ``cpu_ref`` under ``torch.compile(fullgraph=True)``, and on the Triton kernels in
Triton's CPU interpreter (or on the GPU where there is one). The Python snippets of
``docs/INTEGRATION.md`` run in order as one program, except those marked ``<!-- not run ... -->``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run(args: list[str], timeout: int = 300) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def run_example(script: str, *args: str) -> None:
    out = run([os.path.join(EXAMPLES, script), *args])
    assert out.splitlines()[-1].startswith("OK: "), out


def test_transformers_generate():
    pytest.importorskip("transformers")
    run_example("transformers_generate.py")


def test_speculative_step_compiled_on_cpu_ref():
    run_example("speculative_step.py", "--backend", "cpu_ref", "--compile")


def test_speculative_step_kda_on_cpu_ref():
    run_example("speculative_step.py", "--backend", "cpu_ref", "--arch", "kda")


@pytest.mark.interpreter
@pytest.mark.parametrize("arch, compiled", [("gdn", True), ("kda", False)])
def test_speculative_step_on_triton_interpreter(arch, compiled):
    extra = ["--compile", "--compile-backend", "aot_eager"] if compiled else []
    run_example("speculative_step.py", "--backend", "cuda", "--arch", arch, "--layers", "2", "--steps", "2", *extra)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_speculative_step_on_gpu(arch):
    run_example("speculative_step.py", "--device", "cuda", "--arch", arch, "--compile")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_cuda_graph_step(arch):
    run_example("cuda_graph_step.py", "--arch", arch)


def doc_program(path: str) -> str:
    """The ``python`` blocks of a Markdown file, in order, without those marked as not run."""
    with open(path) as f:
        text = f.read()
    blocks = re.findall(r"(<!-- not run[^\n]*-->\n)?```python\n(.*?)```", text, re.DOTALL)
    return "\n".join(body for marker, body in blocks if not marker)


def test_integration_guide_snippets_run(tmp_path):
    program = doc_program(os.path.join(ROOT, "docs", "INTEGRATION.md"))
    assert "ctx.commit(" in program and "rs.plan_commit(" in program
    script = tmp_path / "integration_snippets.py"
    script.write_text(program)
    out = run([str(script)])
    assert "'final_slot': [2, 4, 11]" in out, out

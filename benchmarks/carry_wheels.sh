# Sourced by the GPU scripts (h200_check.sh, ncu_run.sh) from the repository root: the device
# machine has no network, so wheels it lacks (fla-core, for the peer benchmark) are carried in
# .whl/ and installed into /tmp/site here, which is appended to PYTHONPATH; an unpacked mamba-ssm
# sdist in .whl/mamba_ssm_src (the Mamba2 suite's peer) is named by RECOVERSSM_MAMBA_SSM. Without
# .whl/ it does nothing.
# Usage: . benchmarks/carry_wheels.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site
fi
if [ -d .whl/mamba_ssm_src/mamba_ssm ]; then
  export RECOVERSSM_MAMBA_SSM=${RECOVERSSM_MAMBA_SSM:-$PWD/.whl/mamba_ssm_src}
fi

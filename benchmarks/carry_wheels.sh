# Sourced by the H200 scripts: the device machine has no network, so wheels it lacks (fla-core
# for the peer benchmark) are carried in .whl/ and installed into /tmp/site here.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

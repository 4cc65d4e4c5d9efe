"""``recoverssm.integrations.transformers.speculative``: speculative ``generate`` on transformers'
hybrid models (tiny random-weight Qwen3-Next, Qwen3.5, Qwen4Exp, OLMo-hybrid and Kimi-Linear from transformers' own
config classes), compared with plain greedy ``generate``; on a GPU where one is present, else on
the CPU."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402
from recoverssm.integrations.transformers import UnsupportedModelError, speculative, supported_models  # noqa: E402

MODELS = ["qwen3_next", "qwen3_5", "qwen4_exp", "olmo_hybrid", "kimi_linear"]
# Where CUDA is present, transformers' modeling modules bind flash-linear-attention's kernels (GPU
# only) when they are imported, and its own models then cannot run on the CPU in that process.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42]]


def _ids(prompt):
    return torch.tensor([prompt], device=DEVICE)


class _Forwards:
    """Counts the model's forwards (fewer forwards than new tokens: some candidates accepted)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._pre)

    def _pre(self, *_):
        self.count += 1


def _greedy(model, ids, **kw):
    return model.generate(ids, do_sample=False, **kw)


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name, dtype=torch.float32, eos=None):
        key = (name, dtype, eos)
        if key not in cache:
            cache[key] = hf_models.build(name, dtype=dtype, eos=eos).to(DEVICE)
        return cache[key]
    return get


@pytest.mark.parametrize("name", MODELS)
def test_prompt_lookup_gives_the_greedy_tokens(built, name):
    model = built(name)
    forwards, new_tokens = 0, 0
    for prompt in PROMPTS:
        ids = _ids(prompt)
        plain = _greedy(model, ids, max_new_tokens=64)
        with speculative(model):
            counter = _Forwards(model)
            spec = _greedy(model, ids, max_new_tokens=64, prompt_lookup_num_tokens=4)
            counter.handle.remove()
        assert torch.equal(plain, spec), (plain, spec)
        forwards, new_tokens = forwards + counter.count, new_tokens + spec.shape[1] - ids.shape[1]
    if name != "qwen4_exp":     # its n-gram-hashed tiny model never repeats: every window rolled back whole
        assert forwards < new_tokens, "no candidate was ever accepted"


@pytest.mark.parametrize("name", MODELS)
def test_an_assistant_model_gives_the_greedy_tokens(built, name):
    model, draft = built(name), hf_models.assistant().to(DEVICE)
    ids = _ids(PROMPTS[0])
    plain = _greedy(model, ids, max_new_tokens=64)
    with speculative(model):
        spec = _greedy(model, ids, max_new_tokens=64, assistant_model=draft)
    assert torch.equal(plain, spec)


@pytest.mark.parametrize("name", MODELS)
def test_plain_generate_inside_the_context(built, name):
    """Without candidates the layers decode token by token (no window, no crop)."""
    model = built(name)
    ids = _ids(PROMPTS[1])
    plain = _greedy(model, ids, max_new_tokens=24)
    with speculative(model):
        assert torch.equal(plain, _greedy(model, ids, max_new_tokens=24))


@pytest.mark.parametrize("name", MODELS)
def test_a_prompt_shorter_than_the_conv(built, name):
    model, draft = built(name), hf_models.assistant().to(DEVICE)
    ids = torch.tensor([[7, 8]], device=DEVICE)
    plain = _greedy(model, ids, max_new_tokens=32)
    with speculative(model):
        assert torch.equal(plain, _greedy(model, ids, max_new_tokens=32, prompt_lookup_num_tokens=3))
        assert torch.equal(plain, _greedy(model, ids, max_new_tokens=32, assistant_model=draft))


@pytest.mark.parametrize("name", MODELS)
def test_generation_stops_at_an_eos_inside_a_window(built, name):
    ids = _ids(PROMPTS[0])
    free = _greedy(built(name), ids, max_new_tokens=64)[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(free) if i >= 6 and t not in free[:i] and t != 0)
    model = built(name, eos=eos)
    plain = _greedy(model, ids, max_new_tokens=64)
    assert plain[0, -1].item() == eos and plain.shape[1] < ids.shape[1] + 64
    with speculative(model):
        spec = _greedy(model, ids, max_new_tokens=64, prompt_lookup_num_tokens=8)
    assert torch.equal(plain, spec)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen4_exp"])
def test_dict_outputs_and_a_cache_passed_in_are_handed_back(built, name):
    """``return_dict_in_generate`` with scores; a cache passed in holds, after the context, the
    states transformers' own forward over the same tokens leaves (Qwen4Exp: also its per-layer
    embeddings' conv inputs and n-gram ids)."""
    model = built(name)
    ids = _ids(PROMPTS[0])
    plain = _greedy(model, ids, max_new_tokens=40, return_dict_in_generate=True, output_scores=True)
    cache = transformers.DynamicCache(config=model.config)
    with speculative(model):
        spec = _greedy(model, ids, max_new_tokens=40, prompt_lookup_num_tokens=4, return_dict_in_generate=True,
                       output_scores=True, cache=cache)
    assert torch.equal(plain.sequences, spec.sequences)
    assert len(plain.scores) == len(spec.scores)
    for a, b in zip(plain.scores, spec.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    reference = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=spec.sequences[:, :-1], cache=reference, use_cache=True)
    linear = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    for i in linear:
        got, want = cache.layers[i], reference.layers[i]
        assert type(got) is type(want)
        torch.testing.assert_close(got.recurrent_states[0], want.recurrent_states[0], rtol=1e-4, atol=1e-5)
        # (the conv inputs come from hidden states computed in windows: equal up to rounding)
        torch.testing.assert_close(got.conv_states[0][..., 1:], want.conv_states[0][..., 1:], rtol=1e-4, atol=1e-5)
        if want.conv_states.get(1) is not None:       # a PLE layer
            torch.testing.assert_close(got.conv_states[1], want.conv_states[1], rtol=1e-4, atol=1e-5)
            assert torch.equal(got.conv_states[2], want.conv_states[2])


@pytest.mark.parametrize("name", MODELS)
def test_sampling_runs_within_the_vocabulary(built, name):
    model = built(name)
    ids = _ids(PROMPTS[1])
    torch.manual_seed(3)
    with speculative(model):
        out = model.generate(ids, do_sample=True, max_new_tokens=32, prompt_lookup_num_tokens=3, top_k=20)
    assert out.shape[1] == ids.shape[1] + 32
    assert int(out.min()) >= 0 and int(out.max()) < hf_models.VOCAB


@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear"])
def test_bf16_models_run(built, name):
    """bf16 models speculate; their tokens equal greedy decoding's up to rounding (transformers'
    own chunked and per-token kernels differ by rounding too), so only the run is checked."""
    model = built(name, dtype=torch.bfloat16)
    ids = _ids(PROMPTS[0])
    with speculative(model):
        out = _greedy(model, ids, max_new_tokens=24, prompt_lookup_num_tokens=3)
    assert out.shape[1] == ids.shape[1] + 24 and int(out.max()) < hf_models.VOCAB


def test_without_the_context_generate_refuses_and_the_context_is_undone(built):
    model = built("qwen3_next")
    ids = _ids(PROMPTS[0])
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=3)
    other = hf_models.build("qwen3_next", seed=5).to(DEVICE)
    with speculative(model):
        with pytest.raises(ValueError, match="stateful"):       # another instance of the class
            other.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=3)
    assert "_is_stateful" not in model.__dict__ and model._is_stateful
    assert all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=3)


def test_a_stateful_assistant_and_an_unsupported_model_are_refused(built):
    model = built("qwen3_5")
    with speculative(model):
        with pytest.raises(ValueError, match="assistant model .* is stateful"):
            model.generate(_ids(PROMPTS[0]), max_new_tokens=4, assistant_model=built("qwen3_next"))
    with pytest.raises(UnsupportedModelError, match="supported: " + ", ".join(supported_models())):
        with speculative(hf_models.assistant()):
            pass

"""LLM inference as users run it: Hugging Face models with their default KV cache, `generate()`
and hand-written decode loops, compiled end to end.

Every model is a tiny config with random weights and default settings otherwise (`use_cache=True`).
Tokens are compared with eager's exactly; the kernels run in Triton's interpreter with poisoned
buffers (gjit.config.debug); every test asserts that no call ran eagerly and how many compiles the
whole decode took.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

import gjit
from gjit.capture import kv_cache
from gjit.debug.report import build_report
from helpers import run_compiled

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.cpu

VOCAB = 500
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)


def build(name: str) -> torch.nn.Module:
    tf = transformers
    configs = {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**TINY)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**TINY)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**TINY)),  # sliding-window cache layers
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**TINY, head_dim=16)),
        # sliding-window layers with every prompt longer than the window (4): the cache holds the
        # last 3 positions (a prompt that crosses the window mid-decode is a third program: the
        # layer's Python branches on it, and export guards the entry on which side it is)
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**TINY, head_dim=16, sliding_window=4)),
        "t5": lambda: tf.T5ForConditionalGeneration(
            tf.T5Config(
                vocab_size=VOCAB,
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=0,
            )
        ),
        "bart": lambda: tf.BartForConditionalGeneration(
            tf.BartConfig(
                vocab_size=VOCAB,
                d_model=64,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
                max_position_embeddings=256,
            )
        ),
    }
    torch.manual_seed(0)
    return configs[name]().eval()


def prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    ids = torch.randint(
        3, VOCAB, (batch, length), generator=torch.Generator("cpu").manual_seed(seed), device="cpu"
    )
    return ids.to(torch.get_default_device())  # GJIT_TEST_DEVICE=cuda: the same prompts on the GPU


def generate(model: torch.nn.Module, ids: torch.Tensor, tokens: int, **kwargs) -> torch.Tensor:
    """`tokens` new tokens exactly (no early stop at a random EOS), sampling under a fixed seed."""
    torch.manual_seed(1)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)


def compiled_forward(model: torch.nn.Module) -> gjit.CompiledFunction:
    """The standard recipe for compiled generation."""
    model.forward = gjit.compile(model.forward)
    return model.forward


# what may stay an ATen extern in a decode step; everything else (the cache update, rotary
# embeddings, masks, norms, activations) must be generated kernels
MATMUL_ATTENTION = {
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.scaled_dot_product_attention.default",
}


def externs(cm: gjit.CompiledFunction) -> set[str]:
    return {e.op for entry in cm.entries for e in build_report(entry).externs}


def counters() -> tuple[int, int]:
    stats = gjit.stats()
    return stats["compiles"], stats["eager_runs"]


# ------------------------------------------------------------------------------------------------
# generate(): greedy and sampled, then another prompt length and batch size


# the models beyond one of each kind (GPT-2 and T5 through generate(), Llama by hand below; Mistral's
# sliding-window cache by hand too) run in CI's sweep step (GJIT_TEST_SLOW=1), and so do the longest
# runs of the default models: the default run stays inside its 15 minutes
SWEEP = pytest.mark.slow


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("gpt2", marks=SWEEP),  # the default run's GPT-2 generate(): test_proved_masks.py's
        pytest.param("llama", marks=SWEEP),  # the default run's Llama: the manual decode loop below
        pytest.param("t5", marks=SWEEP),  # the default run's T5: the encoder-decoder loop below
        pytest.param("mistral", marks=SWEEP),
        pytest.param("qwen2", marks=SWEEP),
        pytest.param("gemma", marks=SWEEP),
        pytest.param("gemma2", marks=SWEEP),
        pytest.param("bart", marks=SWEEP),
    ],
)
def test_generate_matches_eager_with_two_compiles(name):
    model = build(name)
    ids, other = prompt(2, 7, seed=0), prompt(3, 12, seed=1)
    expected = [generate(model, ids, 6), generate(model, ids, 6, do_sample=True), generate(model, other, 6)]
    cm = compiled_forward(model)
    with gjit.config.scope(interpret=True, debug=True):
        first = generate(model, ids, 6)
        assert counters() == (2, 0), "prefill and one dynamic decode entry, nothing eager"
        rest = [generate(model, ids, 6, do_sample=True), generate(model, other, 6)]
    for got, want in zip([first, *rest], expected):
        assert torch.equal(got, want), f"{name}: tokens differ from eager\n{got}\n{want}"
    assert counters() == (2, 0), "sampling, another prompt length and batch size: no new compile"
    assert gjit.stats()["cache_hits"] == 3 * 6 - 2
    assert externs(cm) <= MATMUL_ATTENTION, externs(cm) - MATMUL_ATTENTION


@SWEEP  # 32 tokens: a minute of the default run's
def test_generate_32_tokens_two_compiles_any_prompt_length():
    """A prompt of length 1 and one of length 9: the decode entry admits a KV cache of length 1."""
    model = build("gpt2")
    short, long = prompt(2, 1, seed=2), prompt(2, 9, seed=3)
    want_short, want_long = generate(model, short, 32), generate(model, long, 4)
    compiled_forward(model)
    with gjit.config.scope(interpret=True):
        got_short = generate(model, short, 32)
        compiles_short = gjit.stats()["compiles"]
        got_long = generate(model, long, 4)
    assert torch.equal(got_short, want_short) and torch.equal(got_long, want_long)
    assert compiles_short == 2, "prefill of one token, then every decode step from one entry"
    # the one-token prompt's prefill is an entry of its own (export specializes a size of 1), as
    # batch 1 is; the longer prompt's prefill is the only new compile
    assert counters() == (3, 0)


@SWEEP  # 56 s; the default run's static cache: tests/test_cache_aliases.py
def test_static_cache_generate_writes_in_place():
    model = build("llama")
    ids, other = prompt(2, 5, seed=4), prompt(2, 8, seed=5)
    want = [
        generate(model, ids, 6, cache_implementation="static"),
        generate(model, other, 6, cache_implementation="static"),
    ]
    cm = compiled_forward(model)
    with gjit.config.scope(interpret=True, debug=True):
        got = [
            generate(model, ids, 6, cache_implementation="static"),
            generate(model, other, 6, cache_implementation="static"),
        ]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert counters() == (2, 0)
    # the decode step writes the new position into the caller's cache buffers: a kernel per
    # buffer into its memory, no functional copy of the whole cache and no copy back
    decode = cm.entries[1].program
    wrapper = open(decode.graph.wrapper_path).read()
    assert len(re.findall(r"^    index_put\w* = \w+_(?:keys|values)$", wrapper, re.M)) == 4, wrapper
    assert "aten.index_put" not in wrapper
    assert externs(cm) <= MATMUL_ATTENTION, externs(cm)


# ------------------------------------------------------------------------------------------------
# a hand-written decode loop: the cache passed back in, positions and the attention mask grown


def decode_loop(model, ids: torch.Tensor, steps: int, cache) -> tuple[torch.Tensor, list]:
    """Greedy decoding by hand; returns the tokens and the cache objects each call returned."""
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    returned = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        tokens = [out.logits[:, -1].argmax(-1)]
        returned.append(out.past_key_values)
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=tokens[-1][:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
            )
            tokens.append(out.logits[:, -1].argmax(-1))
            returned.append(out.past_key_values)
    return torch.stack(tokens, dim=1), returned


def cache_tensors(cache) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(cache) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", ["llama", pytest.param("mistral", marks=SWEEP)])
def test_manual_decode_loop_updates_the_callers_cache(name):
    model = build(name)
    ids = prompt(2, 6, seed=6)
    want, _ = decode_loop(model, ids, 5, transformers.DynamicCache(config=model.config))
    want_cache = _[-1]
    cm = gjit.compile(model)
    cache = transformers.DynamicCache(config=model.config)
    with gjit.config.scope(interpret=True, debug=True):
        got, returned = decode_loop(cm, ids, 5, cache)
    assert torch.equal(got, want)
    assert counters() == (2, 0)
    # as in eager, each call returns the cache it was given, now holding the new keys and values
    assert all(r is cache for r in returned)
    assert type(cache) is type(want_cache) and len(cache.layers) == len(want_cache.layers)
    for mine, theirs in zip(cache_tensors(cache), cache_tensors(want_cache)):
        assert mine.shape == theirs.shape
        torch.testing.assert_close(mine, theirs, rtol=1.3e-6, atol=1e-5)
    assert cache.get_seq_length() == want_cache.get_seq_length() == 6 + 5
    assert externs(cm) <= MATMUL_ATTENTION, externs(cm) - MATMUL_ATTENTION


def test_encoder_decoder_manual_loop():
    """T5 by hand: encoder once, then decoder steps with an EncoderDecoderCache passed back in."""
    model = build("t5")
    ids = prompt(2, 7, seed=7)

    def run(forward):
        cache = transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
        with torch.no_grad():
            encoded = model.get_encoder()(input_ids=ids)
            tokens = torch.zeros(2, 1, dtype=torch.long)
            for _ in range(5):
                out = forward(
                    encoder_outputs=encoded, decoder_input_ids=tokens[:, -1:], past_key_values=cache
                )
                assert out.past_key_values is cache
                tokens = torch.cat([tokens, out.logits[:, -1:].argmax(-1)], dim=1)
        return tokens, cache

    want, want_cache = run(model)
    with gjit.config.scope(interpret=True, debug=True):
        got, cache = run(gjit.compile(model))
    assert torch.equal(got, want)
    assert counters() == (2, 0), "the first step (empty caches), then one entry from a length of 1 up"
    for mine, theirs in zip(cache_tensors(cache), cache_tensors(want_cache)):
        torch.testing.assert_close(mine, theirs, rtol=1.3e-6, atol=1e-5)


def test_use_cache_default_call_returns_a_dynamic_cache():
    """`gjit.compile(model)(ids)` with use_cache=True (the default): the cache the model builds
    inside the call comes back as a real DynamicCache holding eager's tensors."""
    model = build("gpt2")
    ids = prompt(2, 8, seed=8)
    with torch.no_grad():
        want = model(ids)
        with gjit.config.scope(interpret=True, debug=True):
            got = gjit.compile(model)(ids)
    assert counters() == (1, 0)
    assert type(got.past_key_values) is transformers.DynamicCache
    torch.testing.assert_close(got.logits, want.logits, rtol=1.3e-6, atol=1e-5)
    for mine, theirs in zip(cache_tensors(got.past_key_values), cache_tensors(want.past_key_values)):
        torch.testing.assert_close(mine, theirs, rtol=1.3e-6, atol=1e-5)
    assert got.past_key_values.get_seq_length() == 8


# ------------------------------------------------------------------------------------------------
# when capture fails: the class and the fix, once, and none of torch's own trace logs


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class PagedCache:
    """A user's own cache class, not a pytree node."""

    def __init__(self):
        self.keys = torch.randn(2, 4, 3, 8)


def attend(query: torch.Tensor, cache: PagedCache) -> torch.Tensor:
    return torch.softmax(query @ cache.keys.transpose(-1, -2), dim=-1)


def test_unknown_cache_class_named_with_the_fix_once():
    gjit_log, torch_log = _Records(), _Records()
    logging.getLogger("gjit").addHandler(gjit_log)
    logging.getLogger("torch").addHandler(torch_log)
    try:
        cm = gjit.compile(attend)
        query = torch.randn(2, 4, 5, 8)
        for _ in range(3):
            out, _ = run_compiled(cm, query, PagedCache(), expect_eager=True)
    finally:
        logging.getLogger("gjit").removeHandler(gjit_log)
        logging.getLogger("torch").removeHandler(torch_log)
    warnings = [r.getMessage() for r in gjit_log.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "PagedCache" in warnings[0] and "register_pytree_node" in warnings[0]
    assert "PagedCache" in cm.eager_reason
    assert not [r for r in torch_log.records if r.levelno >= logging.WARNING]
    assert counters() == (0, 3)


def test_torch_trace_errors_go_to_the_capture_log_only():
    """torch's tracing modules log errors with tracebacks while a trace fails (a meta kernel that
    raised); during capture they reach GJIT_LOGS=+capture, not the user's terminal."""

    def noisy(x):
        if torch.compiler.is_exporting():
            logging.getLogger("torch._subclasses.fake_tensor").error("failed while attempting to run meta")
        return x.sin()

    torch_log, capture_log = _Records(), _Records()
    logging.getLogger("torch").addHandler(torch_log)
    capture = logging.getLogger("gjit.capture")
    capture.addHandler(capture_log)
    level = capture.level
    capture.setLevel(logging.DEBUG)
    try:
        run_compiled(noisy, torch.randn(8))
    finally:
        logging.getLogger("torch").removeHandler(torch_log)
        capture.removeHandler(capture_log)
        capture.setLevel(level)
    assert not [r for r in torch_log.records if r.levelno >= logging.ERROR]
    assert any("failed while attempting to run meta" in r.getMessage() for r in capture_log.records)


# ------------------------------------------------------------------------------------------------
# writes through indices in place: only where no one reads the old value


def _write_then_read(x, idx, src):
    x.index_copy_(0, idx, src)
    return x * 2


def _read_then_write(x, idx, src):
    before = x * 2
    x.index_copy_(0, idx, src)
    return before + x


def _functional_on_input(x, idx, src):
    return torch.index_put(x, (idx,), src) + x  # x itself is not written


def _accumulate(x, idx, src):
    x.index_put_((idx,), src, accumulate=True)
    return x + 1


def _fresh_buffer(x, idx, src):
    z = torch.zeros_like(x)
    z.index_copy_(0, idx, src)
    return z + x


@pytest.mark.parametrize(
    "fn, in_place",
    [
        (_write_then_read, True),
        (_read_then_write, False),
        (_functional_on_input, False),
        (_accumulate, False),
        (_fresh_buffer, False),  # a kernel writes into the zeros' memory (below)
    ],
)
def test_index_writes_in_place_only_when_safe(fn, in_place):
    """In place: the write's kernel stores into x's own memory (no copy of x, none back after)."""
    x = torch.randn(6, 5)
    idx, src = torch.tensor([4, 1]), torch.randn(2, 5)
    x_eager = x.clone()
    want = fn(x_eager, idx, src)
    x_gjit = x.clone()
    got, cm = run_compiled(fn, x_gjit, idx, src)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x_gjit, x_eager)  # the input holds what eager left in it
    program = cm.entries[0].program
    wrapper = open(program.graph.wrapper_path).read()
    assert ("    index_put = x\n" in wrapper) == in_place, wrapper
    assert "index_put_.default(" not in wrapper, wrapper  # every write a kernel
    assert any(k.name.startswith("gjit_scatter") for k in program.kernels)


def test_an_index_write_into_a_fresh_tensor_is_a_kernel_in_its_memory():
    x = torch.randn(6, 5)
    idx, src = torch.tensor([4, 1]), torch.randn(2, 5)
    got, cm = run_compiled(_fresh_buffer, x, idx, src)
    torch.testing.assert_close(got, _fresh_buffer(x, idx, src))
    program = cm.entries[0].program
    assert [k.name.split("_")[1] for k in program.kernels] == ["poi", "scatter", "poi"]  # zeros, write, add
    wrapper = open(program.graph.wrapper_path).read()
    assert "index_put = full_like\n" in wrapper, wrapper  # the write's result is the zeros' buffer


def test_a_cache_changed_but_not_returned_runs_eagerly():
    """The new state of a cache the model does not return has no way out of a compiled call:
    gjit says so and runs the call eagerly rather than leave the caller's cache stale."""

    def step(x, cache):
        cache.update(x, x + 1, 0)
        return x * 2

    x = torch.randn(2, 4, 3, 8)
    mine, eager = transformers.DynamicCache(), transformers.DynamicCache()
    want = step(x, eager)
    got, cm = run_compiled(step, x, mine, expect_eager=True)
    torch.testing.assert_close(got, want)
    assert (
        "DynamicCache passed as argument 1" in cm.eager_reason and "without returning it" in cm.eager_reason
    )
    assert mine.get_seq_length() == eager.get_seq_length() == 3


def _write_own_values(x, perm):
    t = x + 0
    return torch.index_put(t, (perm,), t)  # the write reads the tensor it writes into


def test_index_write_that_reads_its_own_target_stays_functional():
    x, perm = torch.randn(5, 3), torch.tensor([4, 3, 2, 1, 0])
    got, cm = run_compiled(_write_own_values, x, perm)
    torch.testing.assert_close(got, _write_own_values(x, perm))
    assert "index_put_.default(" not in open(cm.entries[0].program.graph.wrapper_path).read()


@SWEEP  # transformers' own torch.compile of the decode step: 17 s
def test_static_cache_generate_under_transformers_auto_compile():
    """On a GPU, generate() with a static cache wraps the model's __call__ in torch.compile
    (forced here on CPU): Dynamo must not trace into the compiled forward, gjit still runs it."""
    model = build("llama")
    ids = prompt(2, 5, seed=9)
    config = transformers.CompileConfig()
    config._compile_all_devices = True  # transformers' own switch for compiling off-GPU
    want = generate(model, ids, 4, cache_implementation="static")
    compiled_forward(model)
    with gjit.config.scope(interpret=True):
        got = generate(model, ids, 4, cache_implementation="static", compile_config=config)
    assert torch.equal(got, want)
    assert hasattr(model, "_compiled_call"), "transformers did not wrap the call in torch.compile"
    assert counters() == (2, 0) and gjit.stats()["cache_hits"] == 2


def test_cache_trees_survive_serialization():
    """gjit's flatten of the cache classes is also what torch.export.save writes: every context
    round-trips through JSON to an equal tree."""
    model = build("llama")
    dynamic = transformers.DynamicCache(config=model.config)
    static = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(prompt(2, 5, seed=10), past_key_values=dynamic)
        model(prompt(2, 5, seed=10), past_key_values=static)
    both = transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
    both.self_attention_cache.update(torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8), 0)
    kv_cache.register([dynamic, static, both])
    for cache in (dynamic, static, both):
        leaves, spec = torch.utils._pytree.tree_flatten(cache)
        assert leaves, f"{type(cache).__name__} flattened to nothing"
        loaded = torch.utils._pytree.treespec_loads(torch.utils._pytree.treespec_dumps(spec))
        assert loaded == spec
        rebuilt = torch.utils._pytree.tree_unflatten(leaves, loaded)
        assert type(rebuilt) is type(cache) and rebuilt.get_seq_length() == cache.get_seq_length()

"""gjit.save / gjit.load: a package serves calls in a fresh process with no export and no compile.

Round trips load the package in a subprocess of its own (a fresh process, as a server restart
would), run the kernels in Triton's interpreter with poisoned buffers, compare with eager, and
count: no export, no decomposition, no compile, no eager run. The refusal tests damage, edit or
mismatch a package and check that loading says what is wrong and never runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from test_llm import build, prompt

import gjit
from helpers import check
from model_zoo import MODELS, MORE_MODELS

pytestmark = pytest.mark.cpu

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = """
import json, sys, torch, gjit
import torch.utils._pytree as pytree
from model_zoo import MODELS, MORE_MODELS, max_rel_err
name, path = sys.argv[1:3]
gjit.config.interpret = True
gjit.config.debug = True
model, args = {**MODELS, **MORE_MODELS}[name]()
with torch.no_grad():
    fn = gjit.load(path, model=model)
    out = fn(*args)
    expected = model(*args)
errors = [
    max_rel_err(a, e)
    for a, e in zip(pytree.tree_leaves(out), pytree.tree_leaves(expected))
    if isinstance(e, torch.Tensor) and e.is_floating_point()
]
print(json.dumps({"stats": {k: v for k, v in gjit.stats().items() if isinstance(v, int)}, "errors": errors}))
"""


def run_child(script: str, *argv: str, cache_dir: str) -> dict:
    env = dict(os.environ, GJIT_CACHE_DIR=cache_dir, GJIT_CACHE="0")
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def saved(name: str, path) -> None:
    model, args = {**MODELS, **MORE_MODELS}[name]()
    with torch.no_grad():
        cm = gjit.compile(model)
        cm(*args)
    gjit.save(cm, str(path))


def assert_served_from_package(result: dict, entries: int = 1) -> None:
    counters = result["stats"]
    assert counters.get("package_loads") == 1
    for name in ("exports", "decompositions", "compiles", "eager_runs", "disk_cache_hits"):
        assert counters.get(name, 0) == 0, (name, counters)
    assert counters["cache_hits"] >= 1


def round_trip(name: str, tmp_path) -> None:
    saved(name, tmp_path / "model.gjit")
    result = run_child(CHILD, name, str(tmp_path / "model.gjit"), cache_dir=str(tmp_path / "cache"))
    assert_served_from_package(result)
    assert result["errors"] and max(result["errors"]) < 1e-4, result["errors"]


# a fresh process each (about 12 s): the default run keeps one of each kind of attention, the rest
# run in CI's sweep step
SWEPT = {"gpt2-eager", "llama-eager", "llama-sdpa", "bert-sdpa", "bert-eager", "transformer_encoder_layer"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SWEPT else n for n in MODELS]
)
def test_package_round_trip_in_a_fresh_process(name, tmp_path):
    round_trip(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MORE_MODELS))
def test_package_round_trip_more_architectures(name, tmp_path):
    round_trip(name, tmp_path)


GENERATE_CHILD = """
import json, sys, torch, transformers, gjit
path, weights = sys.argv[1], sys.argv[2] == "weights"
gjit.config.interpret = True
gjit.config.debug = True
torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2)
model = transformers.GPT2LMHeadModel(config).eval()
ids = torch.randint(0, 128, (2, 5))
with torch.no_grad():
    want = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.forward = gjit.load(path) if weights else gjit.load(path, model=model.forward)
    got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
print(json.dumps({"stats": {k: v for k, v in gjit.stats().items() if isinstance(v, int)},
                  "equal": bool(torch.equal(got, want))}))
"""


@pytest.mark.parametrize(
    "weights",
    [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)],
    ids=["live-model", "package-weights"],
)  # (in CI's sweep step: 13 s, and 24 s of a fresh process with the package's own weights)
def test_generate_from_a_package_prefill_and_decode_entries(tmp_path, weights):
    """generate() with the default KV cache from a package of its two entries (prefill, decode):
    the bound-method recipe, the cache classes as pytree nodes, the caller's cache updated."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 5))
    compiled = gjit.compile(model.forward)
    model.forward = compiled
    with torch.no_grad():
        model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert len(compiled.entries) == 2
    gjit.save(compiled, str(tmp_path / "gpt2.gjit"), weights=weights)
    argv = [str(tmp_path / "gpt2.gjit"), "weights" if weights else "model"]
    result = run_child(GENERATE_CHILD, *argv, cache_dir=str(tmp_path / "cache"))
    assert result["equal"]
    assert_served_from_package(result)


# ----------------------------------------------------------------------------------------------
# In this process: refusals and misses
# ----------------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.proj(self.norm(x))) + x


@pytest.fixture
def package(tmp_path):
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(4, 16)
    with torch.no_grad(), gjit.config.scope(interpret=True, debug=True):
        cm = check(model, x)
    path = tmp_path / "block.gjit"
    gjit.save(cm, str(path))
    return model, x, path


def test_a_loaded_package_serves_in_range_calls_and_names_the_guard_of_a_miss(package):
    model, x, path = package
    fn = gjit.load(str(path), model=model)
    exports = gjit.stats().get("exports", 0)
    with torch.no_grad(), gjit.config.scope(interpret=True, debug=True):
        torch.testing.assert_close(fn(x), model(x))
        y = torch.randn(9, 16)  # dim 0 is dynamic in the entry
        torch.testing.assert_close(fn(y), model(y))
        with pytest.raises(gjit.RecompileError, match=r"x.dtype == torch.float32, got torch.float64"):
            fn(x.double())
    assert gjit.stats().get("exports", 0) == exports


def test_a_miss_compiles_when_allowed(package):
    model, x, path = package
    fn = gjit.load(str(path), model=model, recompile=True)
    y = torch.randn(5, 16, dtype=torch.float64)
    model.double()  # the input's dtype guard (and the parameters'): a new entry, exported from the model
    with torch.no_grad(), gjit.config.scope(interpret=True, debug=True):
        torch.testing.assert_close(fn(y), model(y))
    assert len(fn.entries) == 2


def test_parameters_are_read_live_from_the_given_model(package):
    model, x, path = package
    fn = gjit.load(str(path), model=model)
    with torch.no_grad(), gjit.config.scope(interpret=True, debug=True):
        model.proj.weight.mul_(2)
        torch.testing.assert_close(fn(x), model(x))
        model.proj.weight = torch.nn.Parameter(torch.randn(16, 16).t())  # another layout: a miss
        with pytest.raises(gjit.RecompileError, match="proj.weight keeps its shape, strides"):
            fn(x)


def test_a_package_tuned_on_another_gpu_is_refused(tmp_path, monkeypatch):
    """Tile configurations measured on one GPU (gjit/tuning.py) may not fit another's shared
    memory: such a package loads only on that GPU (none here)."""
    from gjit import packaging

    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(4, 16)
    with torch.no_grad(), gjit.config.scope(interpret=True):
        cm = check(model, x)
    monkeypatch.setattr(packaging, "_tuned_on", lambda compiled: "NVIDIA H200")
    gjit.save(cm, str(tmp_path / "tuned.gjit"))
    with pytest.raises(gjit.PackageError, match="was tuned on a NVIDIA H200.*GJIT_TUNE=0"):
        gjit.load(str(tmp_path / "tuned.gjit"), model=model)


def test_a_model_with_another_config_is_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        cm = gjit.compile(model)
        cm(ids)
    gjit.save(cm, str(tmp_path / "g.gjit"))
    config.layer_norm_epsilon = 1e-3  # no weight shows it
    other = transformers.GPT2LMHeadModel(config).eval()
    with pytest.raises(
        gjit.PackageError, match=r"config.layer_norm_epsilon is 0.001, the package's is 1e-05"
    ):
        gjit.load(str(tmp_path / "g.gjit"), model=other)


def test_a_package_saved_after_a_warm_start(tmp_path):
    """Entries that came from the on-disk cache (their program in its served form) package too."""
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(4, 16)
    with torch.no_grad(), gjit.config.scope(cache=True, cache_dir=str(tmp_path / "cache")):
        gjit.compile(model)(x)
        warm = gjit.compile(model)
        warm(x)
        assert gjit.stats()["disk_cache_hits"] == 1
    gjit.save(warm, str(tmp_path / "warm.gjit"))
    with torch.no_grad(), gjit.config.scope(interpret=True, debug=True):
        torch.testing.assert_close(gjit.load(str(tmp_path / "warm.gjit"), model=model)(x), model(x))


def test_a_model_that_does_not_match_the_manifest_is_refused(package):
    _, _, path = package
    with pytest.raises(
        gjit.PackageError, match=r"proj.weight is float32\[24, 24\], the package's is float32\[16, 16\]"
    ):
        gjit.load(str(path), model=Block(24).eval())
    with pytest.raises(gjit.PackageError, match="built for a .*Block, not a .*Linear"):
        gjit.load(str(path), model=torch.nn.Linear(16, 16))


def test_a_package_without_weights_needs_the_model(package):
    _, _, path = package
    with pytest.raises(gjit.PackageError, match="saved without weights: pass the model"):
        gjit.load(str(path))


class Scaled(Block):
    """A non-persistent buffer and a parameter stored transposed (not contiguous)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.rand(16) + 0.5, persistent=False)
        self.proj.weight = torch.nn.Parameter(torch.randn(16, 16).t())

    def forward(self, x):
        return super().forward(x) * self.scale


def test_a_package_with_weights_runs_without_the_model(tmp_path):
    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(4, 16)
    with torch.no_grad():
        cm = gjit.compile(model)
        cm(x)
    gjit.save(cm, str(tmp_path / "w.gjit"), weights=True)
    fn = gjit.load(str(tmp_path / "w.gjit"))
    with torch.no_grad(), gjit.config.scope(interpret=True, debug=True):
        torch.testing.assert_close(fn(x), model(x))
        torch.testing.assert_close(fn(x=x), model(x))  # keywords bind through the saved signature


def rewrite(path, edit) -> None:
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    edit(members)
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def test_a_package_of_another_version_is_refused_with_what_differs(package):
    model, _, path = package

    def edit(members):
        manifest = json.loads(members["manifest.json"])
        manifest["versions"]["torch"] = "2.0.0"
        members["manifest.json"] = json.dumps(manifest).encode()

    rewrite(path, edit)
    with pytest.raises(gjit.PackageError, match=r"another version: torch '2.0.0' \(this process: '"):
        gjit.load(str(path), model=model)


@pytest.mark.parametrize("damage", ["member", "truncated", "extra", "missing"])
def test_a_damaged_package_is_refused(package, damage):
    model, _, path = package
    if damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "member":  # the archive is intact, a member is not what was saved

        def edit(members):
            text = members["entries/0.json"].decode().replace("tl.store", "tl.load", 1)
            members["entries/0.json"] = text.encode()

        rewrite(path, edit)
    elif damage == "extra":
        rewrite(path, lambda members: members.update({"entries/1.json": b"{}"}))
    else:
        rewrite(path, lambda members: members.pop("entries/0.json"))
    with pytest.raises(gjit.PackageError, match="not a readable gjit package|is damaged"):
        gjit.load(str(path), model=model)


def test_a_size_expression_that_is_not_sympy_is_refused():
    from gjit.runtime import size_expressions

    size_expressions.check_expressions({"expr_str": "Mul(Integer(2), Symbol('s0', integer=True))"})
    refused = (
        "__import__('os').system('true')",
        "Symbol('s0').__class__",
        "[x for x in ()]",
        "S('__import__(1)')",  # sympify of a string
        "floor('__import__(1)')",  # a function given a string sympifies it
        "Symbol('s0', integer='__import__(1)')",
        "Symbol('s0; x')",
    )
    for text in refused:
        with pytest.raises(size_expressions.ExpressionError):
            size_expressions.check_expressions({"a": [{"expr_str": text}]})


def test_save_before_any_call_says_to_call_first(tmp_path):
    with pytest.raises(gjit.PackageError, match="call it"):
        gjit.save(gjit.compile(Block()), str(tmp_path / "x.gjit"))


@pytest.mark.slow  # about 20 s: two generate() runs compiled, one from the package
def test_a_package_written_after_a_warm_start_holds_the_lifted_constants(tmp_path):
    """A warm start serves the stored program, whose record leaves out the constants export lifted
    (read live from the model's export); its package holds them. Llama's decode steps with the
    dynamic cache read one a layer: the package once did not load ("the program reads
    ...self_attn.lifted_tensor_0, which the model does not have")."""
    model, ids = build("llama"), prompt(2, 5, seed=5)
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    forward = model.forward
    with torch.no_grad():
        want = model.generate(ids, **settings)
    with torch.no_grad(), gjit.config.scope(cache=True, cache_dir=str(tmp_path / "cache"), interpret=True):
        for _ in range(2):  # cold, then warm from the disk cache
            model.forward = compiled = gjit.compile(forward)
            assert torch.equal(model.generate(ids, **settings), want)
    programs = [e.program.captured.program for e in compiled.entries]
    assert any("lifted" in name for p in programs for name in p.constants), "nothing lifted: tests nothing"
    assert gjit.stats().get("disk_cache_hits", 0) >= 2
    path = str(tmp_path / "llama.gjit")
    gjit.save(compiled, path)
    with torch.no_grad(), gjit.config.scope(interpret=True):
        model.forward = gjit.load(path, model=forward)
        assert torch.equal(model.generate(ids, **settings), want)
    assert gjit.stats()["eager_runs"] == 0

"""The on-disk compile cache (gjit/runtime/disk_cache.py): warm starts across processes, concurrent writers,
damaged entries, what the key covers, and the sympy codec that replaces pickle."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import sympy
import torch
import torch.utils._sympy.functions as torch_sympy

import gjit
from gjit.runtime import disk_cache as cache
from helpers import check

pytestmark = pytest.mark.cpu


@pytest.fixture
def disk_cache(tmp_path):
    """The on-disk cache on, in a folder of this test's own."""
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path / "cache")):
        yield tmp_path / "cache"


def entries(root) -> list:
    return sorted((root / "graphs").rglob("*.json"))


def counter(name: str) -> int:
    return gjit.stats().get(name, 0)


class Block(torch.nn.Module):
    """A reduction, a matmul extern and pointwise epilogues: a few kernels of each kind."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return torch.softmax(h, -1) + x


# ----------------------------------------------------------------------------------------------
# Across processes
# ----------------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import hashlib, json, torch, gjit
    from test_cache import Block
    gjit.config.interpret = True
    gjit.config.debug = True
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(4, 8, 16)
    with torch.no_grad():
        cm = gjit.compile(model)
        out = cm(x)
        torch.testing.assert_close(out, model(x), rtol=1.3e-6, atol=1e-5)
    print(json.dumps({
        "stats": {k: v for k, v in gjit.stats().items() if k != "compile_seconds"},
        "stages": sorted(cm.entries[0].program.timings),
        "kernels": [k.source for k in cm.entries[0].program.kernels],
        "out": hashlib.sha256(out.numpy().tobytes()).hexdigest(),
    }))
    """
)


def _child(root, env_extra: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, GJIT_CACHE_DIR=str(root), GJIT_CACHE="1", GJIT_LOGS="cache")
    env.pop("GJIT_DUMP_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=env | (env_extra or {}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.slow  # CI's sweep step: 16 s of child processes (the in-process disk hits stay)
def test_two_processes_at_once_then_a_warm_start(tmp_path):
    root = tmp_path / "cache"
    first, second = _child(root), _child(root)  # started together on an empty cache
    (a, _), (b, _) = _result(first), _result(second)
    assert a["stats"].get("disk_cache_misses", 0) + b["stats"].get("disk_cache_misses", 0) >= 1
    assert "disk_cache_errors" not in a["stats"] and "disk_cache_errors" not in b["stats"]
    assert {"lower", "fuse", "codegen", "wrapper"} <= set(a["stages"]) | set(b["stages"])
    assert a["out"] == b["out"] and a["kernels"] == b["kernels"]
    assert len(entries(root)) == 1
    assert not list(root.rglob("*.tmp")), "a temp file of an atomic write was left behind"

    warm, log = _result(_child(root))
    assert warm["stats"]["disk_cache_hits"] == 1 and warm["stats"]["kernels"] == 0
    # what a warm start does: export and guards; no decomposition, lowering, fusion, codegen or
    # kernel writing (the decomposed graph comes from the entry)
    assert set(warm["stages"]) == {"export", "cache", "guards"}
    assert warm["stats"]["exports"] == 1 and "decompositions" not in warm["stats"]
    # whichever of the two compiled decomposed (the other may have started late enough to hit)
    assert a["stats"].get("decompositions", 0) + b["stats"].get("decompositions", 0) >= 1
    assert warm["out"] == a["out"] and warm["kernels"] == a["kernels"]
    assert "on-disk hit: compiled graph" in log


# ----------------------------------------------------------------------------------------------
# In one process (a fresh gjit.compile of the same model reads the disk, like a new process)
# ----------------------------------------------------------------------------------------------


def _fresh_compile(model, x, **scope):
    with torch.no_grad(), gjit.config.scope(**scope):
        return check(model, x)


def test_a_fresh_compile_of_the_same_model_is_a_disk_hit_with_the_same_kernels(disk_cache):
    model, x = Block().eval(), torch.randn(3, 5, 16)
    cold = _fresh_compile(model, x)
    warm = _fresh_compile(model, x)
    assert counter("disk_cache_misses") == 1 and counter("disk_cache_hits") == 1
    assert [k.source for k in warm.entries[0].program.kernels] == [
        k.source for k in cold.entries[0].program.kernels
    ]
    assert "codegen" not in warm.entries[0].program.timings
    # explain and the dump of a warm entry lower and fuse again (no codegen) and agree with the cold one
    with torch.no_grad():
        cold_report, warm_report = gjit.explain(cold, x), gjit.explain(warm, x)
    assert str(warm_report).splitlines()[:-1] == str(cold_report).splitlines()[:-1]
    assert warm_report.traffic == cold_report.traffic


def test_dump_folder_of_a_warm_entry(disk_cache, tmp_path):
    model, x = Block().eval(), torch.randn(2, 4, 16)
    _fresh_compile(model, x)
    cm = gjit.compile(model, dump_dir=str(tmp_path / "dump"))
    with torch.no_grad(), gjit.config.scope(interpret=True, debug=True):
        cm(x)
    assert counter("disk_cache_hits") == 1
    regions = next((tmp_path / "dump").rglob("03_regions.txt")).read_text()
    for k in cm.entries[0].program.kernels:
        assert k.name in regions


def test_torch_cond_branches_come_back_from_the_cache(disk_cache):
    from test_dynamic import Cond

    x = torch.randn(4, 3).abs()
    _fresh_compile(Cond(), x)
    warm = _fresh_compile(Cond(), -x)
    assert counter("disk_cache_hits") == 1
    assert set(warm.entries[0].program.graph.subgraphs) == {"true_graph_0", "false_graph_0"}
    check(warm, x)


def test_what_the_key_covers(disk_cache):
    x = torch.randn(6, 16)

    def times2(x):
        return (x * 2).sin()

    def times3(x):
        return (x * 3).sin()

    _fresh_compile(times2, x)
    _fresh_compile(times3, x)  # another constant: another graph
    assert counter("disk_cache_misses") == 2
    _fresh_compile(times2, x, xblock=256)  # a knob codegen reads
    assert counter("disk_cache_misses") == 3
    _fresh_compile(times2, x[:3])  # another static size
    assert counter("disk_cache_misses") == 4
    _fresh_compile(times2, x.to(torch.float16))
    assert counter("disk_cache_misses") == 5
    assert counter("disk_cache_hits") == 0
    _fresh_compile(times2, x.clone())  # same graph, same config: a hit
    assert counter("disk_cache_hits") == 1


def test_parameter_values_are_not_in_the_key_and_are_read_live(disk_cache):
    model, x = Block().eval(), torch.randn(2, 3, 16)
    _fresh_compile(model, x)
    with torch.no_grad():
        model.up.weight.mul_(-2)
    _fresh_compile(model, x)  # compares with eager under the new weights
    assert counter("disk_cache_hits") == 1
    _fresh_compile(Block(width=8).eval(), torch.randn(2, 3, 8))  # other parameter shapes
    assert counter("disk_cache_misses") == 2


def test_a_new_gjit_version_is_a_miss(disk_cache, monkeypatch):
    x = torch.randn(5, 7)
    _fresh_compile(torch.nn.GELU(), x)
    monkeypatch.setattr(cache, "gjit_fingerprint", lambda: "an edited gjit")
    _fresh_compile(torch.nn.GELU(), x)
    assert counter("disk_cache_misses") == 2


def test_cache_off_writes_no_entry(disk_cache):
    _fresh_compile(torch.nn.GELU(), torch.randn(3, 4), cache=False)
    assert not (disk_cache / "graphs").exists()
    assert counter("disk_cache_misses") == 0


# ----------------------------------------------------------------------------------------------
# Damage: logged, recompiled, rewritten; never a crash or a wrong answer
# ----------------------------------------------------------------------------------------------


def _rewrite_entry(path, edit) -> None:
    """Change an entry's body and give it a valid checksum, so only the content is wrong."""
    body = json.loads(path.read_text().partition("\n")[2])
    body = json.dumps(edit(body))
    path.write_text(hashlib.sha256(body.encode()).hexdigest() + "\n" + body)


def _bad_function(body):
    body["graph"]["kernels"][0]["numel"] = {"sympy": {"func": "builtins.eval", "args": []}}
    return body


def _bad_key(body):
    body["key"] = "0" * 64
    return body


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]), id="truncated"),
        pytest.param(lambda p: p.write_text(""), id="empty"),
        pytest.param(lambda p: p.write_bytes(b"\xff\xfe" + os.urandom(64)), id="garbage"),
        pytest.param(lambda p: _rewrite_entry(p, _bad_function), id="class-outside-the-table"),
        pytest.param(lambda p: _rewrite_entry(p, _bad_key), id="another-key"),
    ],
)
def test_a_damaged_entry_is_logged_and_recompiled(disk_cache, damage, caplog):
    model, x = Block().eval(), torch.randn(2, 5, 16)
    _fresh_compile(model, x)
    (path,) = entries(disk_cache)
    damage(path)
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        _fresh_compile(model, x)
    assert counter("disk_cache_errors") == 1
    assert any("damaged cache entry" in r.getMessage() for r in caplog.records)
    _fresh_compile(model, x)  # the recompile wrote a good entry again
    assert counter("disk_cache_hits") == 1


def test_a_damaged_kernel_file_is_rewritten(disk_cache, caplog):
    model, x = Block().eval(), torch.randn(2, 5, 16)
    cold = _fresh_compile(model, x)
    kernel = cold.entries[0].program.kernels[0]
    path = cold.entries[0].program.graph.kernel_paths[kernel.name]
    with open(path, "w") as f:
        f.write("raise SystemExit('damaged')\n")
    gjit.runtime.graph._KERNELS.clear()  # as in a new process: the file is read again
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        _fresh_compile(model, x)
    assert counter("disk_cache_hits") == 1
    assert any("does not match its content hash" in r.getMessage() for r in caplog.records)
    with open(path) as f:
        assert kernel.name in f.read()


def test_an_unwritable_entry_costs_only_the_next_warm_start(disk_cache, monkeypatch, caplog):
    def refuse(path, text):
        if path.endswith(".json"):
            raise OSError("disk full")
        return real(path, text)

    real = cache.atomic_write
    monkeypatch.setattr(cache, "atomic_write", refuse)
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        _fresh_compile(torch.nn.GELU(), torch.randn(3, 4))
    assert any("could not write the cache entry" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------------------
# The sympy codec
# ----------------------------------------------------------------------------------------------


def test_sympy_expressions_round_trip_without_eval():
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    u0 = sympy.Symbol("u0", integer=True)
    exprs = [
        s0 * 3 + 1,
        torch_sympy.FloorDiv(s0 * 7 + u0, 4),
        torch_sympy.ModularIndexing(s0 + 5, 3, 8),
        torch_sympy.PythonMod(u0, s0),
        sympy.Max(s0, 16) * 2,
        sympy.And(sympy.Lt(s0 * 4096, 2**31), sympy.Ge(u0, 0)),
        sympy.Eq(s0, u0 + 1),
        sympy.Rational(3, 7) * s0,
        sympy.Float("0.5") * s0,
        sympy.true,
        -sympy.oo,
    ]
    for e in exprs:
        back = cache.expr_from_json(json.loads(json.dumps(cache.expr_to_json(e))))
        assert back == e and back.free_symbols == e.free_symbols, e
    with pytest.raises(cache.CacheError):
        cache.expr_from_json({"func": "builtins.eval", "args": ["1"]})
    with pytest.raises(cache.CacheError):
        cache.expr_to_json(sympy.sin(s0))


def test_the_gjit_fingerprint_covers_sub_packages(tmp_path):
    """An edit anywhere in gjit's sources, a sub-package included, is a new version of gjit: the
    disk cache must not serve kernels an older codegen made."""
    (tmp_path / "pkg" / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "pkg" / "top.py").write_text("x = 1\n")
    nested = tmp_path / "pkg" / "sub" / "deeper" / "printer.py"
    nested.write_text("y = 1\n")
    before = cache.sources_digest({"pkg": str(tmp_path / "pkg")})
    nested.write_text("y = 2\n")
    assert cache.sources_digest({"pkg": str(tmp_path / "pkg")}) != before
    # and gjit's own fingerprint reads every module of the package, sub-packages too
    from test_layout import modules

    roots = [os.path.abspath(r) for r in cache.fingerprint_roots().values()]
    for path in modules().values():
        assert any(os.path.abspath(path).startswith(r + os.sep) for r in roots), path


class Returns(torch.nn.Module):
    """The same ops, returned as a tuple or as a dict: one graph, two calling conventions."""

    def __init__(self, as_dict: bool):
        super().__init__()
        self.as_dict = as_dict

    def forward(self, x):
        y, z = x.sin(), x.cos()
        return {"y": y, "z": z} if self.as_dict else (y, z)


def test_a_warm_hit_keeps_the_calls_output_structure(disk_cache):
    x = torch.randn(4, 8)
    _fresh_compile(Returns(as_dict=False), x)
    out = _fresh_compile(Returns(as_dict=True), x)(x)
    assert isinstance(out, dict) and set(out) == {"y", "z"}
    assert counter("disk_cache_misses") == 2 and counter("disk_cache_hits") == 0


class Rotary(torch.nn.Module):
    """A non-persistent buffer (a constant of the program, read live) and a lifted constant."""

    def __init__(self, scale: float):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(8.0) * scale, persistent=False)

    def forward(self, x):
        return x * self.inv_freq + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])


def test_a_warm_hit_reads_buffers_and_constants_of_this_model(disk_cache):
    x = torch.randn(3, 8)
    _fresh_compile(Rotary(1.0), x)
    model = Rotary(2.0)  # the same graph (a hit), other buffer values
    _fresh_compile(model, x)
    assert counter("disk_cache_hits") == 1 and counter("decompositions") == 1


def test_serializing_for_gjit_leaves_other_threads_pickling_alone():
    """Under a torch whose serializer cannot skip the weights (before 2.12), its pickler writes
    nothing while gjit serializes, in gjit's thread only: another thread's `torch.export.save`
    keeps what it pickles."""
    import threading

    from torch._export.serde import serialize as serde

    from gjit.runtime import program_store

    weights, theirs = {"w": torch.randn(3)}, []
    with program_store._without_tensors() as skipped:
        other = threading.Thread(target=lambda: theirs.append(serde.serialize_torch_artifact(weights)))
        other.start()
        other.join()
        mine = serde.serialize_torch_artifact(weights)
    assert torch.equal(serde.deserialize_torch_artifact(theirs[0])["w"], weights["w"])
    assert (mine == b"") == (not skipped), "quiet in gjit's thread where torch has no arguments for it"
    with program_store._without_tensors():
        with program_store._without_tensors():
            pass
        nested = serde.serialize_torch_artifact(weights)  # still quiet after an inner block ends
    assert nested == mine
    after = serde.serialize_torch_artifact(weights)  # and in gjit's thread once it is done
    assert torch.equal(serde.deserialize_torch_artifact(after)["w"], weights["w"])


def test_the_stored_program_is_torchs_serialization_without_its_discarded_check():
    """program_store skips the canonical-form check torch's serializer runs on a copy and drops:
    the record is the same as with it, on a decomposed model with symbolic sizes."""
    from torch._export.serde import serialize as serde

    from gjit.capture.decompose import decompose_program
    from gjit.runtime import program_store
    from model_zoo import MODELS

    model, inputs = MODELS["llama-sdpa"]()
    batch = torch.export.Dim("batch", min=2)
    exported = torch.export.export(model, inputs, dynamic_shapes=({0: batch},))
    program = decompose_program(exported)[0]
    checked = []
    canonicalize = serde.canonicalize

    def counted(*args, **kwargs):
        checked.append(True)
        return canonicalize(*args, **kwargs)

    fast = program_store.dump_program(program)
    assert serde.canonicalize is canonicalize, "torch's function is put back"
    serde.canonicalize = counted
    try:
        with program_store._without_tensors() as skipped:  # torch's arguments, or a pickler of nothing
            artifact = serde.serialize(program, **skipped)
    finally:
        serde.canonicalize = canonicalize
    assert checked, "torch's serializer runs the check this skips (a torch that does not: drop the skip)"
    assert fast["graph"] == json.loads(artifact.exported_program)

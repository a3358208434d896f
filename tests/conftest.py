import gc
import os

import pytest
import torch
from _pytest.mark.expression import Expression

import gjit
from masked_lanes import poison_masked_loads

TIERS = ("cpu", "compile_only", "gpu")  # pyproject.toml's markers: every test is in at least one

# GJIT_TEST_DEVICE=cuda: the tests' tensors and modules are made on the GPU (torch's default device),
# so the `cpu` tier's checks run gjit's kernels compiled for the device instead of interpreted.
TEST_DEVICE = os.environ.get("GJIT_TEST_DEVICE")
if TEST_DEVICE:
    torch.set_default_device(TEST_DEVICE)
# interpreted kernels see garbage in a load's masked-off lanes, as compiled ones may on a GPU
POISONED = not TEST_DEVICE and poison_masked_loads()


def _gates() -> dict[str, tuple[bool, str]]:
    """marker -> (whether this run can run its tests, what runs them)."""
    return {
        "opinfo": (
            os.environ.get("GJIT_TEST_OPINFO") == "1",
            "all of OpInfo: GJIT_TEST_OPINFO=1 runs it (CI does)",
        ),
        "slow": (os.environ.get("GJIT_TEST_SLOW") == "1", "a long sweep: GJIT_TEST_SLOW=1 runs it (CI does)"),
        "gpu": (torch.cuda.is_available(), "needs a CUDA device"),
        "soak": (os.environ.get("GJIT_TEST_SOAK") == "1", "a long soak: GJIT_TEST_SOAK=1 runs it (CI does)"),
    }


def _asks_for(config, marker: str, item) -> bool:
    """Whether the run names this test's kind itself: `-m` selects the marker alone (`-m gpu`,
    `-m "cpu or gpu"`), or an argument names the test (`path::name`)."""
    expression = config.option.markexpr
    if expression and Expression.compile(expression).evaluate(lambda name: name == marker):
        return True
    for arg in config.args:
        path, _, name = arg.partition("::")
        if (
            name
            and os.path.abspath(path) == str(item.path)
            and item.nodeid.split("::", 1)[1].startswith(name)
        ):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({', '.join(TIERS)}): {untiered[:10]}")
    # what this run does not run is deselected, so its summary counts what ran; what the run asks
    # for by name or marker but cannot run here is a skip with the reason
    gates = _gates()
    kept, deselected = [], []
    for item in items:
        closed = [
            (marker, why) for marker, (runs, why) in gates.items() if marker in item.keywords and not runs
        ]
        if not closed:
            kept.append(item)
        elif any(_asks_for(config, marker, item) for marker, _ in closed):
            item.add_marker(pytest.mark.skip(reason=closed[0][1]))
            kept.append(item)
        else:
            deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(scope="session", autouse=True)
def _gjit_cache_dir(tmp_path_factory):
    """Generated sources of the test session go to a temporary folder, not the user's cache.
    Compiled graphs are not reused from disk (tests/test_cache.py turns that on): a test that
    counts stages or plants a codegen bug must see its own compile, whatever ran before it."""
    gjit.config.cache_dir = str(tmp_path_factory.mktemp("gjit_cache"))
    gjit.config.cache = False
    # on a GPU the tests check the kernels codegen emits, not which one a measurement picked
    # (tests/test_tuning.py turns tuning on), and every product is a template, as GJIT_MATMUL
    # template asks (the default, "auto", would leave them to ATen where nothing is measured:
    # tests/test_choice.py checks that choice)
    gjit.config.tune = False
    gjit.config.matmul = "template"
    # where a test turns tuning on, it measures everything: a budget in real seconds would make
    # what it measures depend on the machine's load (tests/test_tuning_budget.py sets its own)
    gjit.config.tune_budget = 1.0
    yield


@pytest.fixture(autouse=True)
def _fresh_counters():
    gjit.reset()
    torch.manual_seed(0)
    yield


@pytest.fixture
def sm90(tmp_path, monkeypatch):
    """Triton's launcher on an sm_90 target that launches nothing (gjit/runtime/prebuild.py's
    TargetDriver), with an empty on-disk cache, no kernel compiled in memory by another test, and
    2 build workers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from gjit.runtime import graph, prebuild

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"))
    monkeypatch.setattr(graph, "_KERNELS", {})
    monkeypatch.setattr(driver, "_active", prebuild.TargetDriver(GPUTarget("cuda", 90, 32)))
    # prebuild's process-wide state as a fresh process has it
    for name, fresh in (("_warned", False), ("_off", ""), ("_no_workers", ""), ("_entry_names_wrong", False)):
        monkeypatch.setattr(prebuild, name, fresh)
    with gjit.config.scope(compile_workers=2):  # parallel builds whatever the machine's CPU count
        yield


@pytest.fixture
def null_cuda(tmp_path, monkeypatch):
    """Triton's own CUDA driver and C launcher over a libcuda that launches nothing
    (tests/null_cuda.py): kernels build for sm_90 into an empty on-disk cache, every launch runs
    Triton's whole host path and is counted. No kernel compiled in memory by another test."""
    import triton
    from triton.runtime.driver import driver

    from gjit.runtime import graph
    from null_cuda import null_driver

    kernels: dict = {}
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"))
    monkeypatch.setattr(graph, "_KERNELS", kernels)
    monkeypatch.setattr(driver, "_active", null_driver())
    yield driver.active
    # the binaries loaded through the stub unload through it, now, while it is the active driver
    # (a kernel still referenced, by a generated module say, would unload at exit without it)
    from triton.compiler.compiler import CompiledKernel

    for obj in gc.get_objects():
        if type(obj) is CompiledKernel and obj.module is not None and hasattr(obj, "__del__"):
            obj.__del__()  # (Triton before 3.7 has no __del__: it never unloads a binary)


@pytest.fixture
def contiguous_output():
    """ATen's SDPA on this CPU returning [B, H, L, E] contiguous, as the math path: another layout
    than the one export traced for the masked call ([B, L, H, E] in memory, as a fused kernel's)."""
    math_sdpa = torch.ops.aten._scaled_dot_product_attention_math.default
    lib = torch.library.Library("aten", "IMPL")

    def contiguous(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        out = math_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
        return out.contiguous()

    lib.impl("scaled_dot_product_attention", contiguous, "CPU")
    try:
        yield
    finally:
        lib._destroy()

"""Every GJIT_* knob in one place: typed, with a default, overridable for a scope.

    gjit.config.interpret             GJIT_INTERPRET=1   run generated Triton kernels through Triton's
                                                         interpreter (CPU tensors); the test mode
    gjit.config.debug                 GJIT_DEBUG=1       poison freshly allocated buffers (NaN / int
                                                         sentinel) so an element a kernel forgot to
                                                         write shows up in comparisons; check the IR
                                                         between passes
    gjit.config.cache_dir             GJIT_CACHE_DIR     the on-disk cache: compiled graphs, kernel and
                                                         wrapper sources (default ~/.cache/gjit)
    gjit.config.cache                 GJIT_CACHE=0       turn the on-disk compile cache off (on by default)
    gjit.config.remote_cache          GJIT_REMOTE_CACHE  redis://[user:password@]host:port/db (rediss:// for
                                                         TLS): a compile cache a fleet shares, behind the
                                                         disk cache (gjit/runtime/remote_cache.py)
    gjit.config.remote_cache_prefix   GJIT_REMOTE_CACHE_PREFIX  key prefix (one per deployment; "gjit:")
    gjit.config.remote_cache_timeout  GJIT_REMOTE_CACHE_TIMEOUT  seconds a server may take (0.5)
    gjit.config.remote_cache_max_bytes  GJIT_REMOTE_CACHE_MAX_BYTES  the largest entry stored or read (32 MB)
    gjit.config.backend               GJIT_BACKEND       triton (default) | cupy: CUDA C kernels (NVRTC, CuPy)
    gjit.config.xblock                GJIT_XBLOCK        block size of pointwise kernels
    gjit.config.reduction             GJIT_REDUCTION     auto | persistent | looped reduction kernels
    gjit.config.persistent_max        GJIT_PERSISTENT_MAX  auto: persistent up to this row length
    gjit.config.matmul                GJIT_MATMUL        auto (default) | template | aten: matmuls and
                                                         attention as generated Triton kernels with their
                                                         neighbours fused in, or as ATen externs; auto:
                                                         per region, whichever is measured faster on the
                                                         GPU, else ATen but where a table measured on the
                                                         card says the template wins (gjit/choice/)
    gjit.config.tune                  GJIT_TUNE=0        on a GPU (default on): time each template
                                                         kernel's tile configurations and, under auto,
                                                         each region's template against ATen's kernels at
                                                         compile time; keep the fastest (gjit/tuning.py)
    gjit.config.tune_budget           GJIT_TUNE_BUDGET   the share of a cold compile tuning may take (0.2:
                                                         a fifth; heaviest kernels first, the rest keep
                                                         the table's choice; 1 or mode="max-autotune":
                                                         no limit). What was measured is kept for every
                                                         later compile (gjit/runtime/tuning_store.py)
    gjit.config.measure_all_templates GJIT_MEASURE_ALL_TEMPLATES=1  under auto, build and measure every
                                                         product's template against the library in every
                                                         mode; by default only the max-autotune modes do,
                                                         the others measure where a template fuses a
                                                         written-out attention (and the table's regions)
    gjit.config.held_masks            GJIT_HELD_MASKS=0  no mask's proof reads a buffer's or constant's
                                                         contents (by default a causal tril held in one
                                                         makes the call causal; the entry assumes writes
                                                         to it bump its version: not through .data)
    gjit.config.conv_layout           GJIT_CONV_LAYOUT   convolutions: auto (on a GPU, each bias added by the
                                                         kernel after the call, and 2-D, 3-D convolutions
                                                         channels-last where the dense ones do most of the
                                                         work) | channels_last (both, on every device) |
                                                         traced (as the model lays them out)
    gjit.config.rblock                GJIT_RBLOCK        chunk size of looped reductions (0: the tile table)
    gjit.config.recompile_limit       GJIT_RECOMPILE_LIMIT  entries per compiled callable; calls that
                                                         miss past it run eagerly (one warning)
    gjit.config.fail_on_recompile_limit  GJIT_FAIL_ON_RECOMPILE_LIMIT  raise instead of running eagerly
    gjit.config.error_on_recompile    GJIT_ERROR_ON_RECOMPILE  raise on any recompile (strict ranges)
    gjit.config.check                 GJIT_CHECK=1       run every kernel and the eager fallback on the
                                                         same inputs, report the error per kernel
    gjit.config.dump_dir              GJIT_DUMP_DIR      write every compile stage of each entry here
    gjit.config.compile_workers       GJIT_COMPILE_WORKERS  processes that build kernel binaries for a GPU
                                                         target at once: gjit.aot, and on a GPU from
                                                         codegen and a graph's first call (default:
                                                         usable CPUs)
    gjit.config.prebound_launches     GJIT_PREBOUND_LAUNCHES=0  on a GPU, launch every kernel through
                                                         Triton's JITFunction.run instead of the compiled
                                                         kernel bound at its first launch (A/B timing)
    gjit.config.mode                  GJIT_MODE          torch.compile's mode for gjit.compile calls that give
                                                         none: default | reduce-overhead (CUDA graphs) |
                                                         max-autotune (CUDA graphs, tuning without a
                                                         budget) | max-autotune-no-cudagraphs (the same
                                                         tuning; tuning follows GJIT_TUNE in every mode)
    gjit.config.cuda_graph_limit      GJIT_CUDA_GRAPH_LIMIT  CUDA graphs an entry holds in the modes that
                                                         record them (8); past it calls run without one
    gjit.config.dynamic_export_budget  GJIT_DYNAMIC_EXPORT_BUDGET  seconds an export with dynamic dims may
                                                         spend in ops slowed by symbolic size reasoning
                                                         (over 0.5 s each) before gjit exports the batch
                                                         dims only, then static (10; 0: no limit)
    gjit.config.progress              GJIT_PROGRESS=0    no progress line on a terminal's stderr while a long
                                                         compile runs (gjit/progress.py; on by default)
    gjit.config.progress_after        GJIT_PROGRESS_AFTER  seconds a compile runs before its progress line
                                                         shows (3)

Tests override knobs with ``with gjit.config.scope(interpret=True): ...``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any


def _env_bool(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        return raw.strip().lower() not in ("0", "false", "no", "off")

    return read


def _env_int(name: str, default: int) -> Callable[[], int]:
    def read() -> int:
        raw = os.environ.get(name)
        return int(raw) if raw else default

    return read


def _env_float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name)
        return float(raw) if raw else default

    return read


def _env_str(name: str, default: Callable[[], str | None]) -> Callable[[], str | None]:
    """The variable's text; unset or empty: `default()` (None for a knob that is off unless set)."""

    def read() -> str | None:
        return os.environ.get(name) or default()

    return read


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity, a container's limit), else the CPU count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.access(os.path.dirname(base) or ".", os.W_OK) and not os.path.isdir(base):
        base = tempfile.gettempdir()
    return os.path.join(base, "gjit")


class _Knob:
    """A config attribute read from the environment unless a scope or assignment set it."""

    def __init__(self, env: str, read: Callable[[], Any], doc: str):
        self.env = env
        self.read = read
        self.doc = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if self.name in obj._overrides:
            return obj._overrides[self.name]
        return self.read()

    def __set__(self, obj: Any, value: Any) -> None:
        obj._overrides[self.name] = value


class Config:
    interpret = _Knob(
        "GJIT_INTERPRET",
        _env_bool("GJIT_INTERPRET", False),
        "run generated Triton kernels on CPU tensors through Triton's interpreter",
    )
    debug = _Knob(
        "GJIT_DEBUG",
        _env_bool("GJIT_DEBUG", False),
        "poison new buffers so unwritten elements are caught; bounds checks; IR checks between passes",
    )
    cache_dir = _Knob(
        "GJIT_CACHE_DIR",
        _env_str("GJIT_CACHE_DIR", _default_cache_dir),
        "directory of the on-disk cache: compiled graphs, kernel and wrapper sources",
    )
    cache = _Knob(
        "GJIT_CACHE",
        _env_bool("GJIT_CACHE", True),
        "reuse compiled graphs (kernels + wrapper) from the on-disk cache across processes",
    )
    remote_cache = _Knob(
        "GJIT_REMOTE_CACHE",
        _env_str("GJIT_REMOTE_CACHE", lambda: None),
        "redis:// (or rediss://) URL of a compile cache shared by a fleet, read after the disk cache",
    )
    remote_cache_prefix = _Knob(
        "GJIT_REMOTE_CACHE_PREFIX",
        _env_str("GJIT_REMOTE_CACHE_PREFIX", lambda: "gjit:"),
        "the remote cache's key prefix (one per deployment)",
    )
    remote_cache_timeout = _Knob(
        "GJIT_REMOTE_CACHE_TIMEOUT",
        _env_float("GJIT_REMOTE_CACHE_TIMEOUT", 0.5),
        "seconds the remote cache's server may take to connect or answer",
    )
    remote_cache_max_bytes = _Knob(
        "GJIT_REMOTE_CACHE_MAX_BYTES",
        _env_int("GJIT_REMOTE_CACHE_MAX_BYTES", 32 * 2**20),
        "the largest entry (uncompressed) written to or accepted from the remote cache",
    )
    backend = _Knob(
        "GJIT_BACKEND",
        _env_str("GJIT_BACKEND", lambda: "triton"),
        "kernel language: triton, or cupy (CUDA C compiled with NVRTC, launched through CuPy)",
    )
    xblock = _Knob("GJIT_XBLOCK", _env_int("GJIT_XBLOCK", 1024), "block size of pointwise kernels")
    reduction = _Knob(
        "GJIT_REDUCTION",
        _env_str("GJIT_REDUCTION", lambda: "auto"),
        "reduction kernel shape: auto | persistent (whole row in one block) | looped (row in chunks)",
    )
    matmul = _Knob(
        "GJIT_MATMUL",
        _env_str("GJIT_MATMUL", lambda: "auto"),
        "matmuls and attention: auto (per region, the template or ATen's kernels, whichever is "
        "measured faster on the GPU; not measured, ATen but where a table measured on the card says "
        "the template wins: gjit/choice/) | template (generated tensor-core kernels with operand "
        "views and the consuming pointwise work fused in; the Triton backend) | aten (ATen externs)",
    )
    tune = _Knob(
        "GJIT_TUNE",
        _env_bool("GJIT_TUNE", True),
        "on a GPU, measure each template kernel's tile configurations and (matmul auto) each region's "
        "template against ATen's kernels at compile time, and keep the fastest (gjit/tuning.py, "
        "gjit/choice/; the choice is stored with the entry)",
    )
    tune_budget = _Knob(
        "GJIT_TUNE_BUDGET",
        _env_float("GJIT_TUNE_BUDGET", 0.2),
        "the share of a cold compile that tuning may take (heaviest kernels first; what is left keeps "
        "the table's configuration and choice); 1 or more, or mode max-autotune: no limit",
    )
    measure_all_templates = _Knob(
        "GJIT_MEASURE_ALL_TEMPLATES",
        _env_bool("GJIT_MEASURE_ALL_TEMPLATES", False),
        "under matmul auto, build and measure every product's template against the library in every "
        "mode (by default only the max-autotune modes do; the others measure the templates of "
        "written-out attention and of the table's regions, and run the library elsewhere: gjit/choice/)",
    )
    held_masks = _Knob(
        "GJIT_HELD_MASKS",
        _env_bool("GJIT_HELD_MASKS", True),
        "a mask's proof may read a buffer's or a constant's contents (a causal tril: the causal call; "
        "gjit/lowering/held_masks.py); the entry assumes they change only by writes torch's version "
        "counter sees (not through .data or NumPy); off: no proof reads them",
    )
    conv_layout = _Knob(
        "GJIT_CONV_LAYOUT",
        _env_str("GJIT_CONV_LAYOUT", lambda: "auto"),
        "convolutions: auto (on a GPU, the bias added by the kernel after each call, and 2-D and 3-D "
        "convolutions channels-last where dense ones do most of the work: gjit/lowering/convolutions.py) "
        "| channels_last (both on every device) | traced (the model's own layout and calls)",
    )
    persistent_max = _Knob(
        "GJIT_PERSISTENT_MAX",
        _env_int("GJIT_PERSISTENT_MAX", 1024),
        "auto picks a persistent reduction when a row has at most this many elements",
    )
    rblock = _Knob(
        "GJIT_RBLOCK",
        _env_int("GJIT_RBLOCK", 0),
        "chunk size of looped reductions; 0: by the tile table (codegen/triton/tiles.py)",
    )
    recompile_limit = _Knob(
        "GJIT_RECOMPILE_LIMIT",
        _env_int("GJIT_RECOMPILE_LIMIT", 8),
        "compiled entries per callable; past it, calls that miss run eagerly with one warning",
    )
    fail_on_recompile_limit = _Knob(
        "GJIT_FAIL_ON_RECOMPILE_LIMIT",
        _env_bool("GJIT_FAIL_ON_RECOMPILE_LIMIT", False),
        "raise gjit.RecompileError at the recompile limit instead of running eagerly",
    )
    error_on_recompile = _Knob(
        "GJIT_ERROR_ON_RECOMPILE",
        _env_bool("GJIT_ERROR_ON_RECOMPILE", False),
        "raise gjit.RecompileError whenever a call misses every entry (e.g. a size outside a range)",
    )

    check = _Knob(
        "GJIT_CHECK",
        _env_bool("GJIT_CHECK", False),
        "compare each kernel's outputs with the eager fallback on the same inputs (per-kernel error table)",
    )
    dump_dir = _Knob(
        "GJIT_DUMP_DIR",
        _env_str("GJIT_DUMP_DIR", lambda: None),
        "write every compile stage of each entry under this folder",
    )

    compile_workers = _Knob(
        "GJIT_COMPILE_WORKERS",
        _env_int("GJIT_COMPILE_WORKERS", _usable_cpus()),
        "worker processes that build a graph's kernel binaries for a GPU target at once, for gjit.aot and "
        "on a GPU from codegen and the graph's first call (gjit/runtime/early_builds.py, prebuild.py; "
        "1: built in process, one by one)",
    )

    prebound_launches = _Knob(
        "GJIT_PREBOUND_LAUNCHES",
        _env_bool("GJIT_PREBOUND_LAUNCHES", True),
        "on a GPU, a kernel's later launches call the compiled kernel its first launch of that "
        "specialization bound (gjit/runtime/launch.py); off: Triton's JITFunction.run every launch",
    )

    mode = _Knob(
        "GJIT_MODE",
        _env_str("GJIT_MODE", lambda: "default"),
        "torch.compile's mode for gjit.compile calls that give none: default | reduce-overhead | "
        "max-autotune (records CUDA graphs and tunes without a budget) | max-autotune-no-cudagraphs "
        "(the same tuning)",
    )
    cuda_graph_limit = _Knob(
        "GJIT_CUDA_GRAPH_LIMIT",
        _env_int("GJIT_CUDA_GRAPH_LIMIT", 8),
        "CUDA graphs an entry holds in mode reduce-overhead (one per set of sizes, another while the "
        "caller holds a replay's outputs); past it calls run without a graph",
    )

    dynamic_export_budget = _Knob(
        "GJIT_DYNAMIC_EXPORT_BUDGET",
        _env_float("GJIT_DYNAMIC_EXPORT_BUDGET", 10.0),
        "seconds an export with dynamic dims may spend in ops slowed by symbolic size reasoning (over "
        "0.5 s each); past it the callable exports the batch dims only, then static (0: no limit)",
    )

    progress = _Knob(
        "GJIT_PROGRESS",
        _env_bool("GJIT_PROGRESS", True),
        "one line of progress on stderr while a compile runs past progress_after seconds, when stderr is "
        "a terminal (stage, kernels built, tuning; gjit/progress.py)",
    )
    progress_after = _Knob(
        "GJIT_PROGRESS_AFTER",
        _env_float("GJIT_PROGRESS_AFTER", 3.0),
        "seconds a compile runs before its progress line shows",
    )

    def __init__(self) -> None:
        self._overrides: dict[str, Any] = {}

    def knobs(self) -> dict[str, _Knob]:
        return {name: k for name, k in type(self).__dict__.items() if isinstance(k, _Knob)}

    @contextlib.contextmanager
    def scope(self, **values: Any) -> Iterator[None]:
        """Override knobs inside a `with` block (tests), restoring what was there before."""
        unknown = set(values) - set(self.knobs())
        if unknown:
            raise AttributeError(f"unknown gjit config knob(s): {sorted(unknown)}")
        saved = dict(self._overrides)
        self._overrides.update(values)
        try:
            yield
        finally:
            self._overrides = saved


config = Config()

BACKENDS = ("triton", "cupy")
# torch.compile's modes. gjit tunes template kernels on a GPU in every mode (GJIT_TUNE); the
# max-autotune modes lift the tuning budget (GJIT_TUNE_BUDGET)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # gjit/runtime/cuda_graphs.py
MATMUL_SETTINGS = ("auto", "template", "aten")
CONV_LAYOUTS = ("auto", "channels_last", "traced")  # gjit/lowering/convolutions.py


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """What one compile is asked for: built once where a compile starts (gjit.compile's arguments
    over the knobs above), then passed down the passes as an argument. Codegen and the wrapper
    read these, never the global config."""

    backend: str
    check: bool  # GJIT_CHECK: the wrapper reports every kernel's stores to the checker
    debug: bool  # GJIT_DEBUG: poisoned buffers, bounds checks, IR checks between passes
    xblock: int
    reduction: str
    persistent_max: int
    rblock: int  # (no defaults here: the knobs above hold them)
    matmul: str
    # on a GPU, whether float32 products may run on TF32 tensor cores, as eager's cuBLAS calls do:
    # torch.backends.cuda.matmul.allow_tf32 (torch.set_float32_matmul_precision("high") sets it);
    # the entry is guarded on it. None: not on a GPU (IEEE, as eager there). Not a gjit knob.
    tf32: bool | None = None
    # the GPU the compile is for, as its compute capability (major * 10 + minor; sm_90: 90): the
    # call's device, or gjit.aot's arch; None: no GPU. Where nothing is measured, the table of
    # kernels/template_wins.py for that card picks templates. Not a gjit knob either.
    target: int | None = None
    # the share of the cold compile tuning may take (gjit/tuning.py's Budget); math.inf under
    # mode="max-autotune"
    tune_budget: float = 0.2
    # under "auto", whether every product's template is built and weighed against the library
    # (mode="max-autotune", GJIT_MEASURE_ALL_TEMPLATES), or only those gjit/choice/table.py's
    # `worth_measuring` names
    measure_all_templates: bool = False
    # a mask's proof may read the contents of buffers and constants (gjit/lowering/held_masks.py)
    held_masks: bool = True
    # convolutions' biases and layout (gjit/lowering/convolutions.py): auto, channels_last, traced
    conv_layout: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"gjit: unknown backend {self.backend!r}: expected one of {BACKENDS}")
        if self.matmul not in MATMUL_SETTINGS:
            raise ValueError(
                f"gjit: unknown matmul setting {self.matmul!r}: expected one of {MATMUL_SETTINGS}"
            )
        if self.conv_layout not in CONV_LAYOUTS:
            raise ValueError(
                f"gjit: unknown convolution layout {self.conv_layout!r}: expected one of {CONV_LAYOUTS}"
            )
        if not self.tune_budget >= 0:  # NaN too
            raise ValueError(
                f"gjit: a tuning budget of {self.tune_budget!r}: expected a share of the cold compile "
                "(0.2: a fifth; 0: nothing measured; 1 or more: no limit)"
            )

    @property
    def matmul_template(self) -> bool:
        """Matmuls may become template kernels: asked for ("template", or "auto" where it chooses
        them), and the backend has the template (Triton)."""
        return self.matmul != "aten" and self.backend == "triton"

    @classmethod
    def from_config(cls, **given: Any) -> CompileOptions:
        """The knobs' values, with what a caller gave (None: not given) on top."""
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if hasattr(Config, f.name)}
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)

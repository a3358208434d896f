"""Convolutions as the library runs them fastest on a GPU (gjit/lowering/convolutions.py): the bias
added by the kernel after the call, 2-D convolutions channels-last with the layout flowing through
the pointwise work after them, boundaries (views that cannot take it, stride reads, outputs) given
the traced layout back. On the CPU under GJIT_CONV_LAYOUT=channels_last (auto changes nothing
there); the values are eager's and so are the outputs' strides."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gjit
from gjit.capture.decompose import decompose_program
from gjit.lowering.channels_last import CONVOLUTION, in_order
from gjit.lowering.convolutions import library_convolutions, spatial_convolutions, worth_channels_last
from helpers import check, check_against_float64, run_compiled

pytestmark = [pytest.mark.cpu]
CHANNELS_LAST = (0, 2, 3, 1)


class Block(nn.Module):
    """A residual block: conv, batch norm, ReLU, conv (with a bias), batch norm, the residual, ReLU."""

    def __init__(self, c, groups=1):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False, groups=groups)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(x + self.b2(self.c2(y)))


class Net(nn.Module):
    """A stem (conv with a bias, stride 2), two blocks, global average pooling and a linear head."""

    def __init__(self, c=8, groups=1):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.blocks = nn.Sequential(Block(c, groups), Block(c, groups))
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        x = self.blocks(torch.relu(self.stem(x)))
        return self.head(x.mean((2, 3)))


class Features(Net):
    """The blocks' feature map returned as it is, and flattened whole (a view channels-last cannot take)."""

    def forward(self, x):
        x = self.blocks(torch.relu(self.stem(x)))
        return x, x.flatten(1).sum(1), x.flatten(2)


def _randomized(model):
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def _program(model, x):
    dims = ({0: torch.export.Dim.DYNAMIC, 2: torch.export.Dim.DYNAMIC, 3: torch.export.Dim.DYNAMIC},)
    with torch.no_grad():
        exported = torch.export.export(model, (x,), dynamic_shapes=dims)
        return decompose_program(exported)[0].module()


def _convolutions(gm):
    return list(gm.graph.find_nodes(op="call_function", target=CONVOLUTION))


def _as_eager(model, x, dynamic=None):
    """`model` compiled with its convolutions channels-last and run on `x` through the kernels (it
    must run compiled): each output equal to eager's, strides too. The entry's program."""
    with gjit.config.scope(conv_layout="channels_last"), torch.no_grad():
        out, cm = run_compiled(gjit.compile(model, dynamic=dynamic), x)
        expected = model(x)
    if not isinstance(expected, tuple):
        out, expected = (out,), (expected,)
    for a, e in zip(out, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        assert a.stride() == e.stride()
    return cm.entries[-1].program.captured.full_graph_module


def _clones(gm, memory_format=torch.channels_last):
    """The copies into `memory_format` in `gm`."""
    return [n for n in gm.graph.nodes if n.kwargs.get("memory_format") == memory_format]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_residual_net_matches_eager_channels_last(dtype):
    model = _randomized(Net()).to(dtype)
    reference = copy.deepcopy(model).double()
    with gjit.config.scope(conv_layout="channels_last"), torch.no_grad():
        for shape in ((2, 3, 16, 12), (3, 3, 20, 18)):
            check_against_float64(model, torch.randn(*shape, dtype=dtype), reference_fn=reference)


def test_the_pass_lays_out_the_program_channels_last():
    """One copy into channels-last before the stem; every convolution after it reads the layout the
    pointwise kernels before it wrote; the biases are gone from the calls."""
    model = _randomized(Net())
    gm = _program(model, torch.randn(2, 3, 16, 12))
    peeled, laid = library_convolutions(gm, "channels_last", on_gpu=False)
    convs = _convolutions(gm)
    assert (peeled, laid) == (3, 1)  # the stem's and each block's second conv; one input copied
    assert all(c.args[2] is None for c in convs)
    assert all(in_order(c.args[0].meta["val"], CHANNELS_LAST) for c in convs)
    assert all(in_order(c.meta["val"], CHANNELS_LAST) for c in convs)
    clones = _clones(gm)
    assert len(clones) == 1 and clones[0].args[0].op == "placeholder"
    x = torch.randn(2, 3, 16, 12)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_auto_changes_nothing_on_the_cpu_and_traced_nothing_anywhere():
    model = _randomized(Net())
    for setting, on_gpu in (("auto", False), ("traced", False), ("traced", True)):
        gm = _program(model, torch.randn(2, 3, 16, 12))
        before = gm.code
        assert library_convolutions(gm, setting, on_gpu) == (0, 0)
        assert gm.code == before


@pytest.mark.parametrize(
    "library, laid",
    [(("cudnn", True), 1), (("cudnn", False), 0), (None, 0)],
    ids=["cudnn-on", "cudnn-off", "no-library"],
)
def test_auto_on_a_gpu_lays_out_where_cudnn_runs_the_convolutions(library, laid):
    """Under auto on a GPU (the default there): the biases are always peeled; the layout changes
    only where cuDNN runs the convolutions (its kernels return channels-last for such inputs)."""
    model = _randomized(Net())
    gm = _program(model, torch.randn(2, 3, 16, 12))
    assert library_convolutions(gm, "auto", True, library) == (3, laid)
    x = torch.randn(2, 3, 16, 12)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_outputs_keep_eagers_strides_and_views_that_cannot_take_the_layout_read_a_copy():
    _as_eager(_randomized(Features()), torch.randn(2, 3, 16, 12))


def test_a_one_by_one_output_compiles_again():
    """Tracing the new layout guards that convolution outputs are wider than 1 (where channels-last
    and contiguous are one layout); a call that breaks it compiles a new entry and is right."""
    model = _randomized(Net())
    with gjit.config.scope(conv_layout="channels_last"), torch.no_grad():
        cm = check(model, torch.randn(2, 3, 16, 12))
        check(cm, torch.randn(2, 3, 2, 2))  # the stem's output is 1 x 1
    assert len(cm.entries) == 2


def test_the_guards_travel_with_a_disk_cache_entry(tmp_path):
    """A warm start does not run the pass: the guards its trace added are stored with the entry."""
    model = _randomized(Net())
    with gjit.config.scope(conv_layout="channels_last", cache=True, cache_dir=str(tmp_path)), torch.no_grad():
        check(model, torch.randn(2, 3, 16, 12))
        warm = check(model, torch.randn(2, 3, 16, 12))  # a new callable: the disk cache's entry
        assert gjit.stats()["disk_cache_hits"] >= 1
        check(warm, torch.randn(2, 3, 2, 2))
        assert len(warm.entries) == 2


@pytest.mark.parametrize(
    "model, x",
    [
        (nn.Sequential(nn.Conv2d(4, 8, 3, groups=4), nn.ReLU(), nn.Conv2d(8, 8, 1)), (2, 4, 9, 7)),
        (
            nn.Sequential(nn.ConvTranspose2d(4, 6, 3, stride=2), nn.GELU(), nn.Conv2d(6, 4, 3, dilation=2)),
            (1, 4, 8, 8),
        ),
        (
            nn.Sequential(nn.Conv2d(3, 6, 3), nn.MaxPool2d(2), nn.Conv2d(6, 6, 3), nn.AdaptiveAvgPool2d(1)),
            (2, 3, 14, 12),
        ),
        (nn.Sequential(nn.Conv1d(3, 6, 3), nn.ReLU(), nn.Conv1d(6, 6, 3)), (2, 3, 20)),
        (
            nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.Upsample(scale_factor=2), nn.Conv2d(6, 2, 1)),
            (1, 3, 5, 6),
        ),
        (
            nn.Sequential(
                nn.Conv3d(3, 6, 3), nn.BatchNorm3d(6), nn.ReLU(), nn.MaxPool3d(2), nn.Conv3d(6, 4, 1)
            ),
            (2, 3, 7, 8, 6),
        ),
    ],
    ids=["depthwise-then-pointwise", "transposed-dilated", "pooling", "1-d-untouched", "upsample", "volumes"],
)
def test_convolution_kinds_match_eager(model, x):
    torch.manual_seed(1)
    _as_eager(model.eval(), torch.randn(*x))


def test_a_stride_read_gets_the_traced_layout():
    class Strides(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)

        def forward(self, x):
            y = torch.relu(self.a(x))
            return self.b(y), torch.as_strided(y, (2, 4), (y.stride(0), y.stride(1)))

    model = Strides().eval()
    x = torch.randn(2, 3, 9, 9)
    with gjit.config.scope(conv_layout="channels_last"), torch.no_grad():
        out, _ = run_compiled(model, x)
        expected = model(x)
    for a, e in zip(out, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_which_programs_are_worth_channels_last():
    def convs(*specs):
        graph = torch.fx.Graph()
        nodes = []
        mode = torch._subclasses.FakeTensorMode()
        for cin, cout, groups in specs:
            x = graph.placeholder(f"x{len(nodes)}")
            w = graph.placeholder(f"w{len(nodes)}")
            with mode:
                x.meta["val"] = torch.empty(2, cin, 16, 16)
                w.meta["val"] = torch.empty(cout, cin // groups, 3, 3)
                args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], groups)
                node = graph.call_function(CONVOLUTION, args)
                node.meta["val"] = torch.empty(2, cout, 16, 16)
            nodes.append(node)
        return nodes

    assert worth_channels_last(convs((16, 16, 1), (16, 16, 1)))
    assert not worth_channels_last(convs((16, 16, 1)))  # one convolution: a patch embedding
    assert not worth_channels_last(convs((64, 64, 64), (64, 64, 64), (8, 8, 1)))  # mostly depthwise
    assert worth_channels_last(convs((64, 64, 64), (64, 64, 1)))  # a depthwise and a dense one


def test_spatial_convolutions_are_the_four_and_five_d_ones():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(2), nn.Conv1d(4, 4, 3)).eval()
    gm = _program(model, torch.randn(2, 3, 9, 9))
    assert [c.meta["val"].dim() for c in spatial_convolutions(gm)] == [4]
    volumes = nn.Sequential(nn.Conv3d(3, 4, 3), nn.ReLU(), nn.Conv3d(4, 4, 1)).eval()
    gm = _program(volumes, torch.randn(2, 3, 5, 6, 7))
    assert [c.meta["val"].dim() for c in spatial_convolutions(gm)] == [5, 5]


def test_a_trace_sized_by_symbols_of_its_own_takes_the_traced_sizes():
    """A value traced again whose sizes are new symbols (nothing binds them) is laid out as it is
    over the traced value's sizes; one that is not dense at the example's sizes is refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from gjit.lowering.channels_last import _over

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
    old = mode.from_tensor(torch.empty(2, 3, 4, 5), symbolic_context=dynamic)
    new = mode.from_tensor(
        torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last), symbolic_context=dynamic
    )
    assert new.shape[0] is not old.shape[0] and str(new.shape[2]) != str(old.shape[2])
    with mode:
        laid = _over(new, old)
        assert [str(s) for s in laid.shape] == [str(s) for s in old.shape]
        assert in_order(laid, CHANNELS_LAST)
        strided = mode.from_tensor(torch.empty(2, 3, 4, 10)[..., ::2], symbolic_context=dynamic)
        with pytest.raises(ValueError):
            _over(strided, old)


def test_elementwise_values_are_laid_out_as_a_trace_lays_them_out():
    """The batch norms, activations and residual adds take their inputs' order without a trace
    (`_Plan._kept`): the layout a trace in export's fake mode would give them."""
    from gjit.lowering.attention_layout import same_layout
    from gjit.lowering.channels_last import _Plan

    gm = _program(_randomized(Net()), torch.randn(2, 3, 16, 12))
    plan = _Plan(gm.graph, spatial_convolutions(gm))
    kept = {n: plan._kept(n) for n in plan.values}
    kept = {n: v for n, v in kept.items() if v is not None}
    assert {n.target.__name__.split(".")[0] for n in kept} >= {
        "_native_batch_norm_legit_no_training",
        "relu",
        "add",
    }
    for node, value in kept.items():
        traced = plan._trace(node)
        first = lambda v: v[0] if isinstance(v, tuple) else v
        assert same_layout(first(value), first(traced)), node.name


class Bottleneck(nn.Module):
    """An autoencoder's bottleneck (a convolution to 1 x 1, read by a transposed one) and a
    convolution to one channel read by another: ATen's outputs there differ from the traced
    strides only on dims of size 1, which its next convolution reads to pick its memory format."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.down = nn.Conv2d(8, 16, 8, bias=False)
        self.up = nn.ConvTranspose2d(16, 8, 4, bias=False)
        self.one = nn.Conv2d(8, 1, 3, padding=1, bias=False)
        self.out = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x):
        y = self.a(x)
        return torch.relu(self.up(self.down(y))), torch.relu(self.out(self.one(y)))


class Heads(nn.Module):
    """Three branches on one input (one channels-last copy for all), a feature map's channel slice
    returned (a view of a value whose layout changed: replayed on the value given back), a split
    over channels (YOLO's C2f), a padding and a nearest upsampling (both flow)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Conv2d(3, 8, k, padding=k // 2) for k in (1, 3, 5))
        self.d = nn.Conv2d(12, 8, 3)
        self.e = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = torch.cat([self.a(x), self.b(x), self.c(x)], 1).relu()
        first, second = y.split([12, 12], 1)
        z = F.interpolate(F.pad(self.d(first + second), (1, 1, 1, 1)), scale_factor=2)
        return self.e(z), y[:, :2]


@pytest.mark.parametrize("model", [Bottleneck, Heads], ids=["size-one-dims", "heads"])
def test_layouts_that_differ_only_on_dims_of_size_one_and_views_of_changed_values(model):
    torch.manual_seed(0)
    gm = _as_eager(model().eval(), torch.randn(2, 3, 8, 8))
    assert len(_clones(gm)) == 1  # the input's: every convolution after it reads its producer's layout


def test_no_copy_where_the_convolution_would_not_return_channels_last():
    """An empty batch (on a GPU: cuDNN off, float64): ATen's convolution returns its contiguous
    layout for a channels-last input, so a copy into channels-last would only cost."""
    gm = _program(_randomized(Net()), torch.randn(2, 3, 16, 12))
    with torch.no_grad():
        empty = decompose_program(torch.export.export(_randomized(Net()), (torch.randn(0, 3, 16, 12),)))
    for program, clones in ((gm, 1), (empty[0].module(), 0)):
        library_convolutions(program, "channels_last", on_gpu=False)
        assert len(_clones(program)) == clones


def test_an_entry_with_convolutions_holds_its_library_flag():
    """Which library runs ATen's convolutions (cuDNN on a GPU, oneDNN on the CPU, or their
    fallbacks) decides the layout of their outputs, which the kernels after them read: an entry
    with convolutions requires the flag as it was when it compiled, both ways."""
    from gjit.guards import build_guards

    x = torch.randn(2, 3)
    assert "cudnn" not in build_guards([x], ["x"]).source
    for value in (True, False):
        guards = build_guards([x], ["x"], conv_library=("cudnn", value))
        assert "torch.backends.cudnn.enabled" in guards.source
        for enabled in (True, False):
            with torch.backends.cudnn.flags(enabled=enabled):
                runs = enabled and torch.backends.cudnn.is_available()
                assert (guards.check([x]) is not None) == (runs == value)
    model = _randomized(Net())
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        cm = check(model, x)
        assert cm.entries[0].program.graph.conv_library == ("mkldnn", torch.backends.mkldnn.is_available())
        if torch.backends.mkldnn.is_available():
            with torch.backends.mkldnn.flags(enabled=False):
                check(cm, x)  # compiled again, under the fallback's layouts
            assert len(cm.entries) == 2


def test_a_cached_entry_is_analyzed_again_under_the_library_it_compiled_under(tmp_path):
    """explain (or a dump) of a disk-cache entry lowers its program again; with the library flag
    turned since, the convolutions are traced as they were when it compiled."""
    model = _randomized(Net())
    x = torch.randn(2, 3, 8, 8)
    with gjit.config.scope(conv_layout="channels_last", cache=True, cache_dir=str(tmp_path)), torch.no_grad():
        check(model, x)
        warm = check(model, x)
        with torch.backends.mkldnn.flags(enabled=not torch.backends.mkldnn.enabled):
            report = gjit.explain(warm, x)
    assert report.kernels


def test_a_contiguous_copy_in_the_program_stays_contiguous():
    """`.contiguous()` of a channels-last value is a copy into the contiguous layout (traced, not
    taken as elementwise): the flatten after it is a view, with no copy given back."""

    class Flatten(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)

        def forward(self, x):
            y = torch.relu(self.b(torch.relu(self.a(x))))
            return y.contiguous().view(y.shape[0], -1).sum(1), y.contiguous()

    gm = _as_eager(Flatten().eval(), torch.randn(2, 3, 10, 10))
    formats = [
        n.kwargs.get("memory_format") for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default
    ]
    assert formats == [torch.channels_last, torch.contiguous_format]


@torch.library.custom_op("gjit_test::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return (x.contiguous().view(-1) * 2).view(x.shape)  # contiguous, whatever its input's layout


@_doubled.register_fake
def _(x):
    return torch.empty_like(x)  # (its fake says otherwise for a channels-last input)


class Readers(nn.Module):
    """Readers of channels-last values whose layout neither a trace nor their inputs decide alone:
    a library's op (its fake's layout is not its kernel's), an extern whose broadcast operand comes
    first (integer pow: TensorIterator lays the output out by that operand's strides), a split's
    pieces and a batch's slice returned."""

    def __init__(self, reader):
        super().__init__()
        self.reader = reader
        self.a, self.b, self.c = (
            nn.Conv2d(4, 4, 3, padding=1),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.Conv2d(4, 4, 1),
        )
        self.register_buffer("base", torch.arange(4 * 6 * 8).view(1, 4, 6, 8) % 3)

    def forward(self, x):
        y = self.a(x)
        if self.reader == "library op":
            return self.b(_doubled(y) + 1) * torch.arange(8.0).view(1, 1, 1, 8)
        y = self.b(y)
        if self.reader == "broadcast first":
            return torch.pow(self.base, (y > 0).to(torch.int64) + 1) * 2 + torch.arange(8).view(1, 1, 1, 8)
        z = torch.relu(self.c(y))
        first, second = z.split(2, 1)
        return first, second, z[1:]


@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "dynamic"])
@pytest.mark.parametrize("reader", ["library op", "broadcast first", "pieces"])
def test_readers_whose_layout_a_trace_or_the_inputs_do_not_decide(reader, dynamic):
    torch.manual_seed(0)
    gm = _as_eager(Readers(reader).eval(), torch.randn(2, 4, 6, 8), dynamic)
    assert _clones(gm)

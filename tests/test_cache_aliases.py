"""A returned input cache after a compiled call (gjit/capture/cache_aliases.py): `rebuild` gives the
caller's cache object the returned state without building the returned cache first, and must leave
exactly what building it and `restore` leave: the same output tree, the caller's object in it, its
layer objects kept where they line up, every tensor the returned one."""

from __future__ import annotations

import collections
import copy
import enum

import pytest
import torch
import torch.utils._pytree as pytree

import gjit
from gjit.capture import cache_aliases, kv_cache

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.cpu

IN_PATH = (pytree.SequenceKey(1), pytree.MappingKey("past_key_values"))
OUT_PATH = (pytree.MappingKey("past_key_values"),)


def dynamic(layers: int, length: int, seed: int) -> transformers.DynamicCache:
    torch.manual_seed(seed)
    cache = transformers.DynamicCache()
    for i in range(layers):
        cache.update(torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8), i)
    return cache


def static(seed: int) -> transformers.StaticCache:
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=50
    )
    cache = transformers.StaticCache(config=config, max_cache_len=16)
    torch.manual_seed(seed)
    for i in range(3):
        cache.update(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), i, {"cache_position": torch.arange(4)})
    return cache


def longer(cache):
    """The same cache one position on (new tensors), as a decode step returns it."""
    grown = copy.deepcopy(cache)
    for i, layer in enumerate(grown.layers):
        grown.update(
            torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), i, {"cache_position": torch.tensor([4])}
        )
        layer.extra = i  # a new attribute on a layer
    return grown


def one_more_layer(cache):
    grown = longer(cache)
    grown.update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), len(grown.layers))
    return grown


def with_stale(cache):
    cache.layers[0].stale = 1
    cache.stale = 2
    return cache


def without_stale(cache):
    """One position on, and attributes the caller's object has gone from the returned one."""
    grown = longer(cache)
    del grown.layers[0].stale, grown.stale
    return grown


CASES = {
    "dynamic, one position on": lambda: (dynamic(3, 4, 0), longer),
    "dynamic, a layer more": lambda: (dynamic(2, 4, 1), one_more_layer),
    "dynamic, attributes gone": lambda: (with_stale(dynamic(2, 4, 7)), without_stale),
    "static, written in place": lambda: (static(2), lambda c: c),
    "static, one position on": lambda: (static(3), longer),
    "encoder-decoder": lambda: (
        transformers.EncoderDecoderCache(dynamic(2, 4, 4), dynamic(2, 3, 5)),
        lambda c: transformers.EncoderDecoderCache(longer(c.self_attention_cache), c.cross_attention_cache),
    ),
}


def objects(value, path: str = "") -> list:
    """Each object of a cache's state (the cache, its layers, nested caches) with its path."""
    if isinstance(value, list):
        return [o for i, v in enumerate(value) for o in objects(v, f"{path}[{i}]")]
    if isinstance(value, torch.Tensor) or not hasattr(value, "__dict__") or callable(value):
        return []
    return [(path, value)] + [o for k, v in vars(value).items() for o in objects(v, f"{path}.{k}")]


def state(cache) -> tuple:
    """What a caller sees of its cache: every value of its state (tensors by identity)."""
    leaves, context = kv_cache.flatten_cache(cache)
    return [id(x) if isinstance(x, torch.Tensor) else x for x in leaves], context


def returned_into(given, returned, how: str) -> None:
    """A decode step's output holding `returned` handed back to the caller whose cache is `given`,
    as a compiled call does: `restore` (from the built output) or `rebuild` (from its leaves)."""
    output = transformers.modeling_outputs.CausalLMOutputWithPast(
        logits=torch.randn(1, 1, 50), past_key_values=returned
    )
    leaves, spec = pytree.tree_flatten(output)
    aliases = cache_aliases.CacheAliases(pairs=[(OUT_PATH, IN_PATH)])
    call = ((), {"past_key_values": given})
    if how == "restore":
        aliases.restore(*call, pytree.tree_unflatten(leaves, spec))
    else:
        aliases.rebuild(*call, leaves, spec)


@pytest.mark.parametrize("case", list(CASES))
def test_rebuild_leaves_what_restore_leaves(case):
    kv_cache.register_all()
    given, step = CASES[case]()
    returned = step(given)
    output = transformers.modeling_outputs.CausalLMOutputWithPast(
        logits=torch.randn(1, 1, 50), past_key_values=returned
    )
    leaves, spec = pytree.tree_flatten(output)
    aliases = cache_aliases.CacheAliases(pairs=[(OUT_PATH, IN_PATH)])
    results = []
    for how in ("restore", "rebuild"):
        # the caller's object: a copy of its own (layers, nested caches), over the same tensors
        tensors = [x for x in pytree.tree_leaves(given) if isinstance(x, torch.Tensor)]
        mine = copy.deepcopy(given, {id(t): t for t in tensors})
        originals = {id(o) for _, o in objects(mine)}
        call = ((), {"past_key_values": mine})
        if how == "restore":
            out = aliases.restore(*call, pytree.tree_unflatten(leaves, spec))
        else:
            out = aliases.rebuild(*call, leaves, spec)
        assert out.past_key_values is mine and out.logits is output.logits
        kept = [(path, id(o) in originals) for path, o in objects(mine)]
        results.append((state(mine), kept, list(out.keys())))
    assert results[0] == results[1]
    assert aliases._plans[id(spec)][1] is not None  # rebuild did not fall back to restore


def test_an_output_a_skeleton_cannot_stand_for_falls_back_to_restore(monkeypatch):
    kv_cache.register_all()
    given = dynamic(2, 4, 6)
    returned = longer(given)
    output = {"logits": torch.randn(2), "past_key_values": returned}
    leaves, spec = pytree.tree_flatten(output)
    aliases = cache_aliases.CacheAliases(pairs=[(OUT_PATH, IN_PATH)])

    def refuse(*args):
        raise ValueError("no skeleton")

    monkeypatch.setattr(cache_aliases, "_plan", refuse)
    out = aliases.rebuild((), {"past_key_values": given}, leaves, spec)
    assert out["past_key_values"] is given and aliases._plans[id(spec)][1] is None
    assert state(given)[0] == state(returned)[0]


@pytest.mark.slow  # (CI's sweep step: 12 s)
def test_a_compiled_decode_loop_rebuilds_its_cache_in_place(monkeypatch):
    """The compiled path: each decode call's output holds the caller's cache, rebuilt (not restored)."""
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=50,
        )
    ).eval()  # fmt: skip
    plans = []
    plan = cache_aliases._plan
    monkeypatch.setattr(cache_aliases, "_plan", lambda *a: plans.append(plan(*a)) or plans[-1])
    ids = torch.randint(0, 50, (1, 5))

    def loop(forward, cache):
        out = forward(input_ids=ids, past_key_values=cache)
        for _ in range(3):
            assert out.past_key_values is cache
            out = forward(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache)
        return out.logits

    with torch.no_grad():
        want = loop(model, transformers.DynamicCache(config=model.config))
    cache = transformers.DynamicCache(config=model.config)
    eager_runs = gjit.stats()["eager_runs"]
    with gjit.config.scope(interpret=True, debug=True), torch.no_grad():
        got = loop(gjit.compile(model), cache)
    assert gjit.stats()["eager_runs"] == eager_runs, "a call ran eagerly"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert plans and all(p is not None for p in plans)


class Odd:
    """A cache-like object with every kind of value a cache's state may hold."""

    def __init__(self):
        self.layers = [Odd.Layer(), Odd.Layer()]
        self.weight = torch.nn.Parameter(torch.randn(2))  # a tensor subclass: a leaf
        self.table = {"a": torch.randn(1), "b": [1, (2, torch.randn(1))]}
        self.ordered = collections.OrderedDict(x=torch.randn(1))
        self.pair = (3, None)
        self.flags = (True, 0.5, "s", torch.float16, torch.device("cpu"))
        self.kind = enum.Enum("Kind", "A").A
        self.method = self.__init__  # a callable: a constant

    class Layer:
        def __init__(self):
            self.keys, self.length, self.ready = torch.randn(2), 7, False


@pytest.mark.parametrize("case", [*CASES, "every kind of value"])
def test_the_flatten_on_every_calls_path_is_the_general_one(case):
    """kv_cache's hot-path flatten gives the context and leaves the general walk gives."""
    cache = Odd() if case == "every kind of value" else CASES[case]()[0]
    leaves, context = kv_cache.flatten_cache(cache)
    general: list = []
    assert context == (type(cache), kv_cache._state(vars(cache), general, [], ""))
    assert len(leaves) == len(general) and all(a is b for a, b in zip(leaves, general))


Pair = collections.namedtuple("Pair", "keys values")


class Tagged(list):
    """A list subclass with an attribute of its own."""


class Fields(dict):
    pass


class Steps(collections.OrderedDict):
    pass


class Containers:
    """A cache-like object whose state holds list, tuple and dict subclasses with tensors in them."""

    def __init__(self):
        self.pairs = [Pair(torch.randn(2), torch.randn(2)), Pair(torch.randn(1), 3)]
        self.tagged = Tagged([torch.randn(3), 4])
        self.tagged.note, self.tagged.scale = "x", torch.randn(1)
        self.fields = Fields(a=torch.randn(2), b=Pair(1, 2))
        self.steps = Steps(first=torch.randn(1), second=[torch.randn(1)])


def test_list_tuple_and_dict_subclasses_in_a_caches_state_keep_their_items():
    """Their items (and a list subclass's own attributes) are the state's leaves, and the rebuild
    gives the same classes holding the same values, also from the context written as JSON (a
    package). A namedtuple is a sequence, not a constant: its tensors are the call's."""
    cache = Containers()
    leaves, context = kv_cache.flatten_cache(cache)
    tensors = [t for t in pytree.tree_leaves(vars(cache)) if isinstance(t, torch.Tensor)]
    assert len(leaves) == 12 and {id(t) for t in tensors} <= {id(x) for x in leaves}
    general: list = []
    assert context == (type(cache), kv_cache._state(vars(cache), general, [], ""))
    assert [id(x) for x in general] == [id(x) for x in leaves]
    for ctx in (context, kv_cache._load_context(kv_cache._dump_context(context))):
        fresh = [x + 1 if isinstance(x, torch.Tensor) else x for x in leaves]
        state = kv_cache.build_state(ctx[1], iter(fresh))
        rebuilt = vars(cache) | state
        assert type(rebuilt["pairs"][0]) is Pair and rebuilt["pairs"][1].values == 3
        torch.testing.assert_close(rebuilt["pairs"][0].keys, cache.pairs[0].keys + 1)
        assert type(rebuilt["tagged"]) is Tagged and len(rebuilt["tagged"]) == 2
        assert rebuilt["tagged"].note == "x" and rebuilt["tagged"][1] == 4
        torch.testing.assert_close(rebuilt["tagged"].scale, cache.tagged.scale + 1)
        assert type(rebuilt["fields"]) is Fields and rebuilt["fields"]["b"] == Pair(1, 2)
        assert type(rebuilt["steps"]) is Steps and list(rebuilt["steps"]) == ["first", "second"]
        torch.testing.assert_close(rebuilt["steps"]["second"][0], cache.steps["second"][0] + 1)
    assert not kv_cache.is_state_object(cache.tagged)  # replaced whole, never adopted by attribute


@pytest.mark.parametrize("how", ["restore", "rebuild"])
def test_a_list_subclass_the_step_rebinds_is_the_returned_one_with_its_attributes(how):
    """A list subclass of a cache's state with an attribute of its own: the caller's cache ends
    with the returned items and attributes, whichever way it takes them (before, `restore` wrote
    the items into the caller's list and kept its old attribute)."""
    kv_cache.register_all()
    given = dynamic(2, 4, 9)
    given.tagged = Tagged([torch.randn(2)])
    given.tagged.scale = torch.randn(1)
    returned = longer(given)
    returned.tagged = Tagged([torch.randn(2)])
    returned.tagged.scale = torch.randn(1)
    returned_into(given, returned, how)
    assert type(given.tagged) is Tagged and given.tagged[0] is returned.tagged[0]
    assert given.tagged.scale is returned.tagged.scale
    assert state(given) == state(returned)


class Shaped:
    """A cache-like object whose state holds values gjit cannot rebuild from their items: a
    torch.Size (a tuple subclass with a constructor of its own) and a defaultdict (its factory)."""

    def __init__(self):
        self.keys = torch.randn(2)
        self.shape = torch.Size([2, 3])
        self.counts = collections.defaultdict(int, a=1)


def test_values_gjit_cannot_rebuild_from_items_stay_constants_of_the_context():
    """A torch.Size and a defaultdict are constants of the context, as before list, tuple and dict
    subclasses were looked into: the same objects come back (a defaultdict keeps its factory), and
    the flatten does not fail (it runs in every compiled call: before, these raised TypeError from
    the call itself)."""
    cache = Shaped()
    leaves, context = kv_cache.flatten_cache(cache)
    assert leaves == [cache.keys]
    state = dict(context[1][1])
    assert state["shape"] == ("const", torch.Size([2, 3])) and state["counts"][1] is cache.counts
    rebuilt = kv_cache.unflatten_cache(leaves, context)
    assert rebuilt.shape == torch.Size([2, 3]) and rebuilt.counts["b"] == 0
    general: list = []
    assert context == (type(cache), kv_cache._state(vars(cache), general, [], ""))


def test_a_compiled_call_whose_cache_holds_a_torch_size_runs_compiled():
    """The compiled path (the fallback interpreter: what flattens the call is under test): a
    DynamicCache holding a torch.Size and a defaultdict, as a user's code may leave on it."""
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=50,
        )
    ).eval()  # fmt: skip
    ids = torch.randint(0, 50, (1, 5))

    def cache():
        made = transformers.DynamicCache(config=model.config)
        made.shape, made.counts = torch.Size([1, 5]), collections.defaultdict(int)
        return made

    with torch.no_grad():
        want = model(input_ids=ids, past_key_values=cache()).logits
        eager_runs = gjit.stats()["eager_runs"]
        got = gjit.compile(model)(input_ids=ids, past_key_values=cache()).logits
    assert gjit.stats()["eager_runs"] == eager_runs, "the call ran eagerly"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class Window(enum.Enum):
    SLIDING = 1
    FULL = 2


def masked(x):  # functions held by a cache's state: constants of its context
    return x


def unmasked(x):
    return x


module_lambda = lambda x: x  # noqa: E731 - its __qualname__ is "<lambda>"


def test_enum_members_and_functions_of_a_caches_state_are_written_into_a_package():
    """The context as JSON (torch.export.save, a package): an enum member by its class and name,
    a module-level function by its import path, both the same objects when read back; a local
    function cannot be imported again and is refused."""
    cache = Containers()
    cache.window, cache.mask = Window.SLIDING, masked
    _, context = kv_cache.flatten_cache(cache)
    back = kv_cache._load_context(kv_cache._dump_context(context))
    assert back == context
    state = dict(back[1][1])
    assert state["window"] == ("const", Window.SLIDING) and state["mask"] == ("const", masked)
    cache.mask = lambda x: x
    with pytest.raises(TypeError, match="function"):
        kv_cache._dump_context(kv_cache.flatten_cache(cache)[1])
    cache.mask = module_lambda  # at module level, but no import path finds it again
    with pytest.raises(TypeError, match="function"):
        kv_cache._dump_context(kv_cache.flatten_cache(cache)[1])


@pytest.mark.parametrize("how", ["restore", "rebuild"])
def test_a_constant_the_step_changes_is_replaced_not_adopted(how):
    """An enum member, a function, an OrderedDict of a cache's state are values, as the flatten
    keeps them (a constant of the context, a mapping): the caller's cache holds the returned one, as
    in eager, and the old one is left alone (an enum member is the whole process's)."""
    kv_cache.register_all()
    given = dynamic(2, 4, 8)
    given.window, given.layers[0].mask, given.layers[1].seen = (
        Window.SLIDING,
        masked,
        collections.OrderedDict(a="x"),
    )
    returned = longer(given)
    returned.window, returned.layers[0].mask = Window.FULL, unmasked
    returned.layers[1].seen = collections.OrderedDict(a="y", b="z")
    returned_into(given, returned, how)
    assert (Window.SLIDING.name, Window.SLIDING.value) == ("SLIDING", 1), "an enum member was overwritten"
    assert given.window is Window.FULL and given.layers[0].mask is unmasked
    assert given.layers[1].seen == collections.OrderedDict(a="y", b="z")

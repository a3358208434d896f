"""Full garbage collections are deferred while gjit compiles, and the collector is given back as
it was: the thresholds restored, nested and concurrent compiles sharing one adjustment."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import gjit
import gjit.api
from gjit.heap import DEFERRED_THRESHOLD, deferred_full_collections
from helpers import run_compiled

pytestmark = pytest.mark.cpu


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_raised_inside_restored_after(thresholds):
    with deferred_full_collections():
        assert gc.get_threshold() == (700, 10, DEFERRED_THRESHOLD)
        with deferred_full_collections():  # nested: one adjustment
            assert gc.get_threshold() == (700, 10, DEFERRED_THRESHOLD)
        assert gc.get_threshold() == (700, 10, DEFERRED_THRESHOLD)
    assert gc.get_threshold() == (700, 10, 10)


def test_restored_when_the_body_raises(thresholds):
    with pytest.raises(ValueError), deferred_full_collections():
        raise ValueError("inside")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_users_change_meanwhile_is_kept(thresholds):
    with deferred_full_collections():
        gc.set_threshold(500, 5, 5)
    assert gc.get_threshold() == (500, 5, 5)


def test_a_disabled_collector_is_left_alone(thresholds):
    gc.disable()
    try:
        with deferred_full_collections():
            assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.enable()


def test_concurrent_compiles_share_one_adjustment(thresholds):
    inside, release = threading.Barrier(3), threading.Event()

    def compile_for_a_while():
        with deferred_full_collections():
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=compile_for_a_while) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert gc.get_threshold() == (700, 10, DEFERRED_THRESHOLD)
    release.set()
    for t in threads:
        t.join()
    assert gc.get_threshold() == (700, 10, 10)


def test_a_compile_runs_with_full_collections_deferred(thresholds, monkeypatch):
    seen = []
    capture = gjit.api.capture

    def recording_capture(*args, **kwargs):
        seen.append(gc.get_threshold())
        return capture(*args, **kwargs)

    monkeypatch.setattr(gjit.api, "capture", recording_capture)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(4, 8)
    with torch.no_grad():
        out, _ = run_compiled(model, x)
        torch.testing.assert_close(out, model(x))
    assert seen == [(700, 10, DEFERRED_THRESHOLD)]
    assert gc.get_threshold() == (700, 10, 10)

"""The remote compile cache (gjit/runtime/remote_cache.py) against a real redis-server started on
a free local port: a fleet of fresh processes with their own disk caches shares one server (the
first compiles, the others hit), and every fault (server down at start or killed mid-run, a
damaged, cut-short or foreign value, a full server, a wrong password) leaves every call correct,
is counted and is logged once."""

import base64
import json
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import triton
from test_prebuild import INPUTS, MlpNorm, first_call, graph_module, jit_first_launches

import gjit
from gjit.runtime import remote_cache

pytestmark = [pytest.mark.cpu]

redis = pytest.importorskip("redis", reason="the redis client library is not installed (pip install redis)")
SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A redis-server process of the test's own, no persistence."""

    def __init__(self, *args: str, password: str | None = None):
        if SERVER is None:
            pytest.skip("no redis-server on this machine (apt-get install redis-server; CI installs it)")
        self.port = free_port()
        command = [
            SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        if password:
            command += ["--requirepass", password]
        self.proc = subprocess.Popen([*command, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port, password=password, socket_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    self.kill()
                    pytest.skip("redis-server did not start")
                time.sleep(0.05)

    def url(self, password: str | None = None) -> str:
        auth = f":{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.kill()


def model(x, w):
    return torch.softmax(torch.relu(x @ w) * 2 + 1, -1)


def args():
    torch.manual_seed(3)
    return torch.randn(8, 16), torch.randn(16, 12)


def compile_on_a_new_machine(tmp_path, name: str, url: str, fn=model):
    """A fresh callable with an empty disk cache of its own (another machine, as far as the cache
    tiers go): run it through the kernels, compare with eager, return the counters it moved."""
    before = dict(gjit.stats())
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path / name), remote_cache=url, interpret=True):
        out = gjit.compile(fn)(*args())
    torch.testing.assert_close(out, fn(*args()))
    after = gjit.stats()
    assert after["eager_runs"] == before["eager_runs"], "the call ran eagerly, not compiled"
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if isinstance(after.get(k), int)}


def flush(url: str) -> None:
    with gjit.config.scope(remote_cache=url):
        remote = remote_cache.current()
    if remote is not None:
        remote.flush()


def stored_keys(server: Server) -> list[bytes]:
    return server.client.keys(b"gjit:*")


def test_a_second_machine_hits_the_remote_and_fills_its_disk(server, tmp_path):
    first = compile_on_a_new_machine(tmp_path, "a", server.url())
    flush(server.url())
    assert first["remote_cache_misses"] >= 1 and first["remote_cache_writes"] >= 1
    assert stored_keys(server)
    second = compile_on_a_new_machine(tmp_path, "b", server.url())
    assert second["remote_cache_hits"] >= 1 and second.get("decompositions", 0) == 0, second
    assert second.get("disk_cache_hits", 0) == 0 and second["disk_cache_misses"] >= 1  # one lookup, one hit
    assert os.listdir(tmp_path / "b" / "graphs")  # written to the local disk
    third = compile_on_a_new_machine(tmp_path, "b", server.url())  # the same machine again: disk
    assert third.get("remote_cache_hits", 0) == 0 and third["disk_cache_hits"] >= 1


FLEET_PROCESS = f"""
import json, sys, torch, gjit
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_remote_cache import model, args
out = gjit.compile(model)(*args())
torch.testing.assert_close(out, model(*args()))
assert gjit.stats()["eager_runs"] == 0, "the call ran eagerly, not compiled"
print(json.dumps({{k: v for k, v in gjit.stats().items() if isinstance(v, int)}}))
"""


def start_process(cache_dir, url: str) -> subprocess.Popen:
    """A fresh process with a disk cache of its own that compiles `model` (kernels interpreted)."""
    env = dict(
        os.environ, GJIT_CACHE="1", GJIT_CACHE_DIR=str(cache_dir), GJIT_REMOTE_CACHE=url, GJIT_INTERPRET="1"
    )
    command = [sys.executable, "-c", FLEET_PROCESS]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def counters_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow  # CI's sweep step: 23 s of processes; the default run's two-process test stays
def test_a_fleet_of_processes(server, tmp_path):
    """Fresh processes, each with its own disk cache: the first compiles, the others hit the
    remote; every output matches eager."""
    results = [counters_of(start_process(tmp_path / f"m{k}", server.url())) for k in range(3)]
    assert results[0].get("remote_cache_writes", 0) >= 1 and results[0].get("decompositions", 0) >= 1
    for r in results[1:]:
        assert r.get("remote_cache_hits", 0) >= 1 and r.get("decompositions", 0) == 0, r


@pytest.mark.slow  # (CI's sweep step: two fresh processes)
def test_two_processes_at_once_both_succeed_and_the_value_is_written_once(server, tmp_path):
    procs = [start_process(tmp_path / f"p{k}", server.url()) for k in range(2)]
    results = [counters_of(proc) for proc in procs]
    keys = stored_keys(server)
    assert sum(r.get("remote_cache_writes", 0) for r in results) == len(keys) >= 1


def warnings_about_the_remote(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "remote cache" in r.getMessage()]


def test_server_down_at_start(tmp_path, caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        first = compile_on_a_new_machine(tmp_path, "a", url)
        second = compile_on_a_new_machine(tmp_path, "b", url, fn=lambda x, w: model(x, w) + 1)
    assert first["remote_cache_errors"] >= 1
    assert second.get("remote_cache_hits", 0) == 0
    assert len(warnings_about_the_remote(caplog)) == 1, caplog.text


def test_server_killed_mid_run(server, tmp_path, caplog):
    compile_on_a_new_machine(tmp_path, "a", server.url())
    flush(server.url())
    server.kill()
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        moved = compile_on_a_new_machine(tmp_path, "b", server.url())
        compile_on_a_new_machine(tmp_path, "c", server.url(), fn=lambda x, w: model(x, w) * 3)
    assert moved["remote_cache_errors"] >= 1 and moved.get("decompositions", 0) >= 1
    assert len(warnings_about_the_remote(caplog)) == 1, caplog.text


@pytest.mark.parametrize(
    "damage",
    [
        lambda v: b"garbage",  # not ours
        lambda v: v[: len(v) // 2],  # cut short
        lambda v: v[:-20] + bytes(20),  # a wrong checksum
        lambda v: v.replace(remote_cache.MAGIC, b"gjit-remote-entry-0\n"),  # another format
    ],
    ids=["foreign", "truncated", "wrong-checksum", "other-format"],
)
def test_a_damaged_value_is_refused(server, tmp_path, caplog, damage):
    compile_on_a_new_machine(tmp_path, "a", server.url())
    flush(server.url())
    for key in stored_keys(server):
        server.client.set(key, damage(server.client.get(key)))
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        moved = compile_on_a_new_machine(tmp_path, "b", server.url())
    assert moved["remote_cache_errors"] >= 1 and moved.get("remote_cache_hits", 0) == 0
    assert moved.get("decompositions", 0) >= 1  # compiled locally
    assert len(warnings_about_the_remote(caplog)) == 1, caplog.text
    flush(server.url())  # its entry replaced the damaged value (not SET NX): the next machine hits
    third = compile_on_a_new_machine(tmp_path, "c", server.url())
    assert third["remote_cache_hits"] >= 1 and third.get("decompositions", 0) == 0, third


def test_a_checksummed_value_for_another_key_is_refused(server, tmp_path):
    """A well-formed entry under the wrong key (another graph's, or another version's): the entry
    names its own key, so it is refused."""
    compile_on_a_new_machine(tmp_path, "a", server.url())
    flush(server.url())
    (key,) = stored_keys(server)
    with gjit.config.scope(remote_cache=server.url()):
        remote = remote_cache.current()
        text = remote.unpack(server.client.get(key))
    checksum, _, body = text.partition("\n")
    record = json.loads(body)
    record["key"] = "0" * 64
    body = json.dumps(record, sort_keys=True)
    forged = disk_cache_text(body)
    server.client.set(key, pack(forged))
    moved = compile_on_a_new_machine(tmp_path, "b", server.url())
    assert moved["remote_cache_errors"] >= 1 and moved.get("remote_cache_hits", 0) == 0


def disk_cache_text(body: str) -> str:
    import hashlib

    return hashlib.sha256(body.encode()).hexdigest() + "\n" + body


def pack(text: str) -> bytes:
    import hashlib
    import zlib

    packed = zlib.compress(text.encode())
    return remote_cache.MAGIC + hashlib.sha256(packed).hexdigest().encode() + b"\n" + packed


def test_a_full_server(server, tmp_path, caplog):
    server.client.config_set("maxmemory-policy", "noeviction")
    server.client.config_set("maxmemory", 1)  # every write is refused (OOM)
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        compile_on_a_new_machine(tmp_path, "a", server.url())
        flush(server.url())
        compile_on_a_new_machine(tmp_path, "b", server.url(), fn=lambda x, w: model(x, w) - 1)
        flush(server.url())
    assert gjit.stats()["remote_cache_errors"] >= 1
    assert not stored_keys(server)
    messages = warnings_about_the_remote(caplog)
    assert len(messages) == 1 and "full" in messages[0], messages


def test_a_wrong_password(tmp_path, caplog):
    s = Server(password="right")
    try:
        with caplog.at_level(logging.WARNING, logger="gjit.cache"):
            moved = compile_on_a_new_machine(tmp_path, "a", s.url(password="not-the-pa55word"))
            flush(s.url(password="not-the-pa55word"))
        assert moved["remote_cache_errors"] >= 1
        messages = warnings_about_the_remote(caplog)
        assert (
            len(messages) == 1 and "authentication" in messages[0] and "not-the-pa55word" not in messages[0]
        ), messages
        assert not s.client.keys(b"*")
    finally:
        s.kill()


def test_no_remote_configured_touches_nothing(tmp_path):
    moved = compile_on_a_new_machine(tmp_path, "a", None)
    assert not any(k.startswith("remote_cache") for k, v in moved.items() if v)


def test_a_slow_server_times_out(server, tmp_path, caplog):
    server.client.client_pause(3000)  # the server answers nobody for 3 s
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gjit.cache"), gjit.config.scope(remote_cache_timeout=0.2):
        moved = compile_on_a_new_machine(tmp_path, "a", server.url())
    assert moved["remote_cache_errors"] >= 1
    messages = warnings_about_the_remote(caplog)
    assert len(messages) == 1 and "timed out" in messages[0], messages
    assert time.monotonic() - start < 3 + 60  # one timeout, then the server is left alone


def test_an_entry_over_the_size_limit_is_not_written(server, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gjit.cache"), gjit.config.scope(remote_cache_max_bytes=100):
        moved = compile_on_a_new_machine(tmp_path, "a", server.url())
        flush(server.url())
    assert moved["remote_cache_errors"] >= 1 and not stored_keys(server)
    messages = warnings_about_the_remote(caplog)
    assert len(messages) == 1 and "over the limit" in messages[0], messages


def test_without_the_client_library_the_remote_is_skipped_with_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` fails as if not installed
    url = f"redis://127.0.0.1:{free_port()}/7"
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        moved = compile_on_a_new_machine(tmp_path, "a", url)
    assert moved["remote_cache_errors"] == 1
    assert len(warnings_about_the_remote(caplog)) == 1 and "not used" in caplog.text


def test_an_unwritable_disk_still_takes_remote_hits_and_fills_the_server(server, tmp_path, caplog):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "graphs").write_text("not a folder")  # no entry can be written under it
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        first = compile_on_a_new_machine(tmp_path, "a", server.url())
        flush(server.url())
        second = compile_on_a_new_machine(tmp_path, "b", server.url())
    assert first["remote_cache_writes"] >= 1  # the server is filled without a local entry
    assert second["remote_cache_hits"] >= 1 and second.get("decompositions", 0) == 0, second


def test_passwords_never_reach_the_log(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gjit.cache"):
        for url in (
            f"user:S3CRET@127.0.0.1:{free_port()}/0",
            f"redis://127.0.0.1:{free_port()}/0?password=S3CRET",
        ):
            compile_on_a_new_machine(tmp_path, "a", url)
    assert "remote cache" in caplog.text and "S3CRET" not in caplog.text


def test_a_bad_timeout_setting_is_said_once_and_the_default_used(server, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gjit.cache"), gjit.config.scope(remote_cache_timeout=0):
        compile_on_a_new_machine(tmp_path, "a", server.url())
    assert "timeout of 0" in caplog.text and gjit.stats().get("remote_cache_errors", 0) == 0


# -- kernel binaries (gjit/runtime/prebuild.py, triton_binaries.py), on a driver that names sm_90 ------


def binary_keys(server: Server) -> list[bytes]:
    return sorted(server.client.keys(b"gjit:triton-binary-*"))


def wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def first_launches_on_another_machine(graph, tmp_path, name: str, monkeypatch):
    """Another machine's view of `graph`: an empty Triton cache, nothing compiled in memory, a new
    wrapper. Returns the wrapper's namespace."""
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / name))
    monkeypatch.setattr(graph_module, "_KERNELS", {})
    graph._calls.clear()
    return graph.call_fn(interpret=False).__globals__


def test_kernel_binaries_a_machine_built_are_installed_on_the_next(server, tmp_path, sm90, monkeypatch):
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    with gjit.config.scope(remote_cache=server.url(), compile_workers=2):
        built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
        assert len(built.builds) == 3 and not built.fetched
        built.wait()
        wait_for(lambda: len(binary_keys(server)) == 3)  # each worker's binary, shared once it is built
        namespace = first_launches_on_another_machine(graph, tmp_path, "second", monkeypatch)
        before = dict(gjit.stats())
        again = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
        moved = {
            k: gjit.stats().get(k, 0) - before.get(k, 0) for k in ("remote_binary_hits", "kernels_prebuilt")
        }
    assert (
        len(again.fetched) == 3
        and not again.futures
        and moved == {"remote_binary_hits": 3, "kernels_prebuilt": 0}
    )
    assert jit_first_launches(graph, args, sizes, namespace) == [True] * 3  # nothing compiled at launch


@pytest.mark.parametrize("damage", ["another entry's value", "cut short", "a third file"])
def test_a_damaged_binary_is_never_installed_and_the_workers_build_it(
    server, tmp_path, sm90, monkeypatch, damage
):
    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    with gjit.config.scope(remote_cache=server.url(), compile_workers=2):
        graph.prebuild(graph.call_fn(interpret=False), args, sizes).wait()
        wait_for(lambda: len(binary_keys(server)) == 3)
        first, other = binary_keys(server)[:2]
        value = remote_cache.RemoteCache.unpack(remote_cache.current(), server.client.get(other))
        if damage == "another entry's value":  # checksummed and well formed, filed under another name
            server.client.set(first, pack(value))
        elif damage == "cut short":
            server.client.set(first, server.client.get(first)[:-100])
        else:
            record = json.loads(value)
            record["entry"] = first.decode().removeprefix("gjit:triton-binary-")
            record["files"]["evil.so"] = base64.b64encode(b"\x7fELF").decode()
            server.client.set(first, pack(json.dumps(record)))
        namespace = first_launches_on_another_machine(graph, tmp_path, "second", monkeypatch)
        before = dict(gjit.stats())
        again = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
        errors = gjit.stats().get("remote_cache_errors", 0) - before.get("remote_cache_errors", 0)
        again.wait()
    assert len(again.fetched) == 2 and sum(map(len, again.futures.values())) == 1 and errors == 1
    assert not list((tmp_path / "second").rglob("evil.so"))
    assert jit_first_launches(graph, args, sizes, namespace) == [True] * 3


# -- packages in the remote cache: gjit.save(cm, "remote:<name>"), gjit.load("remote:<name>") --------


PACKAGE_PROCESS = f"""
import json, sys, torch, gjit
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_remote_cache import model, args
loaded = gjit.load(sys.argv[1])
out = loaded(*args())
torch.testing.assert_close(out, model(*args()))
print(json.dumps({{k: v for k, v in gjit.stats().items() if isinstance(v, int)}}))
"""


def test_a_package_saved_to_the_remote_serves_another_machine_with_no_export(server, tmp_path):
    with gjit.config.scope(cache=False, remote_cache=server.url(), interpret=True):
        compiled = gjit.compile(model)
        compiled(*args())
        gjit.save(compiled, "remote:fleet/model-v1", weights=True)
    assert server.client.exists(b"gjit:package-fleet/model-v1")
    env = dict(
        os.environ, GJIT_REMOTE_CACHE=server.url(), GJIT_CACHE_DIR=str(tmp_path / "other"), GJIT_INTERPRET="1"
    )
    out = subprocess.run(
        [sys.executable, "-c", PACKAGE_PROCESS, "remote:fleet/model-v1"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    moved = json.loads(out.stdout.strip().splitlines()[-1])
    assert moved["package_loads"] == 1 and moved.get("exports", 0) == 0 and moved["eager_runs"] == 0, moved


def test_remote_package_faults_are_clear_errors(server, tmp_path):
    with gjit.config.scope(cache=False, remote_cache=server.url(), interpret=True):
        compiled = gjit.compile(model)
        compiled(*args())
        gjit.save(compiled, "remote:m", weights=True)
        with pytest.raises(gjit.PackageError, match="holds no package of that name"):
            gjit.load("remote:other")
        for bad in ("remote:", "remote:a\n", "remote:a b"):
            with pytest.raises(gjit.PackageError, match="a name of letters"):
                gjit.load(bad)
        value = server.client.get(b"gjit:package-m")
        server.client.set(b"gjit:package-m", value[:-50])
        with pytest.raises(gjit.PackageError, match="does not check out: checksum mismatch"):
            gjit.load("remote:m")
        server.client.set(b"gjit:package-m", pack("not a zip"))
        with pytest.raises(gjit.PackageError, match="not a readable gjit package"):
            gjit.load("remote:m")
    with gjit.config.scope(remote_cache=""):
        with pytest.raises(gjit.PackageError, match="no usable remote cache"):
            gjit.save(compiled, "remote:m")
        with pytest.raises(gjit.PackageError, match="no usable remote cache"):
            gjit.load("remote:m")
        gjit.save(compiled, pathlib.Path(tmp_path / "remote:m"), weights=True)  # a Path is a file
        assert (tmp_path / "remote:m").is_file()
    down = f"redis://127.0.0.1:{free_port()}/0"
    with gjit.config.scope(remote_cache=down, remote_cache_timeout="0.2"):
        with pytest.raises(gjit.PackageError, match="could not be written: .*unreachable"):
            gjit.save(compiled, "remote:m")
        with pytest.raises(gjit.PackageError, match="could not be read: .*unreachable"):
            gjit.load("remote:m")


def test_a_remote_package_saved_with_a_password_never_shows_it(tmp_path):
    server = Server(password="s3cret-pw")
    try:
        with gjit.config.scope(cache=False, remote_cache=server.url("wrong-pw"), interpret=True):
            compiled = gjit.compile(model)
            compiled(*args())
            with pytest.raises(gjit.PackageError) as error:
                gjit.save(compiled, "remote:m")
        assert "authentication" in str(error.value) and "wrong-pw" not in str(error.value)
        # whatever a client error says, the password in it is masked, on save and on load
        with gjit.config.scope(cache=False, remote_cache=server.url("s3cret-pw")):
            remote = remote_cache.current()

            def leaky(*args, **kwargs):
                raise redis.exceptions.ConnectionError("refused for default:s3cret-pw@127.0.0.1")

            bulk = remote.bulk()
            bulk.set, bulk.get = leaky, leaky
            for call in (lambda: gjit.save(compiled, "remote:m"), lambda: gjit.load("remote:m")):
                with pytest.raises(gjit.PackageError) as error:
                    call()
                assert "s3cret-pw" not in str(error.value) and "***" in str(error.value)
            remote.bulk_client = None
        with gjit.config.scope(cache=False, remote_cache=server.url("s3cret-pw"), interpret=True):
            gjit.save(compiled, "remote:m", weights=True)
            assert gjit.load("remote:m")(*args()).shape == (8, 12)
    finally:
        server.kill()


def test_a_binary_for_another_gpu_is_not_installed(server, tmp_path, sm90):
    from gjit.runtime import triton_binaries

    graph, args, sizes = first_call(MlpNorm().eval(), INPUTS["contiguous"]())
    with gjit.config.scope(remote_cache=server.url()):
        built = graph.prebuild(graph.call_fn(interpret=False), args, sizes)
        built.wait()
        wait_for(lambda: len(binary_keys(server)) == 3)
        name, metadata = built.builds[0].entry
        before = gjit.stats().get("remote_cache_errors", 0)
        assert not triton_binaries.fetch(remote_cache.current(), name, metadata, ("cuda", 80, 32))
        assert gjit.stats()["remote_cache_errors"] == before + 1
        assert triton_binaries.fetch(remote_cache.current(), name, metadata, ("cuda", 90, 32))


def test_a_remote_hit_keeps_the_per_region_choice_and_measures_nothing(server, tmp_path, monkeypatch):
    """The choice between templates and ATen (gjit/choice/), measured on the first machine,
    travels with its entry: a second machine serves the same program and measures nothing."""
    from gjit import driver, tuning

    measured: list[str] = []

    def bench(fn, what):  # the template loses: the library's side is faster
        fn()
        measured.append(what)
        return 1.0 if what.startswith("template") else 0.1

    monkeypatch.setattr(tuning, "bench", bench)
    monkeypatch.setattr(driver, "on_gpu", lambda gm: True)  # measured as on a GPU
    with gjit.config.scope(tune=True, matmul="auto", measure_all_templates=True):
        compile_on_a_new_machine(tmp_path, "a", server.url())
        flush(server.url())
        assert measured
        count = len(measured)
        before = gjit.stats().get("remote_cache_hits", 0)
        machine = dict(cache=True, cache_dir=str(tmp_path / "b"), remote_cache=server.url(), interpret=True)
        with gjit.config.scope(**machine):
            cm = gjit.compile(model)
            out = cm(*args())
    torch.testing.assert_close(out, model(*args()))
    assert gjit.stats()["remote_cache_hits"] > before, "the second machine's entry came from the server"
    assert len(measured) == count, "a remote hit measures nothing"
    report = gjit.explain(cm, *args())
    assert [e.op for e in report.externs] == ["aten.mm.default"], "ATen on the second machine as on the first"
    assert "chosen per region: ATen (measured" in report.externs[0].reason

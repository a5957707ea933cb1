"""`hicache simulate`: traces in both formats, sizes, sweeps, the two engines, the outputs."""

from __future__ import annotations

import gzip
import json
import sys
from importlib import resources
from pathlib import Path

import pytest

from hicache.messages import Tokens
from hicache.runtime import Config, HiCache, Request
from hicache.runtime._usage import UsageError
from hicache.runtime.cli import main
from hicache.runtime.demo._simulate import Size, kv_bytes_of_shape, parse_sizes
from hicache.runtime.demo._simulate_cores import SimCores
from hicache.runtime.demo._simulate_trace import read_trace
from hicache.runtime.trace import TraceError, load_trace


@pytest.fixture(scope="module")
def mooncake_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded trace's first 150 lines, as a user's Mooncake-format file."""
    path = tmp_path_factory.mktemp("trace") / "conversation.jsonl"
    ref = resources.files("hicache.runtime") / "data" / "mooncake_conversation_trace.jsonl.gz"
    with ref.open("rb") as raw, gzip.open(raw, "rt") as lines:
        path.write_text("".join(line for _, line in zip(range(150), lines)))
    return path


def test_sizes_are_tokens_or_bytes() -> None:
    assert parse_sizes("--l1", "100000,100k, 2M") == (Size("100000", tokens=100_000), Size("100k", tokens=100_000),
                                                      Size("2M", tokens=2_000_000))
    [gib, mb] = parse_sizes("--l2", "4GiB,500MB")
    assert gib.in_tokens(131072) == 4 * 2**30 // 131072 and mb.in_tokens(1000) == 500_000
    assert parse_sizes("--l3", "unbounded", unbounded=True)[0].in_tokens(1) is None
    with pytest.raises(UsageError, match=r"--l1: '10q' is not a size"):
        parse_sizes("--l1", "10q")
    with pytest.raises(UsageError, match="--l2: '0' is no capacity"):
        parse_sizes("--l2", "0")
    with pytest.raises(UsageError, match="is not a size"):
        parse_sizes("--l1", "unbounded")  # only L3 may be unbounded


def test_a_model_shape_gives_its_kv_bytes_per_token() -> None:
    assert kv_bytes_of_shape("32,8,128") == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_of_shape("32,8,128,float32") == 262144
    with pytest.raises(UsageError, match="is not LAYERS,KV_HEADS,HEAD_DIM"):
        kv_bytes_of_shape("32,8")


def test_a_mooncake_trace_makes_the_embedded_traces_tokens(mooncake_file: Path) -> None:
    [ours] = read_trace(mooncake_file, limit=1)
    [embedded] = load_trace(1)
    assert ours.input_length == embedded.input_length and bool((ours.tokens() == embedded.tokens()).all())
    [small] = read_trace(mooncake_file, "mooncake", block_size=4096, limit=1)  # larger blocks: other tokens
    assert small.input_length == embedded.input_length and not bool((small.tokens() == embedded.tokens()).all())


def test_a_token_trace_takes_arrays_and_objects(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    path.write_text('[1, 2, 3, 4]\n\n{"input_ids": [1, 2, 3, 4, 5], "output_length": 7}\n{"tokens": [9]}\n')
    reqs = read_trace(path)
    assert [r.tokens().tolist() for r in reqs] == [[1, 2, 3, 4], [1, 2, 3, 4, 5], [9]]
    assert [r.output_length for r in reqs] == [1, 7, 1] and [r.index for r in reqs] == [0, 2, 3]


@pytest.mark.parametrize(("text", "says"), [
    ('{"input_length": 10}\n', "line 1: a token record is an array of token ids or an object"),
    ('{"input_length": 600, "hash_ids": [1]}\n', "line 1: input_length 600 must be an int in 1..512"),
    ('[1, 2]\nnot json\n', "line 2: not JSON"),
    ('[1, -2]\n', "line 1: the prompt must be a non-empty list of token ids"),
    ("\n", "holds no request"),
])
def test_a_bad_trace_names_its_line(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match=says):
        read_trace(path)


def test_the_cores_engine_decides_as_the_facade_does(mooncake_file: Path) -> None:
    """Served one at a time (acks applied before the next request), the cores without KV hit
    exactly what `HiCache` on threads hits, request by request, through L1 and L2."""
    cfg = Config(layers=1, kv_heads=1, head_dim=1, page_size=16, device_slots=8192, host_slots=65536)
    sim = SimCores(cfg)
    reqs = [r for r in read_trace(mooncake_file, limit=150) if r.input_length <= cfg.device_slots]
    loads = 0
    with HiCache(cfg) as hc:
        for r in reqs:
            prompt = r.tokens()
            s = sim.serve(f"r{r.index}", Tokens.from_tensor(prompt))
            [a] = hc.admit([Request(f"r{r.index}", prompt[:-1])])
            hc.start_loads().wait_all()
            rest = len(prompt) - a.cached_tokens
            hc.allocate({f"r{r.index}": rest}, commit={})
            hc.commit({f"r{r.index}": prompt[a.cached_tokens:]})
            hc.finish([a.handle])
            hc.quiesce()
            assert (s.device_hit, s.host_hit) == (a.device_hit, a.host_hit), r.index
            loads += a.host_hit
        sim.check_invariants()
    assert loads > 0  # L2 was used, not only L1


def test_a_sweep_runs_every_combination_without_kv(mooncake_file: Path, capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    plot = tmp_path / "sweep.png"
    assert main(["simulate", "--trace", str(mooncake_file), "--l1", "32k,64k", "--l2", "1M", "--l3", "unbounded,1GiB",
                 "--eviction-policy", "lru,lfu", "--page-size", "16", "--no-kv", "--json", "--plot", str(plot),
                 "--model-shape", "2,1,16,float16"]) == 0
    out, err = capsys.readouterr()
    body = json.loads(out)
    runs = body["runs"]
    assert len(runs) == 2 * 2 * 2 and body["kv_bytes_per_token"] == 128
    assert {(r["point"]["l1"], r["point"]["eviction_policy"]) for r in runs} == {
        (l1, e) for l1 in (32000, 64000) for e in ("lru", "lfu")}
    assert {r["point"]["l3"] for r in runs} == {None, 2**30 // 128}
    for r in runs:
        assert r["hit_rate"] == pytest.approx(r["hit_rate_l1"] + r["hit_rate_l2"] + r["hit_rate_l3"], abs=2e-4)
        assert r["requests"] + r["skipped"] == 150 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert any(r["hit_l3"] > 0 for r in runs) and all(r["hit_l1"] > 0 for r in runs)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "run 8/8" in err and "100%" in err  # progress lines off a terminal


def test_the_default_engine_serves_through_hicache(mooncake_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(mooncake_file), "--requests", "8", "--l1", "65536", "--l2", "131072",
                 "--l3", "unbounded", "--page-size", "16", "--json"]) == 0
    [run] = json.loads(capsys.readouterr().out)["runs"]
    assert run["requests"] == 8 and run["hit_l1"] > 0 and run["input_tokens"] > 0


def test_token_traces_hit_their_repeated_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tokens.jsonl"
    prompt = list(range(1000, 1200))
    path.write_text("\n".join(json.dumps(prompt + [i]) for i in range(5)) + "\n")
    assert main(["simulate", "--trace", str(path), "--l1", "4096", "--page-size", "16", "--no-kv", "--json"]) == 0
    [run] = json.loads(capsys.readouterr().out)["runs"]
    assert run["input_tokens"] == 5 * 201 and run["hit_l1"] == 4 * 192  # 12 whole pages of the shared 200


@pytest.mark.parametrize(("argv", "says"), [
    (["--l1", "64k", "--l2", "32k"], "--l2 32k (32,000 tokens) must be larger than --l1 64k"),
    (["--l1", "64k", "--l3", "1M"], "--l3 needs --l2"),
    (["--l1", "10"], "--l1 10 holds no page of 64 tokens"),
    (["--l1", "64k", "--eviction-policy", "lru,mru"], "--eviction-policy: 'mru' is not one of lru, lfu, fifo"),
    (["--l1", "64k", "--plot", "out.svg"], "--plot out.svg: give a .png file name"),
    (["--l1", "64k", "--plot", "/no-such-folder/sweep.png"],  # refused before the runs, not after
     "--plot /no-such-folder/sweep.png: the folder /no-such-folder does not exist or is not writable"),
    (["--l1", "64k", "--l2", "128k", "--l3", "8"], "--l3 8 holds no page of 64 tokens"),  # not an unbounded L3
    (["--l1", "64k", "--l2", "128k", "--l3", "1KiB,unbounded"], "--l3 1KiB holds no page of 64 tokens"),
    (["--l1", "99999999999999999999999999"],
     "--l1 99999999999999999999999999 is more than a tier may hold; give at most 1,099,511,627,776 tokens"),
])
def test_a_sweep_that_cannot_run_is_one_line(mooncake_file: Path, capsys: pytest.CaptureFixture[str],
                                             argv: list[str], says: str) -> None:
    assert main(["simulate", "--trace", str(mooncake_file), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_a_plot_without_matplotlib_is_one_line(mooncake_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """matplotlib is the `plot` extra: without it `--plot` is refused before anything runs."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    plot = tmp_path / "sweep.png"
    assert main(["simulate", "--trace", str(mooncake_file), "--l1", "64k", "--no-kv", "--plot", str(plot)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs matplotlib" in err and "hicache[plot]" in err, err
    assert not plot.exists()


@pytest.mark.parametrize(("data", "says"), [
    (b"[1, 2, 3]\n\xff\xfe\n", "line 2: not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 1: JSON nested too deeply to read"),
    (b"[1]\n[" + b"9" * 5000 + b"]\n", "line 2: a number of more than 4300 digits"),
    (b'{"input_length": 10, "hash_ids": []}\n', "line 1: hash_ids is empty"),
])
def test_a_trace_python_cannot_read_as_records_is_one_line_naming_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    assert main(["simulate", "--trace", str(path), "--l1", "1k", "--no-kv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hicache simulate: {path} {says}"), err


def test_a_line_longer_than_the_bound_is_refused_without_reading_on(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.runtime.demo import _simulate_trace

    monkeypatch.setattr(_simulate_trace, "LINE_BYTES_MAX", 1 << 20)
    path = tmp_path / "one-line.bin"
    path.write_bytes(b"[1]\n" + b"\0" * (2 << 20))
    with pytest.raises(TraceError, match=r"line 2: longer than 1 MiB"):
        read_trace(path)


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc/self/mem (a read fails)")
def test_a_trace_whose_read_fails_is_one_line() -> None:
    with pytest.raises(TraceError, match=r"^cannot read the trace /proc/self/mem at line 1: "):
        read_trace(Path("/proc/self/mem"))

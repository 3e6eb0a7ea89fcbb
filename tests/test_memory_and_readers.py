"""Memory checked before every allocation a user's numbers size (the server's KV cache, Hugging Face's
from_pretrained, convert, each after the range check), and readers that refuse what they cannot read in one
line naming the file and the field: a FIFO for a file, infinity for an integer, a metrics line of other
types, a config.json that does not describe its weights."""

import json
import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import TINY, tiny_checkpoint, tiny_config, tiny_model

from free_transformer.base.checks import ConfigError
from free_transformer.cli import main
from free_transformer.runs import memory
from free_transformer.runs.checkpoint import save_checkpoint


def _one_line_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@contextmanager
def unblocking(*fifos: Path):
    """A reader that opens one of `fifos` (the defect: it would wait forever for a writer) reads an empty file
    instead: a thread waits to open each for writing, and at the end each is opened for reading without
    blocking, which lets that thread go. What a test checks of a reader then fails, instead of hanging."""

    def write(fifo: Path) -> None:
        with open(fifo, "wb"):
            pass

    threads = [threading.Thread(target=write, args=(fifo,), daemon=True) for fifo in fifos]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for fifo, thread in zip(fifos, threads):
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # a reader: the waiting writer opens and ends
            thread.join(timeout=10)


@pytest.fixture
def hf_export(tmp_path):
    """A Free Transformer (4 layers, H = 4) exported to the Hugging Face format; edit(change) rewrites its
    config.json."""
    pytest.importorskip("transformers")
    save_checkpoint(tmp_path / "run", 0, tiny_model(dtype=torch.float32, latent_units=4, vocab_size=256), {})
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    return tmp_path / "hf"


def _edit_config(directory: Path, **changes) -> Path:
    config_file = directory / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))
    return config_file


# ---- memory ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("latent_units", [0, 4])
def test_the_cache_size_counted_is_what_decoding_allocates(latent_units):
    """cache_bytes counts a KV cache's keys and values, and for a Free Transformer the Z a decoding engine
    records at every position: the allocation `serve` makes for max_batch rows."""
    from free_transformer.inference.engine import DecodeEngine

    model = tiny_model(dtype=torch.float32, latent_units=latent_units)
    engine = DecodeEngine(model, 3)
    cache = engine.cache.cache
    allocated = cache.keys.nbytes + cache.values.nbytes + (engine.draws.fed.nbytes if latent_units else 0)
    assert memory.cache_bytes(model.config, 3, model.config.max_seq_len, torch.float32) == allocated


def test_a_kv_cache_larger_than_the_devices_memory_is_one_line(monkeypatch):
    config = tiny_config()
    memory.check_cache_fits(config, 64, config.max_seq_len, torch.bfloat16, torch.device("cpu"))  # fits
    with pytest.raises(ConfigError) as error:
        memory.check_cache_fits(config, 2**40, config.max_seq_len, torch.bfloat16, torch.device("cpu"), hint="ask less")
    message = str(error.value)
    assert message.startswith("a KV cache of 1,099,511,627,776 rows of 40 positions (") and "bfloat16" in message
    assert message.endswith("GiB of memory: ask less") and "\n" not in message
    # on a GPU, what is free there (the model already holds its part)
    size = memory.cache_bytes(config, 8, config.max_seq_len, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (size - 1, 80 * 2**30))
    with pytest.raises(ConfigError, match=r"GiB free on cuda:0: decode fewer rows at once"):
        memory.check_cache_fits(config, 8, config.max_seq_len, torch.bfloat16, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (size, 80 * 2**30))
    memory.check_cache_fits(config, 8, config.max_seq_len, torch.bfloat16, torch.device("cuda", 0))


def test_serve_refuses_a_batch_whose_kv_cache_exceeds_memory_before_allocating(tmp_path, capsys):
    """`serve --max-batch 2**40` allocated max_batch x max_seq_len of KV cache unchecked: the allocator's
    RuntimeError traceback (or, below the address space, the machine's memory taken)."""
    pytest.importorskip("uvicorn")
    run = tiny_checkpoint(tmp_path, "run", 4)
    argv = ["serve", str(run), "--port", "0", "--device", "cpu", "--max-batch", str(2**40)]
    error = _one_line_error(capsys, *argv)
    assert "a KV cache of 1,099,511,627,776 rows of 64 positions" in error and error.endswith("lower --max-batch")


def test_from_pretrained_checks_the_real_size_not_the_meta_one(hf_export):
    """from_pretrained builds the model on the meta device, where the memory check was skipped: a context of
    2**40 then asked the allocator for the RoPE tables (an allocator's RuntimeError of 35 TB)."""
    from free_transformer.hf.modeling import FreeTransformerForCausalLM

    _edit_config(hf_export, max_position_embeddings=2**40)
    with pytest.raises(ConfigError) as error:
        FreeTransformerForCausalLM.from_pretrained(hf_export)
    message = str(error.value)
    assert "RoPE tables for max_seq_len 1,099,511,627,776" in message and "does not fit in" in message
    assert "\n" not in message


# Run in a child, under each limit in turn (the one before lifted again): a limit that leaves 1 GiB above what the
# child maps once torch and the package are imported. The KV cache of `serve` and the RoPE tables of from_pretrained
# ask for 4 GiB or more, less than the machine's memory.
UNDER_A_LIMIT = """
import resource, sys
import torch
from free_transformer.cli import main
from free_transformer.runs import memory
from free_transformer.runs.checkpoint import load_model

run, export, *names = sys.argv[1:]
model, _ = load_model(run)
rows = 4 * 2**30 // memory.cache_bytes(model.config, 1, model.config.max_seq_len, torch.float32) + 1
page = resource.getpagesize()
for name in names:
    with open("/proc/self/statm") as statm:
        fields = [int(value) * page for value in statm.read().split()]
    mapped = fields[0] if name == "RLIMIT_AS" else fields[5]
    resource.setrlimit(getattr(resource, name), (mapped + 2**30, resource.RLIM_INFINITY))
    room, where = memory.host_memory()
    assert room <= 2**30 and where == f"left under this process's {name}", (room, where)
    assert main(["serve", run, "--port", "0", "--device", "cpu", "--max-batch", str(rows)]) == 2
    from free_transformer.hf.modeling import FreeTransformerForCausalLM
    try:
        FreeTransformerForCausalLM.from_pretrained(export)
    except Exception as error:
        print(f"from_pretrained: {type(error).__name__}: {error}", file=sys.stderr)
    resource.setrlimit(getattr(resource, name), (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
"""


def test_memory_is_checked_against_the_process_s_limits_not_only_the_machine_s(hf_export, tmp_path):
    """Under `prlimit --as` (or a data limit), serve's KV cache and from_pretrained's RoPE tables passed the check
    against physical memory and the allocator failed with a RuntimeError traceback; each is now one line."""
    if os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") < 16 * 2**30 or not Path("/proc/self/statm").exists():
        pytest.skip("needs Linux and memory above what the allocations ask for (the machine's check would refuse)")
    run = tiny_checkpoint(tmp_path, "run", 4)
    _edit_config(hf_export, max_position_embeddings=2**25)  # RoPE tables of 2**25 x head_dim x 4 floats: >= 4 GiB
    limits = ("RLIMIT_AS", "RLIMIT_DATA")
    done = subprocess.run(
        [sys.executable, "-c", UNDER_A_LIMIT, str(run), str(hf_export), *limits],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 * len(limits), done.stderr
    for limit, serve, loaded in zip(limits, lines[::2], lines[1::2]):
        assert serve.startswith("error: a KV cache of ")
        assert serve.endswith(f"left under this process's {limit}: lower --max-batch"), serve
        assert loaded.startswith("from_pretrained: ConfigError: a model of "), loaded
        assert f"left under this process's {limit}" in loaded, loaded


def test_convert_checks_the_latent_range_before_counting_memory(hf_export, tmp_path, capsys):
    """`convert` of an HF config with latent_units 62: the memory check counted the parameters of a latent
    space of 2**62 rows, and building it was a RuntimeError traceback ("Storage size calculation overflowed")."""
    config_file = _edit_config(hf_export, latent_units=62)
    error = _one_line_error(capsys, "convert", str(hf_export), str(tmp_path / "out"), "--to", "checkpoint")
    assert f"{config_file}: latent_units must be an integer in [0, " in error and "got 62" in error
    assert not (tmp_path / "out").exists()


# ---- readers --------------------------------------------------------------------------------------------


def _fifo_in_the_weights(directory: Path, which: str) -> Path:
    """The export's weights as two shards, the second (or the index that lists them) a FIFO no process writes."""
    (directory / "model.safetensors").rename(directory / "model-1.safetensors")
    os.mkfifo(directory / "model-2.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-1.safetensors", "model.norm.weight": "model-2.safetensors"}
    index = directory / "model.safetensors.index.json"
    if which == "index":
        os.mkfifo(index)
        return index
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory / "model-2.safetensors"


@pytest.mark.parametrize("which", ["shard", "index"])
def test_a_fifo_in_the_weights_is_refused_not_waited_for(hf_export, tmp_path, which, capsys):
    """An index naming a FIFO as a shard made `convert` (and Python's from_pretrained) wait forever on it; a
    FIFO as the index was said to be no weights at all."""
    from free_transformer.base.fileio import NotARegularFile
    from free_transformer.hf.modeling import FreeTransformerForCausalLM

    fifo = _fifo_in_the_weights(hf_export, which)
    said = f"{fifo} is a FIFO, not a regular file: only regular files are read"
    with unblocking(fifo):
        assert _one_line_error(capsys, "convert", str(hf_export), str(tmp_path / "out"), "--to", "checkpoint") == (
            f"error: {said}"
        )
        assert not (tmp_path / "out").exists()
        with pytest.raises(NotARegularFile) as refused:
            FreeTransformerForCausalLM.from_pretrained(hf_export)
    assert str(refused.value) == said


@pytest.mark.parametrize("source", ["config file", "override"])
@pytest.mark.parametrize("value", [".inf", "-.inf"])
def test_an_infinite_integer_setting_is_one_line(tmp_path, capsys, source, value):
    """`steps: .inf` was an OverflowError traceback (int(inf)); NaN was already refused."""
    config = tmp_path / "config.yaml"
    config.write_text(f"steps: {value}\n" if source == "config file" else "{}\n")
    overrides = [f"steps={value}"] if source == "override" else []
    error = _one_line_error(capsys, "train", "--config", str(config), "--out", str(tmp_path / "run"), *TINY, *overrides)
    assert error == f"error: steps: expected int, got {float(value.replace('.', ''))}"
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run of two steps, with a checkpoint at each."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", "--out", str(run), *TINY, "steps=2", "checkpoint_every=1"]) == 0
    return run


METRIC_DAMAGE = {
    "a step as text": ({"step": "7"}, 'step is "7", not an integer >= 0'),
    "a step of null": ({"step": None}, "step is null, not an integer >= 0"),
    "a loss as text": ({"step": 1, "loss": "1", "cross_entropy_bits": 1, "kl_bits": 0, "kappa_bits": 0}, "loss is"),
    "a kept line without cross_entropy_bits": ({"step": 1, "loss": 1.0}, "it has no cross_entropy_bits"),
}


@pytest.mark.parametrize("damage", list(METRIC_DAMAGE))
def test_a_mistyped_metrics_line_is_one_line_on_resume_and_nothing_is_lost(trained_run, tmp_path, capsys, damage):
    """A metrics.jsonl line with a step of another type was a TypeError traceback on `--resume`; a line
    without cross_entropy_bits (kept: its step is before the checkpoint) trained, then crashed drawing the
    curves. Each is refused before training, naming the file, the line and the field; the run is unchanged."""
    line, said = METRIC_DAMAGE[damage]
    run = shutil.copytree(trained_run, tmp_path / "run")
    metrics = run / "metrics.jsonl"
    with open(metrics, "a") as handle:
        handle.write(json.dumps(line) + "\n")
    before, settings = metrics.read_text(), (run / "config.yaml").read_text()
    for argv in (["train", "--out", str(run), "--resume", "steps=3"], ["inspect", str(run)]):
        error = _one_line_error(capsys, *argv)
        assert error.startswith(f"error: {metrics} holds a line this package did not write (line 3: {said}"), error
    assert metrics.read_text() == before and (run / "config.yaml").read_text() == settings
    assert not (run / "config-changes.jsonl").exists()
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]


# ---- a config.json that does not describe its weights ---------------------------------------------------


@pytest.mark.parametrize(
    "layers,said", [(5, "the weights lack model.layers.4."), (3, "the weights hold model.layers.3.")]
)
def test_from_pretrained_of_a_config_that_does_not_describe_its_weights_is_one_line(hf_export, layers, said):
    """One layer more than the weights was a random layer, one less a layer dropped, without a word."""
    from free_transformer.hf.modeling import FreeTransformerForCausalLM

    _edit_config(hf_export, num_hidden_layers=layers)
    with pytest.raises(ValueError) as error:
        FreeTransformerForCausalLM.from_pretrained(hf_export)
    message = str(error.value)
    assert message.startswith(f"{hf_export}: config.json does not describe the weights (num_hidden_layers {layers}")
    assert said in message and "\n" not in message
    _edit_config(hf_export, num_hidden_layers=4)  # the export as written loads, and says nothing is amiss
    model, info = FreeTransformerForCausalLM.from_pretrained(hf_export, output_loading_info=True)
    assert model.config.num_hidden_layers == 4 and not info["missing_keys"] and not info["unexpected_keys"]


def test_a_latent_bits_that_differs_from_latent_units_is_refused(hf_export, tmp_path, capsys):
    """latent_bits, latent_units's name before 0.3, was ignored in silence beside a different latent_units."""
    from free_transformer.hf.modeling import FreeTransformerForCausalLM

    config_file = _edit_config(hf_export, latent_bits=6)
    said = "latent_bits 6 and latent_units 4 are one field under its old and its new name, with two values"
    with pytest.raises(ValueError, match=said):
        FreeTransformerForCausalLM.from_pretrained(hf_export)
    for to in ("checkpoint", "llama"):
        error = _one_line_error(capsys, "convert", str(hf_export), str(tmp_path / to), "--to", to)
        assert error.startswith(f"error: {config_file}: {said}"), error
    _edit_config(hf_export, latent_bits=4)  # the same value under both names: read
    assert FreeTransformerForCausalLM.from_pretrained(hf_export).config.latent_units == 4

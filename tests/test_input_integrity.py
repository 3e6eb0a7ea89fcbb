"""Input that is data, never code, and never a traceback: a sweep's Slurm folder whose pickles another user
may have written, a relative sweep folder, tokenizing workers orphaned by a killed parent, and bad input
to every command (a config nested too deep, damaged metrics and eval files, absurd seeds and kappas, a
model larger than memory, a pickled HF checkpoint, a closed pipe), each one line."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY, Payload, tiny_checkpoint, tiny_run_config

from free_transformer.cli import main
from free_transformer.train.metrics import read_metrics


def _one_line_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# ---- the Slurm launcher ------------------------------------------------------------------------------------


def _slurm_that_reports_one_running_job(tmp_path, monkeypatch, job: str):
    """A PATH whose squeue lists `job` as RUNNING once, then no more (it ended); no sacct."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "squeue-seen"
    scripts = {
        "sinfo": "printf 'debug*\\n'",
        "srun": "true",
        "sbatch": "exit 1",
        "squeue": f"[ -e {seen} ] && exit 0; : > {seen}; echo '{job}|RUNNING'",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_a_pickled_result_in_the_sweeps_slurm_folder_never_runs(tmp_path, monkeypatch):
    """Anyone who can write OUT can put a pickle where submitit keeps a job's result: attaching to the job
    reads the job's JSON result, never that pickle."""
    pytest.importorskip("submitit")
    from free_transformer.experiments.launch.slurm import SlurmLauncher, SlurmOptions
    from free_transformer.experiments.launch.slurm_cluster import SlurmError
    from free_transformer.experiments.launch.slurm_record import FAILED, JobEntry, Record, jobs_dir

    out, marker = tmp_path / "sweep", tmp_path / "payload-ran"
    Record(out).set("free", JobEntry("4242", "RUNNING", "slurm/jobs/4242_0_log.err", 1))
    jobs_dir(out).mkdir(parents=True, exist_ok=True)
    (jobs_dir(out) / "4242_0_result.pkl").write_bytes(pickle.dumps(("success", Payload(marker))))
    _slurm_that_reports_one_running_job(tmp_path, monkeypatch, "4242")
    launcher = SlurmLauncher(SlurmOptions(), out, cluster="slurm", poll_seconds=0.1)
    with pytest.raises(SlurmError, match="1 of 1 runs failed: free, job 4242: the job ended .* without a result"):
        launcher.train([(tiny_run_config("steps=2"), out / "free")], "training")
    assert not marker.exists()
    assert Record(out).runs["free"].state == FAILED


@pytest.mark.slow  # a job through submitit's local cluster: 10 s
def test_a_sweep_with_a_relative_out_records_its_job_and_finishes(tmp_path, monkeypatch):
    """The study's default --out is relative (runs/study) while submitit's paths are absolute; the job's result
    and the report's come back through their JSON files."""
    pytest.importorskip("submitit")
    from free_transformer.experiments.launch.slurm import SlurmLauncher, SlurmOptions
    from free_transformer.experiments.launch.slurm_record import FINISHED, Record

    monkeypatch.chdir(tmp_path)
    launcher = SlurmLauncher(SlurmOptions(report_on="slurm"), Path("sweep"), cluster="local", poll_seconds=0.2)
    config = tiny_run_config("steps=3", "threads=1")
    wall = launcher.train([(config, Path("sweep") / "free")], "training")
    entry = Record(tmp_path / "sweep").runs["free"]
    assert (entry.state, entry.submissions) == (FINISHED, 1) and entry.log.startswith("slurm/jobs/")
    assert list(wall) == [str(Path("sweep") / "free")]
    assert read_metrics(tmp_path / "sweep" / "free" / "metrics.jsonl")[-1]["step"] == 3
    # the report as a job: its function's value (here a path's text) comes back as a path
    assert launcher.finish("{0}-on-{device}".format, "report", device="cpu") == Path("report-on-cpu")
    assert Record(tmp_path / "sweep").report.state == FINISHED


# ---- tokenizing ---------------------------------------------------------------------------------------------

KILLED_TOKENIZER = """
import sys, time
from pathlib import Path
from free_transformer.data.tokenizing import encode_corpus
from free_transformer.data.tokenizer import get_tokenizer
ids = encode_corpus([Path(sys.argv[1])], get_tokenizer("byte"), workers=2, progress=False, batch_chars=1000)
next(ids)
print("encoding", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that does not reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: the kernel kills a dead parent's workers")
def test_tokenizing_workers_die_with_a_killed_parent(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a line of text to tokenize\n" * 2000)
    parent = subprocess.Popen([sys.executable, "-c", KILLED_TOKENIZER, str(corpus)], stdout=subprocess.PIPE, text=True)
    workers = []
    try:
        assert parent.stdout.readline().strip() == "encoding"
        workers = [
            int(pid)
            for task in Path(f"/proc/{parent.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()
        ]
        assert len(workers) == 2
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)]
    finally:
        for pid in [parent.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---- bad input, one line each --------------------------------------------------------------------------------


def test_a_config_nested_too_deep_is_one_line(tmp_path, capsys):
    config = tmp_path / "deep.yaml"
    config.write_text("[" * 100_000 + "]" * 100_000)
    error = _one_line_error(capsys, "train", "--config", str(config), "--out", str(tmp_path / "run"))
    assert f"cannot read config {config}: nested too deeply" in error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["[1, 2]", "{a: 1}"], ids=["list", "mapping"])
def test_a_yaml_key_that_is_not_a_scalar_is_one_line_naming_the_file(tmp_path, capsys, key):
    """`? [1, 2]` as a key, in a config file, an override, or a run's config.yaml read by `inspect` and
    `--resume`, was a TypeError traceback (an unhashable key)."""
    config = tmp_path / "key.yaml"
    config.write_text(f"optim:\n  ? {key}\n  : 3\n")
    error = _one_line_error(capsys, "train", "--config", str(config), "--out", str(tmp_path / "new"))
    assert f"cannot read config {config}: a key must be a scalar (one line)" in error
    error = _one_line_error(capsys, "train", "--out", str(tmp_path / "new"), f"optim={{? {key} : 3}}")
    assert "override optim: cannot read its value: a key must be a scalar (one line)" in error
    assert not (tmp_path / "new").exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"model: {{latent_bits: 4}}\n? {key}\n: 3\n")
    for argv in (["inspect", str(run)], ["train", "--out", str(run), "--resume"]):
        error = _one_line_error(capsys, *argv)
        assert f"{run / 'config.yaml'}" in error and "a key must be a scalar (one line)" in error, error


@pytest.mark.parametrize(
    "line",
    [
        {"step": 1},  # no losses
        [1, 2, 3],  # not a record
        {
            "step": 1,
            "loss": 1.0,
            "cross_entropy_bits": 1.0,
            "kl_bits": 0.1,
            "kappa_bits": 0.25,
            "val_cross_entropy_bits": 1.0,
            "val_prior_cross_entropy_bits": 1.0,
            "latent_bits_saved": 0.0,
            "val_kl_bits": 0.1,
            "val_kl_bits_per_unit": "0.1",
        },
    ],
    ids=["without-keys", "a-list", "string-kl-per-bit"],
)
def test_inspect_of_damaged_metrics_is_one_line(tmp_path, capsys, line):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {latent_units: 4}\n")
    (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    if isinstance(line, list):  # skipped as a damaged line, or refused: never a traceback
        code = main(["inspect", str(run)])
        assert code in (0, 2) and len(capsys.readouterr().err.strip().splitlines()) == (1 if code else 0)
        return
    error = _one_line_error(capsys, "inspect", str(run))
    assert f"{run / 'metrics.jsonl'} holds a line this package did not write" in error


@pytest.mark.parametrize(
    "content",
    [json.dumps({"tasks": 5}), json.dumps([1]), json.dumps({"tasks": {"piqa": 5}}), b"\xff\xfe not text", "{not json"],
)
def test_compare_of_a_damaged_results_file_is_one_line_naming_it(tmp_path, capsys, content):
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    good.write_text(
        json.dumps({"tasks": {"piqa": {"metric": "acc", "value": 0.5, "n": 1, "per_doc": [{"id": 0, "score": 0.5}]}}})
    )
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert str(bad) in _one_line_error(capsys, "compare", str(good), str(bad))


@pytest.mark.parametrize(
    "seeds, message",
    [
        ("99999999999999999999", "--seeds takes a count from 1 to 1000"),
        ("10000000", "--seeds takes a count from 1 to 1000"),
        ("0,99999999999999999999", "--seeds lists at most 1000 seeds, each from 0 to 2**63 - 1"),
        ("-1,2", "each from 0 to 2**63 - 1"),
    ],
)
def test_absurd_seeds_are_one_line(tmp_path, capsys, seeds, message):
    assert message in _one_line_error(capsys, "demo", "--out", str(tmp_path / "out"), f"--seeds={seeds}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kappas", ["inf", "nan", "1,nan", "-inf"])
def test_non_finite_kappas_are_refused(tmp_path, capsys, kappas):
    error = _one_line_error(capsys, "study", "--out", str(tmp_path / "out"), f"--kappas={kappas}")
    assert f"--kappas must be distinct positive finite numbers, got {kappas!r}" in error


def test_a_model_larger_than_memory_is_one_line_with_its_size(tmp_path, capsys):
    """4 TiB for one projection: the allocator refuses at once (more than the address space)."""
    error = _one_line_error(
        capsys, "train", "--out", str(tmp_path / "run"), "model.dim=1048576", "model.n_layers=64", "steps=1"
    )
    assert "a model of 214,484,237,942,792 parameters (" in error and "does not fit in this machine's memory" in error


@pytest.mark.parametrize("field,value", [("max_seq_len", 2**40), ("dim", 2**24)])
def test_a_checkpoint_whose_sizes_exceed_memory_is_refused_before_any_allocation(tmp_path, capsys, field, value):
    """A checkpoint's config.json with max_seq_len 2**40 (SHA256SUMS rewritten to match) made `generate`
    allocate 4 TiB for the RoPE tables: the memory check counted parameters only, and after allocating."""
    from conftest import rewrite_checksums

    run = tiny_checkpoint(tmp_path, "run", 0)
    checkpoint = next((run / "checkpoints").iterdir())
    config = json.loads((checkpoint / "config.json").read_text())
    config["model"][field] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    rewrite_checksums(checkpoint)
    error = _one_line_error(capsys, "generate", str(run), "--prompt", "a", "--max-new-tokens", "2")
    assert f"{checkpoint / 'config.json'}: a model of " in error and "does not fit in this machine's memory" in error
    if field == "max_seq_len":
        assert "RoPE tables for max_seq_len 1,099,511,627,776" in error, error


def test_a_hugging_face_config_too_large_for_memory_is_refused_before_any_allocation():
    """FreeTransformerForCausalLM builds its model through runs.memory.build_model (the model itself checks
    nothing of the machine): RoPE tables of 4 TiB are one ConfigError with the size, not the allocator's."""
    pytest.importorskip("transformers")
    from free_transformer.base.checks import ConfigError
    from free_transformer.hf.configuration import FreeTransformerConfig
    from free_transformer.hf.modeling import FreeTransformerForCausalLM

    config = FreeTransformerConfig(
        vocab_size=16, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=16, max_position_embeddings=2**40,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="RoPE tables for max_seq_len 1,099,511,627,776") as error:
        FreeTransformerForCausalLM(config)
    assert "does not fit in this machine's memory" in str(error.value) and "\n" not in str(error.value)


def test_convert_of_an_hf_directory_with_a_pickled_bin_is_one_line(tmp_path, capsys):
    import torch

    tiny_checkpoint(tmp_path, "run", latent_units=0)
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    capsys.readouterr()
    marker = tmp_path / "payload-ran"
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save({"weights": Payload(marker)}, tmp_path / "hf" / "pytorch_model.bin")
    error = _one_line_error(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "checkpoint")
    assert "no model.safetensors or model.safetensors.index.json (only safetensors weights are read" in error
    assert not marker.exists()


def test_a_closed_stdout_ends_generate_quietly(tmp_path):
    """`generate | head`: the reader stops; the writer ends as Unix tools do (141: SIGPIPE), with no message."""
    tiny_checkpoint(tmp_path, "run", latent_units=0)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "free_transformer.cli",
            "generate",
            str(tmp_path / "run"),
            "--prompt",
            "a",
            "--num-samples",
            "2",
            "--max-new-tokens",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    process.stdout.close()  # before anything is written: every write fails
    assert process.wait(timeout=120) == 141
    assert process.stderr.read() == b""


# ---- configuration input is bounded ------------------------------------------------------------------------

BOMB = "[" + ", ".join(f"&l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else 'lol'}]" for i in range(10)) + "]"
"""A list whose nested aliases expand to more than 9**9 values."""


def test_a_yaml_alias_bomb_is_one_line_at_once(tmp_path, capsys):
    """The bomb as a setting's value, in a config file and in a key=value override: each is refused in one
    line (they used to get no answer in 60 s: the expanded value was printed in the error message)."""
    config = tmp_path / "bomb.yaml"
    config.write_text(f"optim:\n  lr: {BOMB}\n")
    error = _one_line_error(capsys, "train", "--config", str(config), "--out", str(tmp_path / "run"))
    assert f"cannot read config {config}: its aliases expand to more than 10,000 values" in error
    error = _one_line_error(capsys, "train", "--out", str(tmp_path / "run"), f"optim.lr={BOMB}")
    assert "override optim.lr: cannot read its value: its aliases expand to more than 10,000 values" in error
    assert not (tmp_path / "run").exists()


def test_the_yaml_merge_key_is_read(tmp_path):
    """`<<` merges a mapping (keys given beside it win); it used to be refused. A key given twice is still
    an error."""
    from free_transformer.base.checks import ConfigError
    from free_transformer.base.settings import read_yaml
    from free_transformer.train.config import load_train_config

    config = tmp_path / "merge.yaml"
    config.write_text("steps: 3\noptim:\n  <<: &adam {lr: 0.001, weight_decay: 0.0}\n  lr: 0.002\n")
    assert read_yaml(config) == {"steps": 3, "optim": {"lr": 0.002, "weight_decay": 0.0}}
    assert load_train_config(config).optim.lr == 0.002
    config.write_text("steps: 3\nsteps: 4\n")
    with pytest.raises(ConfigError, match="duplicate key 'steps'"):
        read_yaml(config)


DEEP = "[" * 200_000 + "]" * 200_000


def test_json_nested_too_deep_is_one_line_in_every_reader(tmp_path, capsys):
    """metrics.jsonl on --resume and inspect (the line is skipped, as a damaged one), config.json on
    generate (the checkpoint is damaged) and on resume (it falls back to the older checkpoint), compare
    and eval --data: each used to end in a RecursionError traceback."""
    from conftest import TINY, rewrite_checksums

    from free_transformer.runs.checkpoint import checkpoint_dirs

    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *TINY, "steps=2", "checkpoint_every=1"]) == 0
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write(DEEP + "\n")
    assert main(["inspect", str(run)]) == 0
    older, newest = checkpoint_dirs(run)
    (newest / "config.json").write_text(DEEP)
    rewrite_checksums(newest)
    error = _one_line_error(capsys, "generate", str(newest), "--prompt", "a", "--max-new-tokens", "2")
    assert f"corrupt checkpoint config {newest / 'config.json'}: nested too deeply" in error
    assert main(["train", "--out", str(run), "--resume", "steps=3"]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged" in err and "nested too deeply" in err and "Traceback" not in err
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    error = _one_line_error(capsys, "compare", str(deep), str(deep))
    assert str(deep) in error and "nested too deeply" in error
    data = tmp_path / "deep.jsonl"
    data.write_text(DEEP + "\n")
    error = _one_line_error(
        capsys, "eval", str(run), "--tasks", "race_high", "--data", f"race_high={data}", "--limit", "1", "--no-progress"
    )
    assert str(data) in error and "nested too deeply" in error


@pytest.mark.parametrize(
    "task,field,answer",
    [
        ("race_high", "answer", "1e999"),
        ("race_high", "answer", "1.5"),
        ("race_high", "answer", "7"),
        ("race_high", "answer", "-1"),
        ("race_high", "answer", '"Z"'),
        ("piqa", "label", "1.5"),
        ("piqa", "label", "2"),
    ],
)
def test_an_answer_that_names_no_choice_is_one_line_naming_the_row(tmp_path, capsys, task, field, answer):
    """`eval --data` rows whose answer is 1e999 (an OverflowError traceback), 1.5 (taken as 1), 7 of two
    choices or -1 (accepted silently, scoring against nothing or the last choice)."""
    row = (
        {"article": "a", "question": "q", "options": ["x", "y"]}
        if task == "race_high"
        else {"goal": "g", "sol1": "x", "sol2": "y"}
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({**row, field: 0}) + "\n" + json.dumps(row)[:-1] + f', "{field}": {answer}}}\n')
    checkpoint = tiny_checkpoint(tmp_path, "ckpt", 0)
    error = _one_line_error(
        capsys,
        "eval",
        str(checkpoint),
        "--tasks",
        task,
        "--data",
        f"{task}={rows}",
        "--num-fewshot",
        "0",
        "--no-progress",
        "--output",
        str(tmp_path / "out.json"),
    )
    assert f"{task}: row 1 of user file {rows}: its answer" in error, error


@pytest.mark.parametrize("key", ["sesame", "clé-ключ-鍵"])
def test_an_api_key_matches_whatever_its_characters(key):
    """`serve --api-key` with a non-ASCII key could never match: the header, read as Latin-1, was
    encoded again as UTF-8 before the comparison."""
    import asyncio

    from free_transformer.serve.app import Guard

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    def status(authorization: bytes) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", authorization)]}
        asyncio.run(Guard(app, key, 2**20)(scope, receive, send))
        return sent[0]["status"]

    assert status(b"Bearer " + key.encode()) == 200
    assert status(b"Bearer " + key.encode()[:-1]) == 401 and status(b"Basic " + key.encode()) == 401


@pytest.mark.parametrize("target", ["hf", "checkpoint"])
def test_convert_refuses_a_tokenizer_name_that_generate_would_refuse(tmp_path, capsys, target):
    """A checkpoint (or an HF export) recording tokenizer 'nosuch' converted silently; `generate` then
    refused the result."""
    from conftest import rewrite_checksums

    run = tiny_checkpoint(tmp_path, "run", 0)
    checkpoint = next((run / "checkpoints").iterdir())
    source = run
    if target == "checkpoint":  # from an HF export whose config names the tokenizer
        assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
        config_file, key, source = tmp_path / "hf" / "config.json", "tokenizer_name", tmp_path / "hf"
    else:
        config_file, key = checkpoint / "config.json", "tokenizer"
    config = json.loads(config_file.read_text())
    config[key] = "nosuch"
    config_file.write_text(json.dumps(config))
    rewrite_checksums(checkpoint)
    capsys.readouterr()
    error = _one_line_error(capsys, "convert", str(source), str(tmp_path / "out"), "--to", target)
    assert f"{source}: the model's tokenizer: unknown tokenizer 'nosuch'" in error, error
    assert not (tmp_path / "out").exists()


def test_a_number_too_long_to_read_in_metrics_is_one_line_naming_the_file(tmp_path, capsys):
    """A 5,000-digit integer in metrics.jsonl blocked `--resume` and `inspect` with Python's
    "Exceeds the limit (4300 digits)", naming no file."""
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *TINY, "steps=1"]) == 0
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 1, "loss": ' + "9" * 5000 + "}\n")
    capsys.readouterr()
    for argv in (["train", "--out", str(run), "--resume", "steps=2"], ["inspect", str(run)]):
        assert main(argv) == 2
        error = capsys.readouterr().err.strip()
        assert "Traceback" not in error and error.splitlines()[-1].startswith(
            f"error: {metrics} line 2 holds a line this package did not write (a number too long to read"
        ), error

"""A latent kind from outside the package, with a setting of its own, through the command line: trained with
its setting set, resumed, converted to Hugging Face and loaded back, the setting carried the whole way
(config.yaml, the checkpoints, the HF config). The kind is docs/latent-variants.md's ternary kind, saved as the
reader saves it (one file, `ternary_kind.py`) and imported by each command through FREE_TRANSFORMER_PLUGINS: each
command is a process of its own (forked from one that imported torch, tests/command_server.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from documented_kind import MODULE, documented_kind_source, import_documented_kind

from free_transformer.runs.checkpoint import checkpoint_dirs, load_model

SRC = Path(__file__).parents[1] / "src"
TRAIN = ["model.size=debug", "model.latent.kind=ternary", "batch_size=4", "checkpoint_every=2", "progress=false"]


SERVER = Path(__file__).parent / "command_server.py"


@pytest.fixture(scope="module")
def command_socket(tmp_path_factory):
    """command_server.py's socket: each command a process forked from one that imported torch and the package
    (not the plugin: a command imports it as a new process does, from its environment)."""
    path = tmp_path_factory.mktemp("commands") / "cli.sock"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen([sys.executable, str(SERVER), str(path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        yield path
    finally:
        server.kill()
        server.wait()


@pytest.fixture
def cli(command_socket):
    def run(*args: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
        client = [sys.executable, "-S", str(SERVER), "--client", str(command_socket), *args]
        return subprocess.run(client, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)

    return run


@pytest.fixture
def plugin_env(tmp_path) -> dict:
    """A process environment whose commands import ternary_kind.py, a file beside the run, not in the package."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / f"{MODULE}.py").write_text(documented_kind_source())
    path = os.pathsep.join([str(tmp_path / "plugins"), str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "FREE_TRANSFORMER_PLUGINS": MODULE, "OMP_NUM_THREADS": "1"}


def test_a_plugin_kind_with_a_setting_trains_resumes_converts_and_loads(tmp_path, plugin_env, cli):
    run, hf = tmp_path / "run", tmp_path / "hf"
    shown = cli("train", "model.latent.kind=ternary", "--help", env=plugin_env, cwd=tmp_path)
    assert shown.returncode == 0 and "model.latent.ternary.temperature=1.0  (float)" in shown.stdout, shown.stderr
    setting = "model.latent.ternary.temperature=0.5"
    trained = cli("train", "--out", str(run), *TRAIN, setting, "steps=2", env=plugin_env, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    latent = {
        "kind": "ternary",
        "encoder_layers": 1,
        "policy": False,
        "ternary": {"temperature": 0.5},
    }  # the chosen kind's only
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["latent"] == latent
    resumed = cli("train", "--out", str(run), "--resume", "steps=4", env=plugin_env, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert [path.name for path in checkpoint_dirs(run)] == ["step_00000002", "step_00000004"]
    saved = json.loads((checkpoint_dirs(run)[-1] / "config.json").read_text())
    assert saved["model"]["latent"] == latent and saved["train"]["model"]["latent"] == latent
    converted = cli("convert", str(run), str(hf), "--to", "hf", env=plugin_env, cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr
    hf_config = json.loads((hf / "config.json").read_text())
    assert hf_config["latent_kind"] == "ternary" and hf_config["latent_settings"] == {"temperature": 0.5}

    import_documented_kind()  # this process imports the plugin, as a Python user does
    pytest.importorskip("transformers")
    from free_transformer.hf.modeling import FreeTransformerForCausalLM

    model, _ = load_model(run)
    exported = FreeTransformerForCausalLM.from_pretrained(hf, local_files_only=True).eval()
    for loaded in (model, exported.model):
        assert loaded.config.latent.settings.temperature == 0.5 and loaded.latent_space.settings.temperature == 0.5
    tokens = torch.tensor([[75, 62, 65, 66, 67, 10]])
    z = torch.tensor([[[-1, 0, 1, -1]] * 6])  # (1, T, H): -1 is one of the kind's values
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens, latents=z).logits, model.eval()(tokens, latents=z).logits)


def test_without_the_plugin_its_run_is_one_line(tmp_path, plugin_env, cli):
    run = tmp_path / "run"
    assert cli("train", "--out", str(run), *TRAIN, "steps=2", env=plugin_env, cwd=tmp_path).returncode == 0
    without = {**plugin_env, "FREE_TRANSFORMER_PLUGINS": ""}
    for args in (["train", "--out", str(run), "--resume", "steps=4"], ["inspect", str(run)]):
        refused = cli(*args, env=without, cwd=tmp_path)
        assert refused.returncode == 2 and "unknown latent kind 'ternary'" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    exits = cli(
        "info",
        env={**plugin_env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{SRC}", "FREE_TRANSFORMER_PLUGINS": "exits"},
        cwd=tmp_path,
    )
    assert exits.returncode == 2 and exits.stderr.strip() == (
        "error: FREE_TRANSFORMER_PLUGINS: cannot import exits: it called sys.exit(0)"
    ), exits.stderr  # it was exit 0, silently, for every command
    missing = cli("train", "--help", env={**plugin_env, "FREE_TRANSFORMER_PLUGINS": "no_such_kinds"}, cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        "error: FREE_TRANSFORMER_PLUGINS: cannot import no_such_kinds: ModuleNotFoundError: No module named "
        "'no_such_kinds'"
    )

"""The command line's errors are quick and say what to type: a mistyped setting is refused in one line before
torch is imported (checked by what a fresh interpreter imported, not by a timing: bench/cli_errors.py times
it), a setting written as an option and an option renamed since 0.3 are answered with the spelling to use,
and the latent kind's help lists the kinds."""

import subprocess
import sys

import pytest

from free_transformer.cli import main

MISTYPED = [
    ["train", "stepz=5"],
    ["train", "--out", "run", "steps=abc"],
    ["train", "--out", "run", "optim.lr=-1"],
    ["train", "--out", "run", "steps=0"],
    ["demo", "--out", "out", "stepz=5"],
    ["demo", "--out", "out", "optim.schedule=linear"],
    ["study", "--out", "out", "model.x=1"],
    ["generate", "ckpt", "--prompt", "a", "--temperature", "-1"],
    ["eval", "ckpt", "--tasks", "nope"],
]


@pytest.mark.parametrize("argv", MISTYPED, ids=[" ".join(argv) for argv in MISTYPED])
def test_a_mistyped_setting_is_one_line_before_torch_is_imported(argv, tmp_path):
    script = (
        f"import sys\nfrom free_transformer.cli import main\ncode = main({argv!r})\nprint(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "False"], f"{' '.join(argv)}: {done.stdout} {done.stderr}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr


@pytest.mark.parametrize(
    "where, prompt, said",
    [
        ("no-such-run", "K>", "no checkpoint found at no-such-run"),
        ("empty-run", "K>", "no checkpoint found at empty-run"),
        ("run", "K" * 65, "the prompt has 65 tokens; this model reads at most 64"),
    ],
    ids=["a missing run directory", "a run without a checkpoint", "a prompt past the context"],
)
def test_generate_refuses_a_missing_run_or_checkpoint_and_a_long_prompt_before_torch_is_imported(
    where, prompt, said, tmp_path
):
    """The run's saved config.json gives the context and the tokenizer: no model is loaded to find out."""
    from conftest import tiny_checkpoint

    tiny_checkpoint(tmp_path, "run", 4)  # max_seq_len 64, byte tokens
    (tmp_path / "empty-run").mkdir()
    argv = ["generate", where, "--prompt", prompt]
    script = (
        f"import sys\nfrom free_transformer.cli import main\ncode = main({argv!r})\nprint(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "False"], f"{' '.join(argv)}: {done.stdout} {done.stderr}"
    assert done.stderr.startswith(f"error: {said}") and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["train", "--optim.lr=3e-4"], "optim.lr=3e-4"),
        (["train", "steps=3", "--optim.lr", "3e-4"], "optim.lr=3e-4"),
        (["demo", "--out", "x", "--model.latent.kind=gaussian"], "model.latent.kind=gaussian"),
    ],
)
def test_a_setting_written_as_an_option_gets_its_spelling(argv, hint, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: unrecognized argument --") and error.endswith(f": {hint}")


def test_an_unknown_option_of_a_command_without_settings_stays_argparse_s(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "ckpt", "--optim.lr=1"])
    assert "unrecognized arguments: --optim.lr=1" in capsys.readouterr().err


@pytest.mark.parametrize("word", ["--latent-bits", "--latent-bits=4"])
def test_convert_refuses_latent_bits_with_its_new_name(word, capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        main(
            [
                "convert",
                str(tmp_path),
                str(tmp_path / "out"),
                "--to",
                "checkpoint",
                word,
                *(["4"] if "=" not in word else []),
            ]
        )
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "error: --latent-bits is --latent-units since 0.4\n"
    assert not (tmp_path / "out").exists()


def test_the_latent_kind_s_help_lists_the_registered_kinds():
    """`train model.latent.kind=NAME --help` lists the registry's kinds as the setting's choices; the plain help
    (torch-free) says how to ask for them."""
    from free_transformer.model.latent import LATENT_KINDS
    from free_transformer.train.config import settings_help

    choices = f"model.latent.kind=binary_mapper  ({' | '.join(sorted(LATENT_KINDS))})"
    assert choices in settings_help("binary_mapper")
    assert "model.latent.kind=NAME --help" in settings_help()

"""`free-transformer serve`'s options are ServeConfig's fields (serve/config.py): one flag each, with the
field's docstring as help and its closed set as choices, the defaults unchanged, and a value the server
cannot start with refused in one line, exit 2, before the checkpoint is read. Needs no server library."""

import dataclasses
import typing

import pytest

from free_transformer.base.checks import ConfigError
from free_transformer.base.devices import DTYPE_NAMES
from free_transformer.base.latent_choice import ROW_CHOICES
from free_transformer.base.settings import field_docs
from free_transformer.cli import build_parser, main
from free_transformer.commands.serve import API_KEY_VARIABLE, serve_config
from free_transformer.serve.config import ServeConfig

# the flags as docs/serving.md and scripts write them: a field renamed must not rename its flag unnoticed
FLAGS = {
    "host": "--host",
    "port": "--port",
    "device": "--device",
    "dtype": "--dtype",
    "model_name": "--model-name",
    "api_key": "--api-key",
    "max_batch": "--max-batch",
    "latents": "--latents",
    "max_request_mb": "--max-request-mb",
    "chat_queue": "--chat-queue",
    "compile": "--compile",
}


def serve_parser():
    return build_parser(["serve"])._subparsers._group_actions[0].choices["serve"]


def test_each_setting_is_one_flag_with_its_docstring_as_help(capsys):
    actions = serve_parser()._actions
    assert {action.dest for action in actions} == {"help", "checkpoint", *FLAGS}  # no option besides them
    assert sorted(item.name for item in dataclasses.fields(ServeConfig)) == sorted(FLAGS)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for name, flag in FLAGS.items():
        (action,) = [action for action in actions if action.dest == name]
        assert action.option_strings == [flag]
        first_words = " ".join(field_docs(ServeConfig)[name].split()[:5])
        assert action.help.startswith(first_words) and first_words in shown, name
    assert f"(default: the environment variable {API_KEY_VARIABLE})" in shown  # what the command resolves
    assert "(default: the name of the directory given)" in shown


def test_the_closed_sets_are_the_dtypes_and_the_rows_latents():
    hints = typing.get_type_hints(ServeConfig)
    assert typing.get_args(hints["dtype"]) == ("auto", *DTYPE_NAMES)
    assert typing.get_args(hints["latents"]) == ROW_CHOICES  # a context's Z, or the run's policy head
    choices = {action.dest: action.choices for action in serve_parser()._actions}
    assert choices["dtype"] == ["auto", *DTYPE_NAMES] and choices["latents"] == list(ROW_CHOICES)
    with pytest.raises(ConfigError, match="^dtype must be one of auto, "):  # a value code set, checked too
        ServeConfig(dtype="fp16").check()
    assert choices["compile"] == ["auto", "on", "off"]


def test_the_server_compiles_its_step_on_cuda_unless_told():
    assert ServeConfig().compiles("cuda") and not ServeConfig().compiles("cpu")
    assert ServeConfig(compile="on").compiles("cpu") and not ServeConfig(compile="off").compiles("cuda")


def test_the_options_left_out_are_the_servers_defaults():
    config = serve_config(serve_parser().parse_args(["run"]))
    assert (
        config
        == ServeConfig()
        == ServeConfig(
            host="127.0.0.1",
            port=8000,
            device="auto",
            dtype="auto",
            model_name=None,
            api_key=None,
            max_batch=16,
            latents="encoder",
            max_request_mb=16,
            chat_queue=32,
            compile="auto",
        )
    )
    assert config.max_request_bytes == 16 * 2**20


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--port", "70000", "--port must be in [0, 65535], got 70000"),
        ("--port", "-1", "--port must be in [0, 65535], got -1"),
        ("--max-batch", "0", "--max-batch must be >= 1, got 0"),
        ("--max-request-mb", "0", "--max-request-mb must be > 0 MiB, got 0.0"),
        ("--max-request-mb", "inf", "--max-request-mb must be > 0 MiB, got inf"),
        ("--chat-queue", "-1", "--chat-queue must be >= 0, got -1"),
    ],
)
def test_a_value_the_server_cannot_start_with_is_one_line_and_exit_2(tmp_path, capsys, option, value, message):
    assert main(["serve", str(tmp_path / "not-read"), option, value]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"

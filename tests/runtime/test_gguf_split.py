"""A GGUF split into parts (NAME-00001-of-0000N.gguf, as llama.cpp's gguf-split and the Hub's large
GGUF repositories publish them) loads as the one file it was cut from: the builtin SmolLM2 file,
split here with gguf-py's writer (the one `convert_hf_to_gguf.py --split-max-tensors` uses)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest
import torch

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.load.gguf_reader import GGUFFile, gguf_models
from kvpilot.runtime.load.loader import load_model, resolve_model_path


def split_copy(source: Path, dest: Path, max_tensors: int, small_first_shard: bool = False) -> list[Path]:
    """`source` rewritten as parts of at most `max_tensors` tensors each (and, with small_first_shard,
    a first part with the metadata only, as `gguf-split --no-tensor-first-split` writes): the same
    metadata with its types and the same tensor bytes. Returns the parts in order."""
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(
        str(dest), arch, split_max_tensors=max_tensors, small_first_shard=small_first_shard
    )
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer's own (version, counts) and the one it was built with
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(dest.parent.glob(f"{dest.stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def parts(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("split")
    out = split_copy(
        smollm2_gguf_path, folder / "SmolLM2-135M-Instruct-Q4_1.gguf", 100, small_first_shard=True
    )
    assert [p.name for p in out] == [
        f"SmolLM2-135M-Instruct-Q4_1-0000{i}-of-00004.gguf" for i in (1, 2, 3, 4)
    ]
    return out


def test_any_part_opens_the_whole_model_with_the_same_bytes(
    smollm2_gguf_path: Path, parts: list[Path]
) -> None:
    with GGUFFile(smollm2_gguf_path) as whole:
        for part in (parts[0], parts[2]):
            with GGUFFile(part) as split:
                assert split.paths == parts
                assert list(split.tensors) == list(whole.tensors)
                assert {split.tensors[n].part for n in split.tensors} == {1, 2, 3}  # the first: metadata only
                keys = {k for k in whole.metadata if not k.startswith("split.")}
                assert {k: split.metadata[k] for k in keys} == {k: whole.metadata[k] for k in keys}
                for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
                    assert split.tensors[name].shape == whole.tensors[name].shape
                    assert bytes(split.raw(name)) == bytes(whole.raw(name))


def test_a_split_model_loads_as_the_file_it_was_cut_from(smollm2_gguf_path: Path, parts: list[Path]) -> None:
    """Every weight of the built model, and the tokenizer, equal; the folder of parts resolves to its
    first (the hf://ORG/NAME:QUANT download of a split quantization is such a folder)."""
    assert resolve_model_path(parts[0].parent) == parts[0]
    cpu = torch.device("cpu")
    whole = load_model(EngineConfig(model=str(smollm2_gguf_path)), cpu, torch.float32)
    split = load_model(EngineConfig(model=str(parts[1])), cpu, torch.float32)
    a, b = whole.model.state_dict(), split.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    text = "The parts of a split model, read together."
    assert split.tokenizer.encode(text) == whole.tokenizer.encode(text)


def test_a_missing_or_misnamed_part_is_an_error_naming_it(parts: list[Path], tmp_path: Path) -> None:
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / parts[2].name).unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"split into 4 parts; missing SmolLM2-135M-Instruct-Q4_1-00003-of-00004\.gguf",
    ):
        GGUFFile(tmp_path / parts[0].name)
    # a part renamed out of the pattern: its keys say what it is
    lone = tmp_path / "renamed.gguf"
    shutil.copy(parts[1], lone)
    with pytest.raises(ValueError, match=r"part 2 of a model split into 4 parts, named without"):
        GGUFFile(lone)
    # parts swapped: the names and the keys disagree
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for i, p in enumerate(parts):
        target = parts[{1: 2, 2: 1}.get(i, i)].name
        shutil.copy(p, swapped / target)
    with pytest.raises(ValueError, match=r"its split keys say part 3 of 4; its name, part 2 of 4"):
        GGUFFile(swapped / parts[0].name)


def test_a_folder_of_several_models_names_them_counting_parts_once(parts: list[Path], tmp_path: Path) -> None:
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    shutil.copy(parts[1], tmp_path / "Other-Q8_0.gguf")
    assert [len(m) for m in gguf_models(sorted(tmp_path.glob("*.gguf")))] == [1, 4]
    with pytest.raises(
        ValueError,
        match=r"2 \.gguf models \(Other-Q8_0\.gguf, SmolLM2-135M-Instruct-Q4_1-00001-of-00004\.gguf \(and 3 more parts\)\)",
    ):
        resolve_model_path(tmp_path)

"""`keybatch model build`: a quick build is an ordinary Hugging Face folder, built the same way twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from control.cli.main import main
from tasks.lm.fim import END_OF_TEXT, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, PAD, format_prompt
from tasks.lm.train import corpus
from tasks.lm.train.build import BuildError, build
from tests.support.lm_fixtures import QUICK_SEED, QUICK_STEPS, quick_model  # noqa: F401


def test_a_quick_build_loads_offline_as_an_ordinary_model(quick_model: Path) -> None:  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(quick_model, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(quick_model, local_files_only=True)
    facts = json.loads((quick_model / "keybatch.json").read_text())

    assert model.config.model_type == "llama"
    assert model.config.max_position_embeddings == 1024
    assert model.config.vocab_size == len(tokenizer)
    assert 2e6 <= facts["params"] == model.num_parameters() <= 4.5e6
    assert facts["steps"] == QUICK_STEPS and facts["seed"] == QUICK_SEED
    assert (quick_model / "model.safetensors").exists()
    assert sorted(p.name for p in quick_model.parent.iterdir()) == [".tokenizer", "kb-small"]  # no half-built left


def test_the_tokenizer_round_trips_code_and_keeps_the_fim_specials_whole(quick_model: Path) -> None:  # noqa: F811
    tokenizer = AutoTokenizer.from_pretrained(quick_model)
    code = corpus.held_out_files()[0].text + "\n\tx = 'é ✓'  \r\n    return  None\n"
    ids = tokenizer(code, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == code

    assert (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token) == (END_OF_TEXT, END_OF_TEXT, PAD)
    specials = [END_OF_TEXT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, PAD]
    assert all(len(tokenizer(s, add_special_tokens=False)["input_ids"]) == 1 for s in specials)
    tokens = tokenizer.tokenize(format_prompt("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"))
    assert [t for t in tokens if t in specials] == [FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE]
    assert tokens[0] == FIM_PREFIX and tokens[-1] == FIM_MIDDLE


def test_the_same_seed_gives_the_same_weights_and_another_seed_others(quick_model: Path, tmp_path: Path) -> None:  # noqa: F811
    again = build(tmp_path / "a", "kb-small", steps=QUICK_STEPS, seed=QUICK_SEED, progress=False)
    other = build(tmp_path / "a", "other-small", steps=QUICK_STEPS, seed=QUICK_SEED + 1, progress=False)

    first, second, third = (load_file(folder / "model.safetensors") for folder in (quick_model, again, other))
    assert first.keys() == second.keys() == third.keys()
    assert all((first[k] == second[k]).all() for k in first)
    assert not all((first[k] == third[k]).all() for k in first)
    assert (quick_model / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()


def test_a_name_without_a_size_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BuildError, match="-small"):
        build(tmp_path, "kb-medium", steps=1, progress=False)
    monkeypatch.setenv("KEYBATCH_MODELS_DIR", str(tmp_path))
    assert main(["model", "build", "--name", "kb", "--steps", "1"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_the_cli_does_not_import_torch() -> None:
    code = "import sys, control.cli.main, control.cli.models; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0

"""`pipetune export --gguf`: the file is read as other tools read it (transformers' GGUF loader, pipetune's own GGUF
intake, a chat template renderer, Ollama's template), and equals the merged model within its type's rounding."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from pipetune.cli import main
from pipetune.config import ConfigError, save_config
from pipetune.data.synthetic_splits import synthetic_splits
from pipetune.export import export_run
from pipetune.export_gguf import bpe_tokenizer, gguf_file_name, llama3_rope_factors, write_gguf
from pipetune.generate import inference_config
from pipetune.model.load import build_model
from pipetune.preflight import prepare
from tests.conftest import tiny_config
from tests.data.test_prompt import QWEN3_LIKE
from tests.test_export import leftovers, make_run

MEETING = "Anna: the budget is 2024 euros.\n\nBert:  we ship in May, <|im_end|> not before.\nAnna: agreed."


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is faster than two on a loaded machine (generation here: 0.2 s against 6 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf-run") / "run"
    return make_run(out, tiny_config(out, "train.seed=7", "lora.target_modules=['q_proj','v_proj','down_proj']"))


@pytest.fixture(scope="module")
def exported(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf-export") / "export"
    assert main(["export", "--run", str(run), "--out", str(out), "--merge", "--gguf"]) == 0
    return out


def file_metadata(path: Path) -> dict:
    """The GGUF file's scalar and string metadata (arrays left out), read by pipetune's checked header reader."""
    from pipetune.model.gguf import read_header

    return {key: value for key, value in read_header(path).metadata.items() if isinstance(value, (int, float, str))}


def load_gguf(path: Path, model_type_head_dim: bool = True):
    """transformers' GGUF loader. Its qwen3 reading takes no head size from the file (it assumes Qwen3's 128):
    the tiny model's 64 is given from the file's own attention.key_length."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    key_length = file_metadata(path).get(f"{config.model_type}.attention.key_length")
    if model_type_head_dim and key_length is not None:
        config.head_dim = key_length
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config).eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def test_the_gguf_is_the_merged_model_for_transformers_and_pipetunes_intake(run: Path, exported: Path) -> None:
    """f16 logits within 1e-2 of the merged safetensors model's, the same 32 greedy tokens, read by transformers'
    GGUF loader and by pipetune's GGUF intake (model.name = the file), whose tokenizer builds the training prompt."""
    from transformers import AutoModelForCausalLM

    path = exported / gguf_file_name("f16")
    merged = AutoModelForCausalLM.from_pretrained(exported / "merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(exported / "base", dtype=torch.float32).eval()
    trained = prepare(inference_config(run / "adapter").config)
    meetings = [MEETING, "Anna: ok.", synthetic_splits(seed=3, n_train=1, n_validation=1)["validation"][0].transcript]
    prompts = [torch.tensor([trained.prompts.prompt_ids(text)]) for text in meetings]
    intake = tiny_config(run.parent / "intake", f'model.name="{path}"', 'model.init="pretrained"')
    read_back = prepare(intake)
    intake_model, _ = build_model(read_back.model, torch.float32, torch.device("cpu"), seed=0)
    transformers_model = load_gguf(path)
    greedy = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        for text, ids in zip(meetings, prompts, strict=True):
            assert read_back.prompts.prompt_ids(text) == ids[0].tolist()  # the intake's tokenizer: the same prompt
            want = merged(input_ids=ids).logits
            assert relative_error(base(input_ids=ids).logits, want) > 0.05  # the adapter is in the merged model
            for model in (transformers_model, intake_model):
                assert relative_error(model(input_ids=ids).logits, want) < 1e-2
            expected = merged.generate(input_ids=ids, **greedy)
            assert torch.equal(transformers_model.generate(input_ids=ids, **greedy), expected)
    metadata = file_metadata(path)
    settings = json.loads((exported / "prompt.json").read_text())
    assert metadata["tokenizer.ggml.eos_token_id"] == settings["stop_ids"][0] == 2  # the demo's <|im_end|>
    assert (metadata["general.architecture"], metadata["general.file_type"]) == ("qwen3", 1)
    assert "`model-f16.gguf` is the base with the adapter merged in (f16)" in (exported / "README.md").read_text()


def test_the_files_chat_template_and_the_modelfile_render_the_training_prompt(run: Path, exported: Path) -> None:
    """The template in the file, rendered by a chat front end around (system prompt, transcript), and the
    Modelfile's Go template filled as Ollama fills it, are the training prompt token for token."""
    config = inference_config(run / "adapter").config
    trained = prepare(config)
    tokenizer = trained.tokenizer
    template = file_metadata(exported / gguf_file_name("f16"))["tokenizer.chat_template"]
    messages = [{"role": "system", "content": config.data.system_prompt}, {"role": "user", "content": "Anna: ok."}]
    rendered = tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.encode(rendered, add_special_tokens=False) == trained.prompts.prompt_ids("Anna: ok.")

    modelfile = (exported / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model-f16.gguf\n") and 'PARAMETER stop "<|im_end|>"\n' in modelfile
    go_template = re.search(r'TEMPLATE """(.*?)"""', modelfile, re.S).group(1)
    system = re.search(r'SYSTEM """(.*?)"""', modelfile, re.S).group(1)
    assert system == config.data.system_prompt
    filled = go_template.replace("{{ .System }}", system).replace("{{ .Prompt }}", "Anna: ok.")
    assert filled == rendered and "{{" not in filled
    assert f"PARAMETER num_predict {config.data.max_summary_tokens}\n" in modelfile


def test_a_qwen3_template_is_written_with_thinking_off(run: Path, tmp_path: Path) -> None:
    """Qwen3's template renders an empty thinking block only with enable_thinking = false, as training did; the
    file's template renders it whatever a front end passes (llama.cpp's default is thinking on)."""
    from pipetune.export_gguf import file_chat_template, modelfile

    tokenizer = copy.deepcopy(prepare(inference_config(run / "adapter").config).tokenizer)
    tokenizer.chat_template = QWEN3_LIKE
    template = file_chat_template(tokenizer)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "T"}]
    for thinking in ({}, {"enable_thinking": True}):
        rendered = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False, **thinking
        )
        assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    settings = {"stop_ids": [2], "max_summary_tokens": 8, "max_length": 64}
    assert 'assistant\n<think>\n\n</think>\n\n"""' in modelfile("m.gguf", tokenizer, settings, "S")


def test_every_type_reads_back_within_its_rounding(run: Path, tmp_path: Path) -> None:
    """f32 is exact; bf16 and q8_0 round (q8_0 blocks of 32 values with one scale)."""
    from transformers import AutoModelForCausalLM

    config = inference_config(run / "adapter").config
    prepared = prepare(config)
    model = AutoModelForCausalLM.from_config(prepared.model.config).eval()  # random weights: the writer alone
    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(1))
    settings = {"stop_ids": [2]}
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for gguf_type, bound in (("f32", 1e-6), ("bf16", 3e-2), ("q8_0", 8e-2)):
            path = tmp_path / gguf_file_name(gguf_type)
            write_gguf(path, model, prepared.tokenizer, settings, gguf_type, "t")
            assert relative_error(load_gguf(path)(input_ids=ids).logits, want) < bound, gguf_type


FAMILIES = {
    "llama": dict(model_type="llama", tie_word_embeddings=False, attention_bias=False),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
}
"""Tiny random bases of the families whose GGUF layout differs from Qwen3's: Llama's permuted q/k rows and its
own output layer, Mistral (written as llama.cpp writes it, a Llama), Qwen2's q/k/v biases."""


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_reads_back_as_itself(family: str, run: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = prepare(inference_config(run / "adapter").config).tokenizer
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = AutoConfig.for_model(**FAMILIES[family], **shape, num_key_value_heads=2, vocab_size=2048)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # biases and norms away from their 0 and 1, so a lost one shows
            param.normal_(0, 0.2)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tokenizer, {"stop_ids": [2]}, "f32", "t")
    read = load_gguf(path)
    # llama.cpp has no Mistral architecture: its files are "llama" ones, which compute the same (no sliding window)
    assert read.config.model_type == ("llama" if family == "mistral" else family)
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(read(input_ids=ids).logits, model(input_ids=ids).logits)


def test_llama3_rope_factors_are_transformers_frequencies() -> None:
    """Llama 3.1's rope scaling goes into the file as llama.cpp reads it: factors that divide the base frequencies
    into the scaled ones transformers computes."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(
        rope_type="llama3",
        rope_theta=500_000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (500_000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    factors = torch.from_numpy(llama3_rope_factors(rope, 64))
    assert factors.max() == 32.0 and factors.min() == 1.0
    torch.testing.assert_close(base / factors, scaled, rtol=1e-5, atol=0)


def test_smollm2s_template_renders_the_training_prompt_from_the_file(smollm2: Path, tmp_path: Path) -> None:
    """SmolLM2's real tokenizer and chat template, written with a small Llama-shaped model: the file names its
    pre-tokenizer "smollm" (the digit split pipetune's GGUF intake restores), carries its whole vocabulary, and its
    template renders the training prompt token for token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipetune.model.gguf import read_header

    trained = prepare(tiny_config(tmp_path / "x", 'model.name="smollm2-135m"', 'model.init="pretrained"'))
    tokenizer, prompts = trained.tokenizer, trained.prompts
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = AutoConfig.for_model("llama", **shape, vocab_size=len(tokenizer), tie_word_embeddings=True)
    path = tmp_path / "m.gguf"
    write_gguf(path, AutoModelForCausalLM.from_config(config), tokenizer, {"stop_ids": prompts.end_ids}, "f16", "t")
    header = read_header(path)
    assert header.metadata["tokenizer.ggml.tokens"].length == len(tokenizer) == 49152
    metadata = file_metadata(path)
    assert metadata["tokenizer.ggml.pre"] == "smollm" and metadata["tokenizer.ggml.eos_token_id"] == prompts.end_ids[0]
    # a front end renders the transcript into the prompt's text: control-token text in it would become the control
    # token, where pipetune encodes it as data (the docs say so); this transcript has none
    transcript = MEETING.replace("<|im_end|>", "")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": transcript}]
    rendered = tokenizer.apply_chat_template(
        messages, chat_template=metadata["tokenizer.chat_template"], add_generation_prompt=True, tokenize=False
    )
    prompt = prompts.head_for("Be brief.") + prompts.encode_text(transcript) + prompts.middle_ids
    assert tokenizer.encode(rendered, add_special_tokens=False) == prompt


def test_gguf_bad_input_is_one_line_and_writes_nothing(run: Path, tmp_path: Path, capsys) -> None:
    """A quantized base, a family without a GGUF writer, an unknown type, an --out that exists: one line each,
    exit code 2, nothing written; a failure while writing leaves no directory."""
    quantized = make_run(tmp_path / "fp8", tiny_config(tmp_path / "fp8", "lora.target_modules=['q_proj']"))
    config = inference_config(quantized / "adapter").config
    config.model.quantize = "fp8"
    save_config(config, quantized / "config.toml")
    gemma = tiny_config(tmp_path / "gemma", 'model.name="tiny-gemma3"', "lora.target_modules=['q_proj']")
    gemma_run = make_run(tmp_path / "gemma", gemma)
    (tmp_path / "taken").write_text("")
    outs = tmp_path / "outs"
    outs.mkdir()
    for run_dir, args, message in (
        (quantized, ["--gguf"], "--gguf: the run trained on a base quantized as model.quantize = 'fp8', and a GGUF"),
        (gemma_run, ["--gguf", "q8_0"], "--gguf: the run's base is a Gemma 3 model (gemma3_text), which pipetune"),
        (run, ["--gguf", "q4_0"], "--gguf 'q4_0' is not a type pipetune writes; choose one of f32, f16, bf16, q8_0"),
    ):
        assert main(["export", "--run", str(run_dir), "--out", str(outs / "out"), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert leftovers(outs) == []
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "taken"), "--gguf"]) == 2
    assert "exists and is not an empty directory; choose a new directory" in capsys.readouterr().err

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pipetune.export_gguf.modelfile", broken)  # after the GGUF file is written
        with pytest.raises(OSError, match="No space left"):
            export_run(run, outs / "out", gguf_type="f16")
    assert leftovers(outs) == []
    byte_fallback = copy.deepcopy(prepare(config_without_quantize(quantized)).tokenizer)  # as Mistral v0.3's
    spec = json.loads(byte_fallback.backend_tokenizer.to_str())
    spec["model"]["byte_fallback"] = True
    byte_fallback._tokenizer = Tokenizer.from_str(json.dumps(spec))
    with pytest.raises(ConfigError, match="is a BPE byte-fallback model; pipetune writes byte-level BPE tokenizers"):
        bpe_tokenizer(byte_fallback)
    spec["model"]["byte_fallback"] = False
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    byte_fallback._tokenizer = Tokenizer.from_str(json.dumps(spec))
    with pytest.raises(
        ConfigError, match=r"splits text by a rule llama.cpp has no name for \(\{\"type\": \"Whitespace"
    ):
        bpe_tokenizer(byte_fallback)


def config_without_quantize(run_dir: Path):
    config = inference_config(run_dir / "adapter").config
    config.model.quantize = "none"
    return config

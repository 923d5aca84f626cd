"""Config: TOML round trip, --set overrides, and every validation error named with its fix."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from pipetune.cli import demo_config, main
from pipetune.config import (
    Config,
    ConfigError,
    apply_override,
    from_dict,
    load_config,
    save_config,
    shipped_configs,
    validate,
)
from pipetune.preflight import preflight
from tests.conftest import REPO, tiny_config, write_config


def test_toml_round_trip_keeps_every_value(tmp_path: Path) -> None:
    """What a run saves (config.toml, read by every worker, summarize, eval and export) and `config show` prints
    load back as the same config: a multi-line string with control characters too, a float with an int default."""
    from pipetune.config_docs import annotated_toml

    config = tiny_config(
        tmp_path / "run", "parallel.layers_per_stage=[3, 1]", 'lora.target_modules=["q_proj"]', "lora.alpha=16.5"
    )
    config.data.system_prompt = 'You summarize.\n\tBe "brief", C:\\notes\r\n\x00\x1b\x7f\u00e9 \u2603 \U0001f600\n'
    save_config(config, tmp_path / "c.toml")
    assert load_config(tmp_path / "c.toml") == config
    assert from_dict(tomllib.loads(annotated_toml(config))) == config


def test_set_overrides_parse_toml_values() -> None:
    config = Config()
    apply_override(config, "train.lr=1e-3")
    apply_override(config, "model.name=Qwen/Qwen3-8B")  # bare strings need no quotes
    apply_override(config, 'lora.target_modules=["q_proj","v_proj"]')
    apply_override(config, "output.dir=2024-01-01")  # a string key takes text that TOML reads as a date, as written
    apply_override(config, "data.source=123")
    apply_override(config, "lora.alpha=64")
    assert config.train.lr == 1e-3 and isinstance(config.train.lr, float)
    assert config.model.name == "Qwen/Qwen3-8B"
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert (config.output.dir, config.data.source) == ("2024-01-01", "123")
    assert config.lora.alpha == 64.0 and isinstance(config.lora.alpha, float)
    assert from_dict({"lora": {"alpha": 16.5}}).lora.alpha == 16.5


def test_every_default_has_its_annotated_type() -> None:
    """A key takes the values of its annotation, not only its default's type (`alpha: float = 32` took no 16.5)."""
    import dataclasses
    import typing

    for section in dataclasses.fields(Config):
        values = section.default_factory()
        hints = typing.get_type_hints(type(values))
        for key in dataclasses.fields(values):
            hint = typing.get_args(hints[key.name])[0] if key.metadata.get("also") else hints[key.name]
            expected = typing.get_origin(hint) or hint
            value = getattr(values, key.name)
            named = value in key.metadata.get("also", ())  # "auto": a speed switch's default
            assert type(value) is expected or named, f"{section.name}.{key.name}"


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.nonsense=1", "unknown key train.nonsense"),
        ("nosection.key=1", "unknown section"),
        ("train.batch_size=two", "expected int"),
        ("train.lr", "section.key=value"),
        ("train.lrr=1e-4", r"unknown key train.lrr \(did you mean train.lr\?\); keys of \[train\] are: epochs"),
        ("trian.lr=1e-4", r"unknown section 'trian' \(did you mean --set train.lr=1e-4\?\); sections: model"),
        ("train.pp=4", r"unknown key train.pp \(did you mean parallel.pp\?\)"),  # a key of another section
    ],
)
def test_bad_overrides_name_the_problem(item: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        apply_override(Config(), item)


def test_a_misspelt_or_misused_section_in_a_file_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"unknown config section \[parallell\] \(did you mean \[parallel\]\?\)"):
        from_dict({"parallell": {"pp": 2}})
    with pytest.raises(
        ConfigError,
        match=r'^model = "Qwen/Qwen3-8B" is a value, but \[model\] is a section: write \[model\] on a line of its '
        r"own and its keys below it \(keys of \[model\] are: name, dtype, ",
    ):
        from_dict(tomllib.loads('model = "Qwen/Qwen3-8B"\n'))
    with pytest.raises(
        ConfigError,
        match=r"output.dir = datetime.date\(2024, 1, 1\) has type date; expected str like 'runs/qwen3-4b-ami' "
        r'\(a string: write it in quotes, dir = "2024-01-01"\)$',
    ):
        from_dict(tomllib.loads("[output]\ndir = 2024-01-01\n"))


def test_shipped_configs_load_by_name_from_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every config ships inside the package (configs/ at the top is a link to it) and loads by its name."""
    assert (REPO / "configs").resolve() == (REPO / "src" / "pipetune" / "configs").resolve()
    shipped = shipped_configs()
    assert {"demo", "qwen3-4b-ami", "bench-qwen3-4b"} <= set(shipped)
    monkeypatch.chdir(tmp_path)  # no configs/ here: the names resolve inside the package
    assert load_config("demo") == load_config("demo.toml") == load_config(shipped["demo"]) == demo_config()
    for name in shipped:
        config = load_config(name)
        validate(config, config.parallel.pp * config.parallel.dp)
    with pytest.raises(
        ConfigError,
        match=r"does not exist; .* shipped config: bench-.*, demo, qwen3-4b-ami, qwen3-4b-meetings \(pipetune",
    ):
        load_config("qwen3-4b")


def test_config_show_prints_resolved_toml_with_docs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--config", "qwen3-4b-ami", "--set", "train.lr=1e-4"]) == 0
    text = capsys.readouterr().out
    expected = load_config("qwen3-4b-ami", ["train.lr=1e-4"])
    assert from_dict(tomllib.loads(text)) == expected  # valid TOML: the resolved config, every key
    lines = text.splitlines()
    for section, values in expected.to_dict().items():
        for key in values:
            at = next(
                i for i, line in enumerate(lines) if line.startswith(f"{key} = ") and i > lines.index(f"[{section}]")
            )
            assert lines[at - 1].startswith("# "), f"{section}.{key} has no docstring above it"
    assert "lr = 0.0001  # default: 0.0002" in lines
    assert "# Peak learning rate of AdamW." in lines
    assert 'source = "knkarthick/AMI"  # default' not in text  # equal to the default: not marked

    assert main(["config", "list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in shipped_configs())


def test_config_list_shows_whole_first_sentences(capsys: pytest.CaptureFixture[str]) -> None:
    """Each shipped config's description is its header's first sentence, whole, wrapped under the name."""
    from pipetune.config_docs import WIDTH

    assert main(["config", "list"]) == 0
    entries: dict[str, str] = {}
    for line in capsys.readouterr().out.split("\n\n")[0].splitlines():
        assert len(line) <= WIDTH, line
        name, _, text = line.partition("  ")
        if name.strip():
            entries[name] = text.strip()
        else:
            entries[list(entries)[-1]] += " " + line.strip()
    assert set(entries) == set(shipped_configs())
    for name, text in entries.items():
        header = " ".join(
            line.lstrip("# ") for line in shipped_configs()[name].read_text().splitlines() if line.startswith("#")
        )
        assert text.endswith((".", "!", "?")) and header.startswith(text), (name, text)


@pytest.mark.parametrize(
    "name, content, kind, source",
    [
        ("meetings.jsonl", '{"dialogue": "A: hi.", "summary": "They met."}\n', "JSONL", "meetings.jsonl"),
        ("meetings.csv", "dialogue,summary\nA: hi.,They met.\n", "CSV", "meetings.csv"),
        ("meetings", '{"dialogue": "A: hi.", "summary": "They met."}\n{"dialogue": "B"}\n', "JSONL", "meetings.jsonl"),
        ("rows.dat", "dialogue,summary\nA: hi.,They met.\n", "CSV", "rows.csv"),
        ("table", b"PAR1\x15\x04", "Parquet", "table.parquet"),
    ],
)
def test_data_given_as_the_config_names_the_option_that_takes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str | bytes, kind: str, source: str
) -> None:
    """`--config my.jsonl` (by its suffix, or by content that is not TOML but data): which option takes the file,
    and the command with it there (under the suffix data.source reads it by)."""
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["data", "inspect", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pipetune: error: --config {str(path)!r} holds {kind} data, not a TOML config: "), err
    assert err.endswith(f"`pipetune data inspect --config qwen3-4b-ami --set data.source={tmp_path / source}`\n")


def test_a_transcript_given_as_the_config_points_at_summarize(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "meeting.txt").write_text("A: hi. B: hello.")
    assert main(["train", "--config", str(tmp_path / "meeting.txt")]) == 2
    err = capsys.readouterr().err
    assert "is a text file, not a TOML config: a transcript to summarize goes to `pipetune summarize" in err


def test_config_from_dev_null_and_a_pipe(tmp_path: Path) -> None:
    """Any readable path that is not a directory is read: /dev/null (empty: the defaults) and `<(...)`, a pipe
    named /dev/fd/N."""
    assert load_config("/dev/null") == Config()
    read, write = os.pipe()
    os.write(write, b"[train]\nlr = 0.5\n")
    os.close(write)
    try:
        assert load_config(f"/dev/fd/{read}").train.lr == 0.5
    finally:
        os.close(read)


def test_output_tensorboard_is_read_as_a_logger(capsys: pytest.CaptureFixture[str]) -> None:
    """Configs and run directories written before output.loggers still load."""
    config = from_dict({"output": {"tensorboard": True}})
    assert config.output.loggers == ["csv", "tensorboard"]
    assert "output.loggers" in capsys.readouterr().err
    assert from_dict({"output": {"tensorboard": False}}).output.loggers == ["csv"]
    config = Config()
    apply_override(config, "output.tensorboard=true")
    assert config.output.loggers == ["csv", "tensorboard"]
    config = from_dict(tomllib.loads('[output]\ntensorboard = true\nloggers = ["csv", "wandb"]\n'))
    assert config.output.loggers == ["csv", "wandb", "tensorboard"]  # added to the table's loggers, after it too
    assert 'read as output.loggers = ["csv", "wandb", "tensorboard"]; write that' in capsys.readouterr().err


def test_seed_job_config_matches_the_seed_script() -> None:
    c = load_config("qwen3-4b-ami")
    assert (c.model.name, c.data.source, c.data.max_length) == ("Qwen/Qwen3-4B", "knkarthick/AMI", 512)
    assert (c.train.batch_size, c.parallel.n_microbatches, c.train.grad_accum, c.train.epochs) == (8, 8, 2, 3)
    assert (c.train.lr, c.lora.r, c.lora.alpha, c.lora.dropout) == (2e-4, 16, 32, 0.15)
    assert (c.parallel.schedule, c.parallel.pp) == ("1f1b", 2)
    assert len(c.lora.target_modules) == 7
    validate(c, world_size=2)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (
            ["parallel.pp=4", "parallel.n_microbatches=2", "train.batch_size=4"],
            4,
            r"n_microbatches = 2 < parallel.pp = 4",
        ),
        (
            ["train.batch_size=6", "parallel.n_microbatches=4"],
            2,
            r"batch_size = 6 is not divisible by parallel.n_microbatches = 4",
        ),
        (
            ["parallel.pp=2", "parallel.tp=2"],
            2,
            r"world size 2 does not match parallel.pp x parallel.dp x parallel.tp = 2 x 1 x 2; start 4 processes",
        ),
        (['parallel.schedule="pipedream"'], 2, r"parallel.schedule = 'pipedream' is unknown"),
        (['model.dtype="int4"'], 2, r"model.dtype = 'int4' is unknown"),
        (["parallel.layers_per_stage=[4]"], 2, r"has 1 entries for 2 stages"),
        (["train.grad_accum=0"], 2, r"train.grad_accum = 0 must be at least 1"),
        (['parallel.schedule="interleaved_1f1b"'], 2, r"needs parallel.stages_per_rank >= 2 \(got 1\)"),
        (["parallel.stages_per_rank=2"], 2, r"schedule '1f1b' runs one stage per rank"),
        (['parallel.schedule="zbv"', "parallel.stages_per_rank=3"], 2, r"runs exactly 2 stages per rank"),
        (
            [
                'parallel.schedule="interleaved_1f1b"',
                "parallel.stages_per_rank=2",
                "parallel.n_microbatches=5",
                "train.batch_size=5",
            ],
            2,
            r"n_microbatches = 5: interleaved_1f1b runs microbatches in rounds of parallel.pp = 2; use a multiple of 2",
        ),
        (
            ['parallel.schedule="dualpipev"', "parallel.stages_per_rank=2", "parallel.n_microbatches=2"],
            2,
            r"n_microbatches = 2 < 4 stages: dualpipev needs at least one microbatch per stage",
        ),
        (
            ['parallel.schedule="interleaved_zero_bubble"', "parallel.stages_per_rank=2", "train.compile=true"],
            2,
            r"set train.compile = false or use 1f1b / interleaved_1f1b",
        ),
        (['parallel.schedule="zbv"', "parallel.stages_per_rank=2", "parallel.pp=1"], 1, r"needs parallel.pp >= 2"),
        (
            ['parallel.schedule="zbv"', "parallel.stages_per_rank=2", "train.activation_checkpointing=true"],
            2,
            r"set train.activation_checkpointing = false or use 1f1b / interleaved_1f1b",
        ),
        (["train.cuda_graphs=true"], 2, r"train.cuda_graphs = true replays compiled layers: set train.compile = true"),
        (
            ["train.cuda_graphs=true", "train.compile=true", "train.activation_checkpointing=true"],
            2,
            r"does not combine with train.activation_checkpointing = true",
        ),
        (
            ['train.packed_attention="tiles"'],
            2,
            r"train.packed_attention = 'tiles' is unknown; use \"flex\", \"documents\" or \"auto\"",
        ),
        (
            ['train.packed_attention="documents"', "train.compile=true", "train.cuda_graphs=true"],
            2,
            r"a CUDA graph cannot replay: set train.cuda_graphs = false \(or train.packed_attention = \"flex\"\)",
        ),
        (["train.layers_per_graph=-1"], 2, r"train.layers_per_graph = -1 must be >= 0"),
        (["train.memory_gb=-1"], 2, r"train.memory_gb = -1.0 must be >= 0 \(0: the GPU's total memory; on a CPU, this"),
        (["train.loss_chunk=0"], 2, r"train.loss_chunk = 0 must be at least 1"),
        (["parallel.p2p_channels=-1"], 2, r"parallel.p2p_channels = -1 must be >= 0 \(0: NCCL's choice; e.g. 1\)"),
        (
            ["lora.shared_dropout=true", "lora.fast_path=false"],
            2,
            r"but lora.fast_path = false: set lora.fast_path = true, or lora.shared",
        ),
        (
            ["lora.shared_dropout=true", "lora.fast_path=true", "parallel.pp=1", "parallel.tp=2"],
            2,
            r"lora.shared_dropout = true with parallel.tp = 2: .* set lora.shared_dropout = false, or parallel.tp = 1",
        ),
        (
            ["lora.adapter_in_matmul=true", "lora.fast_path=false"],
            2,
            r"set lora.fast_path = true, or set lora.adapter_in_matmul = false",
        ),
        *(
            (["lora.adapter_in_matmul=true", "lora.fast_path=true", *more], 2, message)
            for more, message in (
                (["parallel.pp=1", "parallel.tp=2"], r"with parallel.tp = 2: the extended weights are not split"),
                (["parallel.pp=1", "parallel.dp=2", "parallel.dp_shard=true"], r"with FSDP .* use ddp, or set lora"),
                (['model.quantize="nf4"'], r"with model.quantize = 'nf4': .* set model.quantize = \"none\", or"),
            )
        ),
    ],
)
def test_validation_errors_name_value_and_fix(
    tmp_path: Path, overrides: list[str], world_size: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(tmp_path, *overrides), world_size)


def test_activation_checkpointing_takes_true_false_or_auto(tmp_path: Path) -> None:
    auto = tiny_config(
        tmp_path, 'train.activation_checkpointing="auto"', "train.compile=true", "train.cuda_graphs=true"
    )
    validate(auto, 2)  # "auto" with graphs: ranks that checkpoint run without them
    apply_override(auto, "train.activation_checkpointing=false")  # back to a bool after a string
    assert auto.train.activation_checkpointing is False
    with pytest.raises(ConfigError, match=r"= 'some' has type str; expected bool or 'auto' or 'offload'"):
        apply_override(auto, 'train.activation_checkpointing="some"')


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (
            ["parallel.pp=8", "parallel.n_microbatches=8", "train.batch_size=8"],
            8,
            r"parallel.pp = 8 > 4 decoder layers",
        ),
        (
            ['parallel.schedule="interleaved_1f1b"', "parallel.stages_per_rank=4"],
            2,
            r"parallel.pp = 2 x stages_per_rank = 4 = 8 stages > 4 decoder layers",
        ),
        (['lora.target_modules=["q_proj","qkv"]'], 2, r"lora.target_modules \['qkv'\] match no linear layer"),
        (['model.name="not-a-model-anywhere"'], 2, r"could not be fetched from the Hugging Face hub"),
        (['model.name="./no/such/dir"'], 2, r"is not a directory with a config.json"),
        (["parallel.layers_per_stage=[1, 2]"], 2, r"sums to 3, but 'tiny-qwen3' has 4 decoder layers"),
        (  # an adapter's weights and optimizer state grow with a rank no layer can use
            ["lora.r=100000"],
            2,
            r"^lora.r = 100000 is beyond the 256 features of 'tiny-qwen3''s layers \(hidden_size\): an adapter's rank "
            r"cannot exceed a layer's narrower side; set lora.r <= 256 \(e.g. 16\)$",
        ),
        (
            ["data.max_length=8"],
            2,
            r"data.max_length = 8 cannot hold the chat template .* set data.max_length >= \d+",
        ),
    ],
)
def test_model_dependent_errors(tmp_path: Path, overrides: list[str], world_size: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        preflight(tiny_config(tmp_path, *overrides), world_size)


def test_more_stages_than_layers_is_named_before_the_microbatches(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """pp = 8 on 4 layers with 4 microbatches breaks two rules; raising the microbatches cannot help, so the stage
    count is named (and only it), for train and data inspect alike."""
    config = tiny_config(tmp_path / "run", "parallel.pp=8")
    assert config.parallel.n_microbatches < 8  # the schedule's rule is broken too
    path = str(write_config(config, tmp_path / "c.toml"))
    for command in (["train", "--config", path], ["data", "inspect", "--config", path]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err == "pipetune: error: parallel.pp = 8 > 4 decoder layers of 'tiny-qwen3'; use at most 4 stages\n"


def test_cli_fails_before_starting_workers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """In this process: the launcher's checks run before it starts any worker (a worker would be a subprocess)."""
    config = tiny_config(tmp_path / "run", "parallel.pp=4", "parallel.n_microbatches=2", "train.batch_size=4")
    assert main(["train", "--config", str(write_config(config, tmp_path / "c.toml"))]) == 2
    err = capsys.readouterr().err
    assert "n_microbatches = 2 < parallel.pp = 4" in err
    assert "raise n_microbatches" in err
    assert not (tmp_path / "run").exists()  # nothing was launched, no run directory


def test_p2p_channels_reach_nccl_before_any_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipetune.parallel.process_group import init_distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NCCL_MAX_P2P_NCHANNELS", "")  # restored as it was at teardown, whatever is set below
    monkeypatch.delenv("NCCL_MAX_P2P_NCHANNELS")
    init_distributed(p2p_channels=0)
    assert "NCCL_MAX_P2P_NCHANNELS" not in os.environ  # 0: NCCL's own choice
    init_distributed(p2p_channels=1)
    assert os.environ["NCCL_MAX_P2P_NCHANNELS"] == "1"


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallel.timeout_s=inf", r"parallel.timeout_s = inf must be positive \(seconds, e.g. 600\) and at most"),
        ("train.weight_decay=-0.1", r"train.weight_decay = -0.1 must be >= 0 and finite"),
        ("train.lr=nan", r"train.lr = nan must be positive and finite"),
        ("train.max_grad_norm=inf", r"train.max_grad_norm = inf must be >= 0 and finite"),
        ("parallel.layers_per_stage=[1.5, 2.5]", r"layers_per_stage = \[1.5, 2.5\] must be whole numbers of layers"),
        ("lora.alpha=0", r"lora.alpha = 0.0 must be positive and finite"),
        ("train.warmup_steps=-1", r"train.warmup_steps = -1 must be >= 0"),
        ("train.seed=-1", r"train.seed = -1 must be within \[0, 2\*\*32\)"),
        ("data.synthetic_train=0", r"data.synthetic_train = 0 must be at least 1"),
        ("data.max_length=1099511627776", r"data.max_length = 1099511627776 is beyond 1048576 tokens"),
        ("lora.target_modules=[1]", r"lora.target_modules = \[1\] must be names of linear layers"),
        ('output.dir=""', r"output.dir is empty"),
    ],
)
def test_values_that_passed_validation_and_crashed_later(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(tmp_path, override), world_size=2)


def test_output_dir_naming_a_file_and_config_files_that_cannot_be_read(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file")
    for out in (tmp_path / "taken", tmp_path / "taken" / "run"):
        with pytest.raises(ConfigError, match=f"{tmp_path / 'taken'}' is a file, not a directory"):
            validate(tiny_config(out), world_size=2)
    with pytest.raises(ConfigError, match="is a directory; pass --config with a TOML file"):
        load_config(tmp_path)
    (tmp_path / "latin1.toml").write_bytes('[model]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(tmp_path / "latin1.toml")


def test_system_prompt_is_the_prompts_system_turn(tmp_path: Path) -> None:
    from pipetune.data.prompt import prompt_settings

    config = tiny_config(tmp_path, 'data.system_prompt="Summarize the meeting in one line."')
    prepared = preflight(config, world_size=2)
    settings = prompt_settings(prepared.prompts, config)
    assert settings["system_prompt"] == "Summarize the meeting in one line."
    assert "Summarize the meeting in one line." in settings["prefix"]
    ids = prepared.prompts.prompt_ids("Anna: hello.")
    assert prepared.tokenizer.decode(ids) == settings["prefix"] + "Anna: hello." + settings["suffix"]

"""Tests for train/config.py: every ConfigError path, CLI overrides, DeepSpeed resolution, writing, field docs."""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from pathlib import Path

import pytest

from model_parallel.plan import check_parallel
from train.config import (
    PROJECT_KEY,
    Config,
    ConfigError,
    ProjectConfig,
    field_docs,
    load_config,
    parse_args,
    resolve_deepspeed,
    to_dict,
    write_resolved,
)
from train.config.files import RANDOM_INIT_ENV

REPO = Path(__file__).resolve().parents[1]
DELETE = object()  # value for `Setup.set` that removes the key


@dataclasses.dataclass
class Setup:
    """A valid minimal setup under tmp_path: fake model dir, data dir, output dir and a JSON config to mutate."""

    root: Path
    model: Path
    data: Path
    output: Path
    raw: dict

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    def set(self, dotted: str, value) -> Setup:
        """Set (or, with DELETE, remove) a dotted key such as 'qwen_edit.lora.rank' in the raw config."""
        *parents, last = dotted.split(".")
        node = self.raw
        for name in parents:
            node = node.setdefault(name, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
        return self

    def write(self) -> Path:
        self.config.write_text(json.dumps(self.raw, indent=2))
        return self.config

    def load(self, *cli: str, world_size: int = 1, has_gpu: bool = False) -> Config:
        self.write()
        return load_config(parse_args(["--ds_config", str(self.config), *cli]), world_size, has_gpu,
                           check_parallel=check_parallel)

    def problems(self, *cli: str, **kwargs) -> list[str]:
        with pytest.raises(ConfigError) as info:
            self.load(*cli, **kwargs)
        return info.value.problems

    def problem(self, *cli: str, **kwargs) -> str:
        """The single problem the current config has."""
        problems = self.problems(*cli, **kwargs)
        assert len(problems) == 1, problems
        return problems[0]


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    """Writes an empty-but-present model_index.json, a metadata.jsonl and a valid config into tmp_path."""
    model, data, output = tmp_path / "model", tmp_path / "data", tmp_path / "out"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    data.mkdir()
    (data / "metadata.jsonl").write_text('{"image": "a.png", "edit_image": "b.png", "prompt": "x"}\n')
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1}},
        "zero_optimization": {"stage": 2},
        PROJECT_KEY: {
            "model": {"path": str(model)},
            "data": {"path": str(data)},
            "output": {"dir": str(output)},
            "train": {"max_steps": 5},
        },
    }
    return Setup(tmp_path, model, data, output, raw)


def q(key: str) -> str:
    """Dotted key inside the project section."""
    return f"{PROJECT_KEY}.{key}"


def help_of(key: str) -> str:
    """How a problem with project field `key` ends: its docstring on one line (pydantic's field description)."""
    return ". Help: " + " ".join(field_docs()[key].split())


# --- the fixture itself -------------------------------------------------------------------------------------------


def test_minimal_setup_is_valid(setup):
    """The fixture's config loads and keeps its values."""
    config = setup.load()
    assert config.project.model.path == str(setup.model)
    assert config.project.train.max_steps == 5
    assert config.micro_batch_size == 1 and config.world_size == 1
    assert config.precision == "bfloat16"
    assert PROJECT_KEY not in config.deepspeed


def test_relative_paths_are_relative_to_the_working_directory(setup, monkeypatch):
    """docs/configuration.md: a relative path in the JSON is read from the directory the command starts
    in, not from the JSON file's folder."""
    setup.set(q("model.path"), "model").set(q("data.path"), "data").set(q("output.dir"), "out")
    (setup.root / "configs").mkdir()
    cfg = setup.root / "configs" / "run.json"
    cfg.write_text(json.dumps(setup.raw))
    monkeypatch.chdir(setup.root)
    assert load_config(parse_args(["--ds_config", str(cfg)]), 1, False).project.model.path == "model"
    monkeypatch.chdir(cfg.parent)  # the JSON's own folder has no model/
    with pytest.raises(ConfigError, match="model.path: 'model' has no model_index.json"):
        load_config(parse_args(["--ds_config", str(cfg)]), 1, False)


# --- the file itself ----------------------------------------------------------------------------------------------


def test_missing_ds_config(tmp_path):
    """A --ds_config path that does not exist names the flag, the path and an example file."""
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as info:
        load_config(parse_args(["--ds_config", str(missing)]), 1, False)
    (msg,) = info.value.problems
    assert "--ds_config" in msg and str(missing) in msg and "ds_configs/zero2.json" in msg


def test_invalid_json_reports_line_and_column(setup):
    """Broken JSON reports the file with the decoder's line and column."""
    setup.config.write_text('{\n  "bf16": {"enabled": true},\n  "fp16": {enabled: true}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(parse_args(["--ds_config", str(setup.config)]), 1, False)
    (msg,) = info.value.problems
    assert "--ds_config" in msg and "not valid JSON" in msg and "line 3, column 12" in msg


@pytest.mark.parametrize("text", ["[1, 2]", '"zero2"', "3", "null"])
def test_top_level_not_an_object(setup, text):
    """A top level that is not a JSON object is reported as such."""
    setup.config.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(parse_args(["--ds_config", str(setup.config)]), 1, False)
    (msg,) = info.value.problems
    assert "--ds_config" in msg and "JSON object at the top level" in msg


def test_parse_args_requires_ds_config():
    """--ds_config is mandatory on the command line."""
    with pytest.raises(SystemExit):
        parse_args([])


# --- project section: keys, types, choices ------------------------------------------------------------------------


@pytest.mark.parametrize("dotted, value, got", [
    (PROJECT_KEY, [1], "list"),
    (q("lora"), 5, "int"),
    (q("train"), "fast", "str"),
])
def test_section_not_an_object(setup, dotted, value, got):
    """A project section written as a non-object names the section first (defaults then stand in for it)."""
    msg = setup.set(dotted, value).problems()[0]
    assert msg.startswith(f"{dotted}: expected an object, got {got}") and "{...}" in msg


def test_unknown_project_key_with_near_miss(setup):
    """A typo of a known key names the key and suggests the right one."""
    msg = setup.set(q("train.max_step"), 10).problem()
    assert msg.startswith(q("train.max_step") + ": unknown key")
    assert "did you mean 'max_steps'?" in msg and "known keys: mode, max_steps" in msg


def test_unknown_project_key_without_near_miss(setup):
    """An unrelated unknown key lists the known keys but makes no suggestion."""
    msg = setup.set(q("lora.zzz"), 1).problem()
    assert msg.startswith(q("lora.zzz") + ": unknown key") and "did you mean" not in msg
    assert "known keys: rank, alpha, dropout, target_modules" in msg


def test_unknown_project_section(setup):
    """An unknown section under the project key is reported with the section names."""
    msg = setup.set(q("optimizer"), {}).problem()
    assert msg.startswith(q("optimizer") + ": unknown key") and "known keys: model, data, lora" in msg


def test_unknown_top_level_key(setup):
    """A DeepSpeed-level typo is not ignored silently: it is named with a fix."""
    msg = setup.set("gradient_acumulation_steps", 4).problem()
    assert msg.startswith("gradient_acumulation_steps: unknown top-level key")
    assert "remove it or move it into the 'qwen_edit' section" in msg


@pytest.mark.parametrize("key, value, want", [
    ("lora.rank", "8", 'expected int, got "8"'),
    ("lora.rank", True, "expected int, got true"),
    ("lora.rank", 8.0, "expected int, got 8.0"),
    ("data.area", None, "expected int, got null"),
    ("lora.alpha", "16", 'expected float, got "16"'),
    ("lora.alpha", False, "expected float, got false"),
    ("data.pin_memory", 1, "expected bool, got 1"),
    ("model.path", 5, "expected str, got 5"),
    ("lora.target_modules", "attn.to_q", 'expected list[str] or null, got "attn.to_q"'),
    ("lora.target_modules", ["attn.to_q", 3], 'expected list[str] or null, got ["attn.to_q", 3]'),
    ("parallel.decoder_cuts", ["30"], 'expected list[int], got ["30"]'),
    ("data.category_weights", {"faces": "2"}, 'expected dict[str, float], got {"faces": "2"}'),
    ("train.mode", 1, "expected str, got 1"),
    ("train.gc_every_steps", 1.5, "expected int, got 1.5"),
])
def test_wrong_type(setup, key, value, want):
    """A value of the wrong JSON type names the key, the expected type, the value, the fix and the field's help
    (listed first): pydantic converts nothing between JSON types."""
    msg = setup.set(q(key), value).problems()[0]
    assert msg == f"{q(key)}: {want}; fix its type in the JSON{help_of(key)}"


def test_unknown_key_near_miss_by_spelling(setup):
    """The suggestion comes from the spelling (difflib), not only from a shared prefix."""
    msg = setup.set(q("data.pth"), "x").problem()
    assert msg.startswith(q("data.pth") + ": unknown key (did you mean 'path'?)")


def test_every_bad_key_of_a_section_is_listed_and_the_rest_still_checked(setup):
    """pydantic's errors become one problem per key (two wrong items of one list: one problem); each bad key's
    default stands in, so the section's other values still go through the range checks, in the same error."""
    (setup.set(q("lora.rank"), "8").set(q("lora.target_modules"), ["attn.to_q", 3, 4]).set(q("lora.dropout"), 1.0)
     .set(q("lora.rnk"), 8).set(q("memory"), 3))
    problems = setup.problems()
    assert [p.split(":")[0] for p in problems] == [
        q("lora.rank"), q("lora.target_modules"), q("lora.rnk"), q("memory"), q("lora.dropout")], problems
    assert problems[-1] == f"{q('lora.dropout')}: must be in [0, 1), got 1.0"


def test_project_section_is_typed_by_pydantic():
    """The sections are pydantic dataclasses: the field help is pydantic's description, read from the docstring."""
    from train.config import LoraConfig

    assert LoraConfig.__pydantic_fields__["rank"].description == field_docs()["lora.rank"] == "LoRA rank r."


@pytest.mark.parametrize("key, value", [("lora.alpha", 16), ("lora.dropout", 0)])
def test_int_accepted_for_float(setup, key, value):
    """JSON integers are accepted where a float is expected (and held as a float)."""
    config = setup.set(q(key), value).load()
    section, name = key.split(".")
    got = getattr(getattr(config.project, section), name)
    assert got == value and isinstance(got, float)


@pytest.mark.parametrize("key, value, choices", [
    ("train.mode", "qlora", "lora, full"),
    ("model.variant", "v2", "auto, edit, edit_plus, edit_plus_2511, t2i, qwen_image_21"),
    ("model.encoder_dtype", "float16", "auto, bfloat16, float32"),
    ("data.bad_rows", "ignore", "stop, skip"),
    ("train.timestep_density", "normal", "shifted, uniform, logit_normal"),
    ("train.loss_weighting", "sigma", "none, cosmap"),
    ("parallel.mode", "zero3", "zero2, model_parallel"),
])
def test_value_not_in_choices(setup, key, value, choices):
    """A string outside a field's choices names the key, the value, every allowed value and the field's help."""
    msg = setup.set(q(key), value).problem()
    assert msg == f"{q(key)}: {value!r} is not one of {choices}{help_of(key)}"


# --- project section: value checks --------------------------------------------------------------------------------


@pytest.mark.parametrize("key, value", [
    ("lora.rank", 0), ("lora.rank", -4), ("lora.alpha", 0.0), ("lora.alpha", -1.5),
    ("train.max_steps", 0), ("output.log_every_steps", 0),
])
def test_must_be_positive(setup, key, value):
    """Counts and sizes that must be positive say so with the offending value."""
    assert setup.set(q(key), value).problem() == f"{q(key)}: must be > 0, got {value}"


@pytest.mark.parametrize("key", ["data.area", "data.condition_area"])
def test_area_zero(setup, key):
    """A zero area is reported as non-positive (not also as too small)."""
    assert setup.set(q(key), 0).problem() == f"{q(key)}: must be > 0, got 0"


@pytest.mark.parametrize("key, value", [("data.area", 100), ("data.condition_area", 1023)])
def test_area_too_small(setup, key, value):
    """An area below one 32x32 tile names the key and the minimum."""
    msg = setup.set(q(key), value).problem()
    assert msg.startswith(f"{q(key)}: {value} px is below one 32x32 tile") and "use at least 1024" in msg


def test_area_of_one_tile_is_accepted(setup):
    """Exactly one 32x32 tile is the smallest area accepted."""
    assert setup.set(q("data.area"), 1024).load().project.data.area == 1024


@pytest.mark.parametrize("key, value, want", [
    ("output.save_every_steps", -1, "must be >= 0 (0 = only at the end)"),
    ("data.num_workers", -1, "must be >= 0"),
    ("lora.dropout", 1.0, "must be in [0, 1), got 1.0"),
    ("lora.dropout", -0.1, "must be in [0, 1), got -0.1"),
    ("train.shift", -1.0, "must be >= 0 (0 = the scheduler's dynamic shift)"),
    ("train.logit_std", 0, "must be > 0"),
    ("data.bucket_aspect_steps", -1, "must be >= 0 (0 = the pipelines' own sizes, e.g. 8 = aspect ratios 9% apart), "
                                     "got -1"),
    ("train.kept_attention_blocks", -2, "must be >= -1 (-1 = every checkpointed block, 0 = none), got -2"),
    ("train.gc_every_steps", -1, "must be >= 0 (0 = Python's automatic collection)"),
])
def test_out_of_range(setup, key, value, want):
    """Other range checks name the key and the allowed range."""
    assert setup.set(q(key), value).problem() == f"{q(key)}: {want}"


def test_gc_every_steps_takes_the_automatic_collector_or_a_cadence(setup):
    """train.gc_every_steps: 0 keeps Python's automatic collection, N > 0 a young collection every N steps."""
    assert setup.set(q("train.gc_every_steps"), 0).load().project.train.gc_every_steps == 0
    assert setup.set(q("train.gc_every_steps"), 50).load().project.train.gc_every_steps == 50


def test_fp8_transposed_needs_fp8_base(setup):
    """train.fp8_transposed without fp8_base is named with both fixes; with it, the config loads."""
    msg = setup.set(q("train.fp8_transposed"), True).problem()
    assert msg.startswith(q("train.fp8_transposed") + ": only applies with train.fp8_base")
    assert setup.set(q("train.fp8_base"), True).load().project.train.fp8_transposed


def test_fp8_fast_accum_needs_an_fp8_base(setup):
    """train.fp8_fast_accum applies to an fp8 base: alone it loads while the memory plan may still choose fp8 (auto,
    the default), and is named with both fixes where nothing will (the plan off, or a full fine-tune)."""
    assert setup.set(q("train.fp8_fast_accum"), True).load().project.train.fp8_fast_accum
    for key, value, default in (("memory.plan", "off", "auto"), ("train.mode", "full", "lora")):
        msg = setup.set(q(key), value).problem()
        assert msg.startswith(q("train.fp8_fast_accum") + ": only applies to an fp8 base"), (key, msg)
        assert "enable fp8_base or set fp8_fast_accum to false" in msg
        setup.set(q(key), default)
    assert setup.set(q("train.fp8_base"), True).set(q("memory.plan"), "off").load().project.train.fp8_fast_accum


def test_empty_target_modules_in_lora_mode(setup):
    """LoRA mode with no target modules asks for at least one, with an example."""
    msg = setup.set(q("lora.target_modules"), []).problem()
    assert msg.startswith(q("lora.target_modules") + ": empty") and '"attn.to_q"' in msg


def test_empty_target_modules_in_full_mode(setup):
    """Full fine-tuning does not need target modules."""
    config = setup.set(q("lora.target_modules"), []).set(q("train.mode"), "full").load()
    assert config.project.train.mode == "full"


def test_model_parallel_needs_a_process_per_stage(setup):
    """model_parallel on a world that is not a multiple of the stage count names the launch that fits."""
    setup.set(q("parallel.mode"), "model_parallel")
    assert setup.load(world_size=4).project.parallel.stages == ["cuda:0", "cuda:1"]
    msg = setup.problem(world_size=3)
    assert msg.startswith(q("parallel.stages") + ": 2 stages per pipeline, but 3 processes")
    assert "deepspeed --num_gpus 2" in msg


# --- paths --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, flag", [("model.path", "--model DIR"), ("data.path", "--data DIR"),
                                       ("output.dir", "--output_dir DIR")])
def test_path_not_set(setup, key, flag):
    """A path set neither in JSON nor on the CLI names the key and the CLI flag."""
    msg = setup.set(q(key), DELETE).problem()
    assert msg.startswith(f"{q(key)}: not set") and f"pass {flag}" in msg


def test_model_dir_missing(setup):
    """A model path that does not exist names the key and model_index.json."""
    missing = setup.root / "missing"
    msg = setup.set(q("model.path"), str(missing)).problem()
    assert msg.startswith(f"{q('model.path')}: {str(missing)!r} has no model_index.json")
    assert "point --model at the directory that holds model_index.json" in msg


def test_model_dir_without_model_index(setup):
    """A model directory without model_index.json is refused."""
    (setup.model / "model_index.json").unlink()
    assert "has no model_index.json" in setup.problem()


NO_TENSORS = (2).to_bytes(8, "little") + b"{}"  # a safetensors file without tensors: its header alone


def test_model_dir_without_weights(setup, monkeypatch):
    """A model that model_index.json lists without its weights file (or with a shard of its index missing) is
    refused before anything loads, naming the folders, the files diffusers and transformers read, and the fix;
    under QWEN_EDIT_RANDOM_INIT=1 (measurements) the configs are enough."""
    monkeypatch.delenv(RANDOM_INIT_ENV, raising=False)
    listed = {"transformer": ["diffusers", "QwenImageTransformer2DModel"],
              "vae": ["diffusers", "AutoencoderKLQwenImage"],
              "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"]}
    (setup.model / "model_index.json").write_text(json.dumps(listed))
    for sub in listed:
        (setup.model / sub).mkdir()
    (setup.model / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(NO_TENSORS)
    msg = setup.problem()
    assert msg.startswith(f"{q('model.path')}: {str(setup.model)!r} has no weights in vae/, text_encoder/: vae/ needs "
                          "diffusion_pytorch_model.safetensors or the shards that "
                          "diffusion_pytorch_model.safetensors.index.json lists, text_encoder/ needs model.safetensors")
    assert "; point --model at a complete diffusers-format directory (QWEN_EDIT_RANDOM_INIT=1" in msg
    (setup.model / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(NO_TENSORS)
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    index = setup.model / "text_encoder" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    (setup.model / "text_encoder" / shards[0]).write_bytes(NO_TENSORS)
    assert setup.problem() == (f"{q('model.path')}: {index} names shard(s) {shards[1]} that are not in "
                               f"{index.parent}; copy them there (a partial download?)")
    (setup.model / "text_encoder" / shards[1]).write_bytes(NO_TENSORS)
    setup.load()  # complete
    index.write_text('{"weight_map": ')
    assert setup.problem().startswith(f"{q('model.path')}: {index} cannot be read as a weight index (JSONDecodeError")
    (setup.model / "model_index.json").write_text("{")
    assert setup.problem().startswith(f"{q('model.path')}: {setup.model / 'model_index.json'} is not valid JSON")
    (setup.model / "model_index.json").write_text(json.dumps(listed))
    for f in setup.model.glob("*/*.safetensors*"):
        f.unlink()
    assert "has no weights in transformer/, vae/, text_encoder/: transformer/ and vae/ need" in setup.problem()
    monkeypatch.setenv(RANDOM_INIT_ENV, "1")
    setup.load()

def test_damaged_or_truncated_weights_are_named_before_anything_loads(setup, tiny_edit, tmp_path):
    """A weights file whose safetensors header cannot be read, or whose tensors reach past its end (an interrupted
    copy), is named with its path and the fix by the pre-flight of training, train.cache and train.infer, and again
    by the transformer's streaming loader should it change after the pre-flight."""
    import shutil

    from train.model import streaming

    model = Path(shutil.copytree(tiny_edit / "model", tmp_path / "copy"))
    setup.set(q("model.path"), str(model))
    setup.load()
    shard = model / "transformer" / "diffusion_pytorch_model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert setup.problem() == (f"{q('model.path')}: {shard} is truncated: {len(data) // 2} bytes where its tensors "
                               f"need {len(data)} (an interrupted copy or download?); copy the file again")
    with pytest.raises(streaming.WeightsError, match=f"^{shard} is truncated: "):
        next(streaming.checkpoint_tensors(shard.parent))
    encoder = model / "text_encoder" / "model.safetensors"
    shard.write_bytes(data)
    encoder.write_bytes(b"\x00" * 64)
    assert setup.problem().startswith(f"{q('model.path')}: {encoder} is damaged: its safetensors header cannot be "
                                      "read (")
    assert setup.problem().endswith("; copy the file again")


def test_data_dir_missing(setup):
    """A data path that does not exist names the key and the metadata files."""
    missing = setup.root / "missing"
    msg = setup.set(q("data.path"), str(missing)).problem()
    assert msg == f"{q('data.path')}: {str(missing)!r} has no metadata.jsonl or metadata.csv"


def test_data_dir_without_metadata(setup):
    """A data directory without metadata.jsonl / metadata.csv is refused."""
    (setup.data / "metadata.jsonl").unlink()
    assert "has no metadata.jsonl or metadata.csv" in setup.problem()


def test_data_dir_with_metadata_csv(setup):
    """metadata.csv is accepted in place of metadata.jsonl."""
    (setup.data / "metadata.jsonl").unlink()
    (setup.data / "metadata.csv").write_text("image,edit_image,prompt\n")
    assert setup.load().project.data.path == str(setup.data)


def test_output_dir_need_not_exist(setup):
    """The output directory is created later; it need not exist at validation time."""
    assert not setup.output.exists()
    setup.load()


# --- DeepSpeed section --------------------------------------------------------------------------------------------


def test_train_batch_size_inconsistent_with_world_size(setup):
    """train_batch_size must equal micro x GAS x world size; the message shows the product and the fix."""
    setup.set("train_batch_size", 2)  # micro 1 x GAS 2 x world 1
    assert setup.load(world_size=1).deepspeed["train_batch_size"] == 2
    msg = setup.problem(world_size=2)
    assert msg.startswith("train_batch_size: 2 != train_micro_batch_size_per_gpu (1) x gradient_accumulation_steps "
                          "(2) x world size (2) = 4")
    assert "remove train_batch_size" in msg


def test_no_train_batch_size_fits_any_world_size(setup):
    """Without train_batch_size the same file validates at several world sizes."""
    for world_size in (1, 2, 8):
        assert setup.load(world_size=world_size).world_size == world_size


@pytest.mark.parametrize("key, value", [
    ("train_micro_batch_size_per_gpu", 0), ("train_micro_batch_size_per_gpu", "2"),
    ("train_micro_batch_size_per_gpu", True), ("gradient_accumulation_steps", -1),
    ("gradient_accumulation_steps", 1.5),
])
def test_batch_counts_must_be_positive_integers(setup, key, value):
    """Micro-batch and accumulation steps must be integers >= 1."""
    assert setup.set(key, value).problem() == f"{key}: must be an integer >= 1, got {json.dumps(value)}"


def test_bf16_and_fp16_both_enabled(setup):
    """Enabling both precisions names both keys and the recommended one."""
    msg = setup.set("fp16", {"enabled": True}).problem()
    assert msg == "bf16.enabled and fp16.enabled: both true; enable one (bf16 for Qwen-Image)"


@pytest.mark.parametrize("stage", [3, 4, -1])
def test_zero_stage_unsupported(setup, stage):
    """ZeRO stages other than 0-2 are refused with the supported ones."""
    msg = setup.set("zero_optimization.stage", stage).problem()
    assert msg.startswith(f"zero_optimization.stage: {stage} is not supported") and "use 0, 1 or 2" in msg


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stage_supported(setup, stage):
    """ZeRO stages 0, 1 and 2 are accepted."""
    assert setup.set("zero_optimization.stage", stage).load().deepspeed["zero_optimization"]["stage"] == stage


def test_scheduler_total_steps_disagrees_with_max_steps(setup):
    """A scheduler length other than max_steps names both keys and says to remove it."""
    msg = setup.set("scheduler.params.total_num_steps", 10).problem()
    assert msg.startswith(f"scheduler.params.total_num_steps: 10 != {q('train.max_steps')} (5)")
    assert "remove total_num_steps" in msg


def test_scheduler_total_steps_equal_to_max_steps(setup):
    """A scheduler length equal to max_steps is accepted."""
    resolved = setup.set("scheduler.params.total_num_steps", 5).load().deepspeed
    assert resolved["scheduler"]["params"]["total_num_steps"] == 5


@pytest.mark.parametrize("dotted, value", [
    ("bf16", True), ("fp16", None), ("zero_optimization", 2), ("optimizer", "AdamW"),
    ("scheduler", "WarmupLR"), ("scheduler.params", [1]), ("optimizer.params", 3),
])
def test_deepspeed_section_not_an_object(setup, dotted, value):
    """A DeepSpeed section that is not an object is a ConfigError naming it, not a crash."""
    msg = setup.set(dotted, value).problem()
    assert msg == f"{dotted}: expected an object, got {json.dumps(value)}; write it as {{...}}"


# --- everything at once -------------------------------------------------------------------------------------------


def test_all_problems_in_one_error(setup):
    """Problems across both sections are all listed in one ConfigError."""
    (setup.set(q("lora.rank"), "8").set(q("train.mode"), "qlora").set(q("model.path"), DELETE)
     .set("gradient_acumulation_steps", 2).set("zero_optimization.stage", 3).set("fp16", {"enabled": True}))
    with pytest.raises(ConfigError) as info:
        setup.load()
    problems = info.value.problems
    assert len(problems) >= 6
    keys = [q("lora.rank"), q("train.mode"), q("model.path"), "gradient_acumulation_steps",
            "zero_optimization.stage", "bf16.enabled and fp16.enabled"]
    for key in keys:
        assert any(p.startswith(key) for p in problems), key
        assert key in str(info.value)
    assert str(info.value).startswith("invalid configuration:\n  - ")


def test_deepspeeds_own_checks_join_the_other_problems(setup):
    """DeepSpeed's config classes read its section even when other keys have problems, and every section they
    refuse is listed, each unknown key with the known one it is closest to."""
    (setup.set("gradient_clipping", "1.0").set("zero_optimization.overlap_com", False)
     .set("bf16.immediate_grad_updat", True).set(q("train.max_stepz"), 3))
    problems = setup.problems()
    assert [p.split(":")[0] for p in problems] == [
        q("train.max_stepz"), "gradient_clipping", "zero_optimization.overlap_com", "bf16.immediate_grad_updat"]
    assert "rename it to 'overlap_comm' or remove it" in problems[2]
    assert "rename it to 'immediate_grad_update' or remove it" in problems[3]


# --- CLI overrides ------------------------------------------------------------------------------------------------


def test_cli_overrides_win_over_json(setup, tmp_path):
    """--model/--data/--output_dir/--max_steps/--seed replace the JSON values."""
    other_model, other_data = tmp_path / "m2", tmp_path / "d2"
    other_model.mkdir()
    (other_model / "model_index.json").write_text("{}")
    other_data.mkdir()
    (other_data / "metadata.csv").write_text("image,prompt\n")
    setup.set(q("train.seed"), 1)
    config = setup.load("--model", str(other_model), "--data", str(other_data), "--output_dir", str(tmp_path / "o2"),
                        "--max_steps", "7", "--seed", "3")
    project = config.project
    assert project.model.path == str(other_model) and project.data.path == str(other_data)
    assert project.output.dir == str(tmp_path / "o2")
    assert project.train.max_steps == 7 and project.train.seed == 3
    assert config.deepspeed["scheduler"]["params"]["total_num_steps"] == 7


def test_cli_fills_paths_missing_from_json(setup):
    """A config without any paths validates when the CLI gives them."""
    for key in ("model.path", "data.path", "output.dir"):
        setup.set(q(key), DELETE)
    config = setup.load("--model", str(setup.model), "--data", str(setup.data), "--output_dir", str(setup.output))
    assert config.project.model.path == str(setup.model)


def test_cli_fixes_a_bad_json_path(setup):
    """A wrong model path in JSON is not reported when --model overrides it."""
    setup.set(q("model.path"), str(setup.root / "missing"))
    assert setup.load("--model", str(setup.model)).project.model.path == str(setup.model)


def test_cli_values_are_validated(setup):
    """Overrides go through the same checks as JSON values."""
    assert setup.problem("--max_steps", "0") == f"{q('train.max_steps')}: must be > 0, got 0"
    assert "has no model_index.json" in setup.problem("--model", str(setup.data))


def test_cli_max_steps_checked_against_scheduler(setup):
    """The scheduler length is compared with the overridden max_steps."""
    setup.set("scheduler.params.total_num_steps", 5)
    assert "!= qwen_edit.train.max_steps (9)" in setup.problem("--max_steps", "9")


# --- resolve_deepspeed --------------------------------------------------------------------------------------------


def fp16_adam(setup: Setup) -> Setup:
    return setup.set("bf16", DELETE).set("fp16", {"enabled": True, "loss_scale": 0}).set("optimizer.type", "Adam")


def test_resolve_on_cpu_turns_fp16_into_bf16(setup):
    """On CPU, fp16 becomes bf16 and Adam uses torch's implementation."""
    ds = fp16_adam(setup).load(has_gpu=False).deepspeed
    assert ds["fp16"]["enabled"] is False and ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["params"]["torch_adam"] is True


def test_resolve_on_gpu_leaves_precision_and_adam(setup):
    """On GPU, fp16 and DeepSpeed's Adam are left as written."""
    config = fp16_adam(setup).load(has_gpu=True)
    ds = config.deepspeed
    assert ds["fp16"]["enabled"] is True and "bf16" not in ds
    assert "torch_adam" not in ds["optimizer"]["params"]
    assert config.precision == "float16"


def test_flex_attention_needs_a_cuda_gpu(setup):
    """train.attention "flex" has no backward on the CPU: refused there with the fix, taken on a GPU machine."""
    setup.set("qwen_edit.train.attention", "flex")
    assert setup.problem(has_gpu=False) == ('qwen_edit.train.attention: "flex" needs a CUDA GPU (torch\'s '
                                            'flex_attention has no backward on the CPU); set it to "auto" or "sdpa"')
    assert setup.load(has_gpu=True).project.train.attention == "flex"


def test_flash_attention_4_needs_its_package_and_a_hopper_gpu(setup):
    """train.attention_kernel "fa4" is refused before step 1 where FlashAttention-4 cannot run, naming the key, the
    reason and the other choices; "auto" (the default) falls back to SDPA's kernel instead."""
    assert setup.load(has_gpu=False).project.train.attention_kernel == "auto"
    setup.set("qwen_edit.train.attention_kernel", "fa4")
    assert setup.problem(has_gpu=False) == ('qwen_edit.train.attention_kernel: "fa4": FlashAttention-4 needs a CUDA '
                                            'GPU of compute capability 9.0 or newer; or set it to "auto" or "sdpa"')


def test_resolve_cpu_precision_property(setup):
    """The precision property follows the resolved CPU choice."""
    assert fp16_adam(setup).load(has_gpu=False).precision == "bfloat16"
    assert setup.set("fp16", {"enabled": False}).load(has_gpu=False).precision == "float32"


def test_resolve_keeps_explicit_torch_adam(setup):
    """An explicit torch_adam in the file is not overwritten on CPU."""
    ds = setup.set("optimizer.params.torch_adam", False).load(has_gpu=False).deepspeed
    assert ds["optimizer"]["params"]["torch_adam"] is False


def test_resolve_non_adam_optimizer_untouched(setup):
    """torch_adam is only added for Adam/AdamW."""
    ds = setup.set("optimizer", {"type": "SGD", "params": {"lr": 0.1}}).load(has_gpu=False).deepspeed
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 0.1}}


@pytest.mark.parametrize("sched, filled", [("WarmupDecayLR", True), ("WarmupCosineLR", True), ("WarmupLR", False)])
def test_resolve_fills_schedule_length(sched, filled):
    """Decaying schedules get total_num_steps from max_steps; WarmupLR does not."""
    ds = resolve_deepspeed({"scheduler": {"type": sched}}, max_steps=12, has_gpu=True)
    assert ds["scheduler"].get("params", {}).get("total_num_steps") == (12 if filled else None)


def test_resolve_defaults_and_no_mutation():
    """Defaults are filled, the project section dropped, and the input left unchanged."""
    raw = {"fp16": {"enabled": True}, "optimizer": {"type": "AdamW"}, PROJECT_KEY: {"train": {}}}
    before = copy.deepcopy(raw)
    ds = resolve_deepspeed(raw, max_steps=3, has_gpu=False)
    assert raw == before
    assert PROJECT_KEY not in ds
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["gradient_accumulation_steps"] == 1
    assert ds["steps_per_print"] >= 10**9
    assert ds["timers"] == {"throughput": {"enabled": False}}  # no device synchronisation for an unprinted figure
    assert ds["bf16"] == {"enabled": True} and ds["optimizer"]["params"] == {"torch_adam": True}
    timers = {"throughput": {"enabled": True, "synchronized": False}}
    assert resolve_deepspeed({"timers": timers}, max_steps=3, has_gpu=True)["timers"] == timers  # the config's own


# --- write_resolved / to_dict -------------------------------------------------------------------------------------


def test_write_resolved_round_trips(setup):
    """OUT/config.json holds exactly to_dict(config)."""
    config = setup.load()
    out = write_resolved(config, setup.output)
    assert out == setup.output / "config.json" and out.is_file()
    assert json.loads(out.read_text()) == to_dict(config)
    assert not list(setup.output.glob("*.tmp"))


def test_written_config_loads_back(setup):
    """The resolved file is itself a valid config that resolves to the same dict."""
    config = setup.load()
    out = write_resolved(config, setup.output)
    again = load_config(parse_args(["--ds_config", str(out)]), 1, False)
    assert to_dict(again) == to_dict(config)


def test_to_dict_layout(setup):
    """to_dict has DeepSpeed keys at the top and every project field under the project key."""
    d = to_dict(setup.load())
    assert d["zero_optimization"] == {"stage": 2}
    assert d[PROJECT_KEY]["train"]["max_steps"] == 5 and d[PROJECT_KEY]["lora"]["rank"] == 64
    assert set(d[PROJECT_KEY]) == {f.name for f in dataclasses.fields(ProjectConfig)}


# --- field docs ---------------------------------------------------------------------------------------------------


def leaf_fields(cls=ProjectConfig, prefix: str = "") -> list[str]:
    """Dotted names of every non-dataclass field, found independently of field_docs."""
    out = []
    for name, hint in typing.get_type_hints(cls).items():
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out += leaf_fields(hint, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_every_field_has_a_docstring():
    """field_docs() covers every project field, each with a non-empty docstring."""
    docs = field_docs()
    fields = leaf_fields()
    assert len(fields) > 20
    assert sorted(docs) == sorted(fields)
    for name, doc in docs.items():
        assert isinstance(doc, str) and doc.strip(), name


# --- the repo's own configs ---------------------------------------------------------------------------------------


def test_repo_ds_configs_validate(setup):
    """Every ds_configs/*.json validates with the fixture's paths as overrides (on CPU and GPU)."""
    files = sorted((REPO / "ds_configs").glob("*.json"))
    assert files, "no ds_configs/*.json found"
    failures = {}
    for path in files:
        for has_gpu in (False, True):
            args = parse_args(["--ds_config", str(path), "--model", str(setup.model), "--data", str(setup.data),
                               "--output_dir", str(setup.output)])
            try:
                parallel = json.loads(path.read_text()).get(PROJECT_KEY, {}).get("parallel", {})
                world = len(parallel["stages"]) if parallel.get("mode") == "model_parallel" else 1  # a process a stage
                load_config(args, world_size=world, has_gpu=has_gpu, check_parallel=check_parallel)
            except ConfigError as e:
                failures[f"{path.name} (has_gpu={has_gpu})"] = e.problems
    assert not failures, failures


# --- model-parallel placement (qwen_edit.parallel) ----------------------------------------------------------------


def mp_problems(setup, world_size: int = 2, num_gpus: int | None = None, **changes) -> list[str]:
    setup.set(q("parallel.mode"), "model_parallel")
    for key, value in changes.items():
        setup.set(q(key.replace("__", ".")), value)
    try:
        load_config(parse_args(["--ds_config", str(setup.write())]), world_size, num_gpus is not None, num_gpus,
                    check_parallel)
    except ConfigError as e:
        return e.problems
    return []


def test_model_parallel_bad_device_name(setup):
    """A device that is neither cuda:N nor cpu is named with the accepted forms."""
    assert mp_problems(setup, parallel__stages=["cuda:0", "gpu1"]) == [
        f"{q('parallel.stages')}: 'gpu1' is not a device name; write \"cuda:N\" or \"cpu\""]


def test_model_parallel_one_stage(setup):
    """One device is not a pipeline."""
    (msg,) = mp_problems(setup, world_size=1, parallel__stages=["cuda:0"])
    assert msg.startswith(q("parallel.stages") + ": ['cuda:0'] names 1 device(s)")


def test_model_parallel_refuses_node_local_storage(setup):
    """Node-local checkpoints are committed by each node's local rank 0, an encoder in this mode: refused."""
    setup.set("checkpoint.use_node_local_storage", True)
    (msg,) = mp_problems(setup)
    assert msg.startswith("checkpoint.use_node_local_storage: not available in the model-parallel mode"), msg


def test_model_parallel_cut_count_must_match_stages(setup):
    """Three stages need exactly one cut."""
    (msg,) = mp_problems(setup, world_size=3, parallel__stages=["cuda:0", "cuda:1", "cuda:2"])
    assert msg.startswith(q("parallel.decoder_cuts") + ": 0 cut(s) for 2 decoder stage(s)")


def test_model_parallel_cut_outside_the_blocks(setup):
    """Cuts are checked against the transformer's block count when its config is readable."""
    (setup.model / "transformer").mkdir()
    (setup.model / "transformer" / "config.json").write_text(json.dumps({"num_layers": 4}))
    (msg,) = mp_problems(setup, world_size=3, parallel__stages=["cuda:0", "cuda:1", "cuda:2"],
                         parallel__decoder_cuts=[4])
    assert msg.startswith(q("parallel.decoder_cuts") + ": [4] must be increasing block indices") and "0 and 4" in msg
    assert not mp_problems(setup, world_size=3, parallel__decoder_cuts=[2])


def test_model_parallel_device_missing_on_this_machine(setup):
    """On a GPU machine the devices must exist, replicas included (4 processes = 2 pipelines need cuda:0-3)."""
    (msg,) = mp_problems(setup, world_size=2, num_gpus=1)
    assert "needs cuda:1, but this machine has 1 GPU(s) (cuda:0-0)" in msg
    (msg,) = mp_problems(setup, world_size=4, num_gpus=2)
    assert "pipeline 1 stage 0 needs cuda:2" in msg
    assert not mp_problems(setup, world_size=4, num_gpus=4)
    assert not mp_problems(setup, world_size=4, num_gpus=None)  # CPU: every stage is a CPU process


def test_model_parallel_repeated_gpu(setup):
    """Two stages on one GPU are refused on a GPU machine."""
    (msg,) = mp_problems(setup, num_gpus=2, parallel__stages=["cuda:1", "cuda:1"])
    assert "must name 2 different cuda devices" in msg


def test_model_parallel_queue_depth_and_fp16_cuts(setup):
    """queue_depth >= 1; fp16 loss scaling cannot cross a decoder cut."""
    setup.set("fp16", {"enabled": True}).set("bf16", DELETE)
    problems = mp_problems(setup, world_size=3, parallel__queue_depth=0, parallel__stages=["cpu", "cpu", "cpu"],
                           parallel__decoder_cuts=[1])
    assert problems == [f"{q('parallel.queue_depth')}: must be >= 1, got 0",
                        f"{q('parallel.decoder_cuts')}: fp16's loss scaling is not carried across a cut; use bf16"]


# --- sampling and prompt processing (data.category_*, prompt_mapping, blocked_terms) -------------------------------


@pytest.mark.parametrize("weight", [-1, -0.5, float("nan"), float("inf")])
def test_category_weight_must_be_non_negative(setup, weight):
    """A negative or non-finite weight names the key, the category and the allowed range."""
    msg = setup.set(q("data.category_weights"), {"faces": 1, "cars": weight}).problem()
    assert msg.startswith(q("data.category_weights") + "['cars']: must be a number >= 0") and "0 leaves" in msg


def test_category_weights_all_zero(setup):
    msg = setup.set(q("data.category_weights"), {"a": 0, "b": 0.0}).problem()
    assert msg.startswith(q("data.category_weights") + ": every weight is 0") and "set it to {}" in msg


def test_category_weights_valid(setup):
    config = setup.set(q("data.category_weights"), {"a": 0, "b": 2, "": 1}).load()
    assert config.project.data.category_weights == {"a": 0, "b": 2, "": 1}


def test_category_rule_must_compile(setup):
    """A rule that is no regular expression names the key, the category and the expression."""
    msg = setup.set(q("data.category_rules"), {"ok": "^a", "faces": "(unclosed"}).problem()
    assert msg.startswith(q("data.category_rules") + "['faces']: '(unclosed' is not a regular expression")
    assert "Python re syntax" in msg


@pytest.mark.parametrize("key", ["prompt_mapping", "blocked_terms"])
def test_prompt_file_missing(setup, key):
    msg = setup.set(q(f"data.{key}"), str(setup.root / "nope.txt")).problem()
    assert msg.startswith(q(f"data.{key}") + ": ") and "is not a file" in msg and 'set it to ""' in msg


@pytest.mark.parametrize("text, fragment", [("{oops", "is not valid JSON (line 1"),
                                            ('["a"]', "must hold one JSON object of strings")])
def test_prompt_mapping_unreadable(setup, text, fragment):
    (setup.root / "map.json").write_text(text)
    msg = setup.set(q("data.prompt_mapping"), str(setup.root / "map.json")).problem()
    assert msg.startswith(q("data.prompt_mapping") + ": ") and fragment in msg


def test_blocked_terms_not_text(setup):
    (setup.root / "blocked.txt").write_bytes(b"\xff\xfe\x00bad")
    msg = setup.set(q("data.blocked_terms"), str(setup.root / "blocked.txt")).problem()
    assert msg.startswith(q("data.blocked_terms") + ": cannot read") and "UTF-8" in msg


def test_prompt_files_valid(setup):
    (setup.root / "map.json").write_text('{"kitty": "cat"}')
    (setup.root / "blocked.txt").write_text("secret\n")
    config = setup.set(q("data.prompt_mapping"), str(setup.root / "map.json")).set(
        q("data.blocked_terms"), str(setup.root / "blocked.txt")).load()
    assert config.project.data.blocked_terms.endswith("blocked.txt")


# --- inference, validation and the GPU monitor (_check_inference) ---------------------------------------------------


def test_inference_values_out_of_range(setup):
    """Sampler settings must be usable: steps > 0, guidance >= 1, areas of at least one 32x32 tile."""
    setup.set(q("inference"), {"num_inference_steps": 0, "true_cfg_scale": 0.5, "area": 100, "condition_area": 0})
    problems = setup.problems()
    assert len(problems) == 4, problems
    assert problems[0] == q("inference.num_inference_steps: must be > 0, got 0")
    assert q("inference.true_cfg_scale: must be >= 1") in problems[1]
    assert q("inference.area: 100 px is below one 32x32 tile") in problems[2]
    assert q("inference.condition_area: 0 px") in problems[3]


def test_validation_every_steps_without_file(setup):
    setup.set(q("validation.every_steps"), 5)
    msg = setup.problem()
    assert msg.startswith(q("validation.every_steps: 5, but validation.file")) and "every_steps to 0" in msg


def test_validation_every_steps_negative(setup):
    setup.set(q("validation"), {"every_steps": -1})
    assert setup.problem() == q("validation.every_steps: must be >= 0 (0 = only at the end)")


def test_validation_file_missing(setup, tmp_path):
    setup.set(q("validation.file"), str(tmp_path / "nope.jsonl"))
    msg = setup.problem()
    assert msg.startswith(q("validation.file: ")) and "nope.jsonl" in msg and "does not exist" in msg


def test_validation_file_rows_checked(setup, tmp_path):
    """Each bad row is named by its line: invalid JSON, no edit_image, empty prompt, a missing image."""
    (tmp_path / "ok.png").write_bytes(b"png")
    path = tmp_path / "val.jsonl"
    path.write_text('{"edit_image": "ok.png", "prompt": "fine"}\n{oops\n{"edit_image": 5, "prompt": "x"}\n\n'
                    '{"edit_image": ["ok.png"], "prompt": " "}\n{"edit_image": "gone.png", "prompt": "x"}\n')
    setup.set(q("validation.file"), str(path))
    problems = setup.problems()
    assert [p.split(": ", 2)[1].rsplit(" line ", 1)[1] for p in problems] == ["2", "3", "5", "6"], problems
    assert "not valid JSON" in problems[0] and "for an edit, 'edit_image'" in problems[1]
    assert "empty or missing 'prompt'" in problems[2] and "'gone.png' not found" in problems[3]


def test_validation_file_empty(setup, tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("\n")
    setup.set(q("validation.file"), str(path))
    assert setup.problem().endswith("has no rows")


def test_validation_file_valid(setup, tmp_path):
    (tmp_path / "a.png").write_bytes(b"png")
    (tmp_path / "val.jsonl").write_text('{"edit_image": "a.png", "prompt": "make it red", "seed": 3}\n')
    setup.set(q("validation"), {"file": str(tmp_path / "val.jsonl"), "every_steps": 100})
    assert setup.load().project.validation.every_steps == 100


def test_gpu_monitor_interval_negative(setup):
    setup.set(q("output.gpu_monitor_interval_s"), -1)
    assert setup.problem() == q("output.gpu_monitor_interval_s: must be >= 0 (0 = off)")


def test_inference_settings_for_train_infer(tmp_path):
    """train.infer reads only the inference-related part of a config: defaults without a file, errors together."""
    from train.config import InferenceConfig, inference_settings

    assert inference_settings(None).inference == InferenceConfig()
    path = tmp_path / "infer.json"
    path.write_text(json.dumps({PROJECT_KEY: {"inference": {"area": 65536, "cpu_offload": "model"}}}))
    settings = inference_settings(path)
    assert settings.inference.area == 65536 and settings.inference.cpu_offload == "model"
    path.write_text(json.dumps({PROJECT_KEY: {"inference": {"cpu_offload": "all", "num_inference_steps": 0}}}))
    with pytest.raises(ConfigError) as info:
        inference_settings(path)
    assert len(info.value.problems) == 2 and "cpu_offload" in info.value.problems[0]
    path.write_text("{")
    with pytest.raises(ConfigError, match="--config: cannot read"):
        inference_settings(path)


def test_alpha_background_must_be_a_colour(setup):
    problem = setup.set("qwen_edit.data.alpha_background", "whiteish").problem()
    assert problem.startswith("qwen_edit.data.alpha_background: 'whiteish' is not a colour") and "#rrggbb" in problem
    assert setup.set("qwen_edit.data.alpha_background", "#101010").load().project.data.alpha_background == "#101010"


def test_export_every_steps_must_not_be_negative(setup):
    problem = setup.set("qwen_edit.output.export_every_steps", -1).problem()
    assert problem == "qwen_edit.output.export_every_steps: must be >= 0 (0 = only the final export)"


# --- trust in values: non-finite numbers, absurd sizes, DeepSpeed's keys before anything loads ----------------------


@pytest.mark.parametrize("key", ["qwen_edit.lora.alpha", "qwen_edit.train.shift", "qwen_edit.train.logit_std",
                                 "qwen_edit.train.logit_mean", "qwen_edit.lora.dropout",
                                 "qwen_edit.inference.true_cfg_scale", "qwen_edit.output.gpu_monitor_interval_s",
                                 "optimizer.params.lr", "gradient_clipping", "scheduler.params.warmup_max_lr"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_numbers_are_refused(setup, key, value):
    """NaN and Infinity (Python's json reads them) pass no range check (NaN <= 0 is False): each is named alone."""
    assert setup.set(key, value).problem() == (
        f"{key}: {value} is not a finite number; write a finite value{help_of(key.removeprefix(PROJECT_KEY + '.'))}"
        if key.startswith(PROJECT_KEY) else f"{key}: not a finite number; write a finite value")


@pytest.mark.parametrize("key, value, limit", [
    ("data.area", 10**15, 8192 * 8192), ("data.condition_area", 10**9, 8192 * 8192), ("train.seed", 2**64, 2**32 - 1),
    ("data.num_workers", 100000, 64), ("lora.rank", 100000, 3072), ("parallel.collective_timeout_s", 10**12, 604800),
])
def test_absurd_sizes_are_refused(setup, key, value, limit):
    """Sizes no run can use are refused at start, naming the limit."""
    assert setup.set(q(key), value).problem().startswith(f"{q(key)}: {value} is above {limit} (")


def test_negative_seed_and_huge_inference_sizes(setup):
    setup.set(q("train.seed"), -1).set(q("inference.area"), 10**12).set(q("inference.num_inference_steps"), 10**6)
    assert setup.problems() == [
        f"{q('train.seed')}: must be >= 0, got -1",
        f"{q('inference.area')}: {10**12} px is above {8192 * 8192} (8192x8192); use about 1024*1024",
        f"{q('inference.num_inference_steps')}: {10**6} is above 1000; use 20-50"]


@pytest.mark.parametrize("key, value, want", [
    ("zero_optimization.overlap_comn", True,
     "zero_optimization.overlap_comn: Extra inputs are not permitted (DeepSpeed's check); rename it to "
     "'overlap_comm' or remove it"),
    ("zero_optimization.offload_optimizer", {"device": "cpu", "pin_memry": True},
     "zero_optimization.offload_optimizer.pin_memry: Extra inputs are not permitted (DeepSpeed's check)"),
    ("optimizer.type", "Adamm", 'optimizer.type: "Adamm" is neither a DeepSpeed optimizer'),
    ("optimizer.params.lr", -1, "optimizer.params.lr: must be a number >= 0, got -1"),
    ("scheduler.type", "WarmupCosine", 'scheduler.type: "WarmupCosine" is neither a DeepSpeed schedule'),
    ("gradient_clipping", -1.0, "gradient_clipping: must be a number >= 0 (0 = off), got -1.0"),
    ("bf16.enabled", "false", 'bf16.enabled: expected true or false, got "false"; write it without quotes'),
    ("fp16", {"enabled": 0}, "fp16.enabled: expected true or false, got 0"),
])
def test_deepspeed_keys_are_checked_before_anything_loads(setup, key, value, want):
    """DeepSpeed's own section is read by DeepSpeed's config classes (pydantic, extra="forbid") and checked for the
    optimizer/scheduler names, learning rate, clipping and true/false switches at load_config time."""
    assert setup.set(key, value).problem().startswith(want)


def test_deepspeed_refuses_what_its_config_refuses(setup):
    """A value of the wrong type inside a DeepSpeed section (DeepSpeed's pydantic type check) is a problem naming
    the key, not a traceback from deepspeed.initialize after the models have loaded."""
    setup.set("zero_optimization.stage", 2).set("zero_optimization.reduce_bucket_size", "lots")
    assert setup.problem().startswith("zero_optimization.reduce_bucket_size: ")

"""`python -m train.export` from DeepSpeed checkpoints, and starting a LoRA run from a file (lora.init_from)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm
from conftest import REPO, TINY_CONFIG, run_trainer, write_config
from safetensors.torch import load_file, save_file
from test_train import check

from train import export
from train.config import LoraConfig, ModelConfig
from train.model import family, loading, lora_io, prepare
from train.runtime import exports
from train.runtime.exports import LORA_WEIGHT_NAME

STEPS = 4
TWO_ADAPTERS = pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")  # intended here
TAG = f"global_step{STEPS}"
TINY_LORA = json.loads(TINY_CONFIG.read_text())["qwen_edit"]["lora"]

# Key templates per layout: (A, B, alpha or None); {m} = module path, {k} = kohya's flattened name.
FORMATS = {
    "diffusers": ("transformer.{m}.lora_A.weight", "transformer.{m}.lora_B.weight", None),
    "peft": ("base_model.model.{m}.lora_A.default.weight", "base_model.model.{m}.lora_B.default.weight", None),
    "peft_saved": ("base_model.model.{m}.lora_A.weight", "base_model.model.{m}.lora_B.weight", None),
    "diffsynth": ("{m}.lora_A.default.weight", "{m}.lora_B.default.weight", None),
    "comfyui": ("diffusion_model.{m}.lora_A.weight", "diffusion_model.{m}.lora_B.weight", "diffusion_model.{m}.alpha"),
    "comfyui_down_up": ("diffusion_model.{m}.lora_down.weight", "diffusion_model.{m}.lora_up.weight",
                        "diffusion_model.{m}.alpha"),
    "kohya": ("lora_unet_{k}.lora_down.weight", "lora_unet_{k}.lora_up.weight", "lora_unet_{k}.alpha"),
}

QWEN_IMAGE = family.family_named("qwen_image")


@pytest.fixture(scope="module")
def lora_run(tiny_edit, tmp_path_factory) -> Path:
    """4 LoRA steps with ZeRO-2 on 2 processes: OUT/global_step4 (2 optimizer shards), OUT/export and the
    intermediate export of step 2 (output.export_every_steps)."""
    out = tmp_path_factory.mktemp("export_lora_run")
    cfg = write_config(out.parent / f"{out.name}.json", **{"qwen_edit.output.export_every_steps": 2})
    check(run_trainer(tiny_edit, out, config=cfg, num_procs=2, extra=("--max_steps", str(STEPS))))
    return out


@pytest.fixture(scope="module")
def lora_exports(lora_run, tmp_path_factory) -> dict[str, Path]:
    """The checkpoint exported through the CLI (diffusers) and in-process (comfyui)."""
    out = tmp_path_factory.mktemp("lora_exports")
    proc = warm.run(["-m", "train.export", "--checkpoint", str(lora_run / TAG), "--out", str(out / "diffusers")],
                    cwd=REPO, timeout=300)
    check(proc)
    assert f"exported {out / 'diffusers' / LORA_WEIGHT_NAME}" in proc.stdout
    comfy = exports.export(lora_run / TAG, out / "comfyui", fmt="comfyui", family_of=family.family_for)
    return {"diffusers": out / "diffusers" / LORA_WEIGHT_NAME, "comfyui": comfy}


@pytest.fixture(scope="module")
def full_run(tiny_edit, tmp_path_factory) -> Path:
    """4 full fine-tuning steps in one process."""
    out = tmp_path_factory.mktemp("export_full_run")
    cfg = write_config(out.parent / f"{out.name}.json", **{"qwen_edit.train.mode": "full"})
    check(run_trainer(tiny_edit, out, config=cfg, extra=("--max_steps", str(STEPS))))
    return out


def fresh_transformer(tiny: Path, **lora_changes):
    """The tiny transformer with a freshly initialised adapter of the tiny config (fields overridable)."""
    transformer = loading.load_transformer(ModelConfig(path=str(tiny / "model")), torch.float32)
    prepare.add_lora(transformer, LoraConfig(**{**TINY_LORA, **lora_changes}))
    return transformer


def adapter_weights(transformer) -> dict[str, torch.Tensor]:
    """{'X.lora_A': tensor, 'X.lora_B': tensor} of the 'default' adapter."""
    return {n.removesuffix(".default.weight"): p.detach().clone()
            for n, p in transformer.named_parameters() if ".lora_" in n}


@pytest.fixture(scope="module")
def known(tiny_edit) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A, B)} with random A and B (B non-zero, unlike a fresh init) in the adapter's shapes."""
    g = torch.Generator().manual_seed(0)
    weights = adapter_weights(fresh_transformer(tiny_edit))
    modules = sorted({k.removesuffix(".lora_A").removesuffix(".lora_B") for k in weights})
    return {m: tuple(torch.randn(weights[f"{m}.{s}"].shape, generator=g) for s in ("lora_A", "lora_B"))
            for m in modules}


def to_format(lora: dict[str, tuple[torch.Tensor, torch.Tensor]], fmt: str, alpha: float | None = None):
    """The LoRA written in key layout `fmt`; alpha keys (when the layout has them) default to the rank."""
    a_key, b_key, alpha_key = FORMATS[fmt]
    out = {}
    for m, (a, b) in lora.items():
        names = {"m": m, "k": m.replace(".", "_")}
        out[a_key.format(**names)], out[b_key.format(**names)] = a, b
        if alpha_key:
            out[alpha_key.format(**names)] = torch.tensor(float(alpha or a.shape[0]))
    return out


def load_via_file(transformer, sd: dict[str, torch.Tensor], path: Path) -> lora_io.LoadReport:
    save_file(sd, path)
    return lora_io.load_into(transformer, path)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:10]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_export_equals_end_of_training_export(lora_run, lora_exports):
    """The CLI export of the last checkpoint (fp32 masters) equals OUT/export (the module weights).

    These runs train in fp32 on CPU, where the module weights are the fp32 masters; so the two must agree
    within 1e-6 (they are in fact bitwise equal). Under bf16 they would differ by bf16 rounding.
    """
    ours = load_file(lora_exports["diffusers"])
    trained = load_file(lora_run / "export" / LORA_WEIGHT_NAME)
    assert max_diff(ours, trained) <= 1e-6
    assert max(v.abs().max().item() for k, v in ours.items() if ".lora_B." in k) > 1e-4, "B never moved"


def header(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_exports_carry_metadata_and_the_users_permissions(lora_run, lora_exports):
    """Every LoRA export (end of training, every output.export_every_steps, train.export in both layouts) says in
    its safetensors header what it is: base model, variant, rank, alpha, target modules, step, config hash; and
    is readable as the user's umask allows (safetensors alone writes 0600)."""
    config = json.loads((lora_run / "config.json").read_text())
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    files = {4: lora_run / "export" / LORA_WEIGHT_NAME, 2: lora_run / "export" / "step_000002" / LORA_WEIGHT_NAME}
    for step, path in [*files.items(), (4, lora_exports["diffusers"]), (4, lora_exports["comfyui"])]:
        meta = header(path)
        assert meta["qwen_edit.base_model"] == config["qwen_edit"]["model"]["path"], path
        assert meta["qwen_edit.variant"] == "edit" and meta["qwen_edit.train_mode"] == "lora"
        assert (meta["qwen_edit.lora_rank"], meta["qwen_edit.lora_alpha"]) == (str(TINY_LORA["rank"]),
                                                                              str(float(TINY_LORA["alpha"])))
        assert json.loads(meta["qwen_edit.target_modules"]) == TINY_LORA["target_modules"]
        assert meta["qwen_edit.step"] == str(step) and meta["qwen_edit.config_sha256"] == digest
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask(), oct(path.stat().st_mode)
    assert not list((lora_run / "export").glob("step_000004"))  # the last step is the final export itself
    assert max_diff(load_file(files[2]), load_file(files[4])) > 0  # step 2 is its own weights


def test_exports_follow_a_non_default_umask(tmp_path):
    """The umask is read without being changed (no moment at 0 for other threads' files), and an export written
    under umask 027 is 0640: readable by the group, by nobody else."""
    old = os.umask(0o027)
    try:
        assert exports.user_umask() == 0o027 and umask() == 0o027
        path = exports.write_diffusers_lora({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 4),
                                             "transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(4, 2)},
                                            tmp_path, alpha=2.0, rank=2, keys=QWEN_IMAGE.lora)
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, oct(path.stat().st_mode)
    finally:
        os.umask(old)


@pytest.mark.slow
def test_export_agrees_with_deepspeeds_zero_to_fp32_script(lora_run, lora_exports, tmp_path):
    """DeepSpeed's own zero_to_fp32.py (copied next to the checkpoint) consolidates to the same tensors."""
    proc = subprocess.run([sys.executable, str(lora_run / "zero_to_fp32.py"), str(lora_run), str(tmp_path),
                           "--tag", TAG, "--exclude_frozen_parameters", "--safe_serialization"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    check(proc)
    script = load_file(tmp_path / "model.safetensors")
    renamed = {"transformer." + k.replace(".default.weight", ".weight"): v for k, v in script.items() if ".lora_" in k}
    assert max_diff(renamed, load_file(lora_exports["diffusers"])) == 0


@pytest.mark.slow
@TWO_ADAPTERS
def test_comfyui_export_loads_through_diffusers(lora_exports, tiny_edit):
    """The ComfyUI layout loads through QwenImageEditPipeline.load_lora_weights to the diffusers export's weights."""
    from diffusers import DiffusionPipeline

    comfy = load_file(lora_exports["comfyui"])
    assert all(k.startswith("diffusion_model.") for k in comfy), list(comfy)[:4]
    assert comfy["diffusion_model.transformer_blocks.0.attn.to_q.alpha"].item() == TINY_LORA["alpha"]
    pipe = DiffusionPipeline.from_pretrained(tiny_edit / "model", local_files_only=True)
    for name, path in lora_exports.items():
        pipe.load_lora_weights(path.parent, weight_name=path.name, adapter_name=name)
    params = dict(pipe.transformer.named_parameters())
    by_adapter = {name: {n.replace(f".{name}.", "."): p for n, p in params.items() if f".{name}.weight" in n}
                  for name in lora_exports}
    assert len(by_adapter["comfyui"]) == len(load_file(lora_exports["diffusers"])) > 0
    assert max_diff(by_adapter["comfyui"], by_adapter["diffusers"]) == 0


@pytest.mark.slow
def test_full_export_loads_and_equals_consolidated_weights(full_run, tiny_edit, tmp_path):
    """mode=full exports DIR/transformer/ that from_pretrained loads to the consolidated fp32 weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from diffusers import QwenImageTransformer2DModel

    path = exports.export(full_run / TAG, tmp_path, family_of=family.family_for)
    assert path == tmp_path / "transformer"
    loaded = QwenImageTransformer2DModel.from_pretrained(path).state_dict()
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(full_run), tag=TAG, exclude_frozen_parameters=True)
    assert max_diff(loaded, consolidated) == 0
    trained = QwenImageTransformer2DModel.from_pretrained(full_run / "export" / "transformer").state_dict()
    assert max_diff(loaded, trained) <= 1e-6  # fp32 run: module weights are the masters
    base = QwenImageTransformer2DModel.from_pretrained(tiny_edit / "model", subfolder="transformer").state_dict()
    assert max_diff(loaded, base) > 1e-4, "full fine-tune did not move the weights"
    for directory in (path, full_run / "export" / "transformer"):  # metadata beside the shards, user's umask
        info = json.loads((directory / "qwen_edit_export.json").read_text())
        assert info["qwen_edit.train_mode"] == "full" and info["qwen_edit.step"] == str(STEPS)
        assert {stat.S_IMODE(f.stat().st_mode) for f in directory.iterdir()} == {0o666 & ~umask()}


def test_export_refuses_wrong_paths_and_foreign_checkpoints(tmp_path, capsys):
    """A path without mp_rank_00_model_states.pt, or a checkpoint without our client_state, exit 2 with the fix."""
    (tmp_path / "latest").write_text("global_step4")
    assert export.main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no mp_rank_00_model_states.pt" in err and f"pass {tmp_path}/global_stepN" in err
    foreign = tmp_path / "global_step1"
    foreign.mkdir()
    torch.save({"module": {}, "buffer_names": []}, foreign / exports.MODEL_STATES)
    assert export.main(["--checkpoint", str(foreign), "--out", str(tmp_path / "x")]) == 2
    assert "has no qwen-edit-trainer client_state" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_an_export_is_replaced_only_with_overwrite(lora_run, full_run, tmp_path, capsys):
    """train.export into a folder that holds its kind of export exits 2 naming it and --overwrite, the file as it
    was; with --overwrite it is replaced (a full export's folder as a whole: no shard of the old one stays)."""
    out = tmp_path / "lora"
    assert export.main(["--checkpoint", str(lora_run / TAG), "--out", str(out)]) == 0
    before = (out / LORA_WEIGHT_NAME).read_bytes()
    argv = ["--checkpoint", str(lora_run / TAG), "--out", str(out), "--dtype", "bfloat16"]
    capsys.readouterr()
    assert export.main(argv) == 2
    assert capsys.readouterr().err.strip() == (f"error: --out {out} already holds an export "
                                               f"({out / LORA_WEIGHT_NAME}); pass --overwrite to replace it, or "
                                               "choose another --out")
    assert (out / LORA_WEIGHT_NAME).read_bytes() == before
    assert export.main([*argv, "--overwrite"]) == 0
    assert {t.dtype for t in load_file(out / LORA_WEIGHT_NAME).values()} == {torch.bfloat16}
    assert export.main([*argv[:4], "--format", "comfyui"]) == 0  # another file: nothing to overwrite
    (tmp_path / "full" / "transformer").mkdir(parents=True)
    (tmp_path / "full" / "transformer" / "stale-00002-of-00002.safetensors").write_bytes(b"old")
    assert export.main(["--checkpoint", str(full_run / TAG), "--out", str(tmp_path / "full")]) == 2
    assert export.main(["--checkpoint", str(full_run / TAG), "--out", str(tmp_path / "full"), "--overwrite"]) == 0
    assert not (tmp_path / "full" / "transformer" / "stale-00002-of-00002.safetensors").exists()


def adapter_updates(transformer) -> dict[str, torch.Tensor]:
    """{module: B @ A x scaling} of the 'default' adapter: what it adds to each module's weight. Compared instead of A
    and B, since diffusers' converter may move a file's alpha / rank between them."""
    return {name: layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
            for name, layer in lora_io.lora_layers(transformer, "default").items()}


def file_updates(lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> dict[str, torch.Tensor]:
    """{module: scale x B @ A} of a LoRA given as {module: (A, B)}."""
    return {m: scale * b @ a for m, (a, b) in lora.items()}


def assert_updates(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool) -> None:
    """Equal updates per module: bit for bit, or within fp32 rounding of a matrix product of scaled factors (an
    absolute 1e-6 of the largest entry: sums of rank products cancel, so small entries carry larger relative error)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:10]
    for m in want:
        atol = 0 if exact else 1e-6 * want[m].abs().max().item()
        torch.testing.assert_close(got[m], want[m], rtol=0 if exact else 1e-5, atol=atol,
                                   msg=lambda text, m=m: f"{m}: {text}")


LAYOUT_CASES = [(fmt, None, None) for fmt in sorted(FORMATS)] + [
    ("comfyui", 32, None),  # scale 2: diffusers folds it into lora_A
    ("comfyui_down_up", 4, None),  # scale 1/4: diffusers splits it, 1/2 into each of A and B
    ("kohya", 3, None),  # scale 3/16: A x 3/8, B x 1/2
    ("kohya", 32, 8),  # file scale 2 into an adapter of scale 1/2
]


@pytest.mark.parametrize(("fmt", "alpha", "adapter_alpha"), LAYOUT_CASES)
def test_each_layout_imports_the_files_update(fmt, alpha, adapter_alpha, known, tiny_edit, tmp_path):
    """diffusers, PEFT ('.default' and saved), DiffSynth, ComfyUI (A/B and down/up) and kohya files, with alpha = rank
    or not, and into an adapter of another alpha: every module's update B @ A x scale is the file's
    (alpha / rank) x B @ A, bit for bit when no scale is involved."""
    rank = TINY_LORA["rank"]
    transformer = fresh_transformer(tiny_edit, **({"alpha": adapter_alpha} if adapter_alpha else {}))
    report = load_via_file(transformer, to_format(known, fmt, alpha=alpha), tmp_path / "lora.safetensors")
    file_scale, adapter_scale = (alpha or rank) / rank, (adapter_alpha or TINY_LORA["alpha"]) / rank
    assert report.loaded == len(known) and not report.not_in_file
    assert report.rescaled == (0 if file_scale == adapter_scale == 1 else len(known)), report
    assert_updates(adapter_updates(transformer), file_updates(known, file_scale),
                   exact=file_scale == adapter_scale == 1)


@TWO_ADAPTERS
def test_imports_agree_with_load_lora_weights(known, tiny_edit, tmp_path):
    """A file means the same to lora.init_from as to the pipeline's load_lora_weights (train.infer --lora): kohya
    and ComfyUI files with alpha != rank, and a diffusers and a ComfyUI file whose lora_adapter_metadata says
    lora_alpha = 2 x rank (diffusers scales by it, on top of .alpha keys; our own exports write none), give the
    pipeline's update in an adapter of alpha 8."""
    from diffusers import DiffusionPipeline

    rank = TINY_LORA["rank"]
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": rank, "transformer.lora_alpha": 2 * rank,
                                                 "transformer.target_modules": sorted(known)})}
    cases = {"kohya": ("kohya", 4, None, 4 / rank), "comfyui": ("comfyui", 40, None, 40 / rank),
             "diffusers_meta": ("diffusers", None, meta, 2.0), "comfyui_meta": ("comfyui", 40, meta, 2 * 40 / rank)}
    pipe = DiffusionPipeline.from_pretrained(tiny_edit / "model", local_files_only=True)
    for name, (fmt, alpha, metadata, scale) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(to_format(known, fmt, alpha=alpha), path, metadata=metadata)
        pipe.load_lora_weights(path.parent, weight_name=path.name, adapter_name=name)
        theirs = {m: layer.lora_B[name].weight @ layer.lora_A[name].weight * layer.scaling[name]
                  for m, layer in lora_io.lora_layers(pipe.transformer, name).items()}
        assert_updates(theirs, file_updates(known, scale), exact=False)
        transformer = fresh_transformer(tiny_edit, alpha=8)
        assert lora_io.load_into(transformer, path).rescaled == len(known)
        assert_updates(adapter_updates(transformer), theirs, exact=False)


def test_rank_mismatch_is_reported(known, tiny_edit, tmp_path):
    """A rank-16 file into a rank-8 adapter names the modules, the file's rank and the config's."""
    transformer = fresh_transformer(tiny_edit, rank=8, alpha=8)
    with pytest.raises(ValueError) as e:
        load_via_file(transformer, to_format(known, "diffusers"), tmp_path / "lora.safetensors")
    msg = str(e.value)
    assert "qwen_edit.lora.init_from: the rank of" in msg and f"for {len(known)} modules" in msg
    assert "transformer_blocks.0.attn.to_q: rank 16" in msg and "qwen_edit.lora.rank = 8" in msg
    assert f"and {len(known) - lora_io.MAX_LISTED} more" in msg and "Set qwen_edit.lora.rank" in msg


def test_unknown_keys_are_reported(known, tiny_edit, tmp_path):
    """Keys of no module, or of a module the config gives no LoRA, are listed with the config's targets."""
    sd = to_format(known, "diffusers")
    sd["transformer.not_a_module.lora_A.weight"] = torch.zeros(16, 4)
    sd["transformer.norm_out.linear.lora_A.weight"] = torch.zeros(16, 4)
    with pytest.raises(ValueError) as e:
        load_via_file(fresh_transformer(tiny_edit), sd, tmp_path / "lora.safetensors")
    msg = str(e.value)
    assert "2 keys of" in msg and "match no LoRA module" in msg
    assert "transformer.not_a_module.lora_A.weight" in msg and "not_a_module.lora_A.weight (module" not in msg
    assert "transformer.norm_out.linear.lora_A.weight (module has no LoRA in this config)" in msg
    assert "target_modules [" in msg and "'proj_out'" in msg and "qwen_edit.lora.target_modules" in msg


def test_unknown_keys_of_converted_layouts_are_named_as_written(known, tiny_edit, tmp_path):
    """In a kohya file, keys diffusers' converter renames are named as the file writes them and as diffusers reads
    them; keys it cannot read at all (a weight diff, DoRA's magnitude) are named too, nothing is loaded."""
    sd = to_format(known, "kohya")
    sd["lora_unet_norm_out_linear.lora_down.weight"] = torch.zeros(16, 4)
    sd["lora_unet_norm_out_linear.lora_up.weight"] = torch.zeros(4, 16)
    sd["lora_unet_proj_out.diff"] = torch.zeros(4, 4)
    sd["lora_unet_img_in.dora_scale"] = torch.ones(1, 4)
    transformer = fresh_transformer(tiny_edit)
    before = adapter_weights(transformer)
    with pytest.raises(lora_io.LoraFileError) as e:
        load_via_file(transformer, sd, tmp_path / "lora.safetensors")
    msg = str(e.value)
    assert "4 keys of" in msg and "match no LoRA module" in msg, msg
    assert ("lora_unet_norm_out_linear.lora_down.weight (read as transformer.norm_out.linear.lora_A.weight; module "
            "has no LoRA in this config)") in msg, msg
    assert "lora_unet_proj_out.diff" in msg and "lora_unet_img_in.dora_scale (DoRA is not supported)" in msg, msg
    assert max_diff(adapter_weights(transformer), before) == 0


@pytest.mark.parametrize("how", ["unpaired", "mixed"])
def test_incomplete_or_mixed_files_are_refused(how, known, tiny_edit, tmp_path):
    """A lora_down without its lora_up is named as written; a file mixing lora_A/B and lora_down/up keys (which
    diffusers' converter reads one at a time) is refused with the converter's reason."""
    if how == "unpaired":
        sd = to_format(known, "kohya")
        del sd["lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight"]
        match = r"has lora_A without lora_B \(or the reverse\) for lora_unet_transformer_blocks_0_attn_to_q\.lora_down"
    else:
        half = dict(list(known.items())[: len(known) // 2])
        sd = {**to_format(half, "comfyui_down_up"), **to_format(dict(list(known.items())[len(half):]), "comfyui")}
        match = "diffusers' Qwen-Image LoRA converter cannot read .*a file holds one layout"
    with pytest.raises(lora_io.LoraFileError, match=match):
        load_via_file(fresh_transformer(tiny_edit), sd, tmp_path / "lora.safetensors")


def test_init_from_must_exist(tiny_edit, tmp_path):
    """A missing lora.init_from is a config error naming the key and the fix."""
    from train import config

    cfg = write_config(tmp_path / "c.json", **{"qwen_edit.lora.init_from": str(tmp_path / "missing.safetensors")})
    args = config.parse_args(["--ds_config", str(cfg), "--model", str(tiny_edit / "model"),
                              "--data", str(tiny_edit / "data"), "--output_dir", str(tmp_path / "out")])
    with pytest.raises(config.ConfigError, match=r"qwen_edit\.lora\.init_from: .*missing\.safetensors' is not a "
                                                 r"file; point it at a LoRA \.safetensors"):
        config.load_config(args, world_size=1, has_gpu=False)


@pytest.mark.slow
def test_training_starts_from_init_file(lora_exports, tiny_edit, tmp_path):
    """With lr 0 a run started from lora.init_from (the ComfyUI export) exports exactly the file's weights."""
    cfg = write_config(tmp_path / "init.json", **{"optimizer.params.lr": 0.0,
                                                  "qwen_edit.lora.init_from": str(lora_exports["comfyui"])})
    out = tmp_path / "out"
    proc = run_trainer(tiny_edit, out, config=cfg, extra=("--max_steps", "1"))
    check(proc)
    assert "LoRA init: 26 modules loaded from" in proc.stdout, proc.stdout[-2000:]
    assert max_diff(load_file(out / "export" / LORA_WEIGHT_NAME), load_file(lora_exports["diffusers"])) == 0


@TWO_ADAPTERS
def test_alpha_other_than_rank_keeps_the_update(known, tiny_edit, tmp_path):
    """lora.alpha = 2 x rank: the diffusers file (scale folded into B) and the ComfyUI file (alpha key) load in
    diffusers to the same update B @ A x scale, and lora_io reads the folded file back to the trained B."""
    from diffusers import DiffusionPipeline

    layers = {f"{m}.{s}.weight": w for m, ab in known.items() for s, w in zip(("lora_A", "lora_B"), ab, strict=True)}
    rank = TINY_LORA["rank"]
    paths = {"diffusers": exports.write_diffusers_lora(layers, tmp_path / "d", 2 * rank, rank, torch.float32,
                                                       keys=QWEN_IMAGE.lora),
             "comfyui": exports.write_comfyui_lora(layers, tmp_path / "c", 2 * rank, torch.float32,
                                                   keys=QWEN_IMAGE.lora)}
    pipe = DiffusionPipeline.from_pretrained(tiny_edit / "model", local_files_only=True)
    for name, path in paths.items():
        pipe.load_lora_weights(path.parent, weight_name=path.name, adapter_name=name)
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    updates = {n: layer.lora_B[n].weight @ layer.lora_A[n].weight * layer.scaling[n] for n in paths}
    m = "transformer_blocks.0.attn.to_q"
    torch.testing.assert_close(updates["diffusers"], 2 * known[m][1] @ known[m][0], rtol=0, atol=0)
    torch.testing.assert_close(updates["comfyui"], updates["diffusers"], rtol=0, atol=0)
    transformer = fresh_transformer(tiny_edit, alpha=2 * rank)
    lora_io.load_into(transformer, paths["diffusers"])
    assert torch.equal(adapter_weights(transformer)[f"{m}.lora_B"], known[m][1])


class Payload:
    """Unpickles into a call of exec: writes `marker`, as a planted checkpoint file would run any code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def plant(file: Path, marker: Path) -> None:
    """Add a Payload to the dict a DeepSpeed checkpoint file holds (the file keeps every real entry)."""
    from train.runtime.checkpoint_files import safe_load

    state = safe_load(file)
    state["extra"] = Payload(marker)
    torch.save(state, file)


def copy_run(run: Path, out: Path, tags: tuple[str, ...] = (TAG,)) -> Path:
    import shutil

    for tag in tags:
        shutil.copytree(run / TAG, out / tag)
        state_file = out / tag / "trainer_state.json"
        step = int(tag.removeprefix("global_step"))
        state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "step": step}))
    (out / "latest").write_text(tags[-1])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_planted_payload_is_refused_and_never_runs(lora_run, tiny_edit, tmp_path, capsys, victim):
    """A checkpoint file with a pickled call of exec: export and --resume exit 2 naming the file and the refused
    global, and the code never runs (full unpickling, as DeepSpeed's own loaders do, would run it)."""
    from train.runtime import checkpoint

    out, marker = copy_run(lora_run, tmp_path / "run"), tmp_path / "marker"
    plant(out / TAG / victim, marker)
    assert export.main(["--checkpoint", str(out / TAG), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"{out / TAG / victim}: refused to load" in err and "builtins.exec" in err, err
    with pytest.raises(checkpoint.CheckpointFileError, match="it holds pickled references to builtins.exec"):
        checkpoint.resolve_tag(out, "latest")
    if victim.startswith("zero"):  # the whole trainer, through its launcher: stops before any model loads
        proc = run_trainer(tiny_edit, out, num_procs=2, extra=("--max_steps", "6", "--resume"))
        assert proc.returncode != 0 and f"{victim}: refused to load" in proc.stderr, proc.stderr[-3000:]
        assert "Loading weights" not in proc.stderr + proc.stdout
    assert not marker.exists() and not (tmp_path / "x").exists()
    torch.load(out / TAG / victim, weights_only=False)  # what DeepSpeed's loaders do: the payload is live
    assert marker.read_text() == "ran"


@pytest.mark.slow
def test_resume_stays_inside_the_output_dir(lora_run, tmp_path):
    """'latest' or --resume naming an absolute path, a parent or a link out of the output directory is refused."""
    from train.runtime import checkpoint

    elsewhere = copy_run(lora_run, tmp_path / "elsewhere")
    out = copy_run(lora_run, tmp_path / "run")
    (out / "global_step9").symlink_to(elsewhere / TAG)
    for name in (str(elsewhere / TAG), f"../elsewhere/{TAG}", "global_step9", ".."):
        (out / "latest").write_text(name)
        with pytest.raises(checkpoint.ResumeError, match=f"names '{re.escape(name)}', which is not a checkpoint "
                                                         "directory inside"):
            checkpoint.resolve_tag(out, "latest")
        with pytest.raises(checkpoint.ResumeError, match="not a checkpoint directory inside"):
            checkpoint.resolve_tag(out, name)
    (out / "latest").write_text(TAG)
    assert checkpoint.resolve_tag(out, "latest")[0] == TAG


@pytest.mark.slow
def test_damaged_checkpoint_names_the_file_and_the_previous_one(lora_run, tmp_path):
    """A truncated shard, a deleted model-states file or a broken trainer_state.json is named before any model
    loads, with the previous complete checkpoint to resume from instead."""
    from train.runtime import checkpoint

    cases = {"truncate": "zero_pp_rank_0_mp_rank_00_optim_states.pt", "delete": "mp_rank_00_model_states.pt",
             "garble": "trainer_state.json"}
    for how, name in cases.items():
        out = copy_run(lora_run, tmp_path / how, tags=("global_step2", TAG))
        victim = out / TAG / name
        if how == "truncate":
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        elif how == "delete":
            victim.unlink()
        else:
            victim.write_text('{"step": 4, "wor')
        with pytest.raises(checkpoint.ResumeError) as e:
            checkpoint.resolve_tag(out, "latest")
        assert str(victim if how != "garble" else out / TAG) in str(e.value), str(e.value)
        assert "resume from the previous complete one with --resume global_step2" in str(e.value), str(e.value)
        if how == "truncate":  # export names the file too, and the complete checkpoint to export instead
            instead = re.escape(f"export the previous complete checkpoint instead: --checkpoint {out}/global_step2")
            with pytest.raises(checkpoint.CheckpointFileError, match=f"{re.escape(str(victim))}: damaged.*{instead}"):
                exports.export(out / TAG, tmp_path / "x", family_of=family.family_for)


def spoil(sd: dict[str, torch.Tensor], how: str) -> tuple[dict[str, torch.Tensor], str]:
    """A copy of the kohya-layout LoRA `sd` with one key made nonsensical; returns (file, the spoiled key)."""
    sd = dict(sd)
    a_key = next(k for k in sorted(sd) if k.endswith(".lora_down.weight"))
    b_key, alpha_key = a_key.replace("lora_down", "lora_up"), a_key.replace(".lora_down.weight", ".alpha")
    if how == "nan_b":
        sd[b_key] = sd[b_key].clone().index_fill_(0, torch.tensor([0]), float("nan"))
    elif how == "inf_a":
        sd[a_key] = torch.full_like(sd[a_key], float("inf"))
    elif how == "bool_a":
        sd[a_key] = sd[a_key] > 0
    elif how == "int_b":
        sd[b_key] = sd[b_key].to(torch.int32)
    else:  # alpha 0, NaN, a bool or two numbers
        sd[alpha_key] = {"zero_alpha": torch.tensor(0.0), "nan_alpha": torch.tensor(float("nan")),
                         "bool_alpha": torch.tensor(True), "vector_alpha": torch.tensor([1.0, 2.0])}[how]
    return sd, {"a": a_key, "b": b_key}.get(how.split("_")[-1], alpha_key)


@pytest.mark.parametrize("how", ["nan_b", "inf_a", "bool_a", "int_b", "zero_alpha", "nan_alpha", "bool_alpha",
                                 "vector_alpha"])
def test_nonsensical_lora_values_are_refused(how, known, tiny_edit, tmp_path):
    """lora.init_from and train.infer --lora refuse NaN/inf weights, bool or integer matrices and alphas that are
    not one finite number > 0, naming the file and the key, before any weight is copied."""
    from train import infer

    sd, key = spoil(to_format(known, "kohya"), how)
    path = tmp_path / "lora.safetensors"
    transformer = fresh_transformer(tiny_edit)
    before = adapter_weights(transformer)
    with pytest.raises(lora_io.LoraFileError, match=f"{re.escape(str(path))} cannot start a run: .*{re.escape(key)}"):
        load_via_file(transformer, sd, path)
    assert max_diff(adapter_weights(transformer), before) == 0
    args = infer.parse_args(["--model", str(tiny_edit / "model"), "--input", str(tiny_edit / "data" / "metadata.jsonl"),
                             "--out", str(tmp_path / "out"), "--lora", f"{path}:0.8"])
    problems = infer.check_args(args, world_size=1)
    assert len(problems) == 1 and str(path) in problems[0] and key in problems[0], problems


def test_lora_metadata_alpha_and_weights_must_be_finite(known, tiny_edit, tmp_path):
    """A NaN lora_alpha in diffusers' metadata, an unreadable file and a NaN --lora weight are refused too."""
    from train import infer

    path = tmp_path / "lora.safetensors"
    save_file(to_format(known, "diffusers"), path,
              metadata={"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": float("nan")})})
    with pytest.raises(lora_io.LoraFileError, match="lora_alpha nan in its lora_adapter_metadata"):
        lora_io.load_into(fresh_transformer(tiny_edit), path)
    (tmp_path / "torn.safetensors").write_bytes(path.read_bytes()[:100])
    args = infer.parse_args(["--model", str(tiny_edit / "model"), "--input", str(tiny_edit / "data" / "metadata.jsonl"),
                             "--out", str(tmp_path / "out"), "--lora", f"{tmp_path / 'torn.safetensors'}",
                             "--lora", f"{path}:nan"])
    problems = infer.check_args(args, world_size=1)
    assert "torn.safetensors cannot be read as safetensors" in problems[0], problems
    assert "the weight nan is not a finite number" in problems[1], problems

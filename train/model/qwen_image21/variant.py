"""Is a model directory Qwen-Image-2.1, and does the installed diffusers build it as released.

model_index.json names QwenImage21Pipeline; its transformer must then be a QwenImage21Transformer2DModel whose
every config key the installed diffusers takes (an older one drops unknown keys with only a warning and would
train another model), and the VAE's latent channels must be the transformer's input channels.
"""

from __future__ import annotations

import json
from pathlib import Path

from train.model.interface import ModelError

VARIANT = "qwen_image_21"
PIPELINE_CLASS = "QwenImage21Pipeline"
TRANSFORMER_CLASS = "QwenImage21Transformer2DModel"
MODEL_NAME = "Qwen-Image-2.1"


def _config(path: Path) -> dict:
    if not path.is_file():
        raise ModelError(f"{path} does not exist; point the model path at a diffusers-format directory")
    return json.loads(path.read_text())


def is_qwen_image21(model_dir: str | Path) -> bool:
    """Whether model_index.json or the transformer's config names 2.1's class (detect_variant then checks the
    two agree)."""
    model_dir = Path(model_dir)
    names = []
    for path in (model_dir / "model_index.json", model_dir / "transformer" / "config.json"):
        if path.is_file():
            names.append(json.loads(path.read_text()).get("_class_name"))
    return PIPELINE_CLASS in names or TRANSFORMER_CLASS in names


def detect_variant(model_dir: str | Path, override: str = "auto") -> str:
    """The variant, "qwen_image_21", of a 2.1 directory after the checks of the module docstring; `override`
    (qwen_edit.model.variant) must be "auto" or "qwen_image_21", and with "qwen_image_21" a directory whose
    model_index.json names another pipeline class is trained as 2.1 if its transformer is 2.1's."""
    model_dir = Path(model_dir)
    pipeline = _config(model_dir / "model_index.json").get("_class_name", "")
    transformer = check_diffusers_supports(model_dir)
    found = transformer.get("_class_name", "")
    if override not in ("auto", VARIANT):
        raise ModelError(
            f"qwen_edit.model.variant is {override!r} but {model_dir} is {MODEL_NAME} (model_index.json: "
            f'{pipeline!r}); set the variant to {VARIANT!r} or "auto"'
        )
    if found != TRANSFORMER_CLASS:
        raise ModelError(
            f"{model_dir}/model_index.json names {pipeline!r} but transformer/config.json is a "
            f"{found!r}, not {TRANSFORMER_CLASS}; the directory mixes two models, fix one of them"
        )
    if pipeline != PIPELINE_CLASS and override == "auto":
        raise ModelError(
            f"{model_dir}/transformer/config.json is a {TRANSFORMER_CLASS} but model_index.json names "
            f"{pipeline!r}; set its _class_name to {PIPELINE_CLASS!r}, or qwen_edit.model.variant to "
            f"{VARIANT!r}"
        )
    vae = _config(model_dir / "vae" / "config.json")
    if vae.get("z_dim") != transformer.get("in_channels"):
        raise ModelError(
            f"{model_dir}: vae/config.json has z_dim {vae.get('z_dim')} but the transformer takes "
            f"in_channels {transformer.get('in_channels')}; the VAE is not this transformer's"
        )
    return VARIANT


def check_diffusers_supports(model_dir: str | Path) -> dict:
    """The transformer's config, after checking that the installed diffusers has QwenImage21Transformer2DModel
    and that it takes every key of the config (else an error naming the keys and the version to install)."""
    import diffusers

    path = Path(model_dir) / "transformer" / "config.json"
    config = _config(path)
    written_by = config.get("_diffusers_version", "a newer version")
    model_class = getattr(diffusers, TRANSFORMER_CLASS, None)
    if model_class is None:
        raise ModelError(
            f"the installed diffusers {diffusers.__version__} has no {TRANSFORMER_CLASS} ({MODEL_NAME}); "
            f"install diffusers>={written_by} (pip install -U diffusers)"
        )
    if config.get("_class_name") != TRANSFORMER_CLASS:
        return config
    _, dropped, _ = model_class.extract_init_dict(dict(config))
    if dropped:
        raise ModelError(
            f"{path} sets {', '.join(f'{k}={json.dumps(config[k])}' for k in sorted(dropped))}, which "
            f"{TRANSFORMER_CLASS} of the installed diffusers {diffusers.__version__} does not take (it would drop "
            f"it and train another model); the config was written by diffusers {written_by}: install "
            f"diffusers>={written_by} (pip install -U diffusers)"
        )
    return config

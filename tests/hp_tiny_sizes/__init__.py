"""Tests only: the sizes of a tiny checkpoint, from its metadata, for the classes whose ComfyUI detection reads none.

HiDream-O1 and ERNIE-Image: ComfyUI 0.33's detection returns only {"image_model": ...}, so it builds the class's
defaults (~8.7B and ~8B parameters) whatever the file holds - and its load is not strict: the layers a small file
lacks stay uninitialised memory, which KSampler and the workers then compute with alike (NaN, or a result that
depends on what the allocator reused). The tiny writers (doctor/tiny_checkpoints.py) put the sizes in the metadata;
this shim hands them to the class, as the real checkpoints' sizes are the class's. Cosmos Predict2 and Anima:
ComfyUI 0.30's detection sets the block count only for the real widths (2048, 5120), so a tiny one gets the class's
default ten blocks; the shim counts the file's, as 0.33's detection does. Inert for every other checkpoint.
"""
import json

import comfy.model_detection as md

_detect = md.detect_unet_config


def detect_unet_config(state_dict, key_prefix, metadata=None):
    config = _detect(state_dict, key_prefix, metadata=metadata)
    if not isinstance(config, dict):
        return config
    meta = metadata or {}
    if config.get("image_model") == "hidream_o1" and meta.get("hp_hidream_o1_config"):
        sizes = json.loads(meta["hp_hidream_o1_config"])
        config = dict(config, text_config_overrides=sizes["text"], vision_config_overrides=sizes["vision"])
    elif config.get("image_model") == "ernie" and meta.get("hp_ernie_config"):
        config = dict(config, **json.loads(meta["hp_ernie_config"]))  # ErnieImageModel's own keyword arguments
    elif config.get("image_model") in ("cosmos_predict2", "anima") and "num_blocks" not in config:
        config = dict(config, num_blocks=md.count_blocks(state_dict, key_prefix + "blocks.{}."))
    return config


md.detect_unet_config = detect_unet_config
NODE_CLASS_MAPPINGS = {}

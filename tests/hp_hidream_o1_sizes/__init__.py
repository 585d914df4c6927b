"""Tests only: HiDream-O1's sizes from a tiny checkpoint's metadata (ComfyUI's detection reads none)."""
import json

import comfy.model_detection as md

_detect = md.detect_unet_config


def detect_unet_config(state_dict, key_prefix, metadata=None):
    config = _detect(state_dict, key_prefix, metadata=metadata)
    sizes = (metadata or {}).get("hp_hidream_o1_config")
    if isinstance(config, dict) and config.get("image_model") == "hidream_o1" and sizes:
        sizes = json.loads(sizes)
        config = dict(config, text_config_overrides=sizes["text"], vision_config_overrides=sizes["vision"])
    return config


md.detect_unet_config = detect_unet_config
NODE_CLASS_MAPPINGS = {}

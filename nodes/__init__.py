"""ComfyUI node classes: thin - validate, turn ComfyUI objects into a job, call the pool."""
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
